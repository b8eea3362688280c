# Poison events and errors in the background worker.
#
# Whatever a destination function does wrong ends in that delivery's retry
# or dead letter, never in the worker's exit, and the well-behaved events of
# the same pass are delivered at once:
#  - it raises query_canceled itself;
#  - it leaves an idempotency claim unfinished (the commit guard would fail
#    the relay's transaction);
#  - it runs past the destination's "timeout";
#  - it violates a deferred constraint (which would fail the commit);
#  - it catches the IK001 of a token call with a stale token (a fenced
#    transaction cannot commit): its own writes roll back with it.
# Each is dead-lettered after exactly its max_attempts, with a clear error.
#
# The worker survives any error of a relay pass or a cleanup pass: it logs
# it, aborts the transaction, backs off and goes on; the cleanup in the same
# process keeps running.  A cancel of the worker (pg_cancel_backend) cancels
# the pass at work without failing the delivery; a terminate still ends it.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

my $node = PostgreSQL::Test::Cluster->new('poison');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1s'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE good_sink (event_id uuid, topic text);
	CREATE FUNCTION good(event jsonb) RETURNS void LANGUAGE sql AS
		$$ INSERT INTO good_sink VALUES ((event->>'id')::uuid, event->>'topic') $$;
	CREATE FUNCTION cancels(event jsonb) RETURNS void LANGUAGE plpgsql AS
		$$ BEGIN RAISE EXCEPTION 'I cancel myself' USING ERRCODE = 'query_canceled'; END $$;
	CREATE FUNCTION leaves_claim(event jsonb) RETURNS void LANGUAGE plpgsql AS
		$$ BEGIN PERFORM idem_claim('poison', event->>'id', '{}'::jsonb); END $$;
	CREATE FUNCTION sleeps(event jsonb) RETURNS void LANGUAGE sql AS
		$$ SELECT pg_sleep(3600) $$;
	CREATE TABLE parent (id int PRIMARY KEY);
	CREATE TABLE child (parent_id int REFERENCES parent DEFERRABLE INITIALLY DEFERRED);
	CREATE FUNCTION orphan(event jsonb) RETURNS void LANGUAGE sql AS
		$$ INSERT INTO child VALUES (42) $$;
	CREATE TABLE stale (token bigint);
	INSERT INTO stale SELECT token FROM idem_claim('poison-op', 'k', '{}'::jsonb, lease => '1 millisecond');
	SELECT pg_sleep(0.01);
	SELECT outcome FROM idem_claim('poison-op', 'k', '{}'::jsonb, lease => '1 hour');
	CREATE TABLE fenced_sink (event_id uuid);
	CREATE FUNCTION fenced(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO fenced_sink VALUES ((event->>'id')::uuid);
		BEGIN
			PERFORM idem_checkpoint('poison-op', 'k', (SELECT token FROM stale), 'late');
		EXCEPTION WHEN SQLSTATE 'IK001' THEN NULL;
		END;
	END $$;
	SELECT idem_destination_create('good', 'function', 'good(jsonb)', '{t.*,u.*}');
	SELECT idem_destination_create('fenced', 'function', 'fenced(jsonb)', '{t.*}',
		'{"max_attempts": 2, "backoff_base": "10ms", "backoff_cap": "10ms"}');
	SELECT idem_destination_create('cancels', 'function', 'cancels(jsonb)', '{t.*}',
		'{"max_attempts": 2, "backoff_base": "10ms", "backoff_cap": "10ms"}');
	SELECT idem_destination_create('leaves_claim', 'function', 'leaves_claim(jsonb)', '{t.*}',
		'{"max_attempts": 3, "backoff_base": "10ms", "backoff_cap": "10ms"}');
	SELECT idem_destination_create('sleeps', 'function', 'sleeps(jsonb)', '{t.*}',
		'{"max_attempts": 2, "backoff_base": "10ms", "backoff_cap": "10ms", "timeout": "200ms"}');
	SELECT idem_destination_create('orphan', 'function', 'orphan(jsonb)', '{t.*}',
		'{"max_attempts": 2, "backoff_base": "10ms", "backoff_cap": "10ms"}');
});

sub worker_pid
{
	return $node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
}

# Whether the server log says, since $offset, that the worker exited.
sub worker_exited
{
	my ($offset) = @_;
	my $log = slurp_file($node->logfile, $offset);
	return $log =~ /background worker "idempotency cleanup" \(PID \d+\) exited/;
}

# Poll $query until it returns 't', or until the worker exits; true if 't'.
sub wait_unless_worker_exits
{
	my ($query, $offset) = @_;
	my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
	while (time() < $deadline)
	{
		return 1 if $node->safe_psql('postgres', $query) eq 't';
		return 0 if worker_exited($offset);
		sleep 0.1;
	}
	return 0;
}

$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';
my $pid = worker_pid();
my $offset = -s $node->logfile;
my $runs_before = $node->safe_psql('postgres',
	q{SELECT cleanup_runs FROM idem_stats WHERE datname = 'postgres'});

# ---- Poison destinations next to a good one.
my @ids = split /\n/, $node->safe_psql('postgres',
	q{SELECT idem_publish('t.x', jsonb_build_object('n', n)) FROM generate_series(1, 3) n});
ok( wait_unless_worker_exits(q{
		SELECT count(*) = 15 FROM idempotency.deliveries WHERE state = 'dead'}, $offset),
	'every poison delivery ends dead-lettered');
