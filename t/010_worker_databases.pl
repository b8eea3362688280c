# The cleanup worker: one per database listed in idempotency.databases, each
# deleting its own database's expired records and inbox marks and keeping the
# live ones.  A listed database that lacks the extension, or does not exist,
# gets a clear log line; creating the extension later starts the cleanup
# without a restart; a reload adds and removes databases; SIGTERM stops a
# worker promptly and the launcher starts it again.  Without preloading, the
# core functions work and the statistics say what is missing.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.cleanup_interval = 1
idempotency.cleanup_batch_size = 100
});
$node->start;

# Before any database is listed: only the launcher runs, and it says why.
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'})
  or die 'the launcher did not start';
ok($node->wait_for_log(qr/idempotency.databases is empty: no idempotency cleanup worker runs/),
	'the launcher logs that no database is listed');

# Expired and live records and inbox marks in db1 and db2; db3 has no extension.
for my $db (qw(db1 db2 db3))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
}
my $load = q{
	CREATE EXTENSION idempotency;
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
									 created_at, completed_at, expires_at)
	SELECT 'tap', 'k' || g, 'completed', idem_fingerprint('{}'), 201, '{"n": 1}', 1,
		   now() - interval '1 day', now() - interval '1 day',
		   CASE WHEN g % 10 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 hour' END
	  FROM generate_series(1, 1000) g;
	INSERT INTO idempotency.inbox (source, message_id, accepted_at, expires_at)
	SELECT 'tap', 'm' || g, now() - interval '1 day',
		   CASE WHEN g % 10 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 hour' END
	  FROM generate_series(1, 300) g;
};
$node->safe_psql($_, $load) for qw(db1 db2);

my $count_sql = q{
	SELECT (SELECT count(*) FILTER (WHERE expires_at < now()) || '/' || count(*) FROM idempotency.records)
		   || ' ' ||
		   (SELECT count(*) FILTER (WHERE expires_at < now()) || '/' || count(*) FROM idempotency.inbox)
};
is($node->safe_psql('db1', $count_sql), '900/1000 270/300', 'db1 has its backlog before cleanup');

# List them (and a database that does not exist), then reload.
$node->append_conf('postgresql.conf', "idempotency.databases = 'db1, db2, db3, nodb'");
$node->reload;

for my $db (qw(db1 db2))
{
	$node->poll_query_until($db, $count_sql, '0/100 0/30')
	  or die "the worker did not clean $db";
	pass("the worker of $db deleted its expired records and marks and kept the live ones");
}

# Three workers (db3's waits for its extension) and the launcher, visible as such.
is( $node->safe_psql('postgres', q{
		SELECT string_agg(coalesce(datname, '-') || ':' || backend_type || ':' || application_name, ', '
						  ORDER BY datname NULLS FIRST)
		  FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'}),
	'-:idempotency launcher:idempotency launcher, db1:idempotency cleanup:idempotency cleanup, '
	  . 'db2:idempotency cleanup:idempotency cleanup, db3:idempotency cleanup:idempotency cleanup',
	'pg_stat_activity shows the launcher and one worker per listed database');
# A worker between passes holds no transaction open.
$node->poll_query_until('postgres', q{
	SELECT count(*) = 3 FROM pg_stat_activity
	 WHERE backend_type = 'idempotency cleanup' AND state = 'idle' AND xact_start IS NULL})
  or die 'no idle workers';
pass('idle workers hold no transaction open');

ok( $node->wait_for_log(qr/database "nodb" listed in idempotency.databases does not exist/),
	'a missing database is logged');
ok( $node->wait_for_log(qr/extension "idempotency" is not installed in database "db3"/),
	'a database without the extension is logged');

# The statistics of each database (the view shows them all): its own
# deletions, its worker.
is( $node->safe_psql('db1', q{
		SELECT string_agg(s.datname || ':' || s.rows_deleted || ':' || (s.cleanup_runs > 0)
						  || ':' || (s.worker_pid = a.pid) || ':' || (s.cleanup_lag < interval '1 minute'),
						  ', ' ORDER BY s.datname)
		  FROM idem_stats s JOIN pg_stat_activity a ON a.datname = s.datname
		 WHERE a.backend_type = 'idempotency cleanup' AND s.datname IN ('db1', 'db2')}),
	'db1:1170:true:true:true, db2:1170:true:true:true',
	'idem_stats: rows deleted, passes, worker and lag per database');

# Creating the extension in db3 starts its cleanup without a restart.
$node->safe_psql('db3', $load);
$node->poll_query_until('db3', $count_sql, '0/100 0/30')
  or die 'the worker did not clean db3 after CREATE EXTENSION';
pass('the worker of db3 starts cleaning once the extension exists');
ok($node->log_contains('extension "idempotency" is now installed in database "db3"'),
	'and says so');

# Unlisting db2 stops its worker; db1 goes on.
$node->append_conf('postgresql.conf', "idempotency.databases = 'db1, db3'");
$node->reload;
$node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup' AND datname = 'db2'})
  or die 'the worker of db2 did not stop';
pass('unlisting a database stops its worker');
ok($node->log_contains('idempotency cleanup worker for database "db2" is stopping'),
	'the worker logs why it stops');
my $expire = q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, token,
									 created_at, completed_at, expires_at)
	SELECT 'late', 'k' || g, 'completed', idem_fingerprint('{}'), 201, 1,
		   now() - interval '1 day', now() - interval '1 day', now() - interval '1 hour'
	  FROM generate_series(1, 50) g;
};
$node->safe_psql($_, $expire) for qw(db1 db2);
$node->poll_query_until('db1', q{SELECT count(*) FROM idempotency.records WHERE scope = 'late'}, '0')
  or die 'db1 is no longer cleaned';
