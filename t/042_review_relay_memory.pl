# Review of issue 11: the worker's relay loop must not grow its memory with
# the work it does.
#
# relay_loop_run() runs outside any transaction between its steps, where
# CurrentMemoryContext is TopMemoryContext (CommitTransactionCommand leaves
# it there).  Whatever the loop allocates there and does not free stays for
# the life of the worker: each failed request's error text (http_outcome's
# psprintf, called from http_async_collect) and, every iteration, the
# arrays of relay_loop_active() and full_ids of step (d).
#
# A flapping endpoint (connections refused, a 1-ms backoff, no circuit) gets
# thousands of attempts from the worker.  TopMemoryContext's own usage,
# reported by pg_log_backend_memory_contexts(), is taken once the loop is
# warm and again after 20,000 more attempts: it must not have grown by more
# than a few kB (caches live in child contexts, which are not counted).
# The test waits for a number of attempts, never for a time.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $node = start_outbox_node('review_memory', worker => 1, conf => q{
log_min_messages = log
});

# Nothing listens here: every attempt fails at once.
my $refused_port = PostgreSQL::Test::Cluster::get_free_port();
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('flap', 'http', 'http://127.0.0.1:%d/hook', '{flap.*}',
		jsonb_build_object('secret', '%s', 'backoff_base', '1ms', 'backoff_cap', '1ms',
			'max_attempts', 1000, 'failure_threshold', 1000000));
	SELECT idem_publish('flap.x', jsonb_build_object('n', n)) FROM generate_series(1, 40) n;},
	$refused_port, $SECRET));

my $pid;
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity WHERE application_name = 'idempotency cleanup'})
  or die 'no worker';
$pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE application_name = 'idempotency cleanup'});

sub attempts
{
	return $node->safe_psql('postgres', q{
		SELECT coalesce(sum(attempts), 0) FROM idempotency.deliveries d
		  JOIN idempotency.destinations t ON t.id = d.destination_id WHERE t.name = 'flap'});
}

# TopMemoryContext's own bytes in use, as the worker reports them.
sub top_used
{
	my $offset = -s $node->logfile;
	$node->safe_psql('postgres', "SELECT pg_log_backend_memory_contexts($pid)");
	$node->wait_for_log(qr/TopMemoryContext: \d+ total in \d+ blocks; \d+ free \(\d+ chunks\); \d+ used/,
		$offset);
	my $log = slurp_file($node->logfile, $offset);
	$log =~ /TopMemoryContext: \d+ total in \d+ blocks; \d+ free \(\d+ chunks\); (\d+) used/
	  or die 'no TopMemoryContext line';
	return $1;
}

# The worker's open file descriptors, with no request in flight: the
# destination is paused until none of its deliveries is claimed (each
# request in flight to the refusing endpoint holds a socket, up to
# max_in_flight of them, however many attempts came before), then resumed.
sub fd_count
{
	$node->safe_psql('postgres', q{SELECT idem_destination_pause('flap')});
	$node->poll_query_until('postgres', q{
		SELECT count(*) = 0 FROM idempotency.deliveries d
		  JOIN idempotency.destinations t ON t.id = d.destination_id
		 WHERE t.name = 'flap' AND d.state = 'pending' AND d.visible_until IS NOT NULL})
	  or die 'the requests in flight did not end';
	opendir(my $dh, "/proc/$pid/fd") or die "cannot read /proc/$pid/fd: $!";
	my $n = grep { !/^\./ } readdir $dh;
	closedir $dh;
	$node->safe_psql('postgres', q{SELECT idem_destination_resume('flap')});
	return $n;
}

# Warm up: caches, prepared statements, the loop's arrays.
$node->poll_query_until('postgres', q{
	SELECT sum(attempts) >= 2000 FROM idempotency.deliveries}) or die 'the relay made no attempts';
my $before = top_used();
my $fds_before = fd_count();
my $attempts_before = attempts();
$node->poll_query_until('postgres', qq{
	SELECT sum(attempts) >= $attempts_before + 20000 FROM idempotency.deliveries})
  or die 'the relay stopped attempting';
my $after = top_used();
my $fds_after = fd_count();
my $attempts_after = attempts();
diag("worker file descriptors: $fds_before -> $fds_after");
cmp_ok($fds_after, '<=', $fds_before + 5, 'nor its file descriptors');
my $growth = $after - $before;
diag(sprintf('TopMemoryContext used: %d -> %d bytes (+%d) over %d attempts (%.1f bytes per attempt)',
		$before, $after, $growth, $attempts_after - $attempts_before,
		$growth / ($attempts_after - $attempts_before)));
cmp_ok($growth, '<', 64 * 1024,
	'the worker\'s TopMemoryContext does not grow with the attempts it makes');

# A healthy endpoint: every iteration of the loop, even one with nothing
# failing, leaves its arrays behind.
my $sink = start_sink();
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_drop('flap');
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s'));
	SELECT idem_publish('healthy.x', '{}') FROM generate_series(1, 200);}, $sink->url, $SECRET));
$node->poll_query_until('postgres', q{
	SELECT count(*) = 200 FROM idempotency.deliveries WHERE state = 'delivered'})
  or die 'the healthy deliveries were not made';
$before = top_used();
# One event per transaction: one or more iterations of the loop each.
for my $round (1 .. 10)
{
	$node->safe_psql('postgres', "SELECT idem_publish('healthy.x', '{}');\n" x 100);
	$node->poll_query_until('postgres', sprintf(q{
		SELECT count(*) = %d FROM idempotency.deliveries WHERE state = 'delivered'}, 200 + 100 * $round))
	  or die 'the healthy deliveries were not made';
}
$after = top_used();
$growth = $after - $before;
diag(sprintf('healthy: TopMemoryContext used: %d -> %d bytes (+%d) over 1000 deliveries',
		$before, $after, $growth));
cmp_ok($growth, '<', 16 * 1024,
	'nor with the deliveries it makes to a healthy endpoint');
$sink->stop;

# The worker survived and is the same process.
is($node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE application_name = 'idempotency cleanup'}),
	$pid, 'the same worker throughout');

$node->stop;
done_testing();
