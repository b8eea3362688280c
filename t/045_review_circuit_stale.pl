# Review of issue 11: a success does not reset the failure count (nor
# close the circuit) when its request was claimed before the failures.
#
# relay_endpoint_states() decides whether a destination's state must be
# read and written from the destination as loaded when the delivery was
# claimed (RelayDest.circuit_open, consecutive_failures, paced).  In the
# worker's loop a request stays in flight across iterations: one claimed
# while the endpoint was healthy (0 failures) and answered after others of
# the same endpoint failed is "not needed", so its success neither clears
# consecutive_failures nor closes a circuit opened meanwhile.  The circuit
# then opens on failures that were not consecutive.
#
# Destination with failure_threshold 4.  Request A is in flight (the sink
# answers it after 10 s); meanwhile B1..B3 fail (3 consecutive failures,
# recorded).  Then A succeeds: the count must be back to 0.  One more
# failure (B4) must leave the circuit closed with 1 failure.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('review_circuit_stale', worker => 1);

my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

# Failed deliveries are not retried during the test (a backoff of an hour).
q1(sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{ep.*}',
	jsonb_build_object('secret', '%s', 'timeout', '60s', 'failure_threshold', 4,
		'max_attempts', 100, 'backoff_base', '1h', 'backoff_cap', '1h'))},
	$sink->url, $SECRET));

sub state
{
	return q1(q{SELECT circuit || ' ' || consecutive_failures FROM idem_outbox_stats WHERE destination = 'ep'});
}

sub delivered
{
	return q1("SELECT state FROM idempotency.deliveries WHERE event_id = '$_[0]'");
}

# A: claimed while the endpoint is healthy, answered late.
$sink->set_mode('sleep 10 204');
my $a = q1(q{SELECT idem_publish('ep.a', '{}')});
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
until (grep { $_->{what} eq 'received' && $_->{id} eq $a } $sink->entries)
{
	die 'A never arrived' if time() > $deadline;
	sleep 0.05;
}

# B1..B3 fail while A is in flight.
$sink->set_mode('500');
q1(qq{SELECT idem_publish('ep.b', jsonb_build_object('n', $_))}) for 1 .. 3;
$node->poll_query_until('postgres', q{
	SELECT consecutive_failures = 3 FROM idempotency.destinations WHERE name = 'ep'})
  or die 'the failures were not recorded';
is(delivered($a), 'pending', 'three failures recorded while A is still in flight');
is(state(), 'closed 3', 'circuit closed, 3 consecutive failures');

# A succeeds.
$node->poll_query_until('postgres', "SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$a'")
  or die 'A was not delivered';
is(state(), 'closed 0', 'the success of A resets the consecutive failures');

# One more failure: not 4 consecutive ones.
my $b4 = q1(q{SELECT idem_publish('ep.b', '{"n": 4}')});
$node->poll_query_until('postgres', "SELECT attempts = 1 AND visible_until IS NULL FROM idempotency.deliveries WHERE event_id = '$b4'")
  or die 'B4 was not attempted';
is(state(), 'closed 1', 'one failure after a success leaves the circuit closed');

$sink->stop;
$node->stop;
done_testing();
