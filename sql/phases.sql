--
-- Multi-phase operations in one session: leases, fencing tokens, recovery
-- points, takeover, downstream keys and resolving stuck operations.  Races are
-- in specs/phases_*.spec, crashes in t/002_three_phase_crash.pl.
--
-- Tokens come from a database-wide sequence: the test keeps them in psql
-- variables (t1, t2, ...) and shows how they compare, not their values.
-- Errors that quote a token are shown through show_error(), which writes
-- <token> for it.
--
CREATE TABLE orders (id serial PRIMARY KEY, op text, charge text);
CREATE FUNCTION show_error(statement text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	state text;
	message text;
	detail text;
BEGIN
	EXECUTE statement;
	RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT,
							detail = PG_EXCEPTION_DETAIL;
	RETURN regexp_replace(state || ': ' || message || coalesce(' DETAIL: ' || nullif(detail, ''), ''),
						  '\m[0-9]{10,}\M', '<token>', 'g');
END $$;

-- A multi-phase claim commits on its own: no commit guard, state 'processing'.
-- Its token is one no claim of this key ever had (it does not start at 1).
SELECT outcome, token AS t1, token > 1 AS fresh_token, coalesce(recovery_point, '(none)') AS recovery_point
  FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :'fresh_token' AS fresh_token, :'recovery_point' AS recovery_point;
SELECT state, status FROM idem_replay('shop:POST /checkout', 'c-1');

-- A duplicate while the owner's lease lives: in_progress, retry_after = lease left.
SELECT outcome, retry_after BETWEEN 3590 AND 3600 AS retry_after_is_lease_left
  FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');
-- With another request: mismatch, as always.
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 8}', lease => '1 hour');

-- Phase 1: a domain write and its recovery point commit together.
BEGIN;
INSERT INTO orders (op) VALUES ('c-1');
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', :t1, 'order_created');
COMMIT;

-- The key an external provider gets for the charge: the same for every
-- owner and retry, different per step, scope and key.
SELECT idem_downstream_key('shop:POST /checkout', 'c-1', 'charge') AS charge_key \gset
SELECT :'charge_key' ~ '^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$' AS is_uuid_v8,
       :'charge_key' = idem_downstream_key('shop:POST /checkout', 'c-1', 'charge') AS stable,
       :'charge_key' <> idem_downstream_key('shop:POST /checkout', 'c-1', 'refund') AS per_step,
       :'charge_key' <> idem_downstream_key('shop:POST /checkout', 'c-2', 'charge') AS per_key,
       idem_downstream_key('a', 'bc', 'x') <> idem_downstream_key('ab', 'c', 'x') AS unambiguous;

-- Heartbeat for a long phase; the owner's token is still current.
SELECT idem_extend('shop:POST /checkout', 'c-1', :t1, '2 hours') > now() + interval '1 hour' AS extended;

-- The owner gives up: idem_release ends its lease now (a crashed owner's
-- lease simply runs out).  The retry takes over with a later token, resuming
-- from the recovery point of phase 1.
BEGIN;
SELECT idem_release('shop:POST /checkout', 'c-1', :t1);
COMMIT;
SELECT outcome, token AS t2, coalesce(recovery_point, '(none)') AS recovery_point
  FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :t2 > :t1 AS later_token, :'recovery_point' AS recovery_point;

-- The old owner wakes up: every token-carrying call is fenced (IK001) and its
-- transaction, with the write in it, rolls back.
BEGIN;
UPDATE orders SET charge = 'charged-by-old-owner' WHERE op = 'c-1';
\set VERBOSITY sqlstate
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', :t1, 'charged');
\set VERBOSITY default
ROLLBACK;
BEGIN;
SELECT show_error(format('SELECT idem_checkpoint(%L, %L, %s, %L)', 'shop:POST /checkout', 'c-1', :t1, 'charged'));
SELECT show_error(format('SELECT idem_succeed(%L, %L, 201, %L, token => %s)', 'shop:POST /checkout', 'c-1', '{"old": true}', :t1));
SELECT show_error(format('SELECT idem_extend(%L, %L, %s, %L)', 'shop:POST /checkout', 'c-1', :t1, '1 hour'));
SELECT show_error(format('SELECT idem_release(%L, %L, %s)', 'shop:POST /checkout', 'c-1', :t1));
ROLLBACK;
-- Catching the IK001 does not save the write: a transaction in which a call
-- was fenced cannot commit, whether the error was rolled back to a
-- savepoint or caught in an EXCEPTION block (show_error has one).
BEGIN;
UPDATE orders SET charge = 'charged-by-old-owner' WHERE op = 'c-1';
SAVEPOINT s;
\set VERBOSITY sqlstate
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', :t1, 'charged');
\set VERBOSITY default
ROLLBACK TO SAVEPOINT s;
COMMIT;
\echo :SQLSTATE
BEGIN;
UPDATE orders SET charge = 'charged-by-old-owner' WHERE op = 'c-1';
SELECT show_error(format('SELECT idem_checkpoint(%L, %L, %s, %L)', 'shop:POST /checkout', 'c-1', :t1, 'charged'));
COMMIT;
\echo :SQLSTATE
SELECT show_error(format('SELECT idem_extend(%L, %L, %s, %L)', 'shop:POST /checkout', 'c-1', :t1, '1 hour'));
\echo :SQLSTATE
SELECT charge FROM orders WHERE op = 'c-1';

