# The relay as the background worker runs it: relay_pass() outside any
# transaction, through the test harness idem_relay_harness() (a short-lived
# background worker of the test-only module idem_test, see
# test/modules/idem_test/idem_test.c, which test/run.sh installs).  Here the
# claim commits before any effect and HTTP requests go out while no
# transaction is open, so a crash leaves committed claims behind:
#
#  - kill -9 of the relay with ten webhooks in flight: after recovery every
#    claimed delivery carries its attempt and stays hidden until its
#    visibility deadline; then it is claimed again and delivered.  Nothing is
#    lost, the sink's duplicates are exactly the ten requests in flight, and
#    the relay counts every repeated attempt as 'redelivered' (possible
#    duplicates: an upper bound, since it cannot know which requests left);
#  - kill -9 inside a destination function: the claims survive but the calls
#    and marks roll back together, and after the deadline each event is
#    delivered exactly once;
#  - a pass skips, rather than waits, while another session holds a lock on
#    the deliveries (DROP EXTENSION, TRUNCATE, CREATE INDEX);
#  - relay_next_due_except() (idem_relay_next_due()) tells the worker when
#    to wake up.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
restart_after_crash = on
idempotency.relay_max_in_flight = 10
idempotency.relay_visibility_margin = '1s'
# the sink listens on loopback, which the relay refuses unless allowed
idempotency.relay_allowed_networks = '127.0.0.1'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE FUNCTION idem_relay_harness(max_events int, max_passes int) RETURNS bigint
		AS 'idem_test', 'idem_relay_harness' LANGUAGE C STRICT;
	CREATE FUNCTION idem_relay_next_due() RETURNS timestamptz
		AS 'idem_test', 'idem_relay_next_due' LANGUAGE C;
});

my $sink = start_sink();

sub harness
{
	my ($max_events, $passes) = @_;
	return $node->safe_psql('postgres', "SELECT idem_relay_harness($max_events, $passes)");
}

sub relay_until_done
{
	my $deadline = time() + 30;
	while (time() < $deadline)
	{
		harness(100, 10);
		return 1 if $node->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'") eq '0';
		sleep 0.1;
	}
	return 0;
}

# kill -9 the harness worker and wait until the server has recovered.
sub crash_worker
{
	my ($caller) = @_;
	my $pid = $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency relay harness'");
	die 'no harness worker running' unless $pid;
	my $offset = log_offset($node);
	kill 'KILL', $pid;
	$caller->{run}->kill_kill;
	wait_for_crash_recovery($node, $offset);
	return $pid;
}

# ---- The worker's path delivers all three kinds.
$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE fsink (event_id uuid, n int);
	CREATE TABLE stall (on_n int);
	INSERT INTO stall VALUES (NULL);
	CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO fsink VALUES ((event->>'id')::uuid, (event->'payload'->>'n')::int);
		IF (event->'payload'->>'n')::int = (SELECT on_n FROM stall) THEN
			PERFORM pg_sleep(60);
		END IF;
	END $$;
	SELECT idem_destination_create('fn', 'function', 'fdest(jsonb)', '{fn.*}');
	SELECT idem_destination_create('hook', 'http', '%s', '{hook.*}',
		jsonb_build_object('secret', '%s', 'timeout', '1s'));
	SELECT idem_destination_create('chan', 'notify', 'worker_events', '{chan.*}');},
	$sink->url, $SECRET));
$node->safe_psql('postgres', q{
	SELECT idem_publish(t || '.x', jsonb_build_object('n', n))
	  FROM generate_series(1, 10) n, unnest('{fn,hook,chan}'::text[]) t});
is(harness(100, 10), '30', 'the harness worker delivers 30 events in its own transactions');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(destination || ':' || delivered || ':' || backlog, ' ' ORDER BY destination)
		  FROM idem_outbox_stats}),
	'chan:10:0 fn:10:0 hook:10:0', 'to each kind of destination');
is($node->safe_psql('postgres', 'SELECT idem_relay_next_due()'), '', 'nothing pending: no next due time');

# ---- HTTP: the relay dies with ten requests in flight.
$sink->clear_log;
$sink->set_mode('sleep 3 204');
my @ids = split /\n/, $node->safe_psql('postgres',
	q{SELECT idem_publish('hook.y', jsonb_build_object('n', n)) FROM generate_series(1, 30) n});
