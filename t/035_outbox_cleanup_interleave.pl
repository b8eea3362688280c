# The worker's relay goes on while it runs a long cleanup pass.
#
# The per-database worker both cleans up and relays.  A cleanup pass over a
# large backlog of expired records runs batch after batch (here 3,000
# records in batches of 10, with idempotency.cleanup_delay = 100 ms after
# each: 30 s at the very least).  Events published meanwhile -- webhooks to
# an endpoint that answers after 2 s, and function deliveries -- are
# claimed, sent, and their outcomes recorded between the batches, while the
# cleanup pass is still far from done.  A worker that relayed only between
# passes delivered none of them before the cleanup ended.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('cleanup_interleave', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.cleanup_batch_size = 10
idempotency.cleanup_delay = '100ms'
});

my $sink = start_sink();
$sink->set_mode('sleep 2 204');
$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE received (event_id uuid);
	CREATE FUNCTION receive(event jsonb) RETURNS void LANGUAGE sql
		AS $$ INSERT INTO received VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('hook', 'http', '%s', '{ev.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s'));
	SELECT idem_destination_create('fn', 'function', 'receive(jsonb)', '{ev.*}');},
	$sink->url, $SECRET));

# The backlog of expired records, then a cleanup pass over it.
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
									 created_at, completed_at, expires_at)
	SELECT 'expired', 'k' || g, 'completed', idem_fingerprint('{}'), 201, '{}', 1,
		   now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
	  FROM generate_series(1, 3000) g;
	ALTER SYSTEM SET idempotency.cleanup_interval = 1;
	SELECT pg_reload_conf();});
my $expired = q{SELECT count(*) FROM idempotency.records WHERE scope = 'expired'};
$node->poll_query_until('postgres', "SELECT ($expired) < 3000")
  or die 'the cleanup pass did not start';
pass('a cleanup pass over 3000 expired records is under way');

# Events published during the pass.
$node->safe_psql('postgres', q{
	SELECT idem_publish('ev.x', jsonb_build_object('n', n)) FROM generate_series(1, 5) n;});
my $done = q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'delivered'};
$node->poll_query_until('postgres', "SELECT ($done) = 10 OR ($expired) = 0")
  or die 'neither the deliveries nor the cleanup finished';
my $left = $node->safe_psql('postgres', $expired);
is($node->safe_psql('postgres', $done), '10',
	'5 webhooks (2 s each) and 5 function deliveries delivered and recorded');
cmp_ok($left, '>', 0, "while the cleanup pass was still running ($left expired records left)");
is(scalar($sink->accepted), 5, 'each webhook sent once');
is($node->safe_psql('postgres', 'SELECT count(*) FROM received'), '5', 'each function call made once');

$node->poll_query_until('postgres', "SELECT ($expired) = 0")
  or die 'the cleanup pass did not finish';
pass('the cleanup pass finished all the same');

$sink->stop;
$node->stop;
done_testing();