sleep 2;
is($node->safe_psql('db2', q{SELECT count(*) FROM idempotency.records WHERE scope = 'late'}),
	'50', 'an unlisted database is left alone');

# SIGTERM: the worker stops at once, the launcher starts a new one.
my $old_pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup' AND datname = 'db1'});
my $t0 = time;
$node->safe_psql('postgres', "SELECT pg_terminate_backend($old_pid)");
$node->poll_query_until('postgres', "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $old_pid")
  or die 'the worker ignored SIGTERM';
cmp_ok(time - $t0, '<', 5, 'SIGTERM stops the worker promptly');
$node->poll_query_until('postgres', qq{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE backend_type = 'idempotency cleanup' AND datname = 'db1' AND pid <> $old_pid})
  or die 'the launcher did not start the worker again';
pass('the launcher starts a terminated worker again');
is($node->safe_psql('db1',
		q{SELECT worker_pid <> } . $old_pid . q{ FROM idem_stats WHERE datname = 'db1'}),
	't', 'idem_stats shows the new worker');

$node->stop;

# Without shared_preload_libraries: no launcher, the core works, the
# statistics ask for preloading.
my $plain = PostgreSQL::Test::Cluster->new('plain');
$plain->init;
$plain->start;
$plain->safe_psql('postgres', 'CREATE EXTENSION idempotency');
is( $plain->safe_psql('postgres', q{
		BEGIN;
		SELECT outcome FROM idem_claim('s', 'k', '{}');
		SELECT idem_succeed('s', 'k', 201);
		COMMIT;
		SELECT outcome FROM idem_claim('s', 'k', '{}');
		SELECT idem_inbox_accept('topic', 'm1');}),
	"claimed\n\nreplay\nt", 'without preloading, claims and the inbox work');
is($plain->safe_psql('postgres', q{SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'}),
	'0', 'without preloading, no background worker runs');
my ($ret, $out, $err) = $plain->psql('postgres', 'SELECT * FROM idem_stats',
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/55000: idem_stats requires idempotency to be loaded via shared_preload_libraries/,
	'idem_stats without preloading: 55000');
like($err, qr/HINT:  Add idempotency to shared_preload_libraries in postgresql.conf and restart the server./,
	'with a hint');
($ret, $out, $err) = $plain->psql('postgres', 'SELECT idem_stats_reset()');
like($err, qr/idem_stats_reset requires idempotency to be loaded via shared_preload_libraries/,
	'idem_stats_reset without preloading: the same error');
$plain->stop;

done_testing();