my $caller = $node->background_psql('postgres', on_error_stop => 0);
$caller->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_relay_harness(30, 1);\n");
my $deadline = time() + 20;
sleep 0.05 while time() < $deadline && (grep { $_->{what} eq 'received' } $sink->entries) < 10;
my @in_flight = map { $_->{id} } grep { $_->{what} eq 'received' } $sink->entries;
is(scalar(@in_flight), 10, 'ten requests in flight');
my $crash_time = time();
crash_worker($caller);
is( $node->safe_psql('postgres', q{
		SELECT count(*) || ' ' || min(attempts) || ' ' || max(attempts) || ' ' || bool_and(visible_until > now())
		  FROM idempotency.deliveries x JOIN idempotency.outbox o USING (event_id) WHERE o.topic = 'hook.y'}),
	'30 1 1 true', 'after the crash, all 30 claims are committed: attempt 1, hidden until their deadline');
is(harness(100, 1), '0', 'before the deadline no relay takes them');
my $due = $node->safe_psql('postgres',
	q{SELECT extract(epoch FROM idem_relay_next_due() - now()) BETWEEN 0 AND 5});
is($due, 't', 'idem_relay_next_due() is their visibility deadline, seconds away');

sleep 3.2;    # the sink answers the abandoned requests
$sink->set_mode('204');
ok(relay_until_done(), 'after the deadline the relay delivers them all');
my %accepted;
$accepted{$_}++ for $sink->accepted;
is(scalar(grep { $accepted{$_} } @ids), 30, 'nothing lost');
my @dups = sort grep { $accepted{$_} > 1 } keys %accepted;
is_deeply(\@dups, [ sort @in_flight ], 'the duplicates are exactly the ten requests in flight');
is( $node->safe_psql('postgres', q{
		SELECT min(attempts) || ' ' || max(attempts) FROM idempotency.deliveries x
		  JOIN idempotency.outbox o USING (event_id) WHERE o.topic = 'hook.y'}),
	'2 2', 'each delivered at its second attempt');
is( $node->safe_psql('postgres', q{SELECT delivered || ' ' || redelivered FROM idem_outbox_stats WHERE destination = 'hook'}),
	'40 30', 'redelivered counts the 30 repeated attempts: at least the 10 actual duplicates');

# ---- Function: the relay dies inside a call, in the middle of a batch.
$node->safe_psql('postgres', q{UPDATE stall SET on_n = 10});
@ids = split /\n/, $node->safe_psql('postgres',
	q{SELECT idem_publish('fn.z', jsonb_build_object('n', n)) FROM generate_series(1, 20) n});
$caller = $node->background_psql('postgres', on_error_stop => 0);
$caller->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_relay_harness(20, 1);\n");
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE backend_type = 'idempotency relay harness' AND wait_event = 'PgSleep'})
  or die 'the destination function never started sleeping';
crash_worker($caller);
is($node->safe_psql('postgres', q{SELECT count(*) FROM fsink WHERE n IS NOT NULL AND event_id IN (SELECT event_id FROM idempotency.outbox WHERE topic = 'fn.z')}),
	'0', 'the calls made before the crash left nothing behind');
is( $node->safe_psql('postgres', q{
		SELECT state || ' ' || attempts || ' ' || count(*) FROM idempotency.deliveries x
		  JOIN idempotency.outbox o USING (event_id) WHERE o.topic = 'fn.z' GROUP BY state, attempts}),
	'pending 1 20', 'their claims (attempt 1) were committed before the calls');
$node->safe_psql('postgres', q{UPDATE stall SET on_n = NULL});
ok(relay_until_done(), 'after the deadline, delivered');
is( $node->safe_psql('postgres', q{
		SELECT count(*) || ' ' || count(DISTINCT event_id) FROM fsink
		 WHERE event_id IN (SELECT event_id FROM idempotency.outbox WHERE topic = 'fn.z')}),
	'20 20', 'exactly once each');

# ---- A relay that lost its claim long ago cannot record over a redriven
# delivery.  Relay A sends an event and stalls (SIGSTOP) past its deadline;
# relay B takes the delivery over and dead-letters it (max_attempts 2); it
# is redriven, and relay C's attempt fails with 502.  The attempt count went
# back to 0 and up to 1 again, A's number: only a claim counter that never
# goes back tells that A's claim is no longer current.  When A resumes, its
# outcome must not be recorded, nor its claim renewed.
$sink->clear_log;
$sink->set_mode('sleep 2 500');
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('aba', 'http', '%s', '{aba.*}',
		jsonb_build_object('secret', '%s', 'timeout', '3s', 'max_attempts', 2,
		                   'backoff_base', '1ms', 'backoff_cap', '1ms'));}, $sink->url, $SECRET));
