# A delivery given back because its row was held keeps the deadline its
# claim really has.
#
# Renewing claims sets each delivery's deadline in memory before the
# UPDATE; one whose row another session held was not renewed, and was given
# back (t/074) with the new deadline in memory but the old one in the
# table.  The loop keeps a destination whose unrecorded outcome's claim has
# run out from claiming (relay_loop_block_unrecorded), going by the deadline
# in memory: when the operator let go just before the real deadline, the
# loop's claim at that deadline took the delivery, still marked claimed,
# for an interrupted attempt -- dead on its last attempt, its function
# never called (found by an adversarial review, 2 runs of 2).
#
# Here a function destination (timeout 200 ms, max_attempts 1, margin 2 s)
# gets six calls of 150 ms in one claim; the row of the last one is held
# from its claim until 50 ms before its deadline.  Five rounds (a round
# whose delivery was made before the lock does not count): each must end
# delivered.  Driven by the worker's relay; waits poll for states.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $node = start_outbox_node('held_row_deadline', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.relay_visibility_margin = '2s'
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(q{
	CREATE TABLE received (event_id uuid, n int);
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		PERFORM pg_sleep((event->'payload'->>'ms')::float8 / 1000);
		INSERT INTO received VALUES ((event->>'id')::uuid, (event->'payload'->>'n')::int);
	END $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}',
		'{"max_attempts": 1, "timeout": "200ms"}');
});

my $bad = 0;
my $expect = '';
my $rounds = 0;
for my $round (1 .. 5)
{
	my $base = $round * 100;
	for (1 .. 5)
	{
		q1(q{SELECT idem_publish('orders.x', jsonb_build_object('n', 0, 'ms', 0)) FROM generate_series(1, 40)});
		$node->poll_query_until('postgres', q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state = 'pending'})
		  or die 'warm-up not delivered';
	}
	q1("SELECT idem_publish('orders.x', jsonb_build_object('n', $base + g, 'ms', 150)) FROM generate_series(1, 6) g");
	my $e = q1("SELECT o.event_id FROM idempotency.outbox o WHERE (o.payload->>'n')::int = $base + 6");
	$node->poll_query_until('postgres',
		"SELECT claims >= 1 FROM idempotency.deliveries WHERE event_id = '$e'")
	  or die 'not claimed';
	my $op = $node->background_psql('postgres');
	$op->query_safe('BEGIN');
	$op->query_safe("SELECT event_id FROM idempotency.deliveries WHERE event_id = '$e' FOR UPDATE");
	my $made_before = q1("SELECT count(*) FROM received WHERE n = $base + 6");
	sleep 0.4;
	my $left = q1("SELECT extract(epoch from next_attempt_at - clock_timestamp()) FROM idempotency.deliveries WHERE event_id = '$e'");
	note("round $round: made before lock $made_before; claim deadline in $left s");
	sleep($left - 0.05) if $left > 0.05;
	$op->query_safe('COMMIT');
	$op->quit;
	$node->poll_query_until('postgres',
		"SELECT state <> 'pending' FROM idempotency.deliveries WHERE event_id = '$e'")
	  or die 'e never settled';
	my $row = q1("SELECT state || ' | ' || attempts || ' | ' || claims || ' | ' || coalesce(last_error, '') FROM idempotency.deliveries WHERE event_id = '$e'");
	note("round $round e: $row");
	next if $made_before ne '0';
	$rounds++;
	if ($row !~ /^delivered/) { $bad++; last; }
}
note(q1(q{SELECT delivered || ' ' || retried || ' ' || dead_lettered || ' ' || redelivered || ' ' || dead
	FROM idem_outbox_stats WHERE destination = 'local'}));
cmp_ok($rounds, '>=', 1, 'at least one round held the row before its delivery was made');
is($bad, 0, "held row released shortly before the claim's deadline: given back, not dead ($rounds rounds)");
$node->stop;
done_testing();
