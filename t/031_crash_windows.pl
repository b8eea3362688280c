# A request can die at any point; whichever it is, the retry with the same
# key takes effect once.  Each window below is hit on purpose -- the victim
# is parked exactly there (behind an advisory lock the test holds, in a
# synchronous-replication wait that never ends, inside pg_sleep, or as an
# HTTP request the sink holds) before the kill -- and then the retry runs:
#
#  A. before COMMIT: the claim and the domain write are in a transaction that
#     is killed (in the middle of the domain write; or idle after
#     idem_succeed, with a duplicate waiting for it): crash recovery rolls it
#     back, and the retry executes -- one domain row in the end;
#  B. after COMMIT, before the client reads the answer: the commit record is
#     flushed, the client still waits (synchronous_commit = on with a
#     standby that never comes), and the server (stop immediate) or the
#     backend (kill -9) dies: the commit stands, the retry replays the
#     response byte for byte, one domain row;
#  C. between two phases of a multi-phase operation: phase 1 committed, the
#     owner is killed; once its lease expires the retry takes over with
#     a later token from 'phase1', the dead owner's token is fenced (IK001), and
#     phase 1's write exists once;
#  D. inside a phase: the owner is killed with phase 2's write and checkpoint
#     uncommitted: they roll back, and the takeover resumes from 'phase1';
#  E. the relay between an HTTP delivery reaching the endpoint and recording
#     it: the sink holds the request, the worker is killed, then the sink
#     answers (the consumer has processed it): after the visibility deadline
#     the event is delivered again under the same webhook-id -- the
#     documented duplicate -- and never lost;
#  F. the relay inside a destination function (pg_sleep): killed, then
#     delivered exactly once after the restart.
#
# Every payment publishes an event to a function destination, delivered by
# the background worker all along, through every crash: exactly once each.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use CrashRecovery;
use ProofHelpers;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init(allows_streaming => 1);    # max_wal_senders > 0: window B waits for a standby
# The node's whole configuration.  The worker (idempotency.databases) is the
# relay; one wave of at most 10 requests per pass makes the visibility
# deadline of a claim its destination's timeout plus 1 s.  For window B, a
# session that sets synchronous_commit = on waits after its commit record is
# flushed for a standby that never comes; everyone else commits locally.
$node->append_conf('postgresql.conf', node_conf() . q{
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.relay_batch_size = 10
idempotency.relay_max_in_flight = 10
idempotency.relay_visibility_margin = '1s'
synchronous_standby_names = 'nobody'
synchronous_commit = local
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
$node->safe_psql('postgres', app_sql());
$node->safe_psql('postgres',
	q{SELECT idem_destination_create('ledger', 'function', 'fdest(jsonb)', '{payment.*,fn.*}')});

my $sink = ProofHelpers::Sink->new(
	port => PostgreSQL::Test::Cluster::get_free_port(),
	dir => PostgreSQL::Test::Utils::tempdir(),
	secrets => [$SECRET])->start;

my %completed;        # payment key => the response its one execution stored
my %orders;           # checkout key => its response
my $dup_attempted = 0;
my $dup_executed = 0;
my $crashes = 0;

my $db = sub { $node->safe_psql('postgres', $_[0]) };

# A retry of a key whose operation completed: it must replay, byte for byte.
sub retry_completed
{
	my ($key, $name) = @_;
	my $r = pay($node, $key, 10);
	$dup_attempted++;
	$dup_executed++ if $r->{outcome} eq 'claimed';
	is("$r->{outcome} $r->{response}", "replay $completed{$key}",
		"$name: the retry replays the stored response byte for byte");
}

# SIGKILL a backend (or worker), wait until the server is back.
sub crash_pid
{
	my ($pid, @sessions) = @_;
	my $offset = log_offset($node);
	kill 'KILL', $pid;
	$_->{run}->kill_kill for @sessions;
	wait_for_crash_recovery($node, $offset);
	$crashes++;
}

# The pid of a session's backend.
sub backend_pid
{
	my ($session) = @_;
	my $pid = $session->query_safe('SELECT pg_backend_pid()');
	chomp $pid;
	return $pid;
}

# Wait until backend $pid waits on $event.
sub wait_for_event
{
	my ($pid, $event, $what) = @_;
	$node->poll_query_until('postgres',
		"SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $pid AND wait_event = '$event'")
	  or die "$what never reached its wait ($event)";
}

# The pid of the database's worker (the relay), once it runs.
sub worker_pid
{
	$node->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
	  or die 'no worker';
	return $db->(q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
}

# Close the gate every domain write passes (see app_sql): a session holds
# advisory lock 4242.
sub close_gate
{
	my $gate = $node->background_psql('postgres');
	$gate->query_safe('SELECT pg_advisory_lock(4242)');
	return $gate;
}

# ---- Operations completed before any crash: they must survive them all.
for my $i (1 .. 10)
{
	my $r = pay($node, "base-$i", 10);
	is($r->{outcome}, 'claimed', "base-$i executed") if $i == 1;
	$completed{"base-$i"} = $r->{response};
}

# ---- A1. Killed in the middle of the domain write, before COMMIT.
{
	my $gate = close_gate();
	my $app = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = backend_pid($app);
	$app->query_until(qr/paying/, "\\echo paying\nSELECT * FROM app_pay('a1', 10);\n");
	wait_for_event($pid, 'advisory', 'the payment');
	is( $db->(qq{SELECT count(*) FROM pg_locks WHERE pid = $pid AND locktype = 'advisory'
				   AND objsubid = 7648 AND granted}),
		'1', 'A1: the victim holds the claim of a1 and is inside its domain write');
	crash_pid($pid, $app, $gate);
	is( $db->(q{SELECT (SELECT count(*) FROM payments WHERE op_key = 'a1') || ' '
				|| (SELECT count(*) FROM idem_replay('shop:POST /payments', 'a1')) || ' '
				|| (SELECT count(*) FROM idempotency.outbox WHERE payload->>'op_key' = 'a1')}),
		'0 0 0', 'A1: after the crash no payment, no record, no event of a1');
	my $r = pay($node, 'a1', 10);
	is($r->{outcome}, 'claimed', 'A1: the retry executes');
	$completed{a1} = $r->{response};
	retry_completed('a1', 'A1');
	is($db->(q{SELECT count(*) FROM payments WHERE op_key = 'a1'}), '1', 'A1: one payment');
}

# ---- A2. Killed idle in transaction after idem_succeed, a duplicate waiting.
{
	my $app = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = backend_pid($app);
	$app->query_safe('BEGIN');
	my $first = $app->query_safe(
		q{SELECT outcome || ' ' || concat_ws('|', status, headers, body) FROM app_pay('a2', 10)});
	like($first, qr/^claimed 201\|/, 'A2: the first attempt executed, its response is stored');
	my $dup = $node->background_psql('postgres', on_error_stop => 0);
	$dup->query_until(qr/retrying/, "\\echo retrying\nSELECT * FROM app_pay('a2', 10);\n");
	$node->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 7648 AND NOT granted})
	  or die 'the duplicate never waited';
	pass('A2: a duplicate waits for the first attempt');
	$dup_attempted++;
	crash_pid($pid, $app, $dup);
	is($db->(q{SELECT count(*) FROM payments WHERE op_key = 'a2'}), '0',
		'A2: the uncommitted payment is gone');
	my $r = pay($node, 'a2', 10);
	is($r->{outcome}, 'claimed', 'A2: the retry executes');
	isnt($r->{response}, substr($first, length('claimed ')),
		'A2: with a response of its own (the killed one was never committed)');
	$completed{a2} = $r->{response};
	retry_completed('a2', 'A2');
	is($db->(q{SELECT count(*) FROM payments WHERE op_key = 'a2'}), '1', 'A2: one payment');
}

# ---- B. After COMMIT, before the client reads the answer.
for my $how ('server', 'backend')
{
	my $key = $how eq 'server' ? 'b1' : 'b2';
	my $app = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = backend_pid($app);
	$app->query_safe('SET synchronous_commit = on');
	$app->query_safe('BEGIN');
	my $sent = $app->query_safe(
		qq{SELECT outcome || ' ' || concat_ws('|', status, headers, body) FROM app_pay('$key', 10)});
	like($sent, qr/^claimed 201\|/, "B $how: executed");
	$sent = substr($sent, length('claimed '));
	$app->query_until(qr/committing/, "\\echo committing\nCOMMIT;\n");
	wait_for_event($pid, 'SyncRep', 'the commit');
	is( $db->(qq{SELECT count(*) FROM idem_replay('$PAY_SCOPE', '$key')}),
		'0', "B $how: the commit record is flushed, the client still waits for the answer");
	if ($how eq 'server')
	{
		$node->stop('immediate');
		$app->{run}->kill_kill;
		$node->start;
		$crashes++;
	}
	else
	{
		crash_pid($pid, $app);
	}
	$completed{$key} = $sent;
	retry_completed($key, "B $how killed");
	is($db->(qq{SELECT count(*) FROM payments WHERE op_key = '$key'}), '1', "B $how: one payment");
}

# ---- C and D: multi-phase operations killed between and inside phases.
my $LEASE = '3 seconds';
for my $case ('between', 'inside')
{
	my $key = $case eq 'between' ? 'c1' : 'd1';
	my $owner = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = backend_pid($owner);
	my ($claimed, $old) = split / /,
	  $owner->query_safe(qq{SELECT outcome || ' ' || token FROM idem_claim('$ORDER_SCOPE', '$key',
							  '{"cart": 1}', lease => '$LEASE')});
	is($claimed, 'claimed', "$case: the owner claims");
	is($owner->query_safe(qq{SELECT app_phase('$key', $old, 1, '$LEASE')}), 'phase1',
		"$case: phase 1 committed");
	my $gate;
	if ($case eq 'inside')
	{
		$gate = close_gate();
		$owner->query_until(qr/phase2/,
			"\\echo phase2\nSELECT app_phase('$key', $old, 2, '$LEASE');\n");
		wait_for_event($pid, 'advisory', 'phase 2');
		is( $db->(qq{SELECT count(*) FROM pg_stat_activity WHERE pid = $pid AND xact_start IS NOT NULL}),
			'1', 'inside: killed with the write and the checkpoint of phase 2 uncommitted');
	}
	crash_pid($pid, $owner, $gate ? $gate : ());
	is( $db->(qq{SELECT state || ' ' || token || ' ' || recovery_point FROM idempotency.records
				 WHERE scope = '$ORDER_SCOPE' AND key = '$key'}),
		"processing $old phase1", "$case: after the crash the operation is at phase1, the owner's token");
	is( $db->(qq{SELECT string_agg(phase::text, ',' ORDER BY phase) FROM phase_writes WHERE op_key = '$key'}),
		'1', "$case: only phase 1's write exists");
	my $dead_lease = $db->(qq{SELECT lease_expires_at FROM idempotency.records
							 WHERE scope = '$ORDER_SCOPE' AND key = '$key'});

	my $r = checkout($node, $key, lease => $LEASE, claim_only => 1);
	my @outcomes = map { $_->{outcome} } @{ $r->{attempts} };
	like(join(' ', @outcomes), qr/^(in_progress )*claimed$/,
		"$case: the retry waits for the dead owner's lease, then claims");
	my $takeover = $r->{attempts}[-1];
	my $new = $takeover->{token};
	is($takeover->{recovery_point}, 'phase1', "$case: takeover from recovery point phase1");
	cmp_ok($new, '>', $old, "$case: with a later token");
	is( $db->(qq{SELECT '$takeover->{lease_expires_at}'::timestamptz - interval '$LEASE'
					 >= '$dead_lease'::timestamptz}),
		't', "$case: the takeover came after the dead owner's lease had expired");
	$dup_attempted += @outcomes;

	# The dead owner's token is fenced: neither a checkpoint nor a phase
	# with it commits anything.
	my ($ret, $out, $err) = $node->psql('postgres',
		qq{SELECT idem_checkpoint('$ORDER_SCOPE', '$key', $old, 'late')},
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/IK001: idem_checkpoint: token $old .* is no longer current/,
		"$case: the old token is fenced (IK001)");
	($ret, $out, $err) = $node->psql('postgres', qq{SELECT app_phase('$key', $old, 2, '$LEASE')},
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/IK001/, "$case: a phase run with the old token fails with IK001");

	$orders{$key} = run_phases($node, $key, $new, $r->{next_phase}, 3, $LEASE);
	like($orders{$key}, qr/^201\|/, "$case: the new owner completes the operation");
	is( $db->(qq{SELECT string_agg(phase || ':' || token, ',' ORDER BY phase) FROM phase_writes
				 WHERE op_key = '$key'}),
		"1:$old,2:$new,3:$new", "$case: each phase's write exists once (phase 1 by the dead owner)");
	my $replay = checkout($node, $key, lease => $LEASE);
	$dup_attempted++;
	is($replay->{response}, $orders{$key}, "$case: a later retry replays the response byte for byte");
}

# Every payment's event reached the function destination.
$node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'})
  or die 'the payment events were not delivered';

# ---- E. HTTP: the worker killed between the delivery and its record.
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('hook', 'http', '%s', '{hook.*}',
		jsonb_build_object('secret', '%s', 'timeout', '10s'))}, $sink->url, $SECRET));
