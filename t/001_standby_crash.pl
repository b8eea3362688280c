# Records survive restarts and crashes, replays work on a hot standby while
# claims need the primary, and a backend killed while holding a claim leaves
# nothing behind: the key is free for the retry.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', "shared_preload_libraries = 'idempotency'\nrestart_after_crash = on");
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');
$primary->safe_psql('postgres', 'CREATE TABLE payments (id serial PRIMARY KEY, k text)');

# A completed operation.
$primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim('t:POST /payments', 'k1', '{"amount": 10}');
	INSERT INTO payments (k) VALUES ('k1');
	SELECT idem_succeed('t:POST /payments', 'k1', 201, '{"id": 1}');
	COMMIT;
});

# A hot standby replays, and refuses to claim.
$primary->backup('backup');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->start;
$primary->wait_for_catchup($standby);

is( $standby->safe_psql('postgres',
		q{SELECT outcome || ' ' || status FROM idem_claim('t:POST /payments', 'k1', '{"amount": 10}')}),
	'replay 201',
	'a standby replays a completed key');
is( $standby->safe_psql('postgres',
		q{SELECT outcome FROM idem_claim('t:POST /payments', 'k1', '{"amount": 11}')}),
	'mismatch',
	'a standby detects a mismatch');
my ($ret, $out, $err) = $standby->psql('postgres',
	q{SELECT idem_claim('t:POST /payments', 'k-new', '{}')},
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/25006.*cannot execute idem_claim\(\) in a read-only transaction/,
	'a standby refuses a new claim with 25006');

# Records written later reach the standby too.
$primary->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_claim('t:POST /payments', 'k2', '{}');
	SELECT idem_succeed('t:POST /payments', 'k2', 202);
	COMMIT;
});
$primary->wait_for_catchup($standby);
is($standby->safe_psql('postgres', q{SELECT status FROM idem_replay('t:POST /payments', 'k2')}),
	'202', 'idem_replay on the standby sees a later record');
$standby->stop;

# A backend killed -9 while it holds a claim (its domain write done, response
# not yet stored): crash recovery rolls everything back and the key is free.
my $victim = $primary->background_psql('postgres');
$victim->query_safe(q{BEGIN});
$victim->query_safe(q{SELECT idem_claim('t:POST /payments', 'k3', '{}')});
$victim->query_safe(q{INSERT INTO payments (k) VALUES ('k3')});
my $pid = $victim->query_safe(q{SELECT pg_backend_pid()});
chomp $pid;

# Meanwhile a duplicate is waiting for the victim's lock.
my $waiter = $primary->background_psql('postgres', on_error_stop => 0);
$waiter->query_until(qr/waiting/, q{
	\echo waiting
	SELECT outcome FROM idem_claim('t:POST /payments', 'k3', '{}');
});
$primary->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 7648 AND NOT granted})
  or die 'the duplicate never waited for the claim';

my $offset = log_offset($primary);
kill 'KILL', $pid;
$victim->{run}->kill_kill;
$waiter->{run}->kill_kill;
wait_for_crash_recovery($primary, $offset);
ok($primary->log_contains('terminated by signal 9'), 'the server went through crash recovery');

is($primary->safe_psql('postgres', q{SELECT count(*) FROM payments WHERE k = 'k3'}),
	'0', 'the killed transaction left no domain write');
is($primary->safe_psql('postgres', q{SELECT count(*) FROM idem_replay('t:POST /payments', 'k3')}),
	'0', 'the killed transaction left no record');
is( $primary->safe_psql('postgres', q{
		BEGIN;
		SELECT outcome FROM idem_claim('t:POST /payments', 'k3', '{}');
		INSERT INTO payments (k) VALUES ('k3');
		SELECT idem_succeed('t:POST /payments', 'k3', 201);
		COMMIT;
	}), "claimed\n", 'the retry after the crash claims the key');

# Completed records survive the crash and a clean restart.
$primary->restart;
is( $primary->safe_psql('postgres',
		q{SELECT string_agg(outcome, ',' ORDER BY k) FROM (VALUES ('k1'), ('k2'), ('k3')) v(k),
		  LATERAL idem_claim('t:POST /payments', k, CASE k WHEN 'k1' THEN '{"amount": 10}' ELSE '{}' END)}),
	'replay,replay,replay',
	'records survive a crash and a restart');
is( $primary->safe_psql('postgres',
		q{SELECT string_agg(k || '=' || n, ',' ORDER BY k) FROM (SELECT k, count(*) AS n FROM payments GROUP BY k) c}),
	'k1=1,k3=1',
	'each paying operation wrote its payment once');

$primary->stop;
done_testing();
