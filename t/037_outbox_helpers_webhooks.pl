# Relay helpers start for a backlog of plain webhooks (issue 11).
#
# The worker starts helpers when an iteration of its loop leaves deliveries
# due that it could not take for its own bounds.  A loop never claims a full
# batch of idempotency.relay_batch_size webhooks (it claims up to each
# destination's max_in_flight), so a backlog must be told by what is left
# due: here two endpoints that answer after 0.2 s, each with max_in_flight 4
# and 100 events due, and idempotency.relay_max_in_flight 4, so that the
# worker's loop can take only one endpoint's room at a time.  A helper
# starts, shares the backlog, and every event is delivered.  (A helper also
# starts for one destination whose max_in_flight is taken, and shares that
# room with the worker: t/060 checks the bound holds across them.)
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('helpers_webhooks', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.relay_workers = 2
idempotency.relay_max_in_flight = 4
});

my $sink = start_sink();
$sink->set_mode('sleep 0.2 204');
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create(d, 'http', '%s', ARRAY[d || '.*'],
		jsonb_build_object('secret', '%s', 'max_in_flight', 4))
	  FROM unnest(ARRAY['a', 'b']) d;
	SELECT count(idem_publish(d || '.x', jsonb_build_object('n', n)))
	  FROM generate_series(1, 100) n, unnest(ARRAY['a', 'b']) d;},
	$sink->url, $SECRET));

# A helper joins while the backlog lasts (200 events, 4 at a time, 0.2 s
# each: some 10 s for the worker alone).
my $helper = 0;
my $deadline = time() + 60;
while (time() < $deadline)
{
	$helper = $node->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay'});
	last if $helper > 0;
	last if $node->safe_psql('postgres',
		q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'}) eq 't';
	sleep 0.05;
}
cmp_ok($helper, '>=', 1, 'a relay helper started for the backlog of webhooks');

$node->poll_query_until('postgres',
	q{SELECT count(*) = 200 FROM idempotency.deliveries WHERE state = 'delivered'})
  or die 'the backlog was not delivered';
is(scalar(grep { $_->{what} eq 'answered' } $sink->entries) >= 200, 1, 'every event was delivered');

$sink->stop;
$node->stop;
done_testing();
