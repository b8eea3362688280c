# Second review of issue 11: max_in_flight does not bound the requests open
# to one endpoint once relay helpers run; reaching it is what starts them.
#
# The contract (issue 11, "Per-destination concurrency"): "an option
# max_in_flight per destination bounds the requests open to one endpoint,
# so one endpoint's backlog cannot take every connection"; README: "At most
# max_in_flight requests (default 16) are open to one destination".
#
# But each relay process counts only its own requests (relay_loop_active),
# and the worker starts helpers when a claim leaves a backlog
# (worker_relay: full || backlog), which relay_takes reports exactly when
# a destination has more due than its max_in_flight lets it take.  So a
# slow endpoint with a backlog makes the worker start helpers, and each
# helper opens max_in_flight more requests to that same endpoint:
# relay_workers x max_in_flight in all.
#
# A slow endpoint (3 s per request), max_in_flight 2, relay_workers 3, 18
# events: the endpoint must never see more than 2 requests at once.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $EVENTS = 18;

my $node = start_outbox_node('review2_mif', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.relay_workers = 3
});

my $sink = start_sink();
$sink->set_mode('sleep 3 204');

$node->safe_psql('postgres', sprintf(q{SELECT idem_destination_create('slow', 'http', '%s', '{slow.*}',
	jsonb_build_object('secret', '%s', 'max_in_flight', 2, 'timeout', '60s'))},
	$sink->url, $SECRET));

# One commit: the whole backlog is due at once.
$node->safe_psql('postgres',
	"SELECT idem_publish('slow.x', '{}') FROM generate_series(1, $EVENTS)");

$node->poll_query_until('postgres',
	"SELECT count(*) = $EVENTS FROM idempotency.deliveries WHERE state = 'delivered'")
  or die 'the events were not delivered';

# Requests open at once, as the endpoint saw them: +1 when a request has
# arrived, -1 when it is answered.
my ($open, $most) = (0, 0);
for my $e ($sink->entries)
{
	$open += $e->{what} eq 'received' ? 1 : -1;
	$most = $open if $open > $most;
}
my %conns = map { $_->{conn} => 1 } grep { $_->{what} eq 'received' } $sink->entries;
note(sprintf('most requests open at once: %d, over %d connections', $most, scalar keys %conns));
cmp_ok($most, '<=', 2, 'never more than max_in_flight (2) requests open to the endpoint');

$sink->stop;
$node->stop;
done_testing();
