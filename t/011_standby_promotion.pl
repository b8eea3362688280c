# On a hot standby the cleanup does nothing: no launcher, no worker, and the
# expired records replicated from the primary stay.  Promotion starts the
# launcher and the worker without a restart, and they clean up.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
# The primary cleans nothing, so the standby receives a backlog.
$primary->append_conf('postgresql.conf', "shared_preload_libraries = 'idempotency'");
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
									 created_at, completed_at, expires_at)
	SELECT 'tap', 'k' || g, 'completed', idem_fingerprint('{}'), 201, '{"n": 1}', 1,
		   now() - interval '1 day', now() - interval '1 day',
		   CASE WHEN g % 10 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 hour' END
	  FROM generate_series(1, 2000) g;
	INSERT INTO idempotency.inbox (source, message_id, accepted_at, expires_at)
	SELECT 'tap', 'm' || g, now() - interval '1 day', now() - interval '1 hour'
	  FROM generate_series(1, 100) g;
});

$primary->backup('backup');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->append_conf('postgresql.conf', qq{
idempotency.databases = 'postgres'
idempotency.cleanup_interval = 1
});
$standby->start;
$primary->wait_for_catchup($standby);

my $count_sql = q{
	SELECT (SELECT count(*) FILTER (WHERE expires_at < now()) || '/' || count(*) FROM idempotency.records)
		   || ' ' || (SELECT count(*) FROM idempotency.inbox)
};
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'), 't', 'the standby is in recovery');
# Several cleanup intervals pass.
sleep 4;
is($standby->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'}),
	'0', 'no launcher and no cleanup worker run on a hot standby');
is($standby->safe_psql('postgres', $count_sql), '1800/2000 100',
	'the standby keeps the expired records and marks it received');
is($standby->safe_psql('postgres', q{SELECT count(*) FROM idem_stats WHERE cleanup_runs > 0}),
	'0', 'no cleanup pass ran on the standby');
# Replays work there all the same.
is($standby->safe_psql('postgres', q{SELECT outcome FROM idem_claim('tap', 'k10', '{}')}),
	'replay', 'the standby replays a live record');

# Promotion: cleanup starts without a restart.
$primary->stop;
$standby->promote;
$standby->poll_query_until('postgres', $count_sql, '0/200 0')
  or die 'no cleanup after promotion';
pass('after promotion the worker deletes the expired records and marks, keeps the live ones');
is( $standby->safe_psql('postgres', q{
		SELECT string_agg(backend_type || ':' || coalesce(datname, '-'), ', ' ORDER BY backend_type)
		  FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'}),
	'idempotency cleanup:postgres, idempotency launcher:-',
	'the launcher and the worker run after promotion');
is($standby->safe_psql('postgres',
		q{SELECT rows_deleted FROM idem_stats WHERE datname = 'postgres'}),
	'1900', 'idem_stats counts the deletions');
ok(!$standby->log_contains('idempotency launcher.*exited'), 'the launcher did not fail');

$standby->stop;
done_testing();
