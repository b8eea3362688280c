# Shard moves on a Citus cluster (a coordinator and two workers) lose and
# duplicate nothing, with idempotency.records and the tenant table "orders"
# colocated (idem_citus_distribute) and POST /orders a distributed,
# force-delegated PL/pgSQL function called from the coordinator:
#
#  A. a move that reaches its switch while a claim's transaction is open on
#     the old worker waits for it (the claim holds the shard's metadata lock
#     in share mode, the move wants it exclusive); a duplicate that arrives
#     meanwhile is refused with 40001 once the shard has moved, and its
#     retry, delegated to the new worker, replays; one order, one record,
#     on the new worker;
#  B. an online move under load: pgbench clients on the coordinator create
#     orders for random tenants and keys, a fraction of them repeated, while
#     the shards of some tenants move between the workers, online (logical
#     replication) and with writes blocked; the 40001 refusals of the switch
#     are retried by pgbench (--max-tries).  Afterwards every order has
#     exactly one record and every record one order, no key has two orders,
#     and a transaction that failed for good left nothing behind;
#  C. a shard split between two tenants of one shard group, the halves on
#     different workers: sessions with the map cached before the split see
#     the new shards, records replay on their tenant's node.
#
# Skipped when Citus is not installed.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CitusCluster;

CitusCluster::skip_unless_citus();

my $cluster = CitusCluster->new(workers => 2, conf => q{
citus.shard_count = 4
});
$cluster->create_idempotency;
my $coord = $cluster->coordinator;
my @workers = $cluster->workers;
my $db = $cluster->dbname;

sub on { my ($node, $sql) = @_; return $cluster->safe_psql($node, $sql); }
sub coord { return on($coord, $_[0]); }

# The application: orders without a unique key (a second execution would be
# a second row), POST /orders for tenant p_tenant and request number p_n
# (its key and amount), answering the outcome and the node it ran on.
coord(q{
	CREATE TABLE orders (tenant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL,
						 port int NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
	SELECT create_distributed_table('orders', 'tenant_id');
	SELECT idem_citus_distribute('orders');

	CREATE FUNCTION place_order(p_tenant bigint, p_n int) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
	BEGIN
		c := idem_citus.idem_claim(p_tenant, 'POST /orders:k' || p_n, jsonb_build_object('amount', p_n));
		IF c.outcome = 'claimed' THEN
			INSERT INTO orders (tenant_id, key, amount, port)
			VALUES (p_tenant, 'k' || p_n, p_n, current_setting('port')::int);
			PERFORM idem_citus.idem_succeed(p_tenant, 'POST /orders:k' || p_n, 201, jsonb_build_object('order', 'k' || p_n));
		END IF;
		RETURN c.outcome || ' ' || current_setting('port');
	END $$;
	SELECT create_distributed_function('place_order(bigint,int)', '$1',
									   colocate_with => 'orders', force_delegation => true);
});

# The node that holds tenant $t's shard of $table.
sub holder
{
	my ($t, $table) = @_;
	$table //= 'idempotency.records';
	my $port = coord(qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		 WHERE p.shardid = get_shard_id_for_distribution_column('$table', $t)});
	return $cluster->node_by_port($port);
}

sub other { my ($node) = @_; my ($o) = grep { $_ != $node } @workers; return $o; }

# The SQL that moves tenant $t's shard group from $from to $to.
sub move_sql
{
	my ($t, $from, $to, $mode) = @_;
	return sprintf(q{SELECT citus_move_shard_placement(get_shard_id_for_distribution_column('orders', %s),
						'%s', %d, '%s', %d, shard_transfer_mode => '%s')},
		$t, $from->host, $from->port, $to->host, $to->port, $mode);
}

# Background sessions: a query sent now, its answer (and error) read later.
sub start_query
{
	my ($session, $sql) = @_;
	$session->query_until(qr/started\n/, "\\echo started\n$sql;\n");
}

sub finish_query
{
	my ($session) = @_;
	$session->{stderr} = '';
	my $out = $session->query_until(qr/finished\n/, "\\echo finished\n");
	$out =~ s/finished\n\z//;
	chomp $out;
	my $err = $session->{stderr};
	$session->{stderr} = '';
	return ($out, $err);
}

# The tenants of each shard group, for tenants 1 .. 20.
my %tenants_of;
for my $t (1 .. 20)
{
	push @{ $tenants_of{ coord("SELECT get_shard_id_for_distribution_column('orders', $t)") } }, $t;
}

