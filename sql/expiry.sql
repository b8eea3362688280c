--
-- Records expire after their ttl (or idempotency.default_ttl), counted from
-- when the response was stored (the clock's time); an expired key
-- behaves as new whether or not the row was deleted yet.
--
BEGIN;
SELECT outcome FROM idem_claim('s:POST /x', 'e-1', '{"v": 1}', interval '1 second');
SELECT idem_succeed('s:POST /x', 'e-1', 201, '{"first": true}');
COMMIT;
SELECT outcome, body FROM idem_claim('s:POST /x', 'e-1', '{"v": 1}');
SELECT expires_at - completed_at AS ttl FROM idem_replay('s:POST /x', 'e-1');
SELECT pg_sleep(1.1);

-- Expired: no status to look up, and the key claims as new, even with a
-- different request (the old fingerprint expired with the record).
SELECT count(*) FROM idem_replay('s:POST /x', 'e-1');
BEGIN;
SELECT outcome, token FROM idem_claim('s:POST /x', 'e-1', '{"v": 2}');
SELECT idem_succeed('s:POST /x', 'e-1', 201, '{"first": false}');
COMMIT;
SELECT outcome, body FROM idem_claim('s:POST /x', 'e-1', '{"v": 2}');
-- The expired row was replaced, not duplicated.
SELECT count(*) FROM idempotency.records WHERE scope = 's:POST /x' AND key = 'e-1';

-- Claiming an expired key deletes the old row in the claiming transaction:
-- if that transaction rolls back, the old row is back, still expired.
BEGIN;
SELECT outcome FROM idem_claim('s:POST /x', 'e-2', '{}', interval '100 milliseconds');
SELECT idem_succeed('s:POST /x', 'e-2', 200);
COMMIT;
SELECT pg_sleep(0.2);
BEGIN;
SELECT outcome FROM idem_claim('s:POST /x', 'e-2', '{}');
ROLLBACK;
SELECT count(*) AS rows, bool_and(expires_at < now()) AS expired
  FROM idempotency.records WHERE scope = 's:POST /x' AND key = 'e-2';

-- idempotency.default_ttl applies when no ttl is given, with units.
SET idempotency.default_ttl = '90min';
BEGIN;
SELECT outcome FROM idem_claim('s:POST /x', 'e-3', '{}');
SELECT idem_succeed('s:POST /x', 'e-3', 200);
COMMIT;
SELECT expires_at - completed_at AS ttl FROM idem_replay('s:POST /x', 'e-3');
RESET idempotency.default_ttl;
-- An explicit ttl wins over the setting; months and days count in calendar terms.
BEGIN;
SELECT outcome FROM idem_claim('s:POST /x', 'e-4', '{}', interval '7 days');
SELECT idem_succeed('s:POST /x', 'e-4', 200);
COMMIT;
SELECT expires_at - completed_at AS ttl FROM idem_replay('s:POST /x', 'e-4');

-- Expiry counts on the clock, not from the start of the statement: a claim
-- made late in a long procedure is not born expired.  (It used to be: the
-- retry right after this block claimed the key again.)
DO $$
BEGIN
	PERFORM pg_sleep(1.5);
	PERFORM idem_claim('s:POST /x', 'e-5', '{}'::jsonb, interval '1.2 seconds');
	PERFORM idem_succeed('s:POST /x', 'e-5', 201, '{"late": true}');
END $$;
SELECT outcome, body FROM idem_claim('s:POST /x', 'e-5', '{}');
SELECT completed_at >= created_at AS completed_after_claim,
       expires_at - completed_at AS ttl
  FROM idem_replay('s:POST /x', 'e-5');
