--
-- idem_execute: claim, run the handler, store and answer, in one call.
--
CREATE TABLE transfers (id serial PRIMARY KEY, amount int NOT NULL);

CREATE FUNCTION create_transfer(request jsonb) RETURNS idem_response
LANGUAGE plpgsql AS $$
DECLARE
	new_id int;
BEGIN
	IF (request->>'amount')::int <= 0 THEN
		-- A stable business rejection: stored and replayed like a success.
		RETURN ROW(422, NULL, jsonb_build_object('error', 'amount must be positive'))::idem_response;
	END IF;
	INSERT INTO transfers (amount) VALUES ((request->>'amount')::int) RETURNING id INTO new_id;
	RETURN ROW(201, jsonb_build_object('Location', '/transfers/' || new_id),
			   jsonb_build_object('id', new_id))::idem_response;
END $$;

-- First call runs the handler.
SELECT * FROM idem_execute('bank:POST /transfers', 'x-1', '{"amount": 50}', 'create_transfer(jsonb)');
-- The retry replays, marked with Idempotent-Replayed; the handler does not run.
SELECT * FROM idem_execute('bank:POST /transfers', 'x-1', '{"amount": 50}', 'create_transfer(jsonb)');
SELECT count(*) AS transfers FROM transfers;
-- Same key, another request: 422 with a problem+json body.
SELECT * FROM idem_execute('bank:POST /transfers', 'x-1', '{"amount": 51}', 'create_transfer(jsonb)');
-- A business rejection is stored and replayed with its status.
SELECT status, body, replayed FROM idem_execute('bank:POST /transfers', 'x-2', '{"amount": 0}', 'create_transfer(jsonb)');
SELECT status, body, replayed FROM idem_execute('bank:POST /transfers', 'x-2', '{"amount": 0}', 'create_transfer(jsonb)');
-- A stored response without headers still gets the replay header.
SELECT headers FROM idem_execute('bank:POST /transfers', 'x-2', '{"amount": 0}', 'create_transfer(jsonb)');

-- In progress: another transaction holds the key (here a prepared one), and
-- the duplicate gets 409 with Retry-After after idempotency.wait_timeout.
BEGIN;
SELECT outcome FROM idem_claim('bank:POST /transfers', 'x-3', '{"amount": 7}');
SELECT idem_succeed('bank:POST /transfers', 'x-3', 201, '{"id": 99}');
PREPARE TRANSACTION 'idem-x3';
SET idempotency.wait_timeout = '50ms';
SELECT * FROM idem_execute('bank:POST /transfers', 'x-3', '{"amount": 7}', 'create_transfer(jsonb)');
RESET idempotency.wait_timeout;
ROLLBACK PREPARED 'idem-x3';
-- Once the holder rolled back, the key executes.
SELECT status, body, replayed FROM idem_execute('bank:POST /transfers', 'x-3', '{"amount": 7}', 'create_transfer(jsonb)');

-- A handler that raises: nothing is stored, the error propagates, the retry
-- executes again.
CREATE FUNCTION flaky_transfer(request jsonb) RETURNS idem_response
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO transfers (amount) VALUES (-1);
	RAISE EXCEPTION 'gateway timeout' USING ERRCODE = 'connection_failure';
END $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-4', '{"amount": 1}', 'flaky_transfer(jsonb)');
\echo :SQLSTATE
SELECT count(*) FROM idem_replay('bank:POST /transfers', 'x-4');
SELECT count(*) AS transfers FROM transfers WHERE amount = -1;
SELECT status, replayed FROM idem_execute('bank:POST /transfers', 'x-4', '{"amount": 1}', 'create_transfer(jsonb)');

-- A handler answering an invalid response fails the whole call.
CREATE FUNCTION bad_status(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(700, NULL, NULL)::idem_response $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'bad_status(jsonb)');
\echo :SQLSTATE
CREATE FUNCTION null_response(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT NULL::idem_response $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'null_response(jsonb)');
\echo :SQLSTATE
CREATE FUNCTION null_status(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(NULL, NULL, '{}')::idem_response $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'null_status(jsonb)');
\echo :SQLSTATE

