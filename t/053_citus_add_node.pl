# A worker added to a Citus cluster after idem_citus_distribute (the tenant
# table "orders" distributed by a bigint tenant_id, so records and inbox
# have the column "tenant") and after an outbox destination was created on
# the coordinator:
#
#  1. citus_add_node of a new worker that is not prepared fails, naming the
#     tenant column its tables lack (Citus's metadata names it on every
#     node); prepared as the README says -- the extension and the tenant
#     columns created on it before it is added (idem_citus_add_tenant) --
#     it joins, and idem_citus_distribute run again succeeds;
#  2. once a shard group moves to it, the delegated calls for its tenants
#     run there: the moved records replay, new ones are created, the inbox
#     works;
#  3. it has the destination that was created before it joined (sent by
#     idem_citus_distribute run again), and an event published inside a
#     delegated call there is delivered once by its relay.
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

my $extra_conf = q{
citus.shard_count = 4
idempotency.databases = 'postgres'
};
my $cluster = CitusCluster->new(workers => 2, conf => $extra_conf);
$cluster->create_idempotency;
my $coord = $cluster->coordinator;
my $db = $cluster->dbname;

sub on { my ($node, $sql) = @_; return $node->safe_psql($db, $sql); }
sub coord { return on($coord, $_[0]); }

# The application, as in t/051: orders by tenant, POST /orders as a
# force-delegated PL/pgSQL function that publishes the order's event, and a
# function destination writing a table of each node's own.
coord(q{
	CREATE TABLE orders (tenant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL, port int);
	SELECT create_distributed_table('orders', 'tenant_id');
	SELECT idem_citus_distribute('orders');

	CREATE FUNCTION place_order(p_tenant bigint, p_key text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
	BEGIN
		c := idem_citus.idem_claim(p_tenant, 'POST /orders:' || p_key, '{}'::jsonb);
		IF c.outcome = 'claimed' THEN
			INSERT INTO orders VALUES (p_tenant, p_key, 1, current_setting('port')::int);
			PERFORM idem_publish('order.created', jsonb_build_object('tenant', p_tenant, 'key', p_key));
			PERFORM idem_citus.idem_succeed(p_tenant, 'POST /orders:' || p_key, 201);
		END IF;
		RETURN c.outcome || ' ' || current_setting('port');
	END $$;
	SELECT create_distributed_function('place_order(bigint,text)', '$1',
									   colocate_with => 'orders', force_delegation => true);

	CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO received VALUES ((event->>'id')::uuid, event->'payload'->>'key', current_setting('port')::int);
	END $$;
});
my $received = q{SET citus.enable_ddl_propagation = off;
	CREATE TABLE received (event_id uuid, key text, port int)};
on($_, $received) for $cluster->nodes;
coord(q{SELECT idem_destination_create('ledger', 'function', 'fdest(jsonb)', '{order.*}')});

# Orders of tenant 1 before the new worker joins.
my $t = 1;
my $home = $cluster->node_by_port(coord(qq{
	SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
	 WHERE p.shardid = get_shard_id_for_distribution_column('idempotency.records', $t)}));
is(coord(qq{SELECT place_order($t, 'before')}), 'claimed ' . $home->port, "tenant $t has an order on " . $home->name);

# ---- 1. A third worker joins.
my $new = PostgreSQL::Test::Cluster->new('worker3');
$new->init(allows_streaming => 'logical');
$new->append_conf('postgresql.conf', CitusCluster::node_conf($new->host) . $extra_conf);
$new->start;
on($new, 'CREATE EXTENSION citus');
on($new, $received);
my $add = sprintf(q{SELECT citus_add_node('%s', %d)}, $new->host, $new->port);
my ($out, $err) = ('', '');
my $rc = $coord->psql($db, $add, stdout => \$out, stderr => \$err);
ok($rc != 0 && $err =~ /column "tenant" of relation "records" does not exist/,
	'1: citus_add_node of a new worker without the tenant columns fails, naming the column')
  or diag("rc $rc: $err");
# As the README says: the extension and its tenant columns on the new node
# first (it refuses extension DDL once it is a worker).
on($new, q{
	CREATE EXTENSION idempotency;
	SELECT idem_citus_add_tenant('records', 'bigint', NULL, true);
	SELECT idem_citus_add_tenant('inbox', 'bigint', NULL, true);});
$rc = $coord->psql($db, $add, stdout => \$out, stderr => \$err);
ok($rc == 0, '1: citus_add_node of the prepared worker succeeds') or diag($err);
$rc = $coord->psql($db, q{SELECT idem_citus_distribute('orders')}, stdout => \$out, stderr => \$err);
ok($rc == 0, '1: idem_citus_distribute run again after adding the node succeeds') or diag($err);

# ---- 2. The new worker serves the tenants whose shards move to it.
is( on($new, q{
		SELECT e.extversion || ' ' || (SELECT string_agg(a.attrelid::regclass || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', ' ORDER BY a.attrelid::regclass::text)
		  FROM pg_attribute a
		 WHERE a.attrelid IN ('idempotency.records'::regclass, 'idempotency.inbox'::regclass)
		   AND a.attname = 'tenant' AND NOT a.attisdropped)
		  FROM pg_extension e WHERE e.extname = 'idempotency'}),
	'1.4 idempotency.inbox.tenant bigint, idempotency.records.tenant bigint',
	'2: the new worker has the extension, with the tenant columns');
coord(sprintf(q{
	SELECT citus_move_shard_placement(get_shard_id_for_distribution_column('orders', %d),
		'%s', %d, '%s', %d, shard_transfer_mode => 'block_writes')},
	$t, $home->host, $home->port, $new->host, $new->port));
is( coord(qq{
		SELECT place_order($t, 'before');
		SELECT place_order($t, 'after');
		SELECT idem_citus.idem_inbox_accept($t, 'm1');
		SELECT idem_citus.idem_inbox_accept($t, 'm1');}),
	join("\n", 'replay ' . $new->port, 'claimed ' . $new->port, 't', 'f'),
	'2: after a move to the new worker, the moved record replays there, a new one is created there, the inbox works');

# ---- 3. The new worker relays the events published there.
my $has = is(on($new, q{SELECT coalesce(string_agg(name, ','), '') FROM idem_destinations}), 'ledger',
	'3: the new worker has the destination created before it joined');
# (Without the destination the event has no delivery: nothing to wait for.)
ok( $has && $new->poll_query_until($db, q{SELECT count(*) = 1 FROM received WHERE key = 'after'}),
	'3: the event published on the new worker is delivered by its relay');
is(on($new, q{SELECT count(*) || ' ' || min(port) FROM received}), '1 ' . $new->port, '3: once');

done_testing();
