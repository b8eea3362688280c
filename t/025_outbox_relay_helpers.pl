# idempotency.relay_workers: a backlog is shared by relay helpers that the
# per-database worker starts when a pass claims a full batch, and that exit
# once the backlog is gone.  Every event is delivered exactly once into a
# function destination, events of one key still arrive in publish order
# although several processes deliver them, and with relay_workers = 1 the
# worker works alone.  Helpers go when the setting no longer counts them and
# when the worker that started them is gone.
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
# Each delivery takes a little while (pace.ms), so that a backlog lasts long
# enough for helpers to start and for the test to watch them.
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE SEQUENCE arrival;
	CREATE TABLE pace (ms float8);
	INSERT INTO pace VALUES (0.5);
	CREATE TABLE received (event_id uuid, key text, n int, pid int, arrival bigint);
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE sql AS
		$$ SELECT pg_sleep((SELECT ms FROM pace) / 1000);
		   INSERT INTO received
		   VALUES ((event->>'id')::uuid, event->>'key', (event->'payload'->>'n')::int,
		           pg_backend_pid(), nextval('arrival')) $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}');
});

sub worker_pid
{
	return $node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
}

sub helpers
{
	return $node->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay'});
}

# A backlog of $n events: published while the destination is paused, half
# of them over 40 keys, half without a key, interleaved (none keyed if
# $unkeyed: every pass then claims a full batch while the backlog lasts);
# then resumed.
sub publish_backlog
{
	my ($n, $unkeyed) = @_;
	my $keyed = $unkeyed ? 'false' : 'true';
	$node->safe_psql('postgres', qq{
		SELECT idem_destination_pause('local');
		SELECT idem_publish('orders.created', jsonb_build_object('n', g),
		                    CASE WHEN $keyed AND g % 2 = 0 THEN 'k' || (g / 2) % 40 END)
		  FROM generate_series(1, $n) g;
	});
	$node->safe_psql('postgres', q{SELECT idem_destination_resume('local')});
}

# Wait until $n distinct events arrived, then check that none arrived twice.
sub all_delivered_once
{
	my ($n, $what) = @_;
	$node->poll_query_until('postgres', "SELECT count(DISTINCT event_id) >= $n FROM received")
	  or die "the backlog was not delivered: "
	  . $node->safe_psql('postgres', 'SELECT count(DISTINCT event_id) FROM received');
	is($node->safe_psql('postgres', q{SELECT count(*) || ' ' || count(DISTINCT event_id) FROM received}),
		"$n $n", $what);
}

sub reload_relay_workers
{
	my ($n) = @_;
	$node->safe_psql('postgres', qq{
		ALTER SYSTEM SET idempotency.relay_workers = $n;
		SELECT pg_reload_conf();
	});
}

$node->poll_query_until('postgres', q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';
my $worker_pid = worker_pid();

publish_backlog(4000);
all_delivered_once(4000, 'every event delivered exactly once while several relays shared the backlog');
cmp_ok($node->safe_psql('postgres', "SELECT count(DISTINCT pid) FROM received WHERE pid <> $worker_pid"),
	'>=', 1, 'relay helpers delivered part of the backlog');
cmp_ok($node->safe_psql('postgres', "SELECT count(*) FROM received WHERE pid = $worker_pid"),
	'>', 0, 'the worker delivered its share too');
is($node->safe_psql('postgres', q{
		SELECT count(*) FROM (
			SELECT n < lag(n) OVER (PARTITION BY key ORDER BY arrival) AS behind
			  FROM received WHERE key IS NOT NULL) x
		 WHERE behind}),
	'0', 'the events of each key arrived in publish order across relays');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'}),
	'0', 'no delivery left pending');
ok($node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'}),
	'the helpers exit once the backlog is gone');

# Lowering relay_workers dismisses the helpers it no longer counts, while
# the backlog lasts: 2 keeps one helper, 1 none.  Without keys every pass is
# full, so no helper would leave on its own before the backlog is gone.
$node->safe_psql('postgres', 'TRUNCATE received; UPDATE pace SET ms = 2');
publish_backlog(6000, 1);
$node->poll_query_until('postgres',
	q{SELECT count(*) = 2 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'})
  or die 'two helpers never ran at once';
reload_relay_workers(2);
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'})
  or die 'the second helper was not dismissed';
reload_relay_workers(1);
ok($node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'}),
	'relay_workers = 1 dismisses the last helper');
cmp_ok($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'pending'}),
	'>', 0, 'while the backlog was still there');

# A helper outlives its worker only by a pass: terminate the worker while
# helpers run, and they go too (the launcher starts a new worker after 10 s,
# which starts helpers of its own).
reload_relay_workers(3);
$node->poll_query_until('postgres',
	q{SELECT count(*) = 2 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'})
  or die 'the helpers did not start again';
$node->safe_psql('postgres', "SELECT pg_terminate_backend($worker_pid)");
ok($node->poll_query_until('postgres', qq{
		SELECT count(*) = 0 FROM pg_stat_activity
		 WHERE backend_type = 'idempotency relay' AND backend_start < (
		       SELECT coalesce(max(backend_start), now()) FROM pg_stat_activity
		        WHERE backend_type = 'idempotency cleanup')}),
	'the helpers of a terminated worker exit');
cmp_ok($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'pending'}),
	'>', 0, 'while the backlog was still there');
$node->safe_psql('postgres', 'UPDATE pace SET ms = 0');
all_delivered_once(6000, 'the backlog is delivered exactly once across the dismissals and the restart');

# relay_workers = 1: the worker alone.
reload_relay_workers(1);
$node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'})
  or die 'helpers still running';
$worker_pid = worker_pid();
$node->safe_psql('postgres', 'TRUNCATE received');
# The idle worker rereads the configuration as soon as the signal wakes it.
sleep 1;
publish_backlog(4000);
all_delivered_once(4000, 'every event delivered exactly once');
is($node->safe_psql('postgres', "SELECT count(*) FROM received WHERE pid <> $worker_pid"),
	'0', 'with relay_workers = 1 the worker delivers the whole backlog itself');

$node->stop;
done_testing();