# ---- A. A move waits for a claim in flight; a duplicate meanwhile is refused, then replays.
# Once with writes blocked for the whole move (the move takes the lock
# first), once online: the move copies the shard and catches up while a
# session holds it just before its switch (Citus's own hook for isolation
# tests: with citus.running_under_citus_test_suite on, the move takes
# advisory lock (44000, 55152) in share mode there), the claim begins, and
# the move is let go.
sub move_during_claim
{
	my ($t, $mode) = @_;
	my $from = holder($t);
	my $to = other($from);
	my $shard_index = coord(qq{
		SELECT count(*) FROM pg_dist_shard
		 WHERE logicalrelid = 'orders'::regclass
		   AND shardminvalue::int < (SELECT shardminvalue::int FROM pg_dist_shard
									  WHERE shardid = get_shard_id_for_distribution_column('orders', $t))});
	my $colocation = coord(q{SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'orders'::regclass});
	my $metadata_lock = qq{locktype = 'advisory' AND classid = $shard_index AND objid = $colocation AND objsubid = 8};

	my $holder = $coord->background_psql($db, on_error_stop => 0);
	my $mover = $coord->background_psql($db, on_error_stop => 0);
	my $pause;
	if ($mode eq 'force_logical')
	{
		$pause = $coord->background_psql($db, on_error_stop => 0);
		$pause->query_safe('SELECT pg_advisory_lock(44000, 55152)');
		$mover->query_safe('SET citus.running_under_citus_test_suite = on');
		start_query($mover, move_sql($t, $from, $to, $mode));
		ok( $coord->poll_query_until($db, q{
				SELECT count(*) = 1 FROM pg_locks
				 WHERE locktype = 'advisory' AND classid = 44000 AND objid = 55152 AND objsubid = 2
				   AND mode = 'ShareLock' AND NOT granted}),
			"A $mode: the move has copied the shard and caught up, and waits before its switch");
	}
	$holder->query_safe('BEGIN');
	is($holder->query_safe("SELECT place_order($t, 1)"), 'claimed ' . $from->port,
		"A $mode: a client transaction claims k1 of tenant $t and writes its order, not committed yet");
	if ($mode eq 'force_logical')
	{
		$pause->query_safe('SELECT pg_advisory_unlock(44000, 55152)');
	}
	else
	{
		start_query($mover, move_sql($t, $from, $to, $mode));
	}
	ok( $from->poll_query_until($db, qq{
			SELECT count(*) = 1 FROM pg_locks
			 WHERE $metadata_lock AND mode = 'ExclusiveLock' AND NOT granted}),
		"A $mode: the move waits for the shard metadata lock the claim holds on " . $from->name);

	my $dup = $coord->background_psql($db, on_error_stop => 0);
	$dup->query_safe('\set VERBOSITY verbose');
	start_query($dup, "SELECT place_order($t, 1)");
	ok( $from->poll_query_until($db, qq{
			SELECT count(*) = 1 FROM pg_locks
			 WHERE $metadata_lock AND mode = 'ShareLock' AND NOT granted}),
		"A $mode: a duplicate waits behind the move");

	$holder->query_safe('COMMIT');
	my (undef, $move_err) = finish_query($mover);
	is($move_err, '', "A $mode: the move completes once the claim has committed");
	is(holder($t)->name, $to->name, "A $mode: the shard is on " . $to->name);
	my (undef, $dup_err) = finish_query($dup);
	like($dup_err, qr/ERROR:  40001: the rows of "$t" in idempotency\.records are not on this node/,
		"A $mode: the duplicate that waited is refused with 40001");
	is($dup->query_safe("SELECT place_order($t, 1)"), 'replay ' . $to->port,
		"A $mode: its retry is delegated to the new worker and replays");
	$_->quit for grep { defined } $holder, $mover, $dup, $pause;
	is( coord(qq{SELECT count(*) || ' ' || string_agg(port::text, ',') FROM orders WHERE tenant_id = $t AND key = 'k1'}) . ' '
		  . coord(qq{SELECT count(*) FROM idempotency.records WHERE tenant = $t AND key = 'POST /orders:k1'}),
		'1 ' . $from->port . ' 1', "A $mode: one order (written on the old worker, moved), one record");
	coord('CALL citus_cleanup_orphaned_resources()');
}