-- Handlers with the wrong shape are refused before anything is claimed: 42809.
CREATE FUNCTION wrong_arg(request text) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(200, NULL, NULL)::idem_response $$;
CREATE FUNCTION wrong_result(request jsonb) RETURNS jsonb
LANGUAGE sql AS $$ SELECT request $$;
CREATE FUNCTION wrong_set(request jsonb) RETURNS SETOF idem_response
LANGUAGE sql AS $$ SELECT ROW(200, NULL, NULL)::idem_response $$;
CREATE PROCEDURE wrong_kind(request jsonb) LANGUAGE sql AS $$ SELECT 1 $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'wrong_arg(text)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'wrong_result(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'wrong_set(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'wrong_kind(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'no_such_handler(jsonb)');
\echo :SQLSTATE
-- NULL and invalid arguments.
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', NULL);
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', NULL, 'create_transfer(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', '', '{}', 'create_transfer(jsonb)');
\echo :SQLSTATE
SELECT * FROM idem_execute('bank:POST /transfers', 'x-5', '{}', 'create_transfer(jsonb)', '0 s');
\echo :SQLSTATE
SELECT count(*) FROM idem_replay('bank:POST /transfers', 'x-5');

-- One call site, several handlers: each row runs its own.
CREATE FUNCTION echo_request(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(200, NULL, request)::idem_response $$;
SELECT k, (r).status, (r).body
  FROM (SELECT k, idem_execute('bank:POST /multi', k, '{"amount": 3}', h) AS r
          FROM (VALUES ('m-1', 'create_transfer(jsonb)'::regprocedure),
                       ('m-2', 'echo_request(jsonb)'::regprocedure),
                       ('m-3', 'create_transfer(jsonb)'::regprocedure)) AS v(k, h)) AS calls
 ORDER BY k;

-- An explicit ttl is honoured.
SELECT status FROM idem_execute('bank:POST /transfers', 'x-6', '{"amount": 9}', 'create_transfer(jsonb)', '1 hour');
SELECT expires_at - completed_at AS ttl FROM idem_replay('bank:POST /transfers', 'x-6');

-- A handler's 5xx is a transient failure (issue 12): its writes are rolled
-- back, nothing is stored, the claim is released and the 5xx is answered as
-- it came, so the retry executes again.
CREATE FUNCTION unavailable_transfer(request jsonb) RETURNS idem_response
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO transfers (amount) VALUES (-2);
	RETURN ROW(503, jsonb_build_object('Retry-After', '1'),
			   jsonb_build_object('error', 'gateway unavailable'))::idem_response;
END $$;
SELECT * FROM idem_execute('bank:POST /transfers', 'x-7', '{"amount": 2}', 'unavailable_transfer(jsonb)');
SELECT count(*) AS stored FROM idem_replay('bank:POST /transfers', 'x-7');
SELECT count(*) AS kept_writes FROM transfers WHERE amount = -2;
SELECT status, body, replayed FROM idem_execute('bank:POST /transfers', 'x-7', '{"amount": 2}', 'create_transfer(jsonb)');
SELECT status, replayed FROM idem_execute('bank:POST /transfers', 'x-7', '{"amount": 2}', 'create_transfer(jsonb)');
-- In an explicit transaction: the caller's own writes stay, and the commit
-- succeeds (the claim was released, so nothing is left unfinished).
BEGIN;
INSERT INTO transfers (amount) VALUES (-3);
SELECT status FROM idem_execute('bank:POST /transfers', 'x-8', '{"amount": 3}', 'unavailable_transfer(jsonb)');
COMMIT;
SELECT count(*) AS caller_writes FROM transfers WHERE amount = -3;
SELECT count(*) AS handler_writes FROM transfers WHERE amount = -2;
SELECT count(*) AS stored FROM idem_replay('bank:POST /transfers', 'x-8');
-- 499 is not a server error: stored.
CREATE FUNCTION status_499(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(499, NULL, NULL)::idem_response $$;
SELECT status, replayed FROM idem_execute('bank:POST /transfers', 'x-9', '{}', 'status_499(jsonb)');
SELECT status, replayed FROM idem_execute('bank:POST /transfers', 'x-9', '{}', 'status_499(jsonb)');
-- A 5xx that is not stored is not held to the storage limit
-- (idempotency.max_response_bytes, 1 MB): a 2 MB 503 is answered as it came.
-- Stored (store_server_errors = on), it is refused like any response.
CREATE FUNCTION large_unavailable(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$
	SELECT ROW(503, NULL, jsonb_build_object('page', repeat('x', 2 * 1024 * 1024)))::idem_response
$$;
SELECT status, length(body->>'page') AS page_length, replayed
  FROM idem_execute('bank:POST /transfers', 'x-12', '{}', 'large_unavailable(jsonb)');
SELECT count(*) AS stored FROM idem_replay('bank:POST /transfers', 'x-12');
SET idempotency.store_server_errors = on;
SELECT status FROM idem_execute('bank:POST /transfers', 'x-12', '{}', 'large_unavailable(jsonb)');
RESET idempotency.store_server_errors;
-- idempotency.store_server_errors = on stores a 5xx like any response.
SET idempotency.store_server_errors = on;
SELECT status, replayed FROM idem_execute('bank:POST /transfers', 'x-10', '{"amount": 4}', 'unavailable_transfer(jsonb)');
SELECT status, body, replayed FROM idem_execute('bank:POST /transfers', 'x-10', '{"amount": 4}', 'unavailable_transfer(jsonb)');
SELECT count(*) AS kept_writes FROM transfers WHERE amount = -2;
RESET idempotency.store_server_errors;
-- Inside a caller's exception block: a 5xx, then a handler error caught by
-- the block; the caller's subtransactions stay intact and the key executes
-- afterwards.
DO $$
DECLARE
	r record;
BEGIN
	SELECT * INTO r FROM idem_execute('bank:POST /transfers', 'x-11', '{"amount": 5}', 'unavailable_transfer(jsonb)');
	RAISE NOTICE 'first: %', r.status;
	BEGIN
		PERFORM idem_execute('bank:POST /transfers', 'x-11', '{"amount": 5}', 'flaky_transfer(jsonb)');
	EXCEPTION WHEN connection_failure THEN
		RAISE NOTICE 'caught: %', SQLERRM;
	END;
	SELECT * INTO r FROM idem_execute('bank:POST /transfers', 'x-11', '{"amount": 5}', 'create_transfer(jsonb)');
	RAISE NOTICE 'then: % replayed %', r.status, r.replayed;
END $$;
SELECT count(*) AS handler_writes FROM transfers WHERE amount IN (-1, -2);

SELECT count(*) AS transfers FROM transfers;
DROP FUNCTION create_transfer(jsonb), flaky_transfer(jsonb), bad_status(jsonb),
	unavailable_transfer(jsonb), status_499(jsonb), large_unavailable(jsonb),
	null_response(jsonb), null_status(jsonb), wrong_arg(text), wrong_result(jsonb),
	wrong_set(jsonb), echo_request(jsonb);
DROP PROCEDURE wrong_kind(jsonb);
DROP TABLE transfers;
