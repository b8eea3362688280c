# What the outbox TAP tests share: a node whose relay may reach loopback,
# where the tests' webhook endpoints listen, and those endpoints, which
# know the signing secret the tests give their destinations.
#
#   my $node = start_outbox_node('name', worker => 1, conf => q{...});
#   my $sink = start_sink();          # knows $SECRET
#   my $sink = start_sink($OTHER);    # knows only $OTHER
package OutboxNode;

use strict;
use warnings;

use Exporter 'import';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use WebhookSink;

our @EXPORT = qw($SECRET start_outbox_node start_sink);

# The signing secret of the tests' destinations.
our $SECRET = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';

# A started node with the extension created, its relay allowed to reach
# 127.0.0.1.  Options: worker => 1 runs the per-database worker in database
# "postgres" and returns once it is up (without it a test runs the relay's
# passes itself); preload => shared_preload_libraries (default
# 'idempotency'); conf => more lines of postgresql.conf.
sub start_outbox_node
{
	my ($name, %opt) = @_;
	my $preload = $opt{preload} // 'idempotency';
	my $node = PostgreSQL::Test::Cluster->new($name);

	$node->init;
	$node->append_conf('postgresql.conf', "shared_preload_libraries = '$preload'\n"
		  . "idempotency.relay_allowed_networks = '127.0.0.1'\n"
		  . ($opt{worker} ? "idempotency.databases = 'postgres'\n" : '')
		  . ($opt{conf} // ''));
	$node->start;
	$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
	if ($opt{worker})
	{
		$node->poll_query_until('postgres',
			q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
		  or die 'the per-database worker did not start';
	}
	return $node;
}

# A webhook endpoint (WebhookSink) listening on a free port of loopback,
# started, that verifies signatures with the given secrets ($SECRET when
# none is given).
sub start_sink
{
	my @secrets = @_ ? @_ : ($SECRET);

	return WebhookSink->new(
		port => PostgreSQL::Test::Cluster::get_free_port(),
		dir => PostgreSQL::Test::Utils::tempdir(),
		secrets => \@secrets)->start;
}

1;
