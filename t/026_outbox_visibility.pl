# A relay's claims stay hidden from other relays for as long as its pass
# runs, however long that is.
#
# A claim hides a delivery until a visibility deadline sized for the pass's
# waves of HTTP requests.  The events of one key go out one after the other,
# though: a chain of ten webhooks to an endpoint answering in 0.4 s takes
# 4 s, twice the deadline of a batch of 10 with 10 requests in flight, a 2 s
# timeout and no margin.  Unless the relay keeps its claims hidden as
# the pass goes on, a second relay claims the chain again once the deadline
# has passed and sends it a second time, out of order.
#
# Relay A is the worker's code path (idem_relay_harness of the test module
# idem_test: relay_pass outside a transaction in a background worker, claims
# committed before anything is sent); relay B runs idem_outbox_relay()
# passes back to back while A works.  The sink must accept every event
# exactly once, in publish order.
#
# The same holds for a pass whose webhooks are followed by a slow function
# call: the webhooks' outcomes are recorded before the call starts.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = PostgreSQL::Test::Cluster->new('visibility');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.relay_max_in_flight = 10
idempotency.relay_visibility_margin = 0
# the sink listens on loopback, which the relay refuses unless allowed
idempotency.relay_allowed_networks = '127.0.0.1'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE FUNCTION idem_relay_harness(max_events int, max_passes int) RETURNS bigint
		AS 'idem_test', 'idem_relay_harness' LANGUAGE C STRICT;
});

my $sink = start_sink();
$sink->set_mode('sleep 0.4 204');

$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('hook', 'http', '%s', '{order.*}',
		jsonb_build_object('secret', '%s', 'timeout', '2s'));},
	$sink->url, $SECRET));

# Ten events of one key, in publish order.
my @ids = split /\n/, $node->safe_psql('postgres', q{
	SELECT idem_publish('order.step', jsonb_build_object('n', n), 'order-7',
	                    '{"x-event-key": "order-7", "x-event-topic": "order.step"}')
	  FROM generate_series(1, 10) n ORDER BY n});
is(scalar(@ids), 10, 'ten events of one key published');

# Relay A claims the chain (head and nine followers) and sends it.
my $relay_a = $node->background_psql('postgres', on_error_stop => 0);
$relay_a->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_relay_harness(10, 1);\n");
$node->poll_query_until('postgres', q{
	SELECT count(*) = 10 FROM idempotency.deliveries WHERE attempts = 1})
  or die 'relay A did not claim the chain';

# Relay B tries again and again while A's pass lasts.
my $b_passes = 0;
my $b_attempted = 0;
my $deadline = time() + 60;
while (time() < $deadline)
{
	my $running = $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay harness'});
	last if $running eq '0';
	$b_attempted += $node->safe_psql('postgres', 'SELECT idem_outbox_relay(10)');
	$b_passes++;
	sleep 0.05;
}
$relay_a->quit;
cmp_ok($b_passes, '>=', 2, "relay B made $b_passes passes while relay A's pass lasted");
is($b_attempted, 0, 'relay B found nothing to attempt: every claim of A stayed hidden');

is( $node->safe_psql('postgres', q{
		SELECT string_agg(state || ':' || attempts, ' ' ORDER BY seq) FROM idempotency.deliveries}),
	join(' ', ('delivered:1') x 10), 'relay A delivered the whole chain, each at its first attempt');

my @accepted = $sink->accepted;
my %count;
$count{$_}++ for @accepted;
is(scalar(grep { ($count{$_} // 0) != 1 } @ids), 0, 'the sink accepted every event exactly once');
is_deeply(\@accepted, \@ids, 'in publish order');
is($node->safe_psql('postgres', q{SELECT redelivered FROM idem_outbox_stats WHERE destination = 'hook'}),
	'0', 'nothing counted as redelivered');

# ---- A pass with a webhook and a slow function call: while the function
# runs (4 s, twice the deadline), nothing renews the webhook's claim,
# so its outcome must already be recorded by then.  The function's own
# delivery stays locked by relay A while it runs.
$sink->clear_log;
$sink->set_mode('204');
$node->safe_psql('postgres', q{
	CREATE TABLE fsink (event_id uuid, relay int);
	CREATE FUNCTION slow(event jsonb) RETURNS void LANGUAGE sql AS $$
		SELECT pg_sleep(4);
		INSERT INTO fsink VALUES ((event->>'id')::uuid, pg_backend_pid())
	$$;
	SELECT idem_destination_create('slow', 'function', 'slow(jsonb)', '{order.*}');});
my $mixed = $node->safe_psql('postgres', q{
	SELECT idem_publish('order.mixed', '{}', NULL,
	                    '{"x-event-key": "-", "x-event-topic": "order.mixed"}')});
$relay_a = $node->background_psql('postgres', on_error_stop => 0);
$relay_a->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_relay_harness(10, 1);\n");
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE backend_type = 'idempotency relay harness' AND wait_event = 'PgSleep'})
  or die 'relay A never called the slow function';
$b_attempted = 0;
$deadline = time() + 60;
while (time() < $deadline)
{
	my $running = $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay harness'});
	last if $running eq '0';
	$b_attempted += $node->safe_psql('postgres', 'SELECT idem_outbox_relay(10)');
	sleep 0.05;
}
$relay_a->quit;
is($b_attempted, 0, 'while relay A called the function, relay B found nothing to attempt');
is_deeply([ $sink->accepted ], [$mixed], 'the webhook was sent once');
is( $node->safe_psql('postgres', qq{
		SELECT count(*) || ' ' || count(DISTINCT relay) FROM fsink WHERE event_id = '$mixed'}),
	'1 1', 'the function was called once');
is( $node->safe_psql('postgres', qq{
		SELECT string_agg(t.name || ':' || d.state || ':' || d.attempts, ' ' ORDER BY t.name)
		  FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
		 WHERE d.event_id = '$mixed'}),
	'hook:delivered:1 slow:delivered:1', 'both recorded as delivered at the first attempt');

$sink->stop;
$node->stop;
done_testing();
