# The extension on a Citus cluster (a coordinator and two workers), used
# from the coordinator as the README says, with the tenant table "orders"
# distributed by tenant_id (bigint) and idem_citus_distribute('orders'):
#
#  1. create, replay and mismatch are delegated to the worker that holds the
#     tenant's shard, in a client transaction of several statements, through
#     a distributed PL/pgSQL function and through idem_execute: the record
#     and the order are in that worker's shards, nowhere else, and the shell
#     tables stay empty;
#  2. ten concurrent duplicates (ten coordinator sessions) execute once: one
#     order, nine replays; and a burst of ten pgbench clients with one key
#     gives one order;
#  3. a call that Citus does not delegate (a text scope, a call in a FROM
#     list or a CTE, a call inside a coordinator-side PL/pgSQL function) is
#     refused with 40001 and a hint about delegation, and executes nothing;
#  4. kill -9 of the worker holding the tenant's shard after the claim and
#     the domain INSERT, before COMMIT: after its restart there is neither
#     the order nor the record, and the retry creates exactly one order;
#  5. records and inbox marks with a short ttl are deleted from the shards
#     by the workers' background cleanup; idem_cleanup() on the coordinator
#     returns 0;
#  6. idem_stuck on the coordinator lists a multi-phase operation whose
#     lease expired, with the session's idempotency.stuck_after;
#  7. the inbox is distributed: idem_inbox_accept answers true, then false;
#  8. an event published inside a delegated call is delivered once by the
#     relay of the worker that ran the call, to a function destination
#     created on the coordinator and present on every worker; pause, resume
#     and drop on the coordinator reach the workers;
#  9. fencing across a shard move: a lease taken on one worker, the shard
#     moved to the other, the lease expired: the takeover's token is greater
#     than the old one (whose node's token sequence is far ahead) and the
#     old token is fenced; sessions that cached the shard map before the
#     move follow it (a direct call on the old worker, in a transaction
#     whose snapshot predates the move too, is refused and writes nothing
#     into the old placement, whose drop is deferred);
# 10. fencing after the key's record expired and was cleaned up on the node
#     the shard moved to: a new operation of the key gets a token that the
#     fenced owner of the first one never held;
# 11. an event published on the coordinator in a client transaction whose
#     order and record are written on a worker commits with them or not at
#     all, through a coordinator crash after the worker committed;
# 12. so does a write to a plain table of the coordinator in such a
#     transaction, with idempotency.citus_atomic_local_writes;
# 13. a scope that is another spelling of a tenant ('042' for 42), or no
#     tenant at all ('acme'), is refused with 22023, and nothing is written;
# 14. citext and char(n) tenants are refused; records and inbox marks that
#     idem_citus_distribute moves into the shards get their tenant's
#     canonical text;
# 15. a monitoring role granted only SELECT on idem_stuck reads it from the
#     coordinator, and an operator granted only destination commands runs
#     them there: they reach every worker, and its function destination runs
#     as the operator everywhere;
# 16. a worker's own function destination that would run as another role or
#     call another function is not taken over by the coordinator's of the
#     same name; destinations whose creator was dropped are still paused
#     everywhere;
# 17. nor when the coordinator's creator was dropped, nor by a destination
#     created and dropped in one coordinator transaction, and a worker
#     refuses a function destination whose function there another role
#     made;
# 18. copies are told apart by the role that made them, drops by what the
#     destination was when the coordinator's transaction began, functions
#     by their own name (renamed) or absence (dropped); a resume rolled
#     back to a savepoint does not clear what a worker's relay learned; the
#     workers commit a transaction's destinations with the coordinator
#     (two-phase commit): a drop with a worker down drops nothing on the
#     others, a coordinator crash after the pre-commit step leaves nothing,
#     and a worker's cleanup and relay go on while it holds a drop prepared;
#     a worker without Citus's metadata makes destination commands fail;
#     secrets reach neither a worker's log or pg_stat_activity nor,
#     through Citus's echo of its commands, a role that may not read them.
#
# Skipped when Citus is not installed.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CitusCluster;

CitusCluster::skip_unless_citus();

# Four shards keep the moves short.  Every node runs the cleanup worker and
# relay of the database, a pass a second.  A duplicate waits up to a minute
# for the transaction that holds its key (block 2 holds it on purpose).
my $cluster = CitusCluster->new(workers => 2, conf => q{
citus.shard_count = 4
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1s'
idempotency.wait_timeout = '60s'
});
$cluster->create_idempotency;
my $coord = $cluster->coordinator;
my @workers = $cluster->workers;

# SQL on a node, or on the coordinator.
sub on { my ($node, $sql) = @_; return $cluster->safe_psql($node, $sql); }
sub coord { return on($coord, $_[0]); }

# The application: orders (no unique key, so a second execution shows as a
# second row), distributed by tenant, and POST /orders as a PL/pgSQL
# function distributed by its tenant and force-delegated.  It answers the
# claim's outcome and the port of the node it ran on; it publishes an event
# when asked to.
coord(q{
	CREATE TABLE orders (tenant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL,
						 port int, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
	SELECT create_distributed_table('orders', 'tenant_id');
	SELECT idem_citus_distribute('orders');

	CREATE FUNCTION place_order(p_tenant bigint, p_key text, p_amount int, p_publish boolean DEFAULT false)
	RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
	BEGIN
		c := idem_citus.idem_claim(p_tenant, 'POST /orders:' || p_key, jsonb_build_object('amount', p_amount));
		IF c.outcome = 'claimed' THEN
			INSERT INTO orders (tenant_id, key, amount, port)
			VALUES (p_tenant, p_key, p_amount, current_setting('port')::int);
			IF p_publish THEN
				PERFORM idem_publish('order.created', jsonb_build_object('tenant', p_tenant, 'key', p_key),
									 'order-' || p_tenant || '-' || p_key);
			END IF;
			PERFORM idem_citus.idem_succeed(p_tenant, 'POST /orders:' || p_key, 201, jsonb_build_object('order', p_key));
		END IF;
		RETURN c.outcome || ' ' || current_setting('port');
	END $$;
	SELECT create_distributed_function('place_order(bigint,text,int,boolean)', '$1',
									   colocate_with => 'orders', force_delegation => true);

	-- An idem_execute handler (PL/pgSQL: Citus refuses LANGUAGE sql ones there).
	CREATE FUNCTION order_handler(request jsonb) RETURNS idem_response LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO orders (tenant_id, key, amount, port)
		VALUES ((request->>'tenant')::bigint, request->>'key', (request->>'amount')::int,
				current_setting('port')::int);
		RETURN ROW(201, NULL, jsonb_build_object('order', request->>'key'))::idem_response;
	END $$;
});

# The node that holds the placement of $table's shard for tenant $t.
sub holder
{
	my ($t, $table) = @_;
	$table //= 'idempotency.records';
	my $port = coord(qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		 WHERE p.shardid = get_shard_id_for_distribution_column('$table', $t)});
	return $cluster->node_by_port($port);
}

# The other worker.
sub other { my ($node) = @_; my ($o) = grep { $_ != $node } @workers; return $o; }

# Where the rows of $table for tenant $t that match $cond are: for each node,
# its name and the count in its shard of the tenant, or "-" where that shard
# does not exist.  E.g. "coordinator:- worker1:1 worker2:-".
sub where_rows
{
	my ($table, $t, $cond) = @_;
	my $column = $table eq 'orders' ? 'tenant_id' : 'tenant';
	my $shard = $table . '_' . coord("SELECT get_shard_id_for_distribution_column('$table', $t)");
	return join ' ', map {
		my $n = on($_, "SELECT to_regclass('$shard') IS NOT NULL");
		$_->name . ':' . ($n eq 't'
			? on($_, "SELECT count(*) FROM $shard WHERE $column = $t AND ($cond)")
			: '-')
	} $cluster->nodes;
}

# What where_rows says when $count rows are on $node and the shard is
# nowhere else.
sub only_on
{
	my ($node, $count) = @_;
	return join ' ', map { $_->name . ':' . ($_ == $node ? $count : '-') } $cluster->nodes;
}

# A tenant whose shard is on each worker.
my %tenant_on;
for my $t (1 .. 100)
{
	my $h = holder($t, 'orders');
	$tenant_on{ $h->name } //= $t;
	last if keys %tenant_on == 2;
}
my ($A, $B) = map { $tenant_on{ $_->name } } @workers;
my ($hold_a, $hold_b) = ($workers[0], $workers[1]);
die 'no tenant on each worker' unless defined $A && defined $B;
is(holder($A)->name . ' ' . holder($B)->name, 'worker1 worker2',
	"the records of tenant $A are colocated with its orders on worker1, those of tenant $B on worker2");

# An error as psql prints it with VERBOSITY verbose (SQLSTATE, detail, hint).
sub coord_error
{
	my ($sql) = @_;
	my ($out, $err) = ('', '');
	$coord->psql($cluster->dbname, "\\set VERBOSITY verbose\n$sql",
		stdout => \$out, stderr => \$err, on_error_stop => 1);
	return $err;
}

# What $sql prints on the coordinator, or its error if it fails: for checks
# that must report a failure rather than stop the test.
sub coord_try
{
	my ($sql) = @_;
	my ($out, $err) = ('', '');
	my $rc = $coord->psql($cluster->dbname, $sql, stdout => \$out, stderr => \$err,
		on_error_stop => 1);
	return $rc == 0 ? $out : $err;
}

# A query on a background session that must fail: its error (VERBOSITY
# verbose, set when the session starts), or '' if it did not fail.
sub session_error
{
	my ($session, $sql) = @_;
	$session->{stderr} = '';
	my (undef, $failed) = $session->query($sql);
	my $err = $session->{stderr};
	$session->{stderr} = '';
	return $failed ? $err : '';
}

# kill -9 of a whole node, as with a power cut: the postmaster and every
# child at once; then wait until they are all gone and start it again
# (crash recovery runs at start).
sub kill9_node
{
	my ($node) = @_;
	my $postmaster = $node->{_pid};
	my @children = grep {
		my $fh;
		my $stat = open($fh, '<', "/proc/$_/stat") ? <$fh> : '';
		$stat =~ /\)\s+\S+\s+(\d+)/ && $1 == $postmaster
	} map { m{/proc/(\d+)$} ? $1 : () } glob('/proc/[0-9]*');
	$node->kill9;
	kill 'KILL', @children;
	for my $pid ($postmaster, @children)
	{
		my $tries = 0;
		while (kill(0, $pid) && $tries++ < 10 * $PostgreSQL::Test::Utils::timeout_default)
		{
			select(undef, undef, undef, 0.1);
		}
	}
	$node->start;
}

