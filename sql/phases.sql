--
-- Multi-phase operations in one session: leases, fencing tokens, recovery
-- points, takeover, downstream keys and resolving stuck operations.  Races are
-- in specs/phases_*.spec, crashes in t/002_three_phase_crash.pl.
--
CREATE TABLE orders (id serial PRIMARY KEY, op text, charge text);

-- A multi-phase claim commits on its own: no commit guard, state 'processing'.
SELECT outcome, token, recovery_point FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');
SELECT state, status FROM idem_replay('shop:POST /checkout', 'c-1');

-- A duplicate while the owner's lease lives: in_progress, retry_after = lease left.
SELECT outcome, retry_after BETWEEN 3590 AND 3600 AS retry_after_is_lease_left
  FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');
-- With another request: mismatch, as always.
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 8}', lease => '1 hour');

-- Phase 1: a domain write and its recovery point commit together.
BEGIN;
INSERT INTO orders (op) VALUES ('c-1');
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', 1, 'order_created');
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
SELECT idem_extend('shop:POST /checkout', 'c-1', 1, '2 hours') > now() + interval '1 hour' AS extended;

-- The owner gives up: idem_release ends its lease now (a crashed owner's
-- lease simply runs out).  The retry takes over: token 2, resuming from the
-- recovery point of phase 1.
BEGIN;
SELECT idem_release('shop:POST /checkout', 'c-1', 1);
COMMIT;
SELECT outcome, token, recovery_point FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');

-- The old owner wakes up: every token-carrying call is fenced (IK001) and its
-- transaction, with the write in it, rolls back.
BEGIN;
UPDATE orders SET charge = 'charged-by-old-owner' WHERE op = 'c-1';
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', 1, 'charged');
\echo :SQLSTATE
ROLLBACK;
SELECT idem_succeed('shop:POST /checkout', 'c-1', 201, '{"old": true}', token => 1);
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-1', 1, '1 hour');
\echo :SQLSTATE
SELECT idem_release('shop:POST /checkout', 'c-1', 1);
\echo :SQLSTATE
SELECT charge FROM orders WHERE op = 'c-1';

-- The new owner finishes: phase 2, then the final response.
BEGIN;
UPDATE orders SET charge = :'charge_key' WHERE op = 'c-1';
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', 2, 'charged');
COMMIT;
SELECT idem_succeed('shop:POST /checkout', 'c-1', 201, '{"order": 1}', '{"Location": "/orders/1"}', token => 2);
SELECT outcome, status, headers, body FROM idem_claim('shop:POST /checkout', 'c-1', '{"cart": 7}', lease => '1 hour');
SELECT state, status, body, expires_at - completed_at AS ttl_from_completion
  FROM idem_replay('shop:POST /checkout', 'c-1');
SELECT key, state, token, recovery_point FROM idempotency.records WHERE key = 'c-1';
-- Completed: further token calls are refused (55000).
SELECT idem_checkpoint('shop:POST /checkout', 'c-1', 2, 'again');
\echo :SQLSTATE

-- A claim without a lease cannot take over a multi-phase operation (55000).
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour');
SELECT idem_release('shop:POST /checkout', 'c-3', 1);
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-3', '{}');
\echo :SQLSTATE
ROLLBACK;
-- With a lease it can; a release keeps the recovery point (none here).
SELECT outcome, token, recovery_point FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour');

-- Stuck operations: processing, lease expired more than
-- idempotency.stuck_after ago, nobody retrying.
SELECT outcome FROM idem_claim('shop:POST /checkout', 'c-4', '{}', lease => '1 hour');
SELECT idem_checkpoint('shop:POST /checkout', 'c-4', 1, 'charge_sent');
SELECT idem_release('shop:POST /checkout', 'c-4', 1);
SET idempotency.stuck_after = '1h';
SELECT count(*) FROM idem_stuck WHERE key = 'c-4';
SET idempotency.stuck_after = 0;
SELECT scope, key, token, recovery_point, owner_age >= '0' AS has_owner_age,
       lease_expired_for >= '0' AS has_expired_for
  FROM idem_stuck ORDER BY key;
RESET idempotency.stuck_after;

-- An operator resolves c-4 with the outcome found at the provider: the token
-- moves on (fencing the old owner), the response is stored, the action audited.
SELECT idem_resolve_complete('shop:POST /checkout', 'c-4', 201, '{"reconciled": true}',
                             note => 'charge found in the gateway dashboard') AS new_token;
SELECT outcome, status, body FROM idem_claim('shop:POST /checkout', 'c-4', '{}', lease => '1 hour');
SELECT idem_checkpoint('shop:POST /checkout', 'c-4', 1, 'late');
\echo :SQLSTATE
-- ... and releases c-3 so that the next retry starts over from its recovery point.
SELECT idem_release('shop:POST /checkout', 'c-3', 2);
SELECT idem_resolve_release('shop:POST /checkout', 'c-3', 'customer asked to retry') AS new_token;
SELECT outcome, token FROM idem_claim('shop:POST /checkout', 'c-3', '{}', lease => '1 hour');
SELECT actor = session_user AS by_me, action, scope, key, token_before, token_after, status, note
  FROM idem_audit ORDER BY at;
-- Only a stuck operation can be resolved: a live lease (55000), a completed
-- operation (55000), an unknown key (42704).
SELECT idem_resolve_release('shop:POST /checkout', 'c-3');
\echo :SQLSTATE
SELECT idem_resolve_release('shop:POST /checkout', 'c-1');
\echo :SQLSTATE
SELECT idem_resolve_complete('shop:POST /checkout', 'nope', 200);
\echo :SQLSTATE

-- Bad input: clear errors, nothing written.
SELECT count(*) AS records_before FROM idempotency.records \gset
SELECT idem_checkpoint('shop:POST /checkout', 'nope', 1, 'x');
\echo :SQLSTATE
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', NULL, 'x');
\echo :SQLSTATE
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', 3, NULL);
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-3', 3, '-1 minute');
\echo :SQLSTATE
SELECT idem_extend('shop:POST /checkout', 'c-3', 3, NULL);
\echo :SQLSTATE
SELECT idem_release('shop:POST /checkout', 'c-3', NULL::bigint);
\echo :SQLSTATE
SELECT idem_succeed('shop:POST /checkout', 'c-3', 700, token => 4);
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
SELECT idem_checkpoint('shop:POST /checkout', 'c-3', 3, 'x');
\echo :SQLSTATE
ROLLBACK;

SELECT op, charge IS NOT NULL AS charged FROM orders ORDER BY op;
DROP TABLE orders;
