# The relay's sockets count against the server process's file descriptors.
#
# PostgreSQL keeps each backend within max_safe_fds open files (derived from
# max_files_per_process), and code that opens descriptors of its own must
# report them (AcquireExternalFD), which it allows up to a third of
# max_safe_fds.  The relay's HTTP connections are such descriptors: with
# idempotency.relay_max_in_flight above that share, it keeps no more
# connections open at once than the share, and still delivers everything.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $node = PostgreSQL::Test::Cluster->new('fds');
$node->init;
# debug2 makes the postmaster log max_safe_fds at start.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
max_files_per_process = 100
log_min_messages = debug2
idempotency.relay_max_in_flight = 60
idempotency.relay_allowed_networks = '127.0.0.1'
});
$node->start;
my ($max_safe_fds) = slurp_file($node->logfile) =~ /max_safe_fds = (\d+)/
  or die 'the postmaster did not log max_safe_fds';
my $share = int($max_safe_fds / 3);
cmp_ok($share, '<', 60, "a third of max_safe_fds ($share) is less than relay_max_in_flight");
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET log_min_messages = warning;
	SELECT pg_reload_conf();
	CREATE EXTENSION idempotency;
});

my $sink = start_sink();
$sink->set_mode('sleep 1 204');
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('hook', 'http', '%s', '{order.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s'));
	SELECT idem_publish('order.created', jsonb_build_object('n', n)) FROM generate_series(1, 60) n;},
	$sink->url, $SECRET));

is($node->safe_psql('postgres', 'SELECT idem_outbox_relay(60)'), '60', 'one pass attempts all 60 events');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FILTER (WHERE state = 'delivered' AND attempts = 1) FROM idempotency.deliveries}),
	'60', 'and delivers all of them at the first attempt');

# The most requests the sink had under way at once, and the connections used.
my ($open, $most) = (0, 0);
my %conns;
for my $e ($sink->entries)
{
	if ($e->{what} eq 'received')
	{
		$open++;
		$most = $open if $open > $most;
		$conns{ $e->{conn} } = 1;
	}
	else
	{
		$open--;
	}
}
cmp_ok($most, '<=', $share, "at most $share requests were under way at once (there were $most)");
cmp_ok(scalar(keys %conns), '<=', $share, 'on as many connections at most (' . scalar(keys %conns) . ')');
cmp_ok($most, '>', 1, 'several at once all the same');

$sink->stop;
$node->stop;
done_testing();