# Wait until $sql, run on $node with psql -q (so that a SET before the
# query prints nothing), answers "t".
sub poll_true
{
	my ($node, $sql) = @_;
	for (1 .. 10 * $PostgreSQL::Test::Utils::timeout_default)
	{
		return 1 if on($node, $sql) eq 't';
		select(undef, undef, undef, 0.1);
	}
	diag("timed out waiting for: $sql");
	return 0;
}

# A query sent on a background session, whose answer is read later.
sub start_query
{
	my ($session, $sql) = @_;
	$session->query_until(qr/started\n/, "\\echo started\n$sql;\n");
}

sub finish_query
{
	my ($session) = @_;
	my $out = $session->query_until(qr/finished\n/, "\\echo finished\n");
	$out =~ s/finished\n\z//;
	chomp $out;
	return $out;
}

# ---- 1. Delegated create, replay and mismatch.
# A client transaction of several statements on the coordinator: the claim,
# the domain INSERT and the stored response commit together on tenant A's
# worker.
is( coord(qq{
		BEGIN;
		SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:c1', '{"amount": 10}');
		INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'c1', 10);
		SELECT idem_citus.idem_succeed($A, 'POST /orders:c1', 201, '{"order": "c1"}');
		COMMIT;}),
	"claimed\n", '1: a client transaction on the coordinator claims the key');
is( coord(qq{
		SELECT outcome || ' ' || status || ' ' || body FROM idem_citus.idem_claim($A, 'POST /orders:c1', '{"amount": 10}');
		SELECT outcome || ' ' || coalesce(status::text, '-') FROM idem_citus.idem_claim($A, 'POST /orders:c1', '{"amount": 11}');
		SELECT state || ' ' || status FROM idem_citus.idem_replay($A, 'POST /orders:c1');}),
	qq{replay 201 {"order": "c1"}\nmismatch -\ncompleted 201},
	'1: the same request replays the stored response, another one is a mismatch');
is( where_rows('idempotency.records', $A, q{key = 'POST /orders:c1' AND state = 'completed'})
	  . ' / ' . where_rows('orders', $A, q{key = 'c1'}),
	only_on($hold_a, 1) . ' / ' . only_on($hold_a, 1),
	'1: the record and the order are in the shards of tenant A on its worker, nowhere else');

# The same through the distributed function, for tenant B on the other
# worker, alone and twice in one transaction block.
is( coord(qq{
		SELECT place_order($B, 'f1', 20);
		SELECT place_order($B, 'f1', 20);
		SELECT place_order($B, 'f1', 21);
		BEGIN;
		SELECT place_order($B, 'f2', 20);
		SELECT place_order($B, 'f2', 20);
		COMMIT;}),
	join("\n", map { "$_ " . $hold_b->port } qw(claimed replay mismatch claimed replay)),
	'1: the distributed function runs on the worker of tenant B: created, replayed, mismatch, in a transaction block too');
is( where_rows('idempotency.records', $B, q{key IN ('POST /orders:f1', 'POST /orders:f2')})
	  . ' / ' . where_rows('orders', $B, q{key IN ('f1', 'f2')}),
	only_on($hold_b, 2) . ' / ' . only_on($hold_b, 2),
	'1: its records and orders are on that worker only, one each');

# idem_execute with a PL/pgSQL handler, delegated too.
is( coord(qq{
		SELECT status || ' ' || body || ' ' || replayed FROM idem_citus.idem_execute($A, 'POST /orders:x1',
			'{"tenant": $A, "key": "x1", "amount": 3}', 'order_handler(jsonb)');
		SELECT status || ' ' || body || ' ' || replayed FROM idem_citus.idem_execute($A, 'POST /orders:x1',
			'{"tenant": $A, "key": "x1", "amount": 3}', 'order_handler(jsonb)');
		SELECT string_agg(port::text, ',') FROM orders WHERE key = 'x1';}),
	qq{201 {"order": "x1"} false\n201 {"order": "x1"} true\n} . $hold_a->port,
	'1: idem_execute runs its handler once, on tenant A\'s worker, and replays');

# ---- 2. Ten concurrent duplicates execute once.
# The first session holds the key in an open transaction; nine more send
# the same request and wait for it on the worker; the first commits.
{
	my @sessions = map { $coord->background_psql($cluster->dbname, on_error_stop => 0) } 1 .. 10;
	$sessions[0]->query_safe('BEGIN');
	my $first = $sessions[0]->query_safe("SELECT place_order($A, 'dup', 30)");
	start_query($_, "SELECT place_order($A, 'dup', 30)") for @sessions[ 1 .. 9 ];
	ok( $hold_a->poll_query_until($cluster->dbname, q{
			SELECT count(*) = 9 FROM pg_locks
			 WHERE locktype = 'advisory' AND objsubid = 7648 AND NOT granted}),
		'2: nine duplicates wait on tenant A\'s worker for the key the first one holds');
	$sessions[0]->query_safe('COMMIT');
	my @answers = map { finish_query($_) } @sessions[ 1 .. 9 ];
	$_->quit for @sessions;
	is_deeply([ $first, @answers ], [ 'claimed ' . $hold_a->port, ('replay ' . $hold_a->port) x 9 ],
		'2: the first executes, the nine others replay');
	is( coord(q{SELECT count(*) FROM orders WHERE key = 'dup'}) . ' '
		  . coord(qq{SELECT count(*) FROM idempotency.records WHERE scope = '$A' AND key = 'POST /orders:dup'}),
		'1 1', '2: one order, one record');
}

# Ten pgbench clients send one request each with the same key at once.
{
	my $script = PostgreSQL::Test::Utils::tempdir() . '/dup.sql';
	PostgreSQL::Test::Utils::append_to_file($script, "SELECT place_order($B, 'burst', 40);\n");
	$coord->command_ok(
		[ 'pgbench', '-n', '-c', '10', '-j', '10', '-t', '1', '-f', $script,
		  '-h', $coord->host, '-p', $coord->port, $cluster->dbname ],
		'2: ten pgbench clients send the same request at once, all succeed');
	is( coord(q{SELECT count(*) FROM orders WHERE key = 'burst'}) . ' '
		  . coord(qq{SELECT count(*) FROM idempotency.records WHERE scope = '$B' AND key = 'POST /orders:burst'}),
		'1 1', '2: one order, one record');
}

# ---- 3. A call Citus does not delegate is refused and executes nothing.
# A text scope (no overload delegated for it), the call in a FROM list
# next to another function, in a CTE, and inside a PL/pgSQL function of the
# coordinator (a "simple expression" Citus never delegates in a
# transaction): each time 40001 with a hint about delegation.
coord(q{
	CREATE FUNCTION app_order(p_tenant bigint, p_key text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
	BEGIN
		c := idem_citus.idem_claim(p_tenant, 'POST /orders:' || p_key, '{"amount": 1}'::jsonb);
		INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, 1);
		PERFORM idem_citus.idem_succeed(p_tenant, 'POST /orders:' || p_key, 201);
		RETURN c.outcome;
	END $$;
});
my %undelegated = (
	n1 => qq{BEGIN; INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'n1', 1);
			 SELECT outcome FROM idem_claim('$A', 'POST /orders:n1', '{"amount": 1}');
			 SELECT idem_succeed('$A', 'POST /orders:n1', 201); COMMIT;},
	n2 => qq{BEGIN; INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'n2', 1);
			 SELECT idem_citus.idem_claim($A, 'POST /orders:n2', '{"amount": 1}'::jsonb) FROM generate_series(1, 1);
			 SELECT idem_citus.idem_succeed($A, 'POST /orders:n2', 201); COMMIT;},
	n3 => qq{WITH c AS (SELECT * FROM idem_citus.idem_claim($A, 'POST /orders:n3', '{"amount": 1}'))
			 SELECT outcome FROM c;},
	n4 => qq{SELECT app_order($A, 'n4');},
	n5 => qq{BEGIN; SELECT app_order($A, 'n5'); COMMIT;},
	n6 => qq{SELECT idem_inbox_accept('$A', 'n6');},
);
for my $key (sort keys %undelegated)
{
	my $err = coord_error($undelegated{$key});
	like($err, qr/ERROR:  40001: the rows of "$A" in idempotency\.(records|inbox) are not on this node/,
		"3: $key is refused with 40001");
	like($err, qr/HINT:  .*delegates/, "3: $key: the hint says how to have the call delegated");
}
is( where_rows('idempotency.records', $A, q{key IN ('POST /orders:n1', 'POST /orders:n2', 'POST /orders:n3',
												'POST /orders:n4', 'POST /orders:n5')})
	  . ' / ' . where_rows('orders', $A, q{key IN ('n1', 'n2', 'n3', 'n4', 'n5')})
	  . ' / ' . where_rows('idempotency.inbox', $A, q{message_id = 'n6'}),
	only_on($hold_a, 0) . ' / ' . only_on($hold_a, 0) . ' / ' . only_on($hold_a, 0),
	'3: the refused calls left no record, no order, no inbox mark');

