--
-- A record belongs to the role that claimed it (current_user at the claim).
-- Only that role, the roles that have its privileges (members that inherit
-- them), and superusers may replay it, complete it, checkpoint, extend or
-- release it, or take it over; the operator functions act on every record
-- for the roles granted EXECUTE on them.  Any other role gets 42501 and
-- learns nothing: not the response, not whether its request matched, not
-- whether a committed operation is still in progress.  The same holds for
-- inbox marks.
--
-- Before version 1.2 any role could read any stored response and, with a
-- guessed token, complete another role's multi-phase operation with a
-- response of its own (both checked to succeed on 1.1).
--
CREATE ROLE idem_alice;
CREATE ROLE idem_mallory;
CREATE ROLE idem_bob IN ROLE idem_alice;             -- inherits alice's privileges
CREATE ROLE idem_carol NOINHERIT IN ROLE idem_alice; -- member, but must SET ROLE
CREATE ROLE idem_ops;
GRANT EXECUTE ON FUNCTION idem_resolve_complete(text, text, int, jsonb, jsonb, text),
                          idem_resolve_release(text, text, text) TO idem_ops;
CREATE FUNCTION handler(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(201, NULL, jsonb_build_object('by', current_user::text))::idem_response $$;
SELECT coalesce((SELECT denied FROM idem_stats WHERE datname = current_database()), 0) AS denied_before \gset

-- Alice completes an operation and keeps another in progress (a live lease).
SET ROLE idem_alice;
BEGIN;
SELECT outcome FROM idem_claim('tenant-a:POST /pay', 'k1', '{"amount": 10}');
SELECT idem_succeed('tenant-a:POST /pay', 'k1', 201, '{"secret": "alice''s receipt"}');
COMMIT;
SELECT outcome, token AS alice_token FROM idem_claim('tenant-a:POST /pay', 'k2', '{}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome;
SELECT idem_inbox_accept('tenant-a:orders', 'm1');
RESET ROLE;
SELECT key, owner FROM idempotency.records WHERE scope = 'tenant-a:POST /pay' ORDER BY key;
SELECT message_id, owner FROM idempotency.inbox WHERE source = 'tenant-a:orders';

-- Mallory gets the same error whatever she asks: the same request, another
-- request, a lookup, the whole flow, the operation in progress.
SET ROLE idem_mallory;
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k1', '{"amount": 10}');
\echo :SQLSTATE
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k1', '{"amount": 99}');
\echo :SQLSTATE
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k1', '\x01'::bytea);
\echo :SQLSTATE
SELECT * FROM idem_replay('tenant-a:POST /pay', 'k1');
\echo :SQLSTATE
SELECT * FROM idem_execute('tenant-a:POST /pay', 'k1', '{"amount": 10}', 'handler(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k2', '{}', lease => '1 hour');
\echo :SQLSTATE
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k2', '{}');
\echo :SQLSTATE
-- With alice's token in hand (tokens can be guessed), mallory can neither
-- complete alice's operation with a response of her own, nor checkpoint,
-- extend or release it.
\set VERBOSITY terse
SELECT idem_succeed('tenant-a:POST /pay', 'k2', 200, '{"forged": true}', token => :alice_token);
SELECT idem_checkpoint('tenant-a:POST /pay', 'k2', :alice_token, 'forged');
SELECT idem_extend('tenant-a:POST /pay', 'k2', :alice_token, '1 hour');
SELECT idem_release('tenant-a:POST /pay', 'k2', :alice_token);
\set VERBOSITY default
-- The inbox: she cannot find out whether alice took a message, nor make
-- alice skip one by taking it first.
SELECT idem_inbox_accept('tenant-a:orders', 'm1');
\echo :SQLSTATE
SELECT idem_inbox_accept('tenant-a:orders', 'm2');
RESET ROLE;
-- Nothing of alice's changed.
SELECT key, state, status, body, recovery_point,
       CASE key WHEN 'k2' THEN token = :alice_token END AS alice_token
  FROM idempotency.records WHERE scope = 'tenant-a:POST /pay' ORDER BY key;

-- Alice, after mallory took 'm2' first: a mark that is not hers.
SET ROLE idem_alice;
SELECT idem_inbox_accept('tenant-a:orders', 'm2');
\echo :SQLSTATE
RESET ROLE;

-- Bob inherits alice's privileges: he replays, and completes her operation.
SET ROLE idem_bob;
SELECT outcome, body FROM idem_claim('tenant-a:POST /pay', 'k1', '{"amount": 10}');
SELECT state FROM idem_replay('tenant-a:POST /pay', 'k2');
SELECT idem_checkpoint('tenant-a:POST /pay', 'k2', :alice_token, 'charged');
SELECT idem_inbox_accept('tenant-a:orders', 'm1');
RESET ROLE;
-- Carol is a member without inheritance: only after SET ROLE idem_alice.
SET ROLE idem_carol;
SELECT * FROM idem_replay('tenant-a:POST /pay', 'k1');
\echo :SQLSTATE
SET ROLE idem_alice;
SELECT state, status FROM idem_replay('tenant-a:POST /pay', 'k1');
RESET ROLE;

-- A superuser may read everything.
SELECT outcome, body FROM idem_claim('tenant-a:POST /pay', 'k1', '{"amount": 10}');

-- Operators: idem_ops releases alice's operation once its lease is over,
-- which fences alice; alice's retry takes it over again.
SET ROLE idem_alice;
SELECT idem_release('tenant-a:POST /pay', 'k2', :alice_token);
RESET ROLE;
SET ROLE idem_ops;
SELECT idem_resolve_release('tenant-a:POST /pay', 'k2', 'owner host died') > :alice_token AS new_token;
RESET ROLE;
SET ROLE idem_mallory;
SELECT * FROM idem_claim('tenant-a:POST /pay', 'k2', '{}', lease => '1 hour');
\echo :SQLSTATE
RESET ROLE;
SET ROLE idem_alice;
SELECT outcome, recovery_point FROM idem_claim('tenant-a:POST /pay', 'k2', '{}', lease => '1 hour');
RESET ROLE;
SELECT actor, session_actor = session_user AS logged_in_as_me, action FROM idem_audit WHERE key = 'k2';

-- After expiry a key is new for everyone: mallory claims an expired key of
-- alice's as her own operation (the old response is not revealed).
SET ROLE idem_alice;
BEGIN;
SELECT outcome FROM idem_claim('tenant-a:POST /pay', 'k3', '{}', ttl => '1 millisecond');
SELECT idem_succeed('tenant-a:POST /pay', 'k3', 200, '{"old": true}');
COMMIT;
RESET ROLE;
SELECT pg_sleep(0.01);
SET ROLE idem_mallory;
BEGIN;
SELECT outcome, body FROM idem_claim('tenant-a:POST /pay', 'k3', '{}');
SELECT idem_succeed('tenant-a:POST /pay', 'k3', 200, '{"new": true}');
COMMIT;
RESET ROLE;
SELECT key, owner, body FROM idempotency.records WHERE key = 'k3';

-- A shared application role (a connection pool, PostgREST's 'authenticated')
-- serves many end users: the end user goes into the scope, so that one
-- user's key never reaches another user's record.
SET ROLE idem_alice;
BEGIN;
SELECT outcome FROM idem_claim('user-1:POST /pay', 'same-key', '{}');
SELECT idem_succeed('user-1:POST /pay', 'same-key', 201, '{"for": "user-1"}');
COMMIT;
BEGIN;
SELECT outcome FROM idem_claim('user-2:POST /pay', 'same-key', '{}');
SELECT idem_succeed('user-2:POST /pay', 'same-key', 201, '{"for": "user-2"}');
COMMIT;
SELECT scope, body FROM idem_replay('user-1:POST /pay', 'same-key') r, (SELECT 'user-1') s(scope)
UNION ALL
SELECT scope, body FROM idem_replay('user-2:POST /pay', 'same-key') r, (SELECT 'user-2') s(scope);
RESET ROLE;

-- A SECURITY DEFINER function claims as its owner, and the claim stays its
-- owner's in the caller's transaction: mallory, who called alice's
-- function, can neither complete the claim with a response of her own nor
-- release it (42501), and cannot commit with it unfinished (25000).  A
-- function of alice's completes it.
CREATE FUNCTION alice_begins(k text) RETURNS text LANGUAGE sql SECURITY DEFINER
AS $$ SELECT outcome FROM idem_claim('tenant-a:POST /pay', k, '{"amount": 10}') $$;
CREATE FUNCTION alice_finishes(k text) RETURNS void LANGUAGE sql SECURITY DEFINER
AS $$ SELECT idem_succeed('tenant-a:POST /pay', k, 201, '{"by": "alice"}') $$;
ALTER FUNCTION alice_begins(text) OWNER TO idem_alice;
ALTER FUNCTION alice_finishes(text) OWNER TO idem_alice;
SET ROLE idem_mallory;
BEGIN;
SELECT alice_begins('k4');
SELECT idem_succeed('tenant-a:POST /pay', 'k4', 200, '{"forged": true}');
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT alice_begins('k4');
SELECT idem_release('tenant-a:POST /pay', 'k4');
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT alice_begins('k4');
COMMIT;
\echo :SQLSTATE
BEGIN;
SELECT alice_begins('k4');
SELECT alice_finishes('k4');
COMMIT;
RESET ROLE;
SELECT key, owner, body FROM idempotency.records WHERE key = 'k4';
DROP FUNCTION alice_begins(text), alice_finishes(text);

-- Every refusal was counted.
SELECT denied - :denied_before AS denied FROM idem_stats WHERE datname = current_database();

DELETE FROM idempotency.records WHERE scope IN ('tenant-a:POST /pay', 'user-1:POST /pay', 'user-2:POST /pay');
DELETE FROM idempotency.inbox WHERE source = 'tenant-a:orders';
DELETE FROM idempotency.audit WHERE key = 'k2';
DROP FUNCTION handler(jsonb);
REVOKE EXECUTE ON FUNCTION idem_resolve_complete(text, text, int, jsonb, jsonb, text),
                           idem_resolve_release(text, text, text) FROM idem_ops;
DROP ROLE idem_alice, idem_mallory, idem_bob, idem_carol, idem_ops;