is(worker_pid(), $pid, 'by the same worker process');
ok(!worker_exited($offset), 'which never exited');
is($node->safe_psql('postgres', q{SELECT count(*) FROM good_sink WHERE topic = 't.x'}),
	'3', 'the good destination got its three events');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(DISTINCT destination || ' ' || attempts || ' ' || last_error, E'\n')
		  FROM idem_outbox_dead}),
	join("\n",
		q{cancels 2 I cancel myself},
		q{fenced 2 destination function was fenced from an idempotency key},
		q{leaves_claim 3 destination function left an idempotency claim unfinished},
		q{orphan 2 insert or update on table "child" violates foreign key constraint "child_parent_id_fkey"},
		q{sleeps 2 the function did not return within the destination's timeout of 200 ms}),
	'each dead after exactly its max_attempts, with its own error');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(destination || ' ' || dead_lettered || ' ' || retried, ', ' ORDER BY destination)
		  FROM idem_outbox_stats WHERE destination <> 'good'}),
	'cancels 3 3, fenced 3 3, leaves_claim 3 6, orphan 3 3, sleeps 3 3',
	'counted as retried, then dead-lettered');
is($node->safe_psql('postgres', q{SELECT count(*) FROM fenced_sink}),
	'0', 'the fenced function\'s writes rolled back with each attempt');
ok( $node->poll_query_until('postgres', qq{
		SELECT cleanup_runs >= $runs_before + 2 AND worker_pid = $pid
		  FROM idem_stats WHERE datname = 'postgres'}),
	'cleanup passes go on in the same process');

# ---- Any error of a relay pass: logged, and the worker goes on.
$offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	ALTER TABLE idempotency.deliveries ADD CONSTRAINT no_claims CHECK (attempts = 0) NOT VALID;
	SELECT idem_publish('u.y', '{}');
});
$node->wait_for_log(
	qr/ERROR:  new row for relation "deliveries" violates check constraint "no_claims"(?:.*\n)+?.*idempotency relay of database "postgres"/,
	$offset);
$node->safe_psql('postgres', q{ALTER TABLE idempotency.deliveries DROP CONSTRAINT no_claims});
ok( wait_unless_worker_exits(q{SELECT count(*) = 1 FROM good_sink WHERE topic = 'u.y'}, $offset),
	'after a failing relay pass, the worker backs off and delivers once the cause is gone');
is(worker_pid(), $pid, 'in the same process');

# ---- Any error of a cleanup pass: logged, and the worker goes on.
$offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS
		$$ BEGIN RAISE EXCEPTION 'no deletes today'; END $$;
	CREATE TRIGGER refuse_delete BEFORE DELETE ON idempotency.deliveries
		FOR EACH ROW EXECUTE FUNCTION refuse_delete();
	ALTER SYSTEM SET idempotency.outbox_retention = 0;
	SELECT pg_reload_conf();
});
$node->wait_for_log(
	qr/ERROR:  no deletes today(?:.*\n)+?.*idempotency cleanup of database "postgres"/, $offset);
$node->safe_psql('postgres', q{DROP TRIGGER refuse_delete ON idempotency.deliveries});
ok( wait_unless_worker_exits(q{
		SELECT count(*) = 0 FROM idempotency.deliveries WHERE state = 'delivered'}, $offset),
	'after a failing cleanup pass, the next one removes the delivered events');
is(worker_pid(), $pid, 'in the same process');

# ---- A cancel of the worker cancels the pass at work, and nothing else.
$node->safe_psql('postgres', q{
	CREATE FUNCTION stuck(event jsonb) RETURNS void LANGUAGE sql AS $$ SELECT pg_sleep(3600) $$;
	SELECT idem_destination_create('stuck', 'function', 'stuck(jsonb)', '{v.*}', '{"timeout": "1h"}');
	SELECT idem_publish('v.z', '{}');
});
$node->poll_query_until('postgres', qq{
	SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $pid})
  or die 'the worker never called the stuck function';
$offset = -s $node->logfile;
$node->safe_psql('postgres', "SELECT pg_cancel_backend($pid)");
$node->wait_for_log(
	qr/ERROR:  canceling statement due to user request(?:.*\n)+?.*idempotency relay of database "postgres"/,
	$offset);
$node->safe_psql('postgres', q{SELECT idem_destination_pause('stuck')});
ok($node->poll_query_until('postgres', qq{
		SELECT wait_event IS DISTINCT FROM 'PgSleep' FROM pg_stat_activity WHERE pid = $pid}),
	'pg_cancel_backend interrupts the function');
is( $node->safe_psql('postgres', q{
		SELECT x.state || ' ' || x.attempts || ' ' || (x.last_error IS NULL) || ' ' || (x.visible_until IS NOT NULL)
		  FROM idempotency.deliveries x JOIN idempotency.destinations t ON t.id = x.destination_id
		 WHERE t.name = 'stuck'}),
	'pending 1 true true', 'the pass is cancelled: its outcome is not recorded, the claim stays');
is(worker_pid(), $pid, 'and the worker goes on');
ok(!worker_exited($offset), 'without exiting');

# ---- A terminate still ends the worker.
$offset = -s $node->logfile;
$node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)");
ok($node->poll_query_until('postgres', qq{SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $pid}),
	'pg_terminate_backend ends the worker');

$node->stop;
done_testing();
