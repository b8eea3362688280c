# idempotency.relay_workers: a backlog is shared by relay helpers that the
# per-database worker starts when a pass claims a full batch, and that exit
# once the backlog is gone.  Every event is delivered exactly once into a
# function destination, events of one key still arrive in publish order
# although several processes deliver them, and with relay_workers = 1 the
# worker works alone.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('helpers');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.relay_batch_size = 50
idempotency.relay_workers = 3
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE SEQUENCE arrival;
	CREATE TABLE received (event_id uuid, key text, n int, pid int, arrival bigint);
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE sql AS
		$$ INSERT INTO received
		   VALUES ((event->>'id')::uuid, event->>'key', (event->'payload'->>'n')::int,
		           pg_backend_pid(), nextval('arrival')) $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}');
});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';
my $worker_pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});

# A backlog: published while the destination is paused, 40 keys of 50
# events each and 2000 events without a key, interleaved.
sub publish_backlog
{
	$node->safe_psql('postgres', q{
		SELECT idem_destination_pause('local');
		SELECT idem_publish('orders.created', jsonb_build_object('n', g),
		                    CASE WHEN g % 2 = 0 THEN 'k' || (g / 2) % 40 END)
		  FROM generate_series(1, 4000) g;
	});
	$node->safe_psql('postgres', q{SELECT idem_destination_resume('local')});
	$node->poll_query_until('postgres', q{SELECT count(*) = 4000 FROM received})
	  or die 'the backlog was not delivered: '
	  . $node->safe_psql('postgres', 'SELECT count(*) FROM received');
}

publish_backlog();
is($node->safe_psql('postgres', q{SELECT count(DISTINCT event_id) FROM received}),
	'4000', 'every event delivered exactly once while several relays shared the backlog');
cmp_ok($node->safe_psql('postgres',
		"SELECT count(DISTINCT pid) FROM received WHERE pid <> $worker_pid"),
	'>=', 1, 'relay helpers delivered part of the backlog');
cmp_ok($node->safe_psql('postgres',
		"SELECT count(*) FROM received WHERE pid = $worker_pid"),
	'>', 0, 'the worker delivered its share too');
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM (
			SELECT n < lag(n) OVER (PARTITION BY key ORDER BY arrival) AS behind
			  FROM received WHERE key IS NOT NULL) x
		 WHERE behind}),
	'0', 'the events of each key arrived in publish order across relays');
is($node->safe_psql('postgres',
		q{SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'}),
	'0', 'no delivery left pending');
ok($node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'}),
	'the helpers exit once the backlog is gone');

# relay_workers = 1: the worker alone.
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.relay_workers = 1;
	SELECT pg_reload_conf();
	TRUNCATE received;
});
# The idle worker rereads the configuration as soon as the signal wakes it.
sleep 1;
publish_backlog();
is($node->safe_psql('postgres', "SELECT count(*) FROM received WHERE pid <> $worker_pid"),
	'0', 'with relay_workers = 1 the worker delivers the whole backlog itself');
is($node->safe_psql('postgres', q{SELECT count(DISTINCT event_id) FROM received}),
	'4000', 'every event delivered exactly once');

$node->stop;
done_testing();