# Two tenants of different shard groups.
my $tA = 1;
my ($tB) = grep { coord("SELECT get_shard_id_for_distribution_column('orders', $_) <> get_shard_id_for_distribution_column('orders', $tA)") eq 't' } 2 .. 20;
move_during_claim($tA, 'block_writes');
move_during_claim($tB, 'force_logical');

# ---- B. An online shard move under load.
# Four clients send requests for 20 tenants: one in five repeats one of a
# tenant's 200 "hot" requests (retries of a request, mostly replayed), the
# others are new requests from a range so wide that they seldom repeat.
# Half of them are a client transaction block around the call (delegated
# too: force_delegation).  pgbench retries a transaction that failed with
# 40001 (serialization failure), up to 20 times, with the same random
# values.
my $script = PostgreSQL::Test::Utils::tempdir() . '/order.sql';
PostgreSQL::Test::Utils::append_to_file($script, <<'EOF');
\set tenant random(1, 20)
\set n random(1000, 100000000)
\if random(1, 5) = 1
\set n random(1, 200)
\endif
\if random(1, 2) = 1
BEGIN;
SELECT place_order(:tenant, :n);
COMMIT;
\else
SELECT place_order(:tenant, :n);
\endif
EOF
my $seconds = 30;
my ($bench_out, $bench_err) = ('', '');
my $bench = IPC::Run::start(
	[ 'pgbench', '-n', '-c', '4', '-j', '4', '-T', $seconds, '--max-tries', '20',
	  '--failures-detailed', '-f', $script, '-h', $coord->host, '-p', $coord->port, $db ],
	'>', \$bench_out, '2>', \$bench_err);
ok($coord->poll_query_until($db, 'SELECT count(*) >= 200 FROM orders'), 'B: the load is running');

# Six moves of three shard groups with tenants in them, each there and
# back, online (logical replication) or with writes blocked.
my @groups = grep { @{ $tenants_of{$_} } } sort keys %tenants_of;
my @moved = map { $tenants_of{ $groups[$_] }[0] } 0 .. 2;
my @moves;
for my $i (0 .. 2)
{
	my $t = $moved[$i];
	my $home = holder($t);
	my ($there, $back) = $i == 1 ? ('block_writes', 'force_logical') : ('force_logical', 'block_writes');
	push @moves, [ $t, $home, other($home), $there ], [ $t, other($home), $home, $back ];
}
@moves = @moves[ 0, 2, 4, 1, 3, 5 ];
for my $move (@moves)
{
	my ($t, $from, $to, $mode) = @$move;
	coord('CALL citus_cleanup_orphaned_resources()');
	my $before = coord(qq{SELECT count(*) FROM orders WHERE tenant_id = $t});
	coord(move_sql($t, $from, $to, $mode));
	is(holder($t)->name, $to->name, "B: the shard group of tenant $t moved from " . $from->name . ' to ' . $to->name . " ($mode) under load");
}
my $moves_done = coord('SELECT clock_timestamp()');
ok($bench->pumpable, 'B: the load was still running when the moves were done');
ok($coord->poll_query_until($db, qq{SELECT count(*) >= 50 FROM orders WHERE created_at > '$moves_done'}),
	'B: and orders are created after them');
my $bench_ok = $bench->finish;
diag($bench_out);
ok($bench_ok, 'B: pgbench exits 0') or diag($bench_err);

my ($processed) = $bench_out =~ /number of transactions actually processed: (\d+)/;
my ($failed) = $bench_out =~ /number of failed transactions: (\d+)/;
my ($retried) = $bench_out =~ /number of transactions retried: (\d+)/;
$retried //= 0;
ok(defined $processed && $processed > 0, "B: pgbench processed $processed requests, $retried of them retried after 40001");
is($failed, '0', 'B: none failed for good');

# What the database holds: one record per order and one order per record,
# each key once.
my $orders = coord('SELECT count(*) FROM orders');
is( coord(q{SELECT count(*) FROM (SELECT tenant_id, key FROM orders GROUP BY 1, 2 HAVING count(*) > 1) d}),
	'0', "B: no key has two orders ($orders orders)");
is( coord(q{
		SELECT count(*) FROM orders o
		  FULL JOIN idempotency.records r ON r.tenant = o.tenant_id AND r.key = 'POST /orders:' || o.key
		 WHERE o.key IS NULL OR r.key IS NULL OR r.state <> 'completed'}),
	'0', 'B: every order has its completed record, every record its order');
