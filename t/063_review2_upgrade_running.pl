# Second review of issue 11: the 1.2 -> 1.3 upgrade with the 1.3 library
# loaded, the worker running and deliveries queued.
#
# The order a DBA follows: install the 1.3 package, restart (the library is
# preloaded), then ALTER EXTENSION idempotency UPDATE.  In between, the
# applications go on publishing; the worker waits for 1.3.  After the
# update, what was queued is delivered, without a publish to wake the relay,
# and the destinations made at 1.2 have 1.3's defaults.
#
# But the worker's loop, having found the schema at 1.2 (relay_schema_current
# false: *due = 0), sleeps until its latch is set or its next due time, and
# it has none: the cleanup pass that notices the update ("cleanup starts")
# does not make the loop look again (relay_loop_look_again is called only by
# helpers).  The backlog queued at 1.2 waits for the next publish, or the
# next cleanup interval, however long that is.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('review2_upgrade');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
});
$node->start;
$node->safe_psql('postgres', q{CREATE EXTENSION idempotency VERSION '1.2'});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';

# A destination as 1.2 made it, and events queued for it.
$node->safe_psql('postgres', q{
	INSERT INTO idempotency.destinations (name, kind, target, topics, run_as, search_path, options,
	                                      max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms)
	VALUES ('old_ui', 'notify', 'old_events', '{*}', current_user::regrole, 'public', '{}',
	        10, 1000, 3600000, 10000);
});
my ($rc, $out, $err) = $node->psql('postgres',
	q{SELECT count(idem_publish('t.x', '{}')) FROM generate_series(1, 5)});
is($rc, 0, 'publishing works between the library upgrade and ALTER EXTENSION UPDATE')
  or diag($err);
my $queued = $node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'pending'});
note("queued before the update: $queued");

$node->safe_psql('postgres', 'ALTER EXTENSION idempotency UPDATE');
# (To the current version: 1.3 changed the relay, later ones keep it.)
is($node->safe_psql('postgres', q{SELECT extversion = default_version FROM pg_extension e
		JOIN pg_available_extensions a ON a.name = e.extname WHERE extname = 'idempotency'}),
	't', 'updated while the worker runs, to the current version');
ok($node->poll_query_until('postgres',
		q{SELECT NOT EXISTS (SELECT FROM idempotency.deliveries WHERE state = 'pending')}),
	'what was queued at 1.2 is delivered after the update, with no publish to wake the relay');
# What the relay was waiting for: one more publish wakes it, and then the
# backlog queued at 1.2 goes too.
$node->safe_psql('postgres', q{SELECT idem_publish('t.x', '{}')});
ok($node->poll_query_until('postgres',
		q{SELECT NOT EXISTS (SELECT FROM idempotency.deliveries WHERE state = 'pending')}),
	'a publish after the update wakes the relay, and everything is delivered');
is($node->safe_psql('postgres',
		q{SELECT max_in_flight || ' ' || connect_timeout_ms || ' ' || failure_threshold || ' ' || disable_after_ms || ' ' || circuit
		    FROM idempotency.destinations WHERE name = 'old_ui'}),
	'16 5000 10 259200000 closed', 'an upgraded destination has 1.3 defaults');
is($node->safe_psql('postgres',
		q{SELECT count(*) FROM pg_indexes WHERE schemaname = 'idempotency' AND indexname = 'deliveries_due'}),
	'0', 'deliveries_due is dropped');

$node->stop;
done_testing();
