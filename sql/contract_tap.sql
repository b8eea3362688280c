--
-- pgTAP: the SQL contract other code relies on (names, shapes, properties,
-- defaults) and a few behaviours that read best as assertions.
--
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS pgtap;
RESET client_min_messages;
\pset format unaligned
\pset tuples_only true

SELECT plan(50);

-- The functions, callable unqualified with the default search_path.
SELECT has_function('idem_claim', ARRAY['text', 'text', 'jsonb', 'interval', 'interval']);
SELECT has_function('idem_claim', ARRAY['text', 'text', 'text', 'interval', 'interval']);
SELECT has_function('idem_claim', ARRAY['text', 'text', 'bytea', 'interval', 'interval']);
SELECT has_function('idem_succeed', ARRAY['text', 'text', 'integer', 'jsonb', 'jsonb', 'bigint']);
SELECT has_function('idem_release', ARRAY['text', 'text']);
SELECT has_function('idem_replay', ARRAY['text', 'text']);
SELECT has_function('idem_execute', ARRAY['text', 'text', 'jsonb', 'regprocedure', 'interval']);
SELECT has_function('idem_fingerprint', ARRAY['jsonb']);
SELECT has_function('idem_canonical', ARRAY['jsonb']);
-- Multi-phase operations (1.1).
SELECT has_function('idem_release', ARRAY['text', 'text', 'bigint']);
SELECT has_function('idem_checkpoint', ARRAY['text', 'text', 'bigint', 'text']);
SELECT has_function('idem_extend', ARRAY['text', 'text', 'bigint', 'interval']);
SELECT has_function('idem_downstream_key', ARRAY['text', 'text', 'text']);
SELECT has_function('idem_resolve_complete', ARRAY['text', 'text', 'integer', 'jsonb', 'jsonb', 'text']);
SELECT has_function('idem_resolve_release', ARRAY['text', 'text', 'text']);
SELECT has_view('idem_stuck');
SELECT function_privs_are('idem_resolve_release', ARRAY['text', 'text', 'text'], 'public', ARRAY[]::text[],
	'operators only: PUBLIC may not resolve operations');
SELECT table_privs_are('idem_stuck', 'public', ARRAY[]::text[], 'operators only: PUBLIC may not list stuck operations');
SELECT volatility_is('idem_downstream_key', ARRAY['text', 'text', 'text'], 'immutable');

-- Result shapes.
SELECT columns_are('idem_claim_result',
	ARRAY['outcome', 'status', 'headers', 'body', 'retry_after', 'token', 'recovery_point']);
SELECT col_type_is('idem_claim_result', 'retry_after', 'integer');
SELECT col_type_is('idem_claim_result', 'token', 'bigint');
SELECT columns_are('idem_response', ARRAY['status', 'headers', 'body']);
SELECT columns_are('idem_execute_result', ARRAY['status', 'headers', 'body', 'replayed']);
SELECT function_returns('idem_claim', ARRAY['text', 'text', 'jsonb', 'interval', 'interval'], 'idem_claim_result');
SELECT function_returns('idem_execute', ARRAY['text', 'text', 'jsonb', 'regprocedure', 'interval'], 'idem_execute_result');
SELECT function_returns('idem_fingerprint', ARRAY['jsonb'], 'bytea');

-- Properties: nothing runs with elevated privileges; writers are volatile;
-- the claim functions are not strict, so a NULL is an error, not a NULL row.
SELECT isnt_definer('idem_claim', ARRAY['text', 'text', 'jsonb', 'interval', 'interval']);
SELECT isnt_definer('idem_execute', ARRAY['text', 'text', 'jsonb', 'regprocedure', 'interval']);
SELECT volatility_is('idem_claim', ARRAY['text', 'text', 'jsonb', 'interval', 'interval'], 'volatile');
SELECT volatility_is('idem_replay', ARRAY['text', 'text'], 'stable');
SELECT volatility_is('idem_fingerprint', ARRAY['jsonb'], 'immutable');
SELECT isnt_strict('idem_claim', ARRAY['text', 'text', 'jsonb', 'interval', 'interval']);
SELECT isnt_strict('idem_succeed', ARRAY['text', 'text', 'integer', 'jsonb', 'jsonb', 'bigint']);

-- Storage: scope leads the primary key, so it can be a distribution key.
SELECT col_is_pk('idempotency'::name, 'records'::name, ARRAY['scope', 'key']::name[], 'scope leads the primary key');
SELECT is(current_setting('idempotency.wait_timeout'), '5s', 'wait_timeout defaults to 5s');
SELECT is(current_setting('idempotency.default_ttl'), '1d', 'default_ttl defaults to 24 hours');
SELECT is(current_setting('idempotency.max_response_bytes'), '1MB', 'max_response_bytes defaults to 1MB');

-- Behaviour.
BEGIN;
SELECT is((idem_claim('tap', 'k1', '{"a": 1}')).outcome, 'claimed', 'a new key is claimed');
SELECT lives_ok($$SELECT idem_succeed('tap', 'k1', 201, '{"id": 1}')$$, 'succeed stores the response');
COMMIT;
SELECT row_eq($$SELECT outcome, status, body FROM idem_claim('tap', 'k1', '{"a": 1.0}')$$,
	ROW('replay'::text, 201, '{"id": 1}'::jsonb), 'a retry replays status and body');
SELECT is((idem_claim('tap', 'k1', '{"a": 2}')).outcome, 'mismatch', 'another request with the key is a mismatch');
SELECT is((idem_claim('tap', 'k1', '{"a": 2}')).status, NULL, 'a mismatch carries no stored response');
SELECT throws_ok($$SELECT idem_claim('tap', '', '{}')$$, '22023', 'idempotency key must not be empty');
SELECT throws_ok($$SELECT idem_claim(NULL, 'k', '{}')$$, '22004', 'scope must not be null');
SELECT throws_ok($$SELECT idem_succeed('tap', 'k-none', 200)$$, '55000');
SELECT throws_ok($$SELECT idem_claim('tap', 'k', '{}', '-1 hour')$$, '22023', 'ttl must be positive');
SELECT is(idem_fingerprint('{"b": [1, {"d": 1, "c": 2}], "a": "x"}'),
	idem_fingerprint('{"a":"x","b":[1.00,{"c":2,"d":1e0}]}'),
	'fingerprints ignore key order, whitespace and number spelling');
SELECT isnt(idem_fingerprint('{"n": 12345678901234567890}'),
	idem_fingerprint('{"n": 12345678901234567891}'),
	'fingerprints keep numbers beyond double precision apart');
SELECT is(length(idem_fingerprint('{}')), 32, 'a fingerprint is a SHA-256');

SELECT * FROM finish();
