# Second review of issue 11: a crash of the worker in the middle of a slice
# of function deliveries dead-letters every delivery of the claim that was
# still waiting for a later slice, though its function was never called.
#
# The loop claims a whole batch of function deliveries (attempts + 1 each,
# visible_until set) and makes them in slices of about 100 ms
# (relay_loop_local_slice), one slice per iteration.  When the worker dies
# (kill -9, or any error of an iteration: relay_loop_abandon), the
# deliveries not made yet look exactly like ones whose attempt was cut
# short, and the next claim dead-letters those at their last attempt: "not
# attempted again: its last attempt (1 of max_attempts 1) was interrupted
# before its outcome was recorded" -- an attempt that never began.  The
# slices make the window a whole batch wide (up to relay_batch_size
# deliveries, many seconds of calls), where a pass of 1.2 made them all in
# one step.  With max_attempts 1 ("never retry a failing function"), one
# crash dead-letters most of the backlog; with the default, each crash uses
# up an attempt of every delivery claimed.
#
# A function that takes 0.3 s; 20 events; the worker is killed once 2 calls
# have committed.  Every event must reach the function exactly once, and
# none that was never called may be dead: at most the one whose call the
# crash cut short (its last allowed attempt was interrupted, README "Poison
# events"), and then its call left nothing behind.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;

my $EVENTS = 20;

my $node = PostgreSQL::Test::Cluster->new('review2_slice_crash');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.relay_visibility_margin = '1s'
restart_after_crash = on
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';

$node->safe_psql('postgres', q{
	CREATE TABLE made (event_id uuid);
	CREATE FUNCTION slow_sink(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		PERFORM pg_sleep(0.3);
		INSERT INTO made VALUES ((event->>'id')::uuid);
	END $$;
	SELECT idem_destination_create('fn', 'function', 'slow_sink(jsonb)', '{fn.*}',
		'{"max_attempts": 1, "timeout": "5s"}');
});

# One commit: one claim takes them all.
$node->safe_psql('postgres', "SELECT idem_publish('fn.x', '{}') FROM generate_series(1, $EVENTS)");
$node->poll_query_until('postgres', 'SELECT count(*) >= 2 FROM made')
  or die 'no call was made';

my $pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
my $offset = log_offset($node);
kill 'KILL', $pid;
wait_for_crash_recovery($node, $offset);
my $made_at_crash = $node->safe_psql('postgres', 'SELECT count(*) FROM made');
note("calls committed before the crash: $made_at_crash");

$node->poll_query_until('postgres',
	q{SELECT NOT EXISTS (SELECT FROM idempotency.deliveries WHERE state = 'pending')})
  or die 'deliveries are still pending';

is($node->safe_psql('postgres', 'SELECT count(*) FROM made GROUP BY event_id HAVING count(*) > 1'),
	'', 'no event reached the function twice');
my $dead = $node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'dead'});
note('a dead letter: ' . $node->safe_psql('postgres',
		q{SELECT last_error FROM idempotency.deliveries WHERE state = 'dead' LIMIT 1}));
cmp_ok($dead, '<=', 1,
	'no delivery whose function was never called is dead-lettered, at most the one cut short');
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM idempotency.deliveries d
		 WHERE d.state = 'dead' AND EXISTS (SELECT FROM made m WHERE m.event_id = d.event_id)}),
	'0', 'a dead-lettered delivery left no effect');
is($node->safe_psql('postgres', 'SELECT count(DISTINCT event_id) FROM made') + $dead, $EVENTS,
	'every other event reached the function');

$node->stop;
done_testing();
