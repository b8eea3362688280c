# Isolation with many destinations: slow endpoints, each with a backlog and
# each within its own max_in_flight, together fill
# idempotency.relay_max_in_flight; a healthy destination with a fresh event
# (no request in flight) must still get its webhook out promptly.
#
# The loop gave a freed request to the destination with the fewest in
# flight, then the oldest due delivery, and each destination its whole room
# in turn: the slow backlogs, all older, kept the fresh event out until
# they had nearly drained (13 s; found by an adversarial review).  The room
# now goes one delivery per destination and turn, and among destinations
# with as many in flight the one served longest ago comes first.
#
# README ("Webhooks: one endpoint never holds up another"): an endpoint
# that takes long to answer "holds up only its own deliveries"; the room
# "goes round the destinations one request per destination and turn", "so
# a long backlog cannot keep the others out" (the claim, under "How the
# relay works"); t/032 measured a healthy endpoint receiving each webhook
# within 2 s of its commit with three slow ones busy.
#
# Here 80 slow endpoints (2 s per answer, all settings at their defaults:
# max_in_flight 16, relay_max_in_flight 64) have 6 events each: more
# destinations with a backlog than the relay has requests in flight.  Driven by the
# worker's relay; waits poll for states.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $NSLOW = 80;
my $PER = 6;

my $node = start_outbox_node('many_slow', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
max_connections = 200
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

my $slow = start_sink();
$slow->set_mode('sleep 2 204');
my $fresh = start_sink();

q1(sprintf(q{SELECT count(idem_destination_create('slow' || i, 'http', '%s' || i,
	ARRAY['slow' || i], jsonb_build_object('secret', '%s')))
	FROM generate_series(1, %d) i}, $slow->url('/s'), $SECRET, $NSLOW));
q1(sprintf(q{SELECT idem_destination_create('fresh', 'http', '%s', '{fresh}',
	jsonb_build_object('secret', '%s'))}, $fresh->url, $SECRET));

# The backlog, in one transaction.
q1(sprintf(q{SELECT count(idem_publish('slow' || i, '{}'))
	FROM generate_series(1, %d) i, generate_series(1, %d) j}, $NSLOW, $PER));

# Wait until the slow endpoints fill the relay's 64 requests in flight.
my $deadline = time + 60;
while (time < $deadline)
{
	last if scalar(grep { $_->{what} eq 'received' } $slow->entries) >= 64;
	sleep 0.1;
}
cmp_ok(scalar(grep { $_->{what} eq 'received' } $slow->entries), '>=', 64,
	'the slow endpoints have 64 requests in flight');

# Fresh events to the healthy destination, one at a time.
for my $n (1 .. 3)
{
	my $t0 = time;
	my $e = q1(q{SELECT idem_publish('fresh', '{}')});
	ok($node->poll_query_until('postgres',
			"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e'"),
		"fresh event $n delivered");
	# How many slow requests the relay started between the fresh event's
	# commit and its delivery: a turn of the destinations waiting (about
	# 17 here), not the slow backlogs (hundreds), whatever the machine's speed.
	my ($lat, $started, $backlog) = split /\|/, q1(qq{
		SELECT round(extract(epoch FROM d.delivered_at - o.published_at)::numeric, 2),
		       (SELECT count(*) FROM idempotency.deliveries s
		          JOIN idempotency.destinations t ON t.id = s.destination_id
		         WHERE t.name LIKE 'slow%'
		           AND s.last_attempt_at > o.published_at AND s.last_attempt_at < d.delivered_at),
		       (SELECT count(*) FROM idempotency.deliveries s
		          JOIN idempotency.destinations t ON t.id = s.destination_id
		         WHERE t.name LIKE 'slow%' AND s.state = 'pending')
		  FROM idempotency.deliveries d JOIN idempotency.outbox o USING (event_id)
		 WHERE d.event_id = '$e'});
	cmp_ok($started, '<', 40,
		"fresh event $n: $started slow requests went before it (delivered ${lat}s after its commit; slow backlog left: $backlog)");
}

ok($node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'}),
	'every backlog drains');

$slow->stop;
$fresh->stop;
$node->stop;
done_testing();
