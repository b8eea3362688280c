# A Citus cluster for the TAP tests: a coordinator and N workers (default 2)
# on this machine, each a PostgreSQL::Test::Cluster with
# shared_preload_libraries = 'citus,idempotency', the workers registered
# from the coordinator.
#
#   use CitusCluster;
#   CitusCluster::skip_unless_citus();      # before anything else
#   my $cluster = CitusCluster->new(workers => 2, conf => "citus.shard_count = 4\n");
#   $cluster->create_idempotency;           # when the test wants it
#   $cluster->safe_psql($cluster->coordinator, 'SELECT ...');
#
# How the nodes reach each other: PostgreSQL::Test::Cluster's nodes listen
# only on Unix sockets, all in one temporary directory, each on its own port,
# with trust authentication.  So a node's name in Citus's metadata
# (pg_dist_node.nodename) is that directory, which libpq takes for a socket
# directory because it starts with "/", and no password is ever needed.
# citus.local_hostname, the name a node uses to connect to itself, is that
# directory too: with its default, localhost, which nothing listens on,
# citus_move_shard_placement fails ("connection to the remote node
# postgres@localhost:<port> failed").  CREATE EXTENSION citus turns ssl on
# with a self-signed certificate, since citus.node_conninfo defaults to
# sslmode=require; libpq uses no SSL on a Unix socket, so nothing changes.
#
# Citus itself is installed by scripts/citus.sh (test/run.sh calls it when a
# test's name matches "citus"); citus_available() tells whether it is there.
package CitusCluster;

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# Every node's settings, before the test's own (conf => ...), which can
# override any of them.  Citus must come first in shared_preload_libraries;
# two-phase commit needs prepared transactions; online shard moves use
# logical replication (wal_level, slots, senders, worker processes);
# PostgreSQL::Test::Cluster's allows_streaming sets max_connections = 10 and
# shared_buffers = 1MB, too few for a coordinator's connections to its
# workers.  No statistics collection: it would try to reach the internet.
sub node_conf
{
	my ($host) = @_;
	return <<"EOF";
shared_preload_libraries = 'citus,idempotency'
max_prepared_transactions = 100
wal_level = logical
max_connections = 100
shared_buffers = 16MB
max_wal_senders = 20
max_replication_slots = 20
max_worker_processes = 32
citus.shard_replication_factor = 1
citus.local_hostname = '$host'
citus.enable_statistics_collection = off
EOF
}

# Whether citus.so is installed for the PostgreSQL under test (the
# pg_config first on PATH, as PostgreSQL::Test::Cluster finds its programs),
# and test/run.sh did not say otherwise (IDEM_CITUS_SKIP holds its reason).
sub citus_available
{
	return 0 if ($ENV{IDEM_CITUS_SKIP} // '') ne '';
	my $libdir = `pg_config --pkglibdir`;
	return 0 if $? != 0;
	chomp $libdir;
	return -f "$libdir/citus.so" ? 1 : 0;
}

# plan skip_all, saying why, unless Citus can run here.
sub skip_unless_citus
{
	return if citus_available();
	my $reason = $ENV{IDEM_CITUS_SKIP} // '';
	if ($reason eq '')
	{
		my $libdir = `pg_config --pkglibdir` // '';
		chomp $libdir;
		$reason = "Citus is not installed for this PostgreSQL (no $libdir/citus.so; "
		  . 'test/run.sh installs it with scripts/citus.sh)';
	}
	plan skip_all => $reason;
}

# new(workers => 2, dbname => 'postgres', conf => '...'): start the
# coordinator and the workers, create the citus extension on each, and
# register them from the coordinator.
sub new
{
	my ($class, %args) = @_;
	my $self = bless {
		dbname => $args{dbname} // 'postgres',
		coordinator => undef,
		workers => [],
	}, $class;
	my $nworkers = $args{workers} // 2;

	for my $name ('coordinator', map { "worker$_" } 1 .. $nworkers)
	{
		my $node = PostgreSQL::Test::Cluster->new($name);
		$node->init(allows_streaming => 'logical');
		$node->append_conf('postgresql.conf', node_conf($node->host) . ($args{conf} // ''));
		$node->start;
		if ($self->{dbname} ne 'postgres')
		{
			$node->safe_psql('postgres', qq{CREATE DATABASE "$self->{dbname}"});
		}
		# Before the node is added: citus_add_node syncs Citus's metadata
		# to the new node, which needs the extension there.
		$node->safe_psql($self->{dbname}, 'CREATE EXTENSION citus');
		if ($name eq 'coordinator')
		{
			$self->{coordinator} = $node;
		}
		else
		{
			push @{ $self->{workers} }, $node;
		}
	}

	my $coord = $self->{coordinator};
	$coord->safe_psql($self->{dbname},
		sprintf("SELECT citus_set_coordinator_host('%s', %d)", $coord->host, $coord->port));
	for my $worker (@{ $self->{workers} })
	{
		$coord->safe_psql($self->{dbname},
			sprintf("SELECT citus_add_node('%s', %d)", $worker->host, $worker->port));
	}
	return $self;
}

# The coordinator node.
sub coordinator { return $_[0]->{coordinator}; }

# The worker nodes, in the order they were added.
sub workers { return @{ $_[0]->{workers} }; }

# All nodes, the coordinator first.
sub nodes { return ($_[0]->{coordinator}, @{ $_[0]->{workers} }); }

# The database the cluster's extensions live in.
sub dbname { return $_[0]->{dbname}; }

# safe_psql on $node in the cluster's database.
sub safe_psql
{
	my ($self, $node, $sql, %params) = @_;
	return $node->safe_psql($self->{dbname}, $sql, %params);
}

# The node whose port is $port (what current_setting('port') says on it).
sub node_by_port
{
	my ($self, $port) = @_;
	my ($node) = grep { $_->port == $port } $self->nodes;
	return $node;
}

# The node that holds the shard of $table for distribution value $value
# (an SQL literal, e.g. "'tenant1'"), from the coordinator's citus_shards.
sub placement_node
{
	my ($self, $table, $value) = @_;
	my $port = $self->safe_psql($self->{coordinator}, qq{
		SELECT nodeport FROM citus_shards
		 WHERE shardid = get_shard_id_for_distribution_column('$table', $value)});
	return $self->node_by_port($port);
}

# CREATE EXTENSION idempotency on the coordinator, which Citus propagates
# to every worker (and to workers added later).  A worker refuses extension
# DDL of its own ("operation is not allowed on this node"), even IF NOT
# EXISTS; a worker that still lacks it (propagation turned off by the test's
# conf) gets it the way Citus sends it, with DDL propagation off.
sub create_idempotency
{
	my ($self) = @_;
	$self->safe_psql($self->{coordinator}, 'CREATE EXTENSION idempotency');
	for my $worker ($self->workers)
	{
		next if $self->safe_psql($worker,
			q{SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'});
		$self->safe_psql($worker,
			'SET citus.enable_ddl_propagation = off; CREATE EXTENSION idempotency');
	}
}

1;