my $aba = $node->safe_psql('postgres', q{SELECT idem_publish('aba.x', '{}')});
my $relay_a = $node->background_psql('postgres', on_error_stop => 0);
$relay_a->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_relay_harness(1, 1);\n");
$deadline = time() + 60;
sleep 0.05 while time() < $deadline && !grep { $_->{what} eq 'received' && $_->{id} eq $aba } $sink->entries;
my $a_pid = $node->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency relay harness'");
ok($a_pid && kill('STOP', $a_pid), 'relay A sent its request and is stalled');
$node->poll_query_until('postgres', qq{
	SELECT next_attempt_at < now() FROM idempotency.deliveries WHERE event_id = '$aba'})
  or die 'the claim of relay A never expired';
$sink->set_mode('500');
is($node->safe_psql('postgres', 'SELECT idem_outbox_relay(1)'), '1', 'relay B takes the delivery over');
is($node->safe_psql('postgres', qq{SELECT state || ' ' || attempts FROM idempotency.deliveries WHERE event_id = '$aba'}),
	'dead 2', 'and dead-letters it at its second attempt');
is($node->safe_psql('postgres', qq{SELECT idem_outbox_redrive('$aba')}), '1', 'redriven');
$sink->set_mode('502');
is($node->safe_psql('postgres', 'SELECT idem_outbox_relay(1)'), '1', 'relay C attempts it');
is( $node->safe_psql('postgres', qq{
		SELECT state || ' ' || attempts || ' ' || last_status FROM idempotency.deliveries WHERE event_id = '$aba'}),
	'pending 1 502', 'and fails: attempt 1 again, the attempt number relay A holds');
$node->safe_psql('postgres', q{SELECT idem_destination_pause('aba')});
kill 'CONT', $a_pid;
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay harness'})
  or die 'relay A did not finish';
$relay_a->quit;
is( $node->safe_psql('postgres', qq{
		SELECT state || ' ' || attempts || ' ' || last_status || ' ' || last_error
		  FROM idempotency.deliveries WHERE event_id = '$aba'}),
	'pending 1 502 HTTP status 502', "relay A's late outcome is not recorded over relay C's");
is( $node->safe_psql('postgres', qq{
		SELECT retried || ' ' || dead_lettered FROM idem_outbox_stats WHERE destination = 'aba'}),
	'1 1', 'nor counted');
$node->safe_psql('postgres', q{SELECT idem_destination_drop('aba')});

# ---- A session holding a lock the relay would wait for: the pass is skipped.
$node->safe_psql('postgres', q{SELECT idem_publish('fn.locked', '{}')});
my $locker = $node->background_psql('postgres');
$locker->query_safe('BEGIN; LOCK idempotency.deliveries IN SHARE MODE');
my $t = time();
is(harness(10, 1), '0', 'while another session holds a SHARE lock on the deliveries, the pass does nothing');
cmp_ok(time() - $t, '<', 5, 'and does not wait for it');
$locker->query_safe('COMMIT');
$locker->quit;
is(harness(10, 1), '1', 'once it is gone, the pass delivers');

# ---- idem_relay_next_due() follows a retry's backoff.
$node->safe_psql('postgres', q{
	CREATE FUNCTION refuse(event jsonb) RETURNS void LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no'; END $$;
	SELECT idem_destination_create('refuser', 'function', 'refuse(jsonb)', '{later.*}',
		'{"backoff_base": "1h", "backoff_cap": "1h"}');
	SELECT idem_publish('later.x', '{}');
});
is(harness(10, 1), '1', 'a failing delivery');
is( $node->safe_psql('postgres', q{
		SELECT idem_relay_next_due() = (SELECT next_attempt_at FROM idempotency.deliveries WHERE state = 'pending')
		   AND idem_relay_next_due() <= now() + interval '1 hour'}),
	't', 'idem_relay_next_due() is its next attempt, within the backoff window');
$node->safe_psql('postgres', q{SELECT idem_destination_pause('refuser')});
is($node->safe_psql('postgres', 'SELECT idem_relay_next_due()'), '', 'a paused destination has nothing due');

$sink->stop;
$node->stop;
done_testing();