-- The new owner finishes: phase 2, then the final response.
BEGIN;
UPDATE orders SET charge = :'charge_key' WHERE op = 'c-1';
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', :t2, 'charged');
COMMIT;
SELECT idem_succeed('shop:POST /checkout', 'c-1', 201, '{"order": 1}', '{"Location": "/orders/1"}', token => :t2);
SELECT outcome, status, headers, body FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');
SELECT state, status, body, expires_at - completed_at AS ttl_from_completion
  FROM idem_replay('shop:POST /checkout', 'c-1');
SELECT key, state, token = :t2 AS token_t2, recovery_point FROM idempotency.records WHERE key = 'c-1';
-- Completed: further token calls are refused (55000).
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', :t2, 'again');
\echo :SQLSTATE

-- A claim without a lease cannot take over a multi-phase operation (55000).
SELECT token AS c3_t1 FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour') \gset
SELECT idem_release('shop:POST /checkout', 'c-3', :c3_t1);
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-3', '{}');
\echo :SQLSTATE
ROLLBACK;
-- With a lease it can; a release keeps the recovery point (none here).
SELECT outcome, token AS c3_t2, coalesce(recovery_point, '(none)') AS recovery_point
  FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :c3_t2 > :c3_t1 AS later_token, :'recovery_point' AS recovery_point;

-- Stuck operations: processing, lease expired more than
-- idempotency.stuck_after ago, nobody retrying.
SELECT token AS c4_t1 FROM idem_claim('shop:POST /checkout', 'c-4', '{}', lease => '1 hour') \gset
SELECT idem_checkpoint('shop:POST /checkout', 'c-4', :c4_t1, 'charge_sent');
SELECT idem_release('shop:POST /checkout', 'c-4', :c4_t1);
SET idempotency.stuck_after = '1h';
SELECT count(*) FROM idem_stuck WHERE key = 'c-4';
SET idempotency.stuck_after = 0;
SELECT scope, key, token = :c4_t1 AS token_c4_t1, recovery_point, owner_age >= '0' AS has_owner_age,
       lease_expired_for >= '0' AS has_expired_for, owner = current_user::regrole AS mine
  FROM idem_stuck ORDER BY key;
-- A monitoring role granted some of the view's columns reads those, as
-- with any view; not the others, and not the function behind the view.
CREATE ROLE idem_stuck_monitor;
GRANT SELECT (scope, key, token) ON idem_stuck TO idem_stuck_monitor;
SET ROLE idem_stuck_monitor;
SELECT scope, key, token = :c4_t1 AS token_c4_t1 FROM idem_stuck ORDER BY key;
SELECT show_error('SELECT owner FROM idem_stuck');
SELECT show_error('SELECT * FROM idempotency.stuck_records()');
RESET ROLE;
-- Given USAGE on the extension's schema, it may call that function itself:
-- the columns it was not granted come back null.  A role granted nothing on
-- the view is refused.
CREATE ROLE idem_stuck_outsider;
GRANT USAGE ON SCHEMA idempotency TO idem_stuck_monitor, idem_stuck_outsider;
SET ROLE idem_stuck_monitor;
SELECT scope, key, token = :c4_t1 AS token_c4_t1, recovery_point IS NULL AS no_recovery_point,
       owner_age IS NULL AS no_owner_age, owner IS NULL AS no_owner
  FROM idempotency.stuck_records() ORDER BY key;
SET ROLE idem_stuck_outsider;
SELECT show_error('SELECT * FROM idempotency.stuck_records()');
RESET ROLE;
REVOKE USAGE ON SCHEMA idempotency FROM idem_stuck_monitor, idem_stuck_outsider;
REVOKE ALL ON idem_stuck FROM idem_stuck_monitor;
DROP ROLE idem_stuck_monitor, idem_stuck_outsider;
RESET idempotency.stuck_after;