$sink->hold(204);
my $pid = worker_pid();
my @hook_ids = split /\n/, $db->(q{
	SELECT idem_publish('hook.x', jsonb_build_object('n', n), key => 'h' || n,
						headers => jsonb_build_object('x-event-key', 'h' || n, 'x-event-topic', 'hook.x'))
	  FROM generate_series(1, 3) n});
my $deadline = time() + 60;
sleep 0.05 while time() < $deadline && $sink->received < 3;
is_deeply([ sort $sink->received ], [ sort @hook_ids ], 'E: the three webhooks reached the endpoint');
is( $db->(q{SELECT string_agg(DISTINCT state || ' attempt ' || attempts || ' ' || (visible_until IS NOT NULL), ',')
			  FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
			 WHERE t.name = 'hook'}),
	'pending attempt 1 true', 'E: their claims committed, their outcome not recorded');
crash_pid($pid);
$sink->release;
$deadline = time() + 60;
sleep 0.05 while time() < $deadline && (grep { $_->{what} eq 'answered' } $sink->entries) < 3;
is(scalar(grep { $_->{what} eq 'answered' && $_->{status} eq '204' } $sink->entries),
	3, 'E: after the kill the endpoint answers them: the consumer processed all three');
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.deliveries d JOIN idempotency.destinations t
	    ON t.id = d.destination_id WHERE t.name = 'hook' AND state <> 'delivered'})
  or die 'the webhooks were not delivered after the crash';
