# SIGHUP: the cleanup worker rereads its settings at once.  A shorter
# idempotency.cleanup_interval makes the next pass come sooner and the passes
# follow each other at the new pace; a longer one spaces them out again.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.cleanup_interval = '1h'
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# The worker's first pass runs as soon as it starts; then it sleeps an hour.
$node->append_conf('postgresql.conf', "idempotency.databases = 'postgres'");
$node->reload;
my $runs_sql = q{SELECT cleanup_runs FROM idem_stats WHERE datname = 'postgres'};
$node->poll_query_until('postgres', $runs_sql, '1') or die 'no first pass';
my $runs0 = $node->safe_psql('postgres', $runs_sql);
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, token,
									 created_at, completed_at, expires_at)
	SELECT 'hup', 'k' || g, 'completed', idem_fingerprint('{}'), 201, 1,
		   now() - interval '1 day', now() - interval '1 day', now() - interval '1 hour'
	  FROM generate_series(1, 100) g;
});
sleep 3;
is($node->safe_psql('postgres', $runs_sql), $runs0, 'with cleanup_interval = 1h, no pass in 3 s');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.records}), '100',
	'and the expired records wait');

# Reload with 1 s: a pass at once, then one a second.
$node->append_conf('postgresql.conf', "idempotency.cleanup_interval = 1");
$node->reload;
$node->poll_query_until('postgres', q{SELECT count(*) FROM idempotency.records}, '0')
  or die 'the reload did not bring the next pass forward';
pass('after the reload the next pass comes at once');
my $runs1 = $node->safe_psql('postgres', $runs_sql);
sleep 4;
my $runs2 = $node->safe_psql('postgres', $runs_sql);
cmp_ok($runs2 - $runs1, '>=', 3, 'one pass a second (' . ($runs2 - $runs1) . ' in 4 s)');
cmp_ok($runs2 - $runs1, '<=', 5, 'and not more');

# Reload with an hour again: the passes stop.
$node->append_conf('postgresql.conf', "idempotency.cleanup_interval = '1h'");
$node->reload;
# Let the reload arrive, then count.
sleep 1;
my $runs3 = $node->safe_psql('postgres', $runs_sql);
sleep 3;
is($node->safe_psql('postgres', $runs_sql), $runs3, 'back to 1h: no pass in 3 s');
is($node->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup' AND state = 'idle'}),
	'1', 'the same worker, idle');

$node->stop;
done_testing();