# ---- 4. kill -9 of the tenant's worker in the middle of a client transaction.
{
	my $session = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$session->query_safe('BEGIN');
	is( $session->query_safe(qq{SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:k9', '{"amount": 9}')}),
		'claimed', '4: the claim of k9 in an open client transaction');
	$session->query_safe(qq{INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'k9', 9)});
	is( on($hold_a, q{
			SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			 WHERE l.locktype = 'advisory' AND l.objsubid = 7648 AND l.granted
			   AND a.state = 'idle in transaction'}),
		'1', '4: on the worker, a transaction holds the key, idle before COMMIT');

	# The whole node dies at once.
	kill9_node($hold_a);

	like(session_error($session, 'COMMIT'), qr/ERROR:  could not commit transaction/,
		'4: the client\'s COMMIT fails');
	$session->quit;
	is( where_rows('idempotency.records', $A, q{key = 'POST /orders:k9'})
		  . ' / ' . where_rows('orders', $A, q{key = 'k9'}),
		only_on($hold_a, 0) . ' / ' . only_on($hold_a, 0),
		'4: after the restart there is neither the record nor the order');
	is( coord(qq{
			BEGIN;
			SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:k9', '{"amount": 9}');
			INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'k9', 9);
			SELECT idem_citus.idem_succeed($A, 'POST /orders:k9', 201, '{"order": "k9"}');
			COMMIT;
			SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:k9', '{"amount": 9}');}),
		"claimed\n\nreplay", '4: the retry executes, its own retry replays');
	is(where_rows('orders', $A, q{key = 'k9'}), only_on($hold_a, 1), '4: exactly one order');
}

# ---- 5. The workers' cleanup deletes expired rows from the shards.
# Three records and two inbox marks per tenant live one second; the
# workers' counters of deleted rows must grow by exactly five each.
{
	my %deleted_before = map { $_->name => on($_, 'SELECT rows_deleted FROM idem_stats') } @workers;
	for my $t ($A, $B)
	{
		coord(join '', map { qq{
			BEGIN;
			SELECT outcome FROM idem_citus.idem_claim($t, 'POST /orders:ttl$_', '{}', ttl => '1 second');
			SELECT idem_citus.idem_succeed($t, 'POST /orders:ttl$_', 200);
			COMMIT;} } 1 .. 3);
		coord(qq{SELECT idem_citus.idem_inbox_accept($t, 'ttl-m$_', ttl => '1 second')}) for 1 .. 2;
	}
	for my $t ($A, $B)
	{
		my $node = holder($t);
		my $shard = 'idempotency.records_' . coord("SELECT get_shard_id_for_distribution_column('idempotency.records', $t)");
		my $inbox = 'idempotency.inbox_' . coord("SELECT get_shard_id_for_distribution_column('idempotency.inbox', $t)");
		ok( $node->poll_query_until($cluster->dbname, qq{
				SELECT (SELECT count(*) FROM $shard WHERE key LIKE 'POST /orders:ttl%')
					 + (SELECT count(*) FROM $inbox WHERE message_id LIKE 'ttl-m%') = 0}),
			"5: the expired records and marks of tenant $t are gone from its shards on " . $node->name);
	}
	is_deeply({ map { $_->name => on($_, 'SELECT rows_deleted FROM idem_stats') - $deleted_before{ $_->name } } @workers },
		{ map { $_->name => 5 } @workers },
		'5: each worker\'s cleanup deleted exactly its five expired rows');
	is( where_rows('idempotency.records', $A, q{key = 'POST /orders:c1'}), only_on($hold_a, 1),
		'5: a live record is left alone');
	is(coord('SELECT idem_cleanup()'), '0', '5: idem_cleanup() on the coordinator deletes nothing and fails not');
}

# ---- 6. idem_stuck from the coordinator.
# A multi-phase operation whose owner never came back: listed once its
# lease expired more than the session's idempotency.stuck_after ago (0),
# not with the default (5 minutes).
{
	my $token = coord(qq{SELECT token FROM idem_citus.idem_claim($B, 'POST /pay:stuck', '{}', lease => '1 second')});
	ok( poll_true($coord, qq{
			SET idempotency.stuck_after = 0;
			SELECT count(*) = 1 FROM idem_stuck WHERE scope = '$B' AND key = 'POST /pay:stuck'}),
		'6: idem_stuck lists the operation once its lease expired, with stuck_after = 0');
	is( coord(q{
			SET idempotency.stuck_after = 0;
			SELECT scope || ' ' || key || ' ' || token || ' ' || (lease_expired_for > '0'::interval)
			  FROM idem_stuck ORDER BY scope, key;
			RESET idempotency.stuck_after;
			SELECT count(*) FROM idem_stuck;}),
		"$B POST /pay:stuck $token true\n0",
		'6: with its scope, key and token; and not with the default stuck_after');
}

# ---- 7. The inbox is distributed.
is( coord(qq{
		SELECT idem_citus.idem_inbox_accept($A, 'm1');
		SELECT idem_citus.idem_inbox_accept($A, 'm1');
		BEGIN;
		SELECT idem_citus.idem_inbox_accept($B, 'm1');
		SELECT idem_citus.idem_inbox_accept($B, 'm1');
		COMMIT;
		SELECT idem_citus.idem_inbox_accept($B, 'm1');}),
	"t\nf\nt\nf\nf", '7: idem_inbox_accept answers true, then false, per tenant, in a transaction block too');
is( where_rows('idempotency.inbox', $A, q{message_id = 'm1'}) . ' / '
	  . where_rows('idempotency.inbox', $B, q{message_id = 'm1'}),
	only_on($hold_a, 1) . ' / ' . only_on($hold_b, 1),
	'7: each mark is in its tenant\'s inbox shard only');

# ---- 8. The outbox: events relayed by the worker that published them.
# The destination function writes a table of each node's own (created with
# DDL propagation off): the relay's call and its mark "delivered" commit in
# one local transaction of that node, which is what makes a function
# destination exactly once.  A reference table would turn every delivery
# into a distributed write from a background worker.
for my $node ($cluster->nodes)
{
	on($node, q{
		SET citus.enable_ddl_propagation = off;
		CREATE TABLE received (event_id uuid, topic text, payload jsonb, port int)});
}
coord(q{
	CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO received VALUES ((event->>'id')::uuid, event->>'topic', event->'payload',
									 current_setting('port')::int);
	END $$;
	SELECT idem_destination_create('ledger', 'function', 'fdest(jsonb)', '{order.*}');
});
is_deeply([ map { on($_, q{SELECT name || ' ' || kind || ' ' || target || ' ' || paused FROM idem_destinations}) } @workers ],
	[ ('ledger function public.fdest(pg_catalog.jsonb) false') x 2 ],
	'8: the destination created on the coordinator is on every worker');

{
	is( coord(qq{SELECT place_order($A, 'e1', 50, true)}) . ' ' . coord(qq{SELECT place_order($B, 'e1', 50, true)}),
		'claimed ' . $hold_a->port . ' claimed ' . $hold_b->port,
		'8: two orders that publish an event, one on each worker');
	for my $node ($hold_a, $hold_b)
	{
		ok( $node->poll_query_until($cluster->dbname, q{
				SELECT count(*) = 1 FROM idempotency.deliveries WHERE state = 'delivered'}),
			'8: the event published on ' . $node->name . ' is delivered by its relay');
	}
	is_deeply([ map { on($_, q{SELECT coalesce(string_agg(topic || ' ' || (payload->>'key') || ' ' || port, ','), '') FROM received}) } $cluster->nodes ],
		[ '', 'order.created e1 ' . $hold_a->port, 'order.created e1 ' . $hold_b->port ],
		'8: each event reached the destination once, on the node that published it');
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.outbox}) } $cluster->nodes),
		'0 1 1', '8: the events are in the outboxes of the workers, none on the coordinator');
}

# Pause on the coordinator: paused on every worker, nothing delivered; resume:
# delivered once; drop: gone everywhere.
{
	coord(q{SELECT idem_destination_pause('ledger')});
	is_deeply([ map { on($_, q{SELECT paused FROM idem_destinations WHERE name = 'ledger'}) } @workers ],
		[ 't', 't' ], '8: a pause on the coordinator reaches every worker');
	coord(qq{SELECT place_order($A, 'e2', 51, true)});
	is( on($hold_a, 'SELECT idem_outbox_relay()') . ' '
		  . on($hold_a, q{SELECT count(*) FROM received WHERE payload->>'key' = 'e2'}),
		'0 0', '8: while paused, the worker\'s relay attempts nothing');
	coord(q{SELECT idem_destination_resume('ledger')});
	ok( $hold_a->poll_query_until($cluster->dbname, q{
			SELECT count(*) = 2 FROM idempotency.deliveries WHERE state = 'delivered'}),
		'8: resumed on the coordinator, the worker delivers it');
	is(on($hold_a, q{SELECT count(*) FROM received WHERE payload->>'key' = 'e2'}), '1',
		'8: once');
	coord(q{SELECT idem_destination_drop('ledger')});
	is_deeply([ map { on($_, q{SELECT count(*) FROM idem_destinations}) } $cluster->nodes ],
		[ '0', '0', '0' ], '8: a drop on the coordinator reaches every worker');
}

# Move the shard of tenant $t (and the colocated ones) from $from to $to.
# The old placements are dropped later, by citus_cleanup_orphaned_resources
# (Citus defers that otherwise).
sub move_shard
{
	my ($t, $from, $to, $mode) = @_;
	coord(sprintf(q{
		SELECT citus_move_shard_placement(get_shard_id_for_distribution_column('orders', %s),
			'%s', %d, '%s', %d, shard_transfer_mode => '%s')},
		$t, $from->host, $from->port, $to->host, $to->port, $mode));
}