-- An operator resolves c-4 with the outcome found at the provider: the token
-- moves on (fencing the old owner), the response is stored, the action audited.
SELECT idem_resolve_complete('shop:POST /checkout', 'c-4', 201, '{"reconciled": true}',
                             note => 'charge found in the gateway dashboard') AS c4_t2 \gset
SELECT :c4_t2 > :c4_t1 AS later_token;
SELECT outcome, status, body FROM idem_claim('shop:POST /checkout', 'c-4', '{}', lease => '1 hour');
BEGIN;
SELECT show_error(format('SELECT idem_checkpoint(%L, %L, %s, %L)', 'shop:POST /checkout', 'c-4', :c4_t1, 'late'));
ROLLBACK;
-- ... and releases c-3 so that the next retry starts over from its recovery point.
SELECT idem_release('shop:POST /checkout', 'c-3', :c3_t2);
SELECT idem_resolve_release('shop:POST /checkout', 'c-3', 'customer asked to retry') AS c3_t3 \gset
SELECT outcome, token AS c3_t4 FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :c3_t3 > :c3_t2 AND :c3_t4 > :c3_t3 AS later_tokens;
SELECT actor = current_user AS by_me, session_actor = session_user AS logged_in_as_me, action, scope, key,
       token_before = CASE key WHEN 'c-4' THEN :c4_t1 ELSE :c3_t2 END AS token_before_ok,
       token_after = CASE key WHEN 'c-4' THEN :c4_t2 ELSE :c3_t3 END AS token_after_ok,
       status, note
  FROM idem_audit ORDER BY at;
-- Only a stuck operation can be resolved: a live lease (55000), a completed
-- operation (55000), an unknown key (42704).
SELECT idem_resolve_release('shop:POST /checkout', 'c-3');
\echo :SQLSTATE
SELECT idem_resolve_release('shop:POST /checkout', 'c-1');
\echo :SQLSTATE
SELECT idem_resolve_complete('shop:POST /checkout', 'nope', 200);
\echo :SQLSTATE

-- Bad input: clear errors, nothing written.  A token call for a key without
-- an operation is fenced (IK001): whoever holds that token owns nothing.
SELECT count(*) AS records_before FROM idempotency.records \gset
SELECT idem_checkpoint('shop:POST /checkout', 'nope', 1, 'x');
\echo :SQLSTATE
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', NULL, 'x');
\echo :SQLSTATE
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', :c3_t4, NULL);
\echo :SQLSTATE
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', :c3_t4, repeat('x', 1025));
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-3', :c3_t4, '-1 minute');
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-3', :c3_t4, NULL);
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-3', :c3_t4, '300000 years');
\echo :SQLSTATE
SELECT idem_release('shop:POST /checkout', 'c-3', NULL::bigint);
\echo :SQLSTATE
SELECT idem_succeed('shop:POST /checkout', 'c-3', 700, token => :c3_t4);
\echo :SQLSTATE
SELECT idem_resolve_release('shop:POST /checkout', 'c-3', repeat('n', 4097));
\echo :SQLSTATE
SELECT * FROM idem_claim('shop:POST /checkout', 'c-5', '{}', lease => '0 s');
\echo :SQLSTATE
SELECT * FROM idem_claim('shop:POST /checkout', 'c-5', '{}', lease => '-1 s');
\echo :SQLSTATE
SELECT idem_downstream_key('shop:POST /checkout', 'c-1', '');
\echo :SQLSTATE
SELECT idem_downstream_key('shop:POST /checkout', 'c-1', NULL);
\echo :SQLSTATE
SELECT idem_downstream_key('shop:POST /checkout', '', 'charge');
\echo :SQLSTATE
SELECT count(*) = :records_before AS nothing_written FROM idempotency.records;

-- Token calls need a writable transaction.
BEGIN READ ONLY;
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', :c3_t4, 'x');
\echo :SQLSTATE
ROLLBACK;

-- A lease of a century: the duplicate's retry_after is capped, not wrapped
-- around (it used to come out as 1).
SELECT token AS c8_t1 FROM idem_claim('shop:POST /checkout', 'c-8', '{}', lease => '100 years') \gset
SELECT outcome, retry_after FROM idem_claim('shop:POST /checkout', 'c-8', '{}', lease => '1 hour');