is(coord('SELECT count(*) FROM idempotency.records'), $orders, 'B: as many records as orders');
# (The two orders of part A count among them: their keys are in the load's range.)
cmp_ok($processed + 2, '>', $orders, 'B: some requests repeated a key and were replayed (' . ($processed + 2 - $orders) . ')');

# The moved tenants' orders were written on both workers: the load ran on
# each side of the moves.  (The moves end where they began.)
for my $t (@moved)
{
	is(coord(qq{SELECT count(DISTINCT port) FROM orders WHERE tenant_id = $t}), '2',
		"B: the orders of tenant $t were written on both workers");
}

# ---- C. A shard split.
# Two tenants of one shard group, with different hashes; the group is split
# between them (writes blocked: an online split needs the "citus" logical
# decoding plugin), the upper half placed on the other worker.  Sessions
# that used the shard map before the split see the new shards: a direct
# call on the old worker for the tenant that left is refused, one for the
# tenant that stayed replays; from the coordinator both replay on their
# node, and records and orders still match one to one.
{
	my ($lo, $hi, $group);
	for my $g (sort keys %tenants_of)
	{
		my %by_hash = map { coord("SELECT worker_hash(${_}::bigint)") => $_ } @{ $tenants_of{$g} };
		my @hashes = sort { $a <=> $b } keys %by_hash;
		next if @hashes < 2;
		($lo, $hi, $group) = ($by_hash{ $hashes[0] }, $by_hash{ $hashes[-1] }, $g);
		last;
	}
	die 'no shard group with two tenants' unless defined $group;
	my $from = holder($lo);
	my $to = other($from);
	is( coord("SELECT place_order($lo, 0)") . ' ' . coord("SELECT place_order($hi, 0)"),
		'claimed ' . $from->port . ' claimed ' . $from->port,
		"C: tenants $lo and $hi of one shard group each have an order on " . $from->name);
	my $direct = $from->background_psql($db, on_error_stop => 0);
	$direct->query_safe('\set VERBOSITY verbose');
	is( $direct->query_safe(qq{
			SELECT outcome FROM idem_claim('$lo', 'POST /orders:k0', '{"amount": 0}'::jsonb);
			SELECT outcome FROM idem_claim('$hi', 'POST /orders:k0', '{"amount": 0}'::jsonb);}),
		"replay\nreplay", 'C: a session on ' . $from->name . ' replays both, its shard map cached');

	coord(sprintf(q{
		SELECT citus_split_shard_by_split_points(%d, ARRAY[worker_hash(%d::bigint)::text],
			ARRAY[(SELECT nodeid FROM pg_dist_node WHERE nodeport = %d),
				  (SELECT nodeid FROM pg_dist_node WHERE nodeport = %d)], 'block_writes')},
		$group, $lo, $from->port, $to->port));
	is(holder($lo)->name . ' ' . holder($hi)->name, $from->name . ' ' . $to->name,
		"C: split: tenant $lo stays on " . $from->name . ", tenant $hi is on " . $to->name);
	is( $direct->query_safe(qq{SELECT outcome FROM idem_claim('$lo', 'POST /orders:k0', '{"amount": 0}'::jsonb)}),
		'replay', 'C: the session on the old worker replays for the tenant that stayed');
	$direct->{stderr} = '';
	$direct->query(qq{SELECT outcome FROM idem_claim('$hi', 'POST /orders:k0', '{"amount": 0}'::jsonb)});
	like($direct->{stderr}, qr/ERROR:  40001: the rows of "$hi" in idempotency\.records are not on this node/,
		'C: and refuses the tenant that left');
	$direct->{stderr} = '';
	$direct->quit;
	is( coord("SELECT place_order($lo, 0)") . ' ' . coord("SELECT place_order($hi, 0)"),
		'replay ' . $from->port . ' replay ' . $to->port,
		'C: from the coordinator each replays on its node');
	is( coord(q{
			SELECT count(*) FROM orders o
			  FULL JOIN idempotency.records r ON r.tenant = o.tenant_id AND r.key = 'POST /orders:' || o.key
			 WHERE o.key IS NULL OR r.key IS NULL}) . ' '
		  . coord(q{SELECT count(*) FROM (SELECT tenant_id, key FROM orders GROUP BY 1, 2 HAVING count(*) > 1) d}),
		'0 0', 'C: after the split, still one record per order and one order per key');
}

# The shells stayed empty.
is( join(' ', map { on($_, q{SELECT pg_relation_size('idempotency.records')}) } $cluster->nodes),
	'0 0 0', 'the shell of records stayed empty on every node');

done_testing();