# ---- 9. Fencing tokens after a shard move.
# Tenant A's worker has handed out many tokens (its sequence is far ahead of
# the other worker's).  A lease is taken there and a phase checkpointed;
# the shard moves to the other worker; once the lease has expired, the
# retry there takes over with a greater token than the old owner's, which
# is fenced.  Sessions that used the shard map before the move see the new
# placement after it: a direct call on the old worker (also in a
# transaction whose snapshot predates the move) is refused and does not
# write the old placement, which still exists until its deferred drop; a
# coordinator session whose connection to the new worker was opened before
# the move has its call for tenant A run there.
{
	on($hold_a, q{SELECT setval('idempotency.tokens', 1000000000000)});
	my ($outcome, $old) = split ' ', coord(qq{
		SELECT outcome || ' ' || token FROM idem_citus.idem_claim($A, 'POST /pay:fence', '{"amount": 5}', lease => '1 second')});
	is($outcome, 'claimed', "9: a lease on tenant A's worker, token $old");
	coord(qq{SELECT idem_citus.idem_checkpoint($A, 'POST /pay:fence', $old, 'phase1')});

	my $direct = $hold_a->background_psql($cluster->dbname, on_error_stop => 0);
	my $rr = $hold_a->background_psql($cluster->dbname, on_error_stop => 0);
	my $client = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$_->query_safe('\set VERBOSITY verbose') for $direct, $rr, $client;
	is( $direct->query_safe(qq{SELECT idem_inbox_accept('$A', 'pre-move')}) . ' '
		  . $client->query_safe(qq{SELECT place_order($B, 'pre-move', 1)}),
		't claimed ' . $hold_b->port,
		'9: before the move, a session on the old worker and a coordinator session that reached the new one');
	$rr->query_safe('BEGIN ISOLATION LEVEL REPEATABLE READ');
	$rr->query_safe('SELECT count(*) FROM pg_class');
	my $inbox_shard = 'idempotency.inbox_'
	  . coord("SELECT get_shard_id_for_distribution_column('idempotency.inbox', $A)");

	move_shard($A, $hold_a, $hold_b, 'force_logical');
	is(holder($A)->name, $hold_b->name, '9: the shard of tenant A moved to the other worker');
	is(on($hold_a, "SELECT count(*) FROM $inbox_shard WHERE message_id = 'pre-move'"), '1',
		'9: the old placement is still on the old worker, its drop deferred');
	like(session_error($direct, qq{SELECT idem_inbox_accept('$A', 'post-move')}),
		qr/ERROR:  40001: the rows of "$A" in idempotency\.inbox are not on this node/,
		'9: a direct call on the old worker after the move is refused');
	like(session_error($rr, qq{SELECT idem_inbox_accept('$A', 'rr-move')}),
		qr/ERROR:  40001: the rows of "$A" in idempotency\.inbox are not on this node/,
		'9: in a transaction whose snapshot predates the move too');
	is(on($hold_a, "SELECT count(*) FROM $inbox_shard WHERE message_id IN ('post-move', 'rr-move')"), '0',
		'9: the old placement got no write');
	is($client->query_safe(qq{SELECT place_order($A, 'post-move', 1)}), 'claimed ' . $hold_b->port,
		'9: the coordinator session\'s call for tenant A runs on the new worker');
	$_->quit for $direct, $rr, $client;
	coord('CALL citus_cleanup_orphaned_resources()');

	is( where_rows('idempotency.records', $A,
			qq{key = 'POST /pay:fence' AND state = 'processing' AND token = $old AND recovery_point = 'phase1'})
		  . ' / ' . coord(qq{SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:c1', '{"amount": 10}')}),
		only_on($hold_b, 1) . ' / replay',
		'9: the records moved with the shard: the lease with its token and recovery point, a completed one replays');
	ok( $coord->poll_query_until($cluster->dbname, qq{
			SELECT lease_expires_at < now() FROM idempotency.records
			 WHERE scope = '$A' AND key = 'POST /pay:fence'}),
		'9: the lease expired');
	my ($again, $new, $point) = split ' ', coord(qq{
		SELECT outcome || ' ' || token || ' ' || recovery_point
		  FROM idem_citus.idem_claim($A, 'POST /pay:fence', '{"amount": 5}', lease => '1 minute')});
	is("$again $point", 'claimed phase1', '9: the retry takes over from phase1');
	cmp_ok($new, '>', $old, '9: the takeover\'s token is greater than the old owner\'s');
	like(coord_error(qq{SELECT idem_citus.idem_checkpoint($A, 'POST /pay:fence', $old, 'phase2')}),
		qr/ERROR:  IK001/, '9: the old owner is fenced');
	is( coord(qq{
			SELECT idem_citus.idem_succeed($A, 'POST /pay:fence', 201, '{"paid": true}', token => $new);
			SELECT outcome || ' ' || status FROM idem_citus.idem_claim($A, 'POST /pay:fence', '{"amount": 5}');}),
		"\nreplay 201", '9: the new owner completes it');
}

# ---- 10. Fencing after the record expired and was deleted on the new node.
# On a new cluster every node's token sequence starts at the same value;
# here the other worker's is set to where tenant B's worker's is.  Tenant
# B's worker hands out a token; its owner is fenced by a takeover that
# completes; the shard moves to the other worker, where the record expires
# and that worker's cleanup deletes it (cleanup of a shard that moved in);
# the key is used again for a new operation.  Its token must be one the
# fenced owner never held (README: a token is never valid twice for a key).
{
	my $other = other($hold_b);
	my $next = on($hold_b, q{SELECT last_value + 1 FROM idempotency.tokens});
	on($other, qq{SELECT setval('idempotency.tokens', $next - 1)});
	my $zombie = coord(qq{SELECT token FROM idem_citus.idem_claim($B, 'POST /pay:again', '{}', ttl => '1 second', lease => '1 second')});
	ok( $coord->poll_query_until($cluster->dbname, qq{
			SELECT lease_expires_at < now() FROM idempotency.records
			 WHERE scope = '$B' AND key = 'POST /pay:again'}),
		'10: the first owner\'s lease expired');
	my $taker = coord(qq{SELECT token FROM idem_citus.idem_claim($B, 'POST /pay:again', '{}', ttl => '1 second', lease => '1 minute')});
	coord(qq{SELECT idem_citus.idem_succeed($B, 'POST /pay:again', 201, token => $taker)});
	like(coord_error(qq{SELECT idem_citus.idem_checkpoint($B, 'POST /pay:again', $zombie, 'late')}),
		qr/ERROR:  IK001/, "10: the first owner (token $zombie) is fenced by the takeover (token $taker)");
	move_shard($B, $hold_b, $other, 'block_writes');
	coord('CALL citus_cleanup_orphaned_resources()');
	my $shard = 'idempotency.records_' . coord("SELECT get_shard_id_for_distribution_column('idempotency.records', $B)");
	is(holder($B)->name, $other->name, '10: the shard of tenant B moved');
	ok( $other->poll_query_until($cluster->dbname, qq{
			SELECT count(*) = 0 FROM $shard WHERE key = 'POST /pay:again'}),
		'10: the completed record expired, and the cleanup of the node it moved to deleted it');
	my $fresh = coord(qq{SELECT token FROM idem_citus.idem_claim($B, 'POST /pay:again', '{}', lease => '1 minute')});
	isnt($fresh, $zombie, "10: the new operation's token ($fresh) is not the fenced owner's");
	like(coord_error(qq{SELECT idem_citus.idem_checkpoint($B, 'POST /pay:again', $zombie, 'late')}),
		qr/ERROR:  IK001/, '10: the fenced owner cannot checkpoint the new operation');
}

# For blocks 11, 12 and 18j: a coordinator session that holds the
# lock of the NOTIFY queue, its own commit waiting for a synchronous
# standby that never comes, so that the next commit that notifies stops
# after its pre-commit step, where Citus has committed or prepared the
# workers' part.
sub notify_gate
{
	my ($n) = @_;
	coord(q{ALTER SYSTEM SET synchronous_standby_names = 'nobody'});
	coord(q{ALTER SYSTEM SET synchronous_commit = 'local'});
	coord('SELECT pg_reload_conf()');
	ok(poll_true($coord, q{SELECT current_setting('synchronous_standby_names') = 'nobody'}),
		"$n: the coordinator waits for a standby that never comes, where asked");
	my $gate = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$gate->query_safe('SET synchronous_commit = on');
	$gate->query_safe('BEGIN');
	# A commit waits for the standby only if its transaction wrote WAL
	# before its commit record, and a NOTIFY writes none (such a commit
	# returned at once, unless something else happened to write WAL, such
	# as pruning a page): a transactional logical message does.
	$gate->query_safe(q{SELECT pg_notify('gate', ''), pg_logical_emit_message(true, 'gate', '')});
	$gate->query_until(qr/committing\n/, "\\echo committing\nCOMMIT;\n");
	ok( $coord->poll_query_until($cluster->dbname, q{
			SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'}),
		"$n: a session holds the NOTIFY queue's lock, its commit waiting");
	return $gate;
}

# For blocks 11 and 12: a client transaction on the coordinator (after
# $setup, if given) that claims tenant A's key POST /orders:$key, writes
# its order (on $holder, A's worker), runs $write on the coordinator,
# notifies and stores the response; its COMMIT stops at the NOTIFY queue (notify_gate), after
# Citus's pre-commit step, where the worker must have prepared its part,
# not committed it.  Returns the session, its COMMIT still waiting.
sub frozen_commit
{
	my ($n, $holder, $key, $amount, $write, $setup) = @_;
	my $app = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$app->query_safe($setup) if defined $setup;
	$app->query_safe('BEGIN');
	is( $app->query_safe(qq{SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:$key', '{"amount": $amount}')}),
		'claimed', "$n: the client transaction claims the key");
	$app->query_safe(qq{INSERT INTO orders (tenant_id, key, amount) VALUES ($A, '$key', $amount)});
	$app->query_safe($write);
	$app->query_safe(qq{SELECT pg_notify('app', '$key')});
	$app->query_safe(qq{SELECT idem_citus.idem_succeed($A, 'POST /orders:$key', 201, '{"order": "$key"}')});
	start_query($app, 'COMMIT');
	ok( $coord->poll_query_until($cluster->dbname, q{
			SELECT count(*) = 1 FROM pg_stat_activity
			 WHERE query = 'COMMIT;' AND wait_event_type = 'Lock' AND wait_event = 'object'}),
		"$n: its COMMIT waits for the NOTIFY queue, on the coordinator");
	is( on($holder, qq{SELECT count(*) FROM orders WHERE key = '$key'}) . ' '
		  . on($holder, q{SELECT count(*) FROM pg_prepared_xacts}),
		'0 1', "$n: by then tenant A's worker has prepared its part, not committed it (two-phase commit)");
	return $app;
}

# kill -9 the coordinator under the sessions given, then undo notify_gate.
sub crash_coordinator
{
	$_->{run}->kill_kill for @_;
	kill9_node($coord);
	coord(q{ALTER SYSTEM RESET synchronous_standby_names});
	coord(q{ALTER SYSTEM RESET synchronous_commit});
	coord('SELECT pg_reload_conf()');
}

# ---- 11. An event published on the coordinator next to a delegated write.
# A client transaction of several statements on the coordinator claims,
# writes the order (on tenant A's worker), publishes the order's event
# (idem_publish is not a distributed function: on the coordinator, into the
# coordinator's outbox) and stores the response.  Citus would commit the
# single worker with a one-phase COMMIT before the coordinator commits (it
# does not see the extension's heap writes on the coordinator); idem_publish
# asks it for two-phase commit, so the worker only prepares.  The
# coordinator is frozen in that window, then killed: its commit waits for
# the lock of the NOTIFY queue (the application also notifies), which a
# session holds while its own commit waits for a synchronous standby that
# never comes.  The event must commit with the order and its record, or
# none of them may; Citus's 2PC recovery then rolls the worker's prepared
# part back, and the retry creates the order, its record and its event once.
{
	my $holder = holder($A);
	my $gate = notify_gate('11');

	my $app = frozen_commit('11', $holder, 'ob1', 70,
		q{SELECT idem_publish('order.created', '{"key": "ob1"}', 'order-ob1')});

	crash_coordinator($gate, $app);
	my $state = join ' ',
	  coord(q{SELECT count(*) FROM orders WHERE key = 'ob1'}),
	  coord(qq{SELECT count(*) FROM idem_citus.idem_replay($A, 'POST /orders:ob1')}),
	  coord(q{SELECT count(*) FROM idempotency.outbox WHERE payload->>'key' = 'ob1'})
	  + on($holder, q{SELECT count(*) FROM idempotency.outbox WHERE payload->>'key' = 'ob1'});
	ok($state eq '1 1 1' || $state eq '0 0 0',
		"11: after the coordinator's crash the order, its record and its event all exist or none (order record event: $state)");
	coord('SELECT recover_prepared_transactions()');
	is(on($holder, q{SELECT count(*) FROM pg_prepared_xacts}), '0',
		'11: Citus\'s recovery resolved the worker\'s prepared part');
	coord(qq{BEGIN;
		SELECT outcome FROM idem_citus.idem_claim($A, 'POST /orders:ob1', '{"amount": 70}');
		INSERT INTO orders (tenant_id, key, amount) VALUES ($A, 'ob1', 70);
		SELECT idem_publish('order.created', '{"key": "ob1"}', 'order-ob1');
		SELECT idem_citus.idem_succeed($A, 'POST /orders:ob1', 201, '{"order": "ob1"}');
		COMMIT;}) if $state eq '0 0 0';
	is( join(' ',
			coord(q{SELECT count(*) FROM orders WHERE key = 'ob1'}),
			coord(qq{SELECT count(*) FROM idem_citus.idem_replay($A, 'POST /orders:ob1')}),
			coord(q{SELECT count(*) FROM idempotency.outbox WHERE payload->>'key' = 'ob1'})),
		'1 1 1', '11: in the end one order, its record and its event');
}

# ---- 12. A coordinator-side write next to a delegated claim and response.
# As in 11, but the coordinator's own write is to a plain table of its own
# (a ledger), not an event: Citus does not see it either, and would commit
# the worker (order and record) with a one-phase COMMIT in its pre-commit
# step, before the coordinator's commit, which can still fail or crash: the
# record would stay without the ledger row, and the retry would replay an
# operation whose coordinator-side effect was lost.  With
# idempotency.citus_atomic_local_writes (not the default: see the README), a
# transaction that wrote on this node commits the other nodes' writes with
# two-phase commit.
{
	my $holder = holder($A);
	coord(q{CREATE TABLE ledger (key text NOT NULL)});
	my $gate = notify_gate('12');

	my $app = frozen_commit('12', $holder, 'lg1', 80, q{INSERT INTO ledger VALUES ('lg1')},
		'SET idempotency.citus_atomic_local_writes = on');

	crash_coordinator($gate, $app);
	coord('SELECT recover_prepared_transactions()');
	my $state = join ' ',
	  coord(q{SELECT count(*) FROM orders WHERE key = 'lg1'}),
	  coord(qq{SELECT count(*) FROM idem_citus.idem_replay($A, 'POST /orders:lg1')}),
	  coord(q{SELECT count(*) FROM ledger WHERE key = 'lg1'});
	ok($state eq '1 1 1' || $state eq '0 0 0',
		"12: after the coordinator's crash the order, its record and the ledger row all exist or none (order record ledger: $state)");
	is(on($holder, q{SELECT count(*) FROM pg_prepared_xacts}), '0',
		'12: Citus\'s recovery resolved the worker\'s prepared part');

	# A parallel query after such a write: its parallel workers, which see
	# the leader's transaction, leave the commit to the leader.
	my $force_parallel = coord(q{SELECT current_setting('server_version_num')::int >= 160000})
	  eq 't' ? 'debug_parallel_query' : 'force_parallel_mode';
	like(coord_try(qq{BEGIN;
			SET LOCAL idempotency.citus_atomic_local_writes = on;
			SELECT place_order($A, 'lg2', 81);
			INSERT INTO ledger VALUES ('lg2');
			SET LOCAL $force_parallel = on;
			EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) SELECT count(*) FROM ledger;
			COMMIT;
			SELECT 'ledger ' || count(*) FROM ledger WHERE key = 'lg2';}),
		qr/Workers Launched: [1-9].*^ledger 1$/ms,
		'12: a parallel query after the coordinator\'s write, then the commit, works');
	coord(q{DROP TABLE ledger});
}

# ---- 13. One tenant, one spelling.  Records are found by the scope's text,
# so a scope that the tenant's type reads as tenant A but writes otherwise
# ('0' || A, ' ' || A) would be a second record of the same key, and the
# operation would execute once per spelling.  On the node that holds A's
# shard (where the text functions run locally, as inside a delegated
# function), such a scope is refused, and nothing is written.
{
	my $holder = holder($A);
	for my $spelling ("0$A", " $A", "+$A")
	{
		my ($out, $err) = ('', '');
		$holder->psql($cluster->dbname, qq{\\set VERBOSITY verbose
			BEGIN; SELECT outcome FROM idem_claim('$spelling', 'POST /orders:sp1', '{}');
			SELECT idem_succeed('$spelling', 'POST /orders:sp1', 201, '{}'); COMMIT;},
			stdout => \$out, stderr => \$err, on_error_stop => 1);
		like($err, qr/ERROR:  22023: scope "\Q$spelling\E" is not the canonical text of its tenant/,
			"13: scope '$spelling' of tenant $A is refused with 22023");
	}
	# A scope that is no tenant at all is refused as a scope, not as text
	# the application sent (22P02 or 22003 of the tenant type's input).
	for my $scope ('acme', '99999999999999999999')
	{
		my ($out, $err) = ('', '');
		$holder->psql($cluster->dbname, qq{\\set VERBOSITY verbose
			SELECT outcome FROM idem_claim('$scope', 'POST /orders:sp1', '{}');},
			stdout => \$out, stderr => \$err);
		like($err, qr/ERROR:  22023: scope "$scope" is not a tenant of type bigint\n.*DETAIL:  Citus distributes idempotency.records by a tenant of type bigint: .*\n.*HINT:  /,
			"13: scope '$scope', which is no bigint, is refused with 22023");
	}
	# The inbox's messages name what the caller passed: a source.
	for my $case ([ "0$A", qr/ERROR:  22023: source "0$A" is not the canonical text of its tenant\n.*DETAIL:  Citus distributes idempotency.inbox /s ],
				  [ 'acme', qr/ERROR:  22023: source "acme" is not a tenant of type bigint\n.*DETAIL:  Citus distributes idempotency.inbox /s ])
	{
		my ($out, $err) = ('', '');
		$holder->psql($cluster->dbname, qq{\\set VERBOSITY verbose
			SELECT idem_inbox_accept('$case->[0]', 'sp-m1');},
			stdout => \$out, stderr => \$err);
		like($err, $case->[1], "13: inbox source '$case->[0]' of tenant $A is refused with 22023, as a source");
	}
	like( on($holder, qq{BEGIN; SELECT outcome FROM idem_claim('$A', 'POST /orders:sp1', '{}');
			SELECT idem_succeed('$A', 'POST /orders:sp1', 201, '{}'); COMMIT;}),
		qr/^claimed$/m, '13: the tenant written canonically is claimed');
	is( coord(q{SELECT count(*) FROM idempotency.records WHERE key = 'POST /orders:sp1'}) . ' / '
		  . where_rows('idempotency.records', $A, q{key = 'POST /orders:sp1'}),
		'1 / ' . only_on($holder, 1), '13: one record of the key, in the holder\'s shard');
}

# ---- 14. Tenant types and the records that idem_citus_distribute moves.
# In a database of its own on the three nodes: a citext or char(n) tenant
# is refused (0A000): citext calls two spellings one tenant and char(n)
# pads them, and records are found by the scope's text.  And records and
# inbox marks made on the coordinator before distribution, under a uuid
# tenant written in upper case, are moved into the shards under the
# tenant's canonical text: the canonical call replays the operation and
# refuses the message again instead of executing them a second time.
{
	my $db = 'types';
	for my $node ($cluster->nodes)
	{
		$node->safe_psql('postgres', qq{CREATE DATABASE $db});
		$node->safe_psql($db, 'CREATE EXTENSION citus');
	}
	$coord->safe_psql($db, sprintf("SELECT citus_set_coordinator_host('%s', %d)", $coord->host, $coord->port));
	$coord->safe_psql($db, sprintf("SELECT citus_add_node('%s', %d)", $_->host, $_->port)) for @workers;
	$coord->safe_psql($db, q{CREATE EXTENSION idempotency; CREATE EXTENSION citext;});
	for my $type ('citext', 'character(5)')
	{
		my ($out, $err) = ('', '');
		$coord->psql($db, qq{\\set VERBOSITY verbose
			CREATE TABLE t_orders (tenant_id $type NOT NULL, id int NOT NULL);
			SELECT create_distributed_table('t_orders', 'tenant_id');
			SELECT idem_citus_distribute('t_orders');},
			stdout => \$out, stderr => \$err, on_error_stop => 1);
		like($err, qr/ERROR:  0A000: tenant columns of type (?:public\.)?\Q$type\E are not supported/,
			"14: a $type tenant is refused with 0A000");
		$coord->safe_psql($db, q{DROP TABLE t_orders});
	}
	my $upper = '3F0C1E2A-0000-4000-8000-000000000001';
	$coord->safe_psql($db, qq{
		CREATE TABLE t_orders (tenant_id uuid NOT NULL, id int NOT NULL);
		SELECT create_distributed_table('t_orders', 'tenant_id');
		BEGIN;
		SELECT outcome FROM idem_claim('$upper', 'pay-1', '{"amount": 10}');
		SELECT idem_succeed('$upper', 'pay-1', 201, '{"payment": 7}');
		COMMIT;
		SELECT idem_inbox_accept('$upper', 'msg-1');
		SELECT idem_citus_distribute('t_orders');});
	my $canonical = lc $upper;
	is( $coord->safe_psql($db, qq{SELECT state, body FROM idem_citus.idem_replay('$canonical'::uuid, 'pay-1')}),
		'completed|{"payment": 7}', '14: the record moved into the shards under the canonical tenant replays');
	is( $coord->safe_psql($db, qq{SELECT outcome FROM idem_citus.idem_claim('$canonical'::uuid, 'pay-1', '{"amount": 10}')}),
		'replay', '14: its canonical claim replays, not executes again');
	is( $coord->safe_psql($db, qq{SELECT idem_citus.idem_inbox_accept('$canonical'::uuid, 'msg-1')}),
		'f', '14: the inbox mark moved too: the message is refused again');
	is( $coord->safe_psql($db, q{SELECT string_agg(scope, ',') FROM idempotency.records}),
		$canonical, '14: one record, under the canonical text of its tenant');
}

# ---- 15. A monitor and an operator that are not superusers.
# Granted on the coordinator only, as the README says: SELECT on idem_stuck
# to a monitoring role, the destination commands to an operator.  Neither
# may read the extension's tables or call idem_destination_sync, yet
# idem_stuck lists the shards' stuck operations and the commands reach every
# worker.  A function destination the operator creates runs as the operator
# on every node, not as the role that takes the command to the workers; a
# role without the grant is refused, on the coordinator, with 42501.
{
	coord(q{
		CREATE ROLE monitor LOGIN;
		CREATE ROLE ops LOGIN;
		GRANT SELECT ON idem_stuck TO monitor;
		GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb),
			idem_destination_pause(text), idem_destination_drop(text) TO ops;});
	my $token = coord(qq{SELECT token FROM idem_citus.idem_claim($A, 'POST /pay:stuck15', '{}', lease => '1 second')});
	ok( poll_true($coord, q{
			SET idempotency.stuck_after = 0;
			SELECT count(*) = 1 FROM idem_stuck WHERE key = 'POST /pay:stuck15'}),
		'15: the operation is stuck, as a superuser sees it');
	is( coord_try(q{
			SET ROLE monitor;
			SET idempotency.stuck_after = 0;
			SELECT scope || ' ' || key || ' ' || token FROM idem_stuck WHERE key = 'POST /pay:stuck15';}),
		"$A POST /pay:stuck15 $token", '15: the monitoring role reads it from the workers\' shards');
	like(coord_error(q{SET ROLE ops; SELECT count(*) FROM idem_stuck;}),
		qr/ERROR:  42501: permission denied for view idem_stuck/,
		'15: a role without SELECT on idem_stuck is refused');
	like(coord_error(q{SET ROLE monitor; SELECT count(*) FROM idempotency.records;}),
		qr/ERROR:  42501: permission denied for schema idempotency/,
		'15: the monitoring role still cannot read the records');

	is( coord_try(q{
			SET ROLE ops;
			SELECT 'created' FROM idem_destination_create('opsdest', 'function', 'fdest(jsonb)', '{ops.*}');}),
		'created', '15: the operator creates a destination on the coordinator');
	is_deeply([ map { on($_, q{SELECT run_as::regrole || ' ' || paused FROM idempotency.destinations WHERE name = 'opsdest'}) } $cluster->nodes ],
		[ ('ops false') x 3 ],
		'15: it is on every node, run as the operator');
	coord_try(q{SET ROLE ops; SELECT idem_destination_pause('opsdest');});
	is_deeply([ map { on($_, q{SELECT paused FROM idem_destinations WHERE name = 'opsdest'}) } $cluster->nodes ],
		[ 't', 't', 't' ], '15: the operator\'s pause reaches every worker');
	like(coord_error(q{SET ROLE ops; SELECT idem_destination_resume('opsdest');}),
		qr/ERROR:  42501: permission denied for function idem_destination_resume/,
		'15: a command the operator was not granted is refused');
	like(coord_error(q{SET ROLE ops; SELECT idem_destination_sync('opsdest', NULL, false);}),
		qr/ERROR:  42501: permission denied for function idem_destination_sync/,
		'15: so is idem_destination_sync');
	coord_try(q{SET ROLE ops; SELECT idem_destination_drop('opsdest');});
	is_deeply([ map { on($_, q{SELECT count(*) FROM idem_destinations WHERE name = 'opsdest'}) } $cluster->nodes ],
		[ '0', '0', '0' ], '15: the operator\'s drop reaches every worker');
	coord(qq{SELECT idem_citus.idem_resolve_release($A, 'POST /pay:stuck15', 'test over')});
}

# ---- 16. A worker's own destination, and a creator that is gone.
# A destination made on a worker itself is not taken over by the
# coordinator's destination of the same name when they would run
# differently: a function destination that runs as another role, or whose
# target now names another function than the one it calls (renamed since),
# is refused, and the worker's copy is left as it was.  And a destination
# whose creator was dropped can still be paused everywhere.
{
	my ($w1) = @workers;
	on($w1, q{
		GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) TO ops;
		SET ROLE ops;
		SELECT idem_destination_create('w1own', 'function', 'fdest(jsonb)', '{w1.*}');});
	like(coord_try(q{SELECT idem_destination_create('w1own', 'function', 'fdest(jsonb)', '{w1.*}')}),
		qr/ERROR:  sending outbox destination "w1own" to the Citus workers failed.*destination "w1own" on this node belongs to role "ops", not to "postgres"/s,
		'16: a worker\'s function destination that runs as another role is not taken over');
	is( on($w1, q{SELECT run_as::regrole || ' ' || array_to_string(topics, ',') FROM idempotency.destinations WHERE name = 'w1own'}),
		'ops w1.*', '16: and it still runs as its creator');

	on($w1, q{
		SET citus.enable_ddl_propagation = off;
		CREATE FUNCTION fsink(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';
		SELECT idem_destination_create('w1fn', 'function', 'fsink(jsonb)', '{w1.*}');
		ALTER FUNCTION fsink(jsonb) RENAME TO fsink_renamed;});
	coord(q{CREATE FUNCTION fsink(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL'});
	like(coord_try(q{SELECT idem_destination_create('w1fn', 'function', 'fsink(jsonb)', '{w1.*}')}),
		qr/ERROR:  sending outbox destination "w1fn" to the Citus workers failed.*destination "w1fn" on this node calls public\.fsink_renamed\(jsonb\), not public\.fsink\(jsonb\)/s,
		'16: a worker\'s function destination that calls another function than its target names is not taken over');
	is( on($w1, q{SELECT func::regproc FROM idempotency.destinations WHERE name = 'w1fn'}),
		'fsink_renamed', '16: and it still calls that function');

	coord(q{
		CREATE ROLE gone;
		GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) TO gone;
		SET ROLE gone;
		SELECT idem_destination_create('gonenotify', 'notify', 'gone_channel', '{gone.*}');
		SELECT idem_destination_create('gonefn', 'function', 'fdest(jsonb)', '{gone.*}');
		RESET ROLE;
		REVOKE EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) FROM gone;
		DROP ROLE gone;});
	is( coord_try(q{
			SELECT 'paused' FROM idem_destination_pause('gonenotify') a, idem_destination_pause('gonefn') b;}),
		'paused', '16: destinations whose creator was dropped are paused on the coordinator');
	is_deeply([ map { on($_, q{SELECT string_agg(name || ' ' || paused, ',' ORDER BY name) FROM idem_destinations WHERE name LIKE 'gone%'}) } $cluster->nodes ],
		[ ('gonefn true,gonenotify true') x 3 ], '16: and on every worker');
	is( coord_try(q{BEGIN; SELECT idem_citus_send_destinations() > 0; COMMIT;}),
		't', '16: idem_citus_send_destinations sends them too');
	for my $node ($cluster->nodes)
	{
		on($node, q{SET citus.enable_ddl_propagation = off;
			SELECT idem_destination_drop(name) FROM idem_destinations WHERE name IN ('w1own', 'w1fn', 'gonenotify', 'gonefn')});
	}
}

# As $role on the coordinator, create destination $name and drop it in one
# transaction: "done", or the error.
sub create_and_drop_as
{
	my ($role, $name, $kind, $target) = @_;
	return coord_try(qq{
		SET ROLE $role;
		DO \$\$BEGIN
			PERFORM idem_destination_create('$name', '$kind', '$target', '{x.*}');
			PERFORM idem_destination_drop('$name');
		END\$\$;
		SELECT 'done';});
}

# On $node only (DDL not propagated), a role $role that may create in
# schema public makes a function $fn(jsonb) there; and undoing it.
sub plant_function
{
	my ($node, $role, $fn) = @_;
	on($node, qq{
		SET citus.enable_ddl_propagation = off;
		CREATE ROLE $role;
		GRANT CREATE ON SCHEMA public TO $role;
		SET ROLE $role;
		CREATE FUNCTION $fn(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';});
}

sub unplant_function
{
	my ($node, $role, $fn) = @_;
	on($node, qq{
		SET citus.enable_ddl_propagation = off;
		DROP FUNCTION $fn(jsonb);
		REVOKE CREATE ON SCHEMA public FROM $role;
		DROP ROLE $role;});
}

# ---- 17. What the coordinator sends is the coordinator's destination only.
# A worker's destination that is not a copy of the coordinator's keeps
# running as it was made there, whatever the coordinator's role does:
#  a. after the coordinator's creator of a function destination was
#     dropped, a worker's function destination of the same name that runs
#     as a role that still exists is refused, not given the coordinator's
#     topics, and a worker that has no copy refuses to make one;
#  b. a destination created and dropped in one coordinator transaction
#     does not drop a worker's own destination of that name;
#  c. a function destination made by a superuser does not call, on a
#     worker, a function of the same name that another role made there.
{
	my ($w1, $w2) = @workers;

	# a.
	coord(q{
		CREATE ROLE gone2;
		GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) TO gone2;
		SET ROLE gone2;
		SELECT idem_destination_create('orphan', 'function', 'fdest(jsonb)', '{gone2.*}');
		RESET ROLE;
		REVOKE EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) FROM gone2;});
	on($w1, q{
		SELECT idem_destination_drop('orphan');
		SET ROLE ops;
		SELECT idem_destination_create('orphan', 'function', 'fdest(jsonb)', '{w1ops.*}');});
	coord(q{DROP ROLE gone2});
	like(coord_try(q{SELECT idem_destination_alter('orphan', '{"max_attempts": 3}')}),
		qr/ERROR:  sending outbox destination "orphan" to the Citus workers failed.*destination "orphan" on this node belongs to role "ops", but the role that created it on the coordinator no longer exists/s,
		'17a: a worker\'s function destination of a role that exists is not taken over after the coordinator\'s creator was dropped');
	is( on($w1, q{SELECT run_as::regrole || ' ' || array_to_string(topics, ',') || ' ' || max_attempts FROM idempotency.destinations WHERE name = 'orphan'}),
		'ops w1ops.* 10', '17a: it keeps its topics and options');
	# A failure is reported for the first worker that fails: neither has
	# one now.
	on($_, q{SELECT idem_destination_drop('orphan')}) for ($w1, $w2);
	like(coord_try(q{SELECT idem_destination_pause('orphan')}),
		qr/ERROR:  sending outbox destination "orphan" to the Citus workers failed.*the role that created destination "orphan" no longer exists/s,
		'17a: a worker that has no copy refuses to make one whose creator was dropped');
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'orphan'}) } ($w1, $w2)),
		'0 0', '17a: and makes none');

	# b.
	coord(q{
		CREATE ROLE dropper;
		GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb),
			idem_destination_drop(text) TO dropper;});
	on($w1, q{SELECT idem_destination_create('w1keep', 'function', 'fdest(jsonb)', '{w1keep.*}')});
	is( create_and_drop_as('dropper', 'w1keep', 'notify', 'dropper_channel'),
		'done', '17b: a role creates and drops a destination in one transaction on the coordinator');
	is( on($w1, q{SELECT kind || ' ' || run_as::regrole FROM idempotency.destinations WHERE name = 'w1keep'}),
		'function postgres', '17b: the worker\'s own destination of that name is still there');

	# c.
	coord(q{
		SET citus.enable_ddl_propagation = off;
		CREATE FUNCTION fplant(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';});
	on($w2, q{
		SET citus.enable_ddl_propagation = off;
		CREATE FUNCTION fplant(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';});
	plant_function($w1, 'planter', 'fplant');
	like(coord_try(q{SELECT idem_destination_create('sudest', 'function', 'fplant(jsonb)', '{su.*}')}),
		qr/ERROR:  sending outbox destination "sudest" to the Citus workers failed.*destination "sudest" on this node calls public\.fplant\(jsonb\), owned by role "planter", not by "postgres" as on the coordinator/s,
		'17c: a worker refuses a function destination whose function there was made by another role');
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'sudest'}) } $cluster->nodes),
		'0 0 0', '17c: it has none, nor has the coordinator, nor the other worker, which made it and dropped it again');
	unplant_function($w1, 'planter', 'fplant');
	for my $node ($cluster->nodes)
	{
		on($node, q{SET citus.enable_ddl_propagation = off;
			DROP FUNCTION IF EXISTS fplant(jsonb);
			SELECT idem_destination_drop(name) FROM idem_destinations WHERE name IN ('orphan', 'w1keep')});
	}
}

# ---- 18. Copies are told apart by their creator, drops by what the
# destination was when the transaction began, functions by their own name:
#  a. a worker's own notify destination, made there by another role, is not
#     dropped by a role that creates and drops one of the same name, kind
#     and target in one coordinator transaction, nor changed by its create;
#  b. a destination dropped, made again and dropped again in one coordinator
#     transaction is dropped on every worker;
#  c. one dropped and made again with another target is made again
#     everywhere;
#  d. a function destination whose function was renamed everywhere is still
#     paused and dropped everywhere;
#  e. a function destination whose function was dropped on the coordinator
#     is not made on a worker, where another role made a function of that
#     name;
#  f. a drop rolled back to a savepoint does not drop the workers' copies;
#     a create rolled back to a savepoint does not make a later drop of
#     that name (another session made it since) leave the workers' copies;
#  g. a transaction that creates several destinations and fails on some
#     worker leaves none of them on any worker; one that changed
#     destinations cannot be prepared.
{
	my ($w1, $w2) = @workers;

	# a.
	on($w1, q{SELECT idem_destination_create('w1note', 'notify', 'w1chan', '{w1note.*}')});
	is( create_and_drop_as('dropper', 'w1note', 'notify', 'w1chan'),
		'done', '18a: a role creates and drops a notify destination in one transaction on the coordinator');
	is( on($w1, q{SELECT run_as::regrole || ' ' || array_to_string(topics, ',') FROM idempotency.destinations WHERE name = 'w1note'}),
		'postgres w1note.*', '18a: the worker\'s own notify destination of that name and target is still there');
	like(coord_try(q{SET ROLE dropper; SELECT idem_destination_create('w1note', 'notify', 'w1chan', '{x.*}')}),
		qr/ERROR:  sending outbox destination "w1note" to the Citus workers failed.*destination "w1note" on this node belongs to role "postgres", not to "dropper"/s,
		'18a: nor does its create take it over');
	is( on($w1, q{SELECT array_to_string(topics, ',') FROM idempotency.destinations WHERE name = 'w1note'}),
		'w1note.*', '18a: its topics are its own');
	is( on($w2, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'w1note'}),
		'0', '18a: the other worker, which made a copy, dropped it again');

	# b.
	coord(q{SELECT idem_destination_create('twice', 'notify', 'chan_a', '{twice.*}')});
	coord(q{BEGIN;
		SELECT idem_destination_drop('twice');
		SELECT idem_destination_create('twice', 'notify', 'chan_b', '{twice.*}');
		SELECT idem_destination_drop('twice');
		COMMIT;});
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'twice'}) } $cluster->nodes),
		'0 0 0', '18b: dropped, made again and dropped again: gone from every node');

	# c.
	coord(q{SELECT idem_destination_create('moved', 'notify', 'chan_a', '{moved.*}')});
	is( coord_try(q{BEGIN;
			SELECT 'dropped' FROM idem_destination_drop('moved');
			SELECT 'made' FROM idem_destination_create('moved', 'notify', 'chan_b', '{moved.*}');
			COMMIT;}),
		"dropped\nmade", '18c: dropped and made again with another target in one transaction');
	is_deeply([ map { on($_, q{SELECT target FROM idempotency.destinations WHERE name = 'moved'}) } $cluster->nodes ],
		[ ('chan_b') x 3 ], '18c: every node has the new target');
	coord(q{SELECT idem_destination_drop('moved')});

	# d.
	coord(q{
		CREATE FUNCTION fren(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';
		SELECT idem_destination_create('renamed', 'function', 'fren(jsonb)', '{renamed.*}');
		ALTER FUNCTION fren(jsonb) RENAME TO fren2;});
	is( coord_try(q{SELECT 'paused' FROM idem_destination_pause('renamed')}),
		'paused', '18d: a function destination whose function was renamed everywhere is paused');
	is_deeply([ map { on($_, q{SELECT func::regproc || ' ' || paused FROM idempotency.destinations WHERE name = 'renamed'}) } $cluster->nodes ],
		[ ('fren2 true') x 3 ], '18d: on every node');
	coord(q{SELECT idem_destination_drop('renamed')});
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'renamed'}) } $cluster->nodes),
		'0 0 0', '18d: and dropped everywhere');
	coord(q{DROP FUNCTION fren2(jsonb)});

	# e.
	coord(q{
		CREATE FUNCTION flost(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';
		SELECT idem_destination_create('lost', 'function', 'flost(jsonb)', '{lost.*}');
		DROP FUNCTION flost(jsonb);});
	on($w2, q{SELECT idem_destination_drop('lost')});
	plant_function($w2, 'mallory', 'flost');
	like(coord_try(q{SELECT idem_destination_pause('lost')}),
		qr/ERROR:  sending outbox destination "lost" to the Citus workers failed.*the function of destination "lost" no longer exists/s,
		'18e: a worker does not make a function destination whose function was dropped on the coordinator');
	is( on($w2, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'lost'}),
		'0', '18e: and calls no function of another role for it');
	unplant_function($w2, 'mallory', 'flost');
	coord(q{SELECT idem_destination_drop('lost')});
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'lost'}) } $cluster->nodes),
		'0 0 0', '18e: its drop reaches the worker that has a copy');

	# f.
	coord(q{SELECT idem_destination_create('kept', 'notify', 'kept_channel', '{kept.*}')});
	my $ids = join ' ', map { on($_, q{SELECT id FROM idempotency.destinations WHERE name = 'kept'}) } @workers;
	coord(q{BEGIN;
		SAVEPOINT s;
		SELECT idem_destination_drop('kept');
		ROLLBACK TO SAVEPOINT s;
		SELECT idem_destination_pause('kept');
		COMMIT;});
	is( join(' ', map { on($_, q{SELECT id FROM idempotency.destinations WHERE name = 'kept'}) } @workers),
		$ids, '18f: a drop rolled back to a savepoint leaves the workers\' copies, with their deliveries');
	is_deeply([ map { on($_, q{SELECT paused FROM idempotency.destinations WHERE name = 'kept'}) } $cluster->nodes ],
		[ ('t') x 3 ], '18f: and the rest of the transaction reaches them');
	my $tx = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$tx->query_safe(q{BEGIN;
		SAVEPOINT s;
		SELECT idem_destination_create('late', 'notify', 'late_channel', '{late.*}');
		ROLLBACK TO SAVEPOINT s;});
	coord(q{SELECT idem_destination_create('late', 'notify', 'late_channel', '{late.*}')});
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'late'}) } $cluster->nodes),
		'1 1 1', '18f: another session makes a destination whose create an open transaction rolled back');
	$tx->query_safe(q{SELECT idem_destination_drop('late'); COMMIT;});
	$tx->quit;
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'late'}) } $cluster->nodes),
		'0 0 0', '18f: that transaction\'s drop of it drops the workers\' copies too');

	# g.
	coord(q{
		SET citus.enable_ddl_propagation = off;
		CREATE FUNCTION fcoordonly(event jsonb) RETURNS void LANGUAGE sql AS 'SELECT NULL';});
	like(coord_try(q{SET ROLE dropper; BEGIN;
			SELECT idem_destination_create('plant1', 'notify', 'plant_channel', '{orders.*}');
			SELECT idem_destination_create('plant2', 'function', 'fcoordonly(jsonb)', '{orders.*}');
			COMMIT;}),
		qr/ERROR:  sending outbox destinations "plant1", "plant2" to the Citus workers failed/,
		'18g: a transaction creating two destinations, the second refused by every worker, fails');
	on($w1, q{SELECT idem_destination_create('plant4', 'notify', 'w1_plant4', '{w1.*}')});
	like(coord_try(q{SET ROLE dropper; BEGIN;
			SELECT idem_destination_create('plant3', 'notify', 'plant_channel', '{orders.*}');
			SELECT idem_destination_create('plant4', 'notify', 'plant_channel', '{orders.*}');
			COMMIT;}),
		qr/ERROR:  sending outbox destinations "plant3", "plant4" to the Citus workers failed/,
		'18g: so does one refused by one worker only');
	is( join(' ', map { on($_, q{SELECT string_agg(name || ':' || run_as::regrole, ',' ORDER BY name) FROM idempotency.destinations WHERE name LIKE 'plant%'}) } $cluster->nodes),
		' plant4:postgres ', '18g: no node has the destinations of either, but the worker\'s own');
	like(coord_error(q{BEGIN;
			SELECT idem_destination_create('prepared', 'notify', 'prepared_channel', '{x.*}');
			PREPARE TRANSACTION 'dest';}),
		qr/ERROR:  0A000: cannot prepare a transaction that changed outbox destinations on a Citus coordinator/,
		'18g: a transaction that changed destinations cannot be prepared');
	coord(q{ROLLBACK PREPARED 'dest'})
		if coord(q{SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'dest'}) eq '1';
	coord(q{SET citus.enable_ddl_propagation = off; DROP FUNCTION fcoordonly(jsonb);});

	# h.  What a worker's relay learned of an endpoint (here set by hand:
	# an open circuit after 12 failures) is cleared by a resume on the
	# coordinator, and only by one that commits.
	coord(q{SELECT idem_destination_create('learned', 'notify', 'learned_channel', '{learned.*}')});
	my $learn = q{UPDATE idempotency.destinations
		SET circuit = 'open', consecutive_failures = 12, failing_since = now() WHERE name = 'learned'};
	my $learned = q{SELECT circuit || ' ' || consecutive_failures || ' ' || paused
		FROM idempotency.destinations WHERE name = 'learned'};
	on($w1, $learn);
	coord(q{BEGIN;
		SAVEPOINT s;
		SELECT idem_destination_resume('learned');
		ROLLBACK TO SAVEPOINT s;
		SELECT idem_destination_pause('learned');
		COMMIT;});
	is(on($w1, $learned), 'open 12 true',
		'18h: a resume rolled back to a savepoint leaves the circuit a worker learned, and the pause reaches it');
	coord(q{BEGIN;
		SAVEPOINT s;
		SELECT idem_destination_resume('learned');
		RELEASE SAVEPOINT s;
		SAVEPOINT t;
		SELECT idem_destination_pause('learned');
		ROLLBACK TO SAVEPOINT t;
		COMMIT;});
	is(on($w1, $learned), 'closed 0 false',
		'18h: a resume in a released savepoint clears it, whatever a later savepoint rolled back');
	on($w1, $learn);
	coord(q{BEGIN;
		SELECT idem_destination_resume('learned');
		SAVEPOINT s;
		SELECT idem_destination_resume('learned');
		ROLLBACK TO SAVEPOINT s;
		COMMIT;});
	is(on($w1, $learned), 'closed 0 false',
		'18h: a resume before a savepoint stays when a second one is rolled back');

	# i.  A drop that a worker cannot apply (it is down) drops nothing on
	# the others: not the copy, not its deliveries.
	coord(q{SELECT idem_destination_create('whole', 'notify', 'whole_channel', '{whole.*}')});
	my $whole = q{SELECT id FROM idempotency.destinations WHERE name = 'whole'};
	my $whole_id = on($w1, $whole);
	$w2->stop;
	like(coord_try(q{SELECT idem_destination_drop('whole')}),
		qr/ERROR:  sending outbox destination "whole" to the Citus workers failed/,
		'18i: a drop fails while a worker is down');
	$w2->start;
	is(join(' ', on($w1, $whole), on($w2, $whole) ne '' ? 'kept' : 'gone', coord($whole) ne '' ? 'kept' : 'gone'),
		"$whole_id kept kept", '18i: and every node still has the destination, the other worker its own copy');
	coord(q{SELECT idem_destination_drop('whole')});

	# j.  The workers commit a transaction's destinations with the
	# coordinator (two-phase commit).  A transaction that drops one
	# destination and creates another is frozen after its pre-commit step
	# (its COMMIT waits for the NOTIFY queue, see notify_gate): the workers
	# have prepared, not committed.  Meanwhile the rows the drop deletes
	# stay locked (after a crash, until Citus's recovery): a worker's
	# cleanup and relay go on without them.  The coordinator killed there,
	# Citus's recovery rolls the workers back: every node still has the
	# dropped destination, and none the created one.
	coord(q{SELECT idem_destination_create('held', 'notify', 'held_channel', '{held.*}');
		SELECT idem_destination_create('flowing', 'notify', 'flowing_channel', '{flowing.*}');});
	on($w1, q{SELECT idem_publish('held.x', '{}')});
	ok( poll_true($w1, q{SELECT count(*) > 0 FROM idempotency.destination_stats s
			JOIN idempotency.destinations d ON d.id = s.destination_id WHERE d.name = 'held'}),
		'18j: a worker delivered an event to a destination, and counted it');
	my $gate = notify_gate('18j');
	my $app = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$app->query_safe('BEGIN');
	$app->query_safe(q{SELECT idem_destination_drop('held')});
	$app->query_safe(q{SELECT idem_destination_create('crashed', 'notify', 'crashed_channel', '{crashed.*}')});
	$app->query_safe(q{SELECT pg_notify('app', 'crashed')});
	start_query($app, 'COMMIT');
	ok( $coord->poll_query_until($cluster->dbname, q{
			SELECT count(*) = 1 FROM pg_stat_activity
			 WHERE query = 'COMMIT;' AND wait_event_type = 'Lock' AND wait_event = 'object'}),
		'18j: the COMMIT of a drop and a create waits for the NOTIFY queue, on the coordinator');
	my $states = q{SELECT (SELECT string_agg(name, ',' ORDER BY name) FROM idempotency.destinations
			WHERE name IN ('held', 'crashed')) || '/' || (SELECT count(*) FROM pg_prepared_xacts)};
	is( join(' ', map { on($_, $states) } @workers),
		'held/1 held/1', '18j: by then each worker has prepared both, committed neither');
	my ($out, $err) = ('', '');
	$w1->psql($cluster->dbname, q{SET statement_timeout = '10s'; SELECT idem_outbox_cleanup() >= 0},
		stdout => \$out, stderr => \$err);
	is("$out$err", 't', '18j: the outbox cleanup of a worker finishes meanwhile');
	# The worker's own cleanup runs every second, in the process of its relay.
	sleep 2;
	on($w1, q{SELECT idem_publish('flowing.x', '{}')});
	my $flowed = 0;
	for (1 .. 100)
	{
		$flowed = on($w1, q{SELECT count(*) FROM idempotency.deliveries v
			JOIN idempotency.destinations d ON d.id = v.destination_id
			WHERE d.name = 'flowing' AND v.state = 'delivered'}) eq '1';
		last if $flowed;
		select(undef, undef, undef, 0.1);
	}
	ok($flowed, '18j: and its relay delivers an event to another destination within 10 s');
	crash_coordinator($gate, $app);
	coord('SELECT recover_prepared_transactions()');
	is( join(' ', map { on($_, $states) } $cluster->nodes),
		'held/0 held/0 held/0', '18j: after the coordinator\'s crash and recovery, every node has the dropped one and none the created one');

	# k.  A worker that refuses a definition logs its error, and no secret:
	# where Citus takes parameters (built for PostgreSQL 15) the definition
	# is one, elsewhere it is part of the statement's text, which the
	# worker's idem_destination_sync keeps out of the log of its error.
	on($w1, q{SELECT idem_destination_create('secretive', 'notify', 'w1_secretive', '{w1.*}')});
	# Not every statement logged with its parameters, as the tests' clusters
	# do: PostgreSQL's default, which logs only statements that fail.
	on($w1, q{ALTER SYSTEM SET log_statement = 'none'; SELECT pg_reload_conf();});
	ok(poll_true($w1, q{SELECT current_setting('log_statement') = 'none'}), '18k: the worker logs failed statements only');
	my $log_offset = -s $w1->logfile;
	like(coord_try(q{SELECT idem_destination_create('secretive', 'http', 'https://partner.example/webhooks',
			topics => '{order.*}', options => '{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}')}),
		qr/ERROR:  sending outbox destination "secretive" to the Citus workers failed/,
		'18k: a worker refuses an http destination whose name it uses for its own');
	my $w1_log = substr(slurp_file($w1->logfile), $log_offset);
	like($w1_log, qr/ERROR:  destination "secretive" on this node is a notify destination to w1_secretive, not a http destination/,
		'18k: the worker logged its error');
	unlike($w1_log, qr/STATEMENT:  .*idem_destination_sync/, '18k: but not the statement');
	unlike($w1_log, qr/MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw/, '18k: and not the secret');
	on($w1, q{ALTER SYSTEM RESET log_statement; SELECT pg_reload_conf();});

	# l.  A worker without Citus's metadata would be left out of the
	# distributed transaction: the command is refused instead.
	coord(sprintf(q{SELECT stop_metadata_sync_to_node('%s', %d)}, $w2->host, $w2->port));
	like(coord_try(q{SELECT idem_destination_create('nometa', 'notify', 'nometa_channel', '{x.*}')}),
		qr/ERROR:  1 active Citus worker has no metadata/,
		'18l: a destination command is refused while a worker has no metadata');
	coord(sprintf(q{SELECT start_metadata_sync_to_node('%s', %d)}, $w2->host, $w2->port));
	is( join(' ', map { on($_, q{SELECT count(*) FROM idempotency.destinations WHERE name = 'nometa'}) } $cluster->nodes),
		'0 0 0', '18l: and no node has the destination');

	# m.  Citus echoes the commands it sends to the client when
	# citus.log_remote_commands is on, which any role may set: an operator
	# granted only the pause, who cannot read the destination's secrets,
	# does not see them so.
	coord(q{SELECT idem_destination_create('echoed', 'http', 'https://partner.example/hooks',
			topics => '{echo.*}', options => '{"secret": "whsec_EchoEchoEchoEchoEcho0123"}')});
	my ($echo_out, $echo_err) = ('', '');
	$coord->psql($cluster->dbname, q{SET ROLE ops; SET citus.log_remote_commands = on;
			SELECT idem_destination_pause('echoed');},
		stdout => \$echo_out, stderr => \$echo_err, on_error_stop => 1);
	like($echo_err, qr/NOTICE:  issuing /, '18m: Citus echoes its commands to the operator');
	unlike($echo_err, qr/whsec_Echo/, '18m: but not the secret');
	is( join(' ', map { on($_, q{SELECT paused FROM idem_destinations WHERE name = 'echoed'}) } $cluster->nodes),
		't t t', '18m: the operator\'s pause reached every node');

	# n.  Nor does the worker's pg_stat_activity while it applies one
	# (whose query a deadlock's report or a crashed backend's log line
	# would show): here the worker's sync waits for a lock on the row.
	coord(q{SELECT idem_destination_create('watched', 'http', 'https://partner.example/watched',
			topics => '{watch.*}', options => '{"secret": "whsec_WatchWatchWatchWatch0123"}')});
	my $row_lock = $w1->background_psql($cluster->dbname);
	$row_lock->query_safe(q{BEGIN; SELECT 1 FROM idempotency.destinations WHERE name = 'watched' FOR UPDATE});
	my $pauser = $coord->background_psql($cluster->dbname, on_error_stop => 0);
	$pauser->query_until(qr/sent\n/, "\\echo sent\nSELECT idem_destination_pause('watched');\n");
	ok( poll_true($w1, q{SELECT count(*) = 1 FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%idem_destination_sync%'}),
		'18n: the worker\'s sync waits for the row');
	unlike(on($w1, q{SELECT string_agg(query, ' ') FROM pg_stat_activity WHERE wait_event_type = 'Lock'}),
		qr/whsec_Watch/, '18n: its pg_stat_activity shows no secret');
	$row_lock->query_safe('COMMIT');
	$row_lock->quit;
	$pauser->quit;
	is( join(' ', map { on($_, q{SELECT paused FROM idem_destinations WHERE name = 'watched'}) } $cluster->nodes),
		't t t', '18n: then the pause reached every node');

	for my $node ($cluster->nodes)
	{
		on($node, q{SET citus.enable_ddl_propagation = off;
			SELECT idem_destination_drop(name) FROM idem_destinations
			 WHERE name IN ('w1note', 'kept', 'plant4', 'learned', 'secretive', 'held', 'flowing', 'echoed', 'watched')});
	}
}

# ---- The shell tables never got a row, on any node.
is( join(' ', map { on($_, q{SELECT pg_relation_size('idempotency.records') + pg_relation_size('idempotency.inbox')}) } $cluster->nodes),
	'0 0 0', 'the shells of records and inbox stayed empty on every node');

done_testing();
