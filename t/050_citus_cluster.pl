# The Citus test infrastructure (t/CitusCluster.pm) works: a coordinator
# and two workers start and know each other, a call of a distributed
# function made on the coordinator runs on the worker that holds the shard
# of its argument (the way the extension is meant to be used under Citus),
# in a transaction block too and after an online shard move, and the
# extension created on the coordinator is there on every node.  It proves
# nothing about the extension under Citus; the tests that do build on this
# one.  Skipped when Citus is not installed.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CitusCluster;

CitusCluster::skip_unless_citus();

my $cluster = CitusCluster->new(workers => 2);
my $coord = $cluster->coordinator;
my @workers = $cluster->workers;

# The coordinator lists both workers as active, by the names and ports
# they listen on.
is( $cluster->safe_psql($coord,
		'SELECT string_agg(node_name || \':\' || node_port, \' \' ORDER BY node_port) FROM citus_get_active_worker_nodes()'),
	join(' ', map { $_->host . ':' . $_->port } sort { $a->port <=> $b->port } @workers),
	'the coordinator has both workers as active nodes');

# A table distributed by tenant, and a PL/pgSQL function distributed by its
# first argument, colocated with it and delegated even inside a transaction
# block: it writes a row for its tenant and says which node it ran on.
$cluster->safe_psql($coord, q{
	CREATE TABLE orders (tenant text NOT NULL, n int NOT NULL, port int NOT NULL);
	SELECT create_distributed_table('orders', 'tenant');
	CREATE FUNCTION place_order(p_tenant text, p_n int) RETURNS int
	LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO orders VALUES (p_tenant, p_n, current_setting('port')::int);
		RETURN current_setting('port')::int;
	END $$;
	SELECT create_distributed_function('place_order(text, int)', '$1',
									   colocate_with => 'orders', force_delegation => true);
});

# 20 tenants, which land on both workers: each call runs on the worker that
# holds its tenant's shard, not on the coordinator.
my (@wrong, %seen);
for my $i (1 .. 20)
{
	my $ran_on = $cluster->safe_psql($coord, "SELECT place_order('tenant$i', $i)");
	my $holder = $cluster->placement_node('orders', "'tenant$i'");
	$seen{ $holder->name } = 1;
	push @wrong, "tenant$i ran on $ran_on, its shard is on " . $holder->port
	  if $ran_on != $holder->port;
}
is_deeply({ wrong => \@wrong, workers => [ sort keys %seen ] },
	{ wrong => [], workers => [ sort map { $_->name } @workers ] },
	'each call from the coordinator ran on the worker holding its shard, on both workers');

# Inside BEGIN ... COMMIT too (force_delegation), and the rows are there.
my $holder = $cluster->placement_node('orders', q{'tenant1'});
is( $cluster->safe_psql($coord, q{
		BEGIN;
		SELECT place_order('tenant1', 100);
		COMMIT;
		SELECT count(*) FROM orders WHERE tenant = 'tenant1' AND port = } . $holder->port . ';'),
	$holder->port . "\n2",
	'a call in a transaction block is delegated to the shard\'s worker too');

# An online shard move (logical replication between the workers; the
# coordinator reaches itself through citus.local_hostname): tenant1's rows
# go with the shard, and its calls follow it to the other worker.
my ($other) = grep { $_ != $holder } @workers;
$cluster->safe_psql($coord, sprintf(q{
	SELECT citus_move_shard_placement(get_shard_id_for_distribution_column('orders', 'tenant1'),
									  '%s', %d, '%s', %d, shard_transfer_mode => 'force_logical')},
	$holder->host, $holder->port, $other->host, $other->port));
is( $cluster->safe_psql($coord, q{
		SELECT place_order('tenant1', 101);
		SELECT count(*) FROM orders WHERE tenant = 'tenant1'}),
	$other->port . "\n3",
	'after an online shard move the calls run on the worker the shard moved to');

# CREATE EXTENSION idempotency, when the test asks for it: made on the
# coordinator, it is on every node, in the same version, and works there.
$cluster->create_idempotency;
my @versions = map {
	$_->name . ' ' . $cluster->safe_psql($_, q{
		SELECT extversion || ' ' || (length(idem_fingerprint('{}')) > 0)
		  FROM pg_extension WHERE extname = 'idempotency'})
} $cluster->nodes;
my $version = $cluster->safe_psql($coord, q{SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'});
is_deeply(\@versions, [ map { $_->name . " $version true" } $cluster->nodes ],
	'CREATE EXTENSION idempotency works on the coordinator and every worker');

done_testing();
