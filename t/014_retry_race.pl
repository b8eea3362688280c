# Late retries racing the cleanup of their own expired records, under load:
# clients keep retrying a small set of keys whose records live 300 ms, while
# the worker deletes expired records every second in small batches.  Every
# retry is either a replay of an execution that happened, or new; none fails
# (no unique violation from a half-deleted record, no serialization error),
# and no key executes twice while its record lives.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = 1
idempotency.cleanup_batch_size = 20
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	-- Each execution, with the time of its claim (its record's created_at).
	CREATE TABLE ops (id serial PRIMARY KEY, key text NOT NULL, claimed_at timestamptz);

	-- One request: claim (records live 300 ms); execute when claimed; when
	-- replayed, the stored response must name an execution of this key.
	CREATE FUNCTION request(k text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c	idem_claim_result;
		n	int;
	BEGIN
		c := idem_claim('race', k, '{}'::jsonb, interval '300 milliseconds');
		IF c.outcome = 'claimed' THEN
			INSERT INTO ops (key) VALUES (k) RETURNING id INTO n;
			PERFORM idem_succeed('race', k, 201, jsonb_build_object('op', n));
			UPDATE ops SET claimed_at = r.created_at FROM idem_replay('race', k) r WHERE id = n;
		ELSIF c.outcome = 'replay' THEN
			IF NOT EXISTS (SELECT 1 FROM ops WHERE id = (c.body->>'op')::int AND key = k) THEN
				RAISE EXCEPTION 'key %: replayed % of no execution', k, c.body;
			END IF;
		ELSE
			RAISE EXCEPTION 'key %: unexpected outcome %', k, c.outcome;
		END IF;
		RETURN c.outcome;
	END $$;
});

$node->pgbench(
	'--no-vacuum --client=4 --jobs=2 --time=8',
	0,
	[ qr{processed: [1-9]} ],
	[ qr{^$} ],
	'retries racing cleanup: no client fails',
	{
		'014_retry_race' => q{
			\set k random(1, 5000)
			SELECT request('k' || :k);
		}
	});

my $executions = $node->safe_psql('postgres', 'SELECT count(*) FROM ops');
cmp_ok($executions, ">", 5000, "keys were executed again after their records expired ($executions executions)");
# A claim's clock is read when it is called, a moment before it looks, so
# allow some slack below the 300 ms; a second execution of a live key would
# come within milliseconds.
is( $node->safe_psql('postgres', q{
		SELECT count(*) FILTER (WHERE claimed_at IS NULL) || ' '
			   || count(*) FILTER (WHERE gap < interval '250 milliseconds') FROM (
			SELECT claimed_at,
				   claimed_at - lag(claimed_at) OVER (PARTITION BY key ORDER BY claimed_at) AS gap
			  FROM ops) g}),
	'0 0', 'no key executed twice while its record lived');
note 'claims, replays, rows deleted by the worker: ' . $node->safe_psql('postgres',
	q{SELECT claims || ', ' || replays || ', ' || rows_deleted FROM idem_stats WHERE datname = 'postgres'});
cmp_ok($node->safe_psql('postgres', q{SELECT rows_deleted FROM idem_stats WHERE datname = 'postgres'}),
	'>', 0, 'the worker deleted expired records meanwhile');
cmp_ok($node->safe_psql('postgres', q{SELECT replays FROM idem_stats WHERE datname = 'postgres'}),
	'>', 0, 'and retries were replayed');

$node->stop;
done_testing();