-- Completing moves expiry to completion + ttl; where that would pass the
-- last timestamp PostgreSQL can store, it is refused (22008) rather than
-- stored as a value that pg_dump would write out and a restore would refuse.
SET timezone = 'UTC';
SELECT token AS c6_t1
  FROM idem_claim('shop:POST /checkout', 'c-6', '{}', lease => '1 hour',
                  ttl => '294276-12-31 23:59:59.999999 UTC'::timestamptz - clock_timestamp() - interval '0.5 s') \gset
SELECT pg_sleep(0.6);
SELECT idem_succeed('shop:POST /checkout', 'c-6', 200, token => :c6_t1);
\echo :SQLSTATE
SELECT state, status FROM idempotency.records WHERE key = 'c-6';
RESET timezone;

-- Tokens never come back for a key, across expiry and cleanup: the owner of
-- an operation that was taken over, completed, expired and deleted cannot
-- complete the next operation of the same key with its old token.  (Tokens
-- used to be counted from 1 per record, so the zombie's token 1 was valid
-- again.)
SELECT token AS z1 FROM idem_claim('shop:POST /checkout', 'c-7', '{}', ttl => '1 s', lease => '1 hour') \gset
SELECT idem_release('shop:POST /checkout', 'c-7', :z1);
SELECT token AS z2 FROM idem_claim('shop:POST /checkout', 'c-7', '{}', ttl => '1 s', lease => '1 hour') \gset
SELECT idem_succeed('shop:POST /checkout', 'c-7', 200, '{"by": "second owner"}', token => :z2);
SELECT pg_sleep(1.1);
SELECT idem_cleanup() > 0 AS cleaned;
SELECT count(*) AS c7_records FROM idempotency.records WHERE key = 'c-7';
SELECT token AS z3 FROM idem_claim('shop:POST /checkout', 'c-7', '{}', lease => '1 hour') \gset
SELECT :z3 <> :z1 AND :z3 <> :z2 AS new_token;
BEGIN;
SELECT show_error(format('SELECT idem_succeed(%L, %L, 200, %L, token => %s)',
                         'shop:POST /checkout', 'c-7', '{"by": "zombie"}', :z1));
ROLLBACK;
SELECT idem_succeed('shop:POST /checkout', 'c-7', 200, '{"by": "third owner"}', token => :z3);
SELECT body FROM idem_replay('shop:POST /checkout', 'c-7');

-- A fenced owner stays fenced after the operation it lost has expired, and
-- after cleanup removed its record: its token call fails, catching that
-- does not save its transaction, and its phase write never commits.  (An
-- expired record used to count as no operation at all: 42704, nothing
-- noted, so the zombie's transaction committed its write.)
SELECT token AS y1 FROM idem_claim('shop:POST /checkout', 'c-20', '{}', ttl => '1 s', lease => '1 s') \gset
SELECT pg_sleep(1.1);
SELECT outcome, token > :y1 AS took_over, token AS y2
  FROM idem_claim('shop:POST /checkout', 'c-20', '{}', ttl => '1 s', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :'took_over' AS took_over;
SELECT idem_succeed('shop:POST /checkout', 'c-20', 200, '{"by": "second owner"}', token => :y2);
SELECT pg_sleep(1.1);
SELECT count(*) AS c20_expired_records FROM idempotency.records
 WHERE key = 'c-20' AND expires_at < now();
CREATE FUNCTION zombie_phase(p_key text, p_token bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO orders (op, charge) VALUES ('zombie ' || p_key, 'ch_zombie');
	BEGIN
		PERFORM idem_checkpoint('shop:POST /checkout', p_key, p_token, 'charged');
	EXCEPTION WHEN OTHERS THEN
		RAISE NOTICE 'zombie caught %', SQLSTATE;
	END;
END $$;
-- Expired, not yet removed: the owner it lost to is known.
SELECT zombie_phase('c-20', :y1);
-- And once cleanup removed the record.
SELECT idem_cleanup() > 0 AS cleaned;
SELECT count(*) AS c20_records FROM idempotency.records WHERE key = 'c-20';
SELECT zombie_phase('c-20', :y1);
-- A token for a key that never had an operation cannot commit either.
SELECT zombie_phase('c-never', 424242);
SELECT count(*) AS zombie_orders FROM orders WHERE op LIKE 'zombie%';
DROP FUNCTION zombie_phase(text, bigint);

-- The longest recovery point is kept whole.
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', :c3_t4, repeat('x', 1024));
SELECT length(recovery_point) FROM idempotency.records WHERE key = 'c-3';

SELECT op, charge IS NOT NULL AS charged FROM orders ORDER BY op;
DROP TABLE orders;
DROP FUNCTION show_error(text);
