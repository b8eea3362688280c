# A relay helper that leaves first makes the function deliveries it has
# claimed.
#
# A helper exits when it is dismissed (idempotency.relay_workers lowered)
# or has had nothing to do for a second.  It waited only for its webhooks
# in flight: function deliveries it had claimed but not made yet (the loop
# makes them in slices of about 100 ms) were left to their claims, which ran
# out; the next claim took each for an interrupted attempt, so that one on
# its last attempt was dead-lettered "not attempted again" without its
# function ever being called, and any other counted as redelivered (found
# by an adversarial review, with helpers that left after a trickle of
# events).
#
# Here calls take 2 ms at first, so that the loops' claims grow to a batch
# of 10 with a backlog of 3,000 events and relay_workers 2 (the worker and a
# helper); then each call takes 300 ms, so each loop holds claimed
# deliveries that later slices will make; then the helper is dismissed.
# Every event must be delivered once, nothing dead-lettered or counted
# redelivered (max_attempts 1).  Driven by the worker's relay; waits poll
# for states.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $EVENTS = 3000;
my $node = start_outbox_node('helper_settles', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.relay_batch_size = 10
idempotency.relay_workers = 2
idempotency.relay_visibility_margin = '1s'
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(q{
	CREATE TABLE pace (ms float8);
	INSERT INTO pace VALUES (2);
	CREATE TABLE received (event_id uuid, backend_type text);
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		PERFORM pg_sleep((SELECT ms FROM pace) / 1000);
		INSERT INTO received SELECT (event->>'id')::uuid, a.backend_type
		  FROM pg_stat_activity a WHERE a.pid = pg_backend_pid();
	END $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}',
		'{"max_attempts": 1, "timeout": "2s"}');
});

q1(qq{SELECT count(idem_publish('orders.x', jsonb_build_object('n', g))) FROM generate_series(1, $EVENTS) g});

# The helper at work, with calls made by it.
ok($node->poll_query_until('postgres',
	q{SELECT count(*) > 50 FROM received WHERE backend_type = 'idempotency relay'}),
	'a relay helper makes deliveries');

# Slow calls: the loops now hold claims that their later slices make.
q1(q{UPDATE pace SET ms = 300});
sleep 1;
my $helpers = q1(q{SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay'});
is($helpers, '1', 'the helper runs when it is dismissed');
q1(q{ALTER SYSTEM SET idempotency.relay_workers = 1});
q1(q{SELECT pg_reload_conf()});
ok($node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'}),
	'the helper leaves');

# The rest, fast again.
q1(q{UPDATE pace SET ms = 0});
ok($node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state = 'pending'}),
	'every delivery settled');
is(q1(q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'dead'}), '0',
	'nothing dead-lettered (no call failed)')
  or diag(q1(q{SELECT last_error, count(*) FROM idempotency.deliveries WHERE state = 'dead' GROUP BY 1}));
is(q1(q{SELECT count(*) || ' ' || count(DISTINCT event_id) FROM received}), "$EVENTS $EVENTS",
	'each event made exactly once');
is(q1(q{SELECT delivered || ' ' || dead_lettered || ' ' || redelivered
	FROM idem_outbox_stats WHERE destination = 'local'}), "$EVENTS 0 0",
	'statistics: all delivered, nothing dead-lettered or redelivered');

$node->stop;
done_testing();
