# The relay runs in the per-database background worker: an event is
# delivered without anyone calling idem_outbox_relay(), promptly after its
# transaction commits (the commit wakes the worker; the cleanup interval is
# an hour, so only that wake-up explains the delivery), and a worker
# restarted after a crash delivers what was published while it was away.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;
use Time::HiRes qw(time);

my $node = PostgreSQL::Test::Cluster->new('relay');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
restart_after_crash = on
max_prepared_transactions = 2
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE received (event_id uuid PRIMARY KEY, topic text, payload jsonb, at timestamptz DEFAULT clock_timestamp());
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE sql AS
		$$ INSERT INTO received (event_id, topic, payload)
		   VALUES ((event->>'id')::uuid, event->>'topic', event->'payload') $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}');
});

# The worker is up and idle on its latch.
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';
sleep 1;

my $t0 = time;
my $id = $node->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_publish('orders.created', '{"order": 1}');
	COMMIT;
});
$node->poll_query_until('postgres', "SELECT count(*) = 1 FROM received WHERE event_id = '$id'")
  or die 'the event was not delivered';
my $latency = time - $t0;
cmp_ok($latency, '<', 5, "delivered by the worker ${latency}s after the commit, without idem_outbox_relay()");

# Nothing is delivered for a transaction that rolls back.
$node->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_publish('orders.created', '{"order": 2}');
	ROLLBACK;
	SELECT idem_publish('orders.created', '{"order": 3}');
});
$node->poll_query_until('postgres', q{SELECT count(*) = 1 FROM received WHERE payload = '{"order": 3}'})
  or die 'event 3 was not delivered';
is($node->safe_psql('postgres', q{SELECT count(*) FROM received WHERE payload = '{"order": 2}'}),
	'0', 'a rolled-back publish is never delivered');

# Events published while the worker is down are delivered once it is back.
my $pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
$node->safe_psql('postgres', q{
	SELECT idem_publish('orders.created', jsonb_build_object('order', 100 + g)) FROM generate_series(1, 50) g;
});
my $offset = log_offset($node);
kill 'KILL', $pid;
wait_for_crash_recovery($node, $offset);
$node->safe_psql('postgres', q{
	SELECT idem_publish('orders.created', jsonb_build_object('order', 200 + g)) FROM generate_series(1, 50) g;
});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 102 FROM received})
  or die 'not every event was delivered after the crash: '
  . $node->safe_psql('postgres', 'SELECT count(*) FROM received');
is($node->safe_psql('postgres', q{SELECT count(*) - count(DISTINCT event_id) FROM received}),
	'0', 'each event delivered exactly once into the function destination');
is($node->safe_psql('postgres',
		q{SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'}),
	'0', 'no delivery left pending');

# A publisher that prepares its transaction cannot wake the relay when it
# is committed later, from another session: COMMIT PREPARED does.  Without
# that the event would wait for the next cleanup pass, an hour away.
$node->safe_psql('postgres', q{
	BEGIN;
	SELECT idem_publish('orders.created', '{"order": 300}');
	PREPARE TRANSACTION 'publisher';
});
sleep 1;
is($node->safe_psql('postgres', q{SELECT count(*) FROM received WHERE payload = '{"order": 300}'}),
	'0', 'nothing is delivered while the publishing transaction is prepared');
$t0 = time;
$node->safe_psql('postgres', q{COMMIT PREPARED 'publisher'});
$node->poll_query_until('postgres', q{SELECT count(*) = 1 FROM received WHERE payload = '{"order": 300}'})
  or die 'the event of the prepared transaction was not delivered';
$latency = time - $t0;
cmp_ok($latency, '<', 5, "delivered ${latency}s after COMMIT PREPARED");

$node->stop;
done_testing();