my %accepted;
$accepted{$_}++ for $sink->accepted;
is_deeply(\%accepted, { map { $_ => 2 } @hook_ids },
	'E: each event delivered again, under the same webhook-id: twice each, never lost');
my %ids_of_key;
$ids_of_key{ $_->{key} }{ $_->{id} } = 1 for grep { $_->{what} eq 'answered' } $sink->entries;
is_deeply([ map { scalar keys %{ $ids_of_key{"h$_"} } } 1 .. 3 ], [ 1, 1, 1 ],
	'E: one webhook-id per event');
is( $db->(q{SELECT delivered || ' ' || redelivered FROM idem_outbox_stats WHERE destination = 'hook'}),
	'3 3', 'E: the relay counts the three repeats as redelivered');
my $http_duplicates = grep { $_ > 1 } values %accepted;
$node->safe_psql('postgres', q{SELECT idem_destination_drop('hook')});

# ---- F. A function destination killed mid-call.
$node->safe_psql('postgres', q{UPDATE stall SET on_n = 2});
$pid = worker_pid();
my @fn_ids = split /\n/, $db->(
	q{SELECT idem_publish('fn.x', jsonb_build_object('n', n)) FROM generate_series(1, 3) n});
wait_for_event($pid, 'PgSleep', 'the destination function');
crash_pid($pid);
my $fn_rows = sub {
	$db->(q{SELECT count(*) || ' ' || count(DISTINCT event_id) FROM fsink
			 WHERE event_id IN (SELECT event_id FROM idempotency.outbox WHERE topic = 'fn.x')});
};
# The loop claims function deliveries about a slice at a time, the first
# claim of a fresh worker one: event 1 is made and marked in a slice of its
# own, the kill cuts event 2's call short (event 3 may or may not be
# claimed with it).
is($fn_rows->(), '1 1', 'F: the call made before the kill stands, the one cut short left nothing');
is( $db->(q{SELECT string_agg(state || ' attempt ' || attempts, ',' ORDER BY (o.payload->>'n')::int)
			  FROM idempotency.deliveries d JOIN idempotency.outbox o USING (event_id)
			 WHERE o.topic = 'fn.x' AND (o.payload->>'n')::int <= 2}),
	'delivered attempt 1,pending attempt 1',
	'F: event 1 is delivered, the claim of event 2 stands, to be taken again after the deadline');
