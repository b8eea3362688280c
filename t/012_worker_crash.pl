# kill -9 of the cleanup worker in the middle of a batch: crash recovery
# rolls the batch back, nothing that had not expired is lost, and the worker
# comes back on its own and finishes the backlog.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
# A long interval: the backlog is loaded while the worker sleeps, then a
# reload with a short interval starts the pass.  No pause between batches:
# the worker spends its time inside them, where it is to be killed.
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
restart_after_crash = on
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.cleanup_batch_size = 100
idempotency.cleanup_delay = 0
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# 400000 expired records with 40000 live ones spread among them.
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
									 created_at, completed_at, expires_at)
	SELECT 'crash', 'k' || g, 'completed', idem_fingerprint('{}'), 201, '{"n": 1}', 1,
		   now() - interval '1 day', now() - interval '1 day',
		   CASE WHEN g % 11 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 hour' END
	  FROM generate_series(1, 440000) g;
});
my $live_sql = q{SELECT count(*) || ' ' || coalesce(sum(hashtext(key)), 0)
				   FROM idempotency.records WHERE expires_at > now()};
my $live_before = $node->safe_psql('postgres', $live_sql);
like($live_before, qr/^40000 /, '40000 live records among the backlog');

# Start the pass and kill the worker while a batch is open, once some
# batches have committed and a good part of the backlog is left.  Each poll
# asks all three in one statement: the test used to poll for "inside a
# batch" only and, once in four runs, caught the very first batch (its check
# "some batches had committed" failed).
my $watch = $node->background_psql('postgres');
$node->append_conf('postgresql.conf', "idempotency.cleanup_interval = 1");
$node->reload;
my $pid = '';
my $expired_at_kill;
for (my $i = 0; $i < 200000 && $pid eq ''; $i++)
{
	my $row = $watch->query_safe(q{
		SELECT a.pid || ' ' || e.n
		  FROM pg_stat_activity a,
			   (SELECT count(*) AS n FROM idempotency.records WHERE expires_at < now()) e
		 WHERE a.backend_type = 'idempotency cleanup' AND a.state = 'active'
		   AND a.xact_start IS NOT NULL
		   AND a.query LIKE 'deleting expired rows of idempotency.records'
		   AND e.n < 400000 AND e.n > 20000});
	chomp $row;
	($pid, $expired_at_kill) = split / /, $row if $row ne '';
	$pid //= '';
}
isnt($pid, '',
	'caught the worker inside a batch after some batches had committed, '
	  . ($expired_at_kill // '?') . ' expired rows left');
my $offset = log_offset($node);
kill 'KILL', $pid;
$watch->{run}->kill_kill;

# Crash recovery, then the launcher starts the worker again and it finishes.
wait_for_crash_recovery($node, $offset);
ok($node->log_contains(qr/background worker "idempotency cleanup" \(PID $pid\) was terminated by signal 9/),
	'the server went through crash recovery');
$node->poll_query_until('postgres',
	q{SELECT count(*) FROM idempotency.records WHERE expires_at < now()}, '0')
  or die 'the worker did not finish after the crash';
pass('the worker came back and deleted the rest of the backlog');
isnt($node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'}),
	$pid, 'a new worker process');
is($node->safe_psql('postgres', $live_sql), $live_before, 'every live record is still there');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.records}), '40000',
	'and nothing else');

$node->stop;
done_testing();