$node->safe_psql('postgres', q{UPDATE stall SET on_n = NULL});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'})
  or die 'the function deliveries were not made after the crash';
is($fn_rows->(), '3 3', 'F: delivered exactly once each after the restart');

# ---- The end state, after all the crashes.
retry_completed($_, "end, $_") for sort keys %completed;
is( $db->(q{SELECT count(*) || ' ' || count(DISTINCT op_key) FROM payments}),
	scalar(keys %completed) . ' ' . scalar(keys %completed),
	'one payment per completed key, none other');
my $extra_rows = $db->(q{SELECT count(*) - count(DISTINCT op_key) FROM payments});
$dup_executed += $extra_rows;
is($dup_executed, 0, 'no duplicate executed');

my $published = $db->(q{SELECT count(*) FROM idempotency.outbox});
my $lost = $db->(q{
	SELECT count(*) FROM idempotency.outbox o
	 WHERE EXISTS (SELECT FROM idempotency.deliveries d WHERE d.event_id = o.event_id
					  AND d.state <> 'delivered')
	    OR (o.topic <> 'hook.x'
		    AND (SELECT count(*) FROM fsink f WHERE f.event_id = o.event_id) <> 1)});
is($lost, '0', 'every committed event delivered, to the function destination exactly once');
is( $db->(q{SELECT count(*) FROM idempotency.outbox WHERE topic = 'payment.created'}),
	scalar(keys %completed), 'one event per payment: none of the killed attempts published one');
is($db->(q{SELECT count(*) FROM fsink WHERE event_id NOT IN (SELECT event_id FROM idempotency.outbox)}),
	'0', 'nothing delivered that was not committed');
is( scalar(() = slurp_file($node->logfile) =~ /terminated by signal 9: Killed/g),
	$crashes - 1, 'every kill but the stop went through crash recovery');

report_figures('031_crash_windows',
	'crashes survived' => $crashes,
	'operations completed' => scalar(keys %completed) + scalar(keys %orders),
	'duplicates attempted' => $dup_attempted,
	'duplicates executed' => $dup_executed,
	'events published' => $published,
	'events lost' => $lost,
	'webhooks delivered twice' => $http_duplicates);

$sink->stop;
$node->stop;
done_testing();
