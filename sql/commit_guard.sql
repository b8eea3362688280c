--
-- A claim can never be committed without its response: committing while a
-- claim is neither succeeded nor released fails, and a rolled-back savepoint
-- takes its claims (and their responses) with it.
--
CREATE TABLE orders (id serial PRIMARY KEY, key text NOT NULL);

-- Commit with an unfinished claim: the whole transaction rolls back,
-- domain write included.
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-1', '{}');
INSERT INTO orders (key) VALUES ('g-1');
COMMIT;
\echo :SQLSTATE
SELECT count(*) AS orders FROM orders;
SELECT count(*) AS records FROM idem_replay('shop:POST /orders', 'g-1');

-- The same in an implicit transaction: a lone claim statement cannot commit.
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-1', '{}');
\echo :SQLSTATE

-- The key is free again: the next attempt claims it.
BEGIN;
SELECT outcome, token FROM idem_claim('shop:POST /orders', 'g-1', '{}');
INSERT INTO orders (key) VALUES ('g-1');
SELECT idem_succeed('shop:POST /orders', 'g-1', 201);
COMMIT;

-- The response stored inside a savepoint that rolls back is gone, so the
-- claim is unfinished again and the commit fails.
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-2', '{}');
SAVEPOINT s1;
SELECT idem_succeed('shop:POST /orders', 'g-2', 201);
ROLLBACK TO SAVEPOINT s1;
COMMIT;
\echo :SQLSTATE

-- ... and the response can be stored again after the rollback.
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-2', '{}');
SAVEPOINT s1;
SELECT idem_succeed('shop:POST /orders', 'g-2', 500);
ROLLBACK TO SAVEPOINT s1;
SELECT idem_succeed('shop:POST /orders', 'g-2', 201);
COMMIT;
SELECT status FROM idem_replay('shop:POST /orders', 'g-2');

-- A claim made inside a savepoint that rolls back is gone: the commit is fine
-- and nothing is stored.
BEGIN;
SAVEPOINT s1;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-3', '{}');
INSERT INTO orders (key) VALUES ('g-3');
ROLLBACK TO SAVEPOINT s1;
COMMIT;
SELECT count(*) AS records FROM idem_replay('shop:POST /orders', 'g-3');

-- A released savepoint keeps its claim: still unfinished at commit.
BEGIN;
SAVEPOINT s1;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-4', '{}');
RELEASE SAVEPOINT s1;
COMMIT;
\echo :SQLSTATE

-- Nested savepoints: the release in s2 is undone, the claim of the outer
-- transaction stays and is completed afterwards.
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-5', '{}');
SAVEPOINT s1;
SAVEPOINT s2;
SELECT idem_release('shop:POST /orders', 'g-5');
ROLLBACK TO SAVEPOINT s1;
SELECT idem_succeed('shop:POST /orders', 'g-5', 201);
COMMIT;
SELECT status FROM idem_replay('shop:POST /orders', 'g-5');

-- A PL/pgSQL exception block is a savepoint too: a handler that fails after
-- claiming leaves no claim behind.
CREATE FUNCTION place_order(k text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	BEGIN
		PERFORM idem_claim('shop:POST /orders', k, '{}');
		INSERT INTO orders (key) VALUES (k);
		RAISE EXCEPTION 'gateway down';
	EXCEPTION WHEN raise_exception THEN
		RETURN 'failed: ' || SQLERRM;
	END;
END $$;
SELECT place_order('g-6');
SELECT count(*) AS records FROM idem_replay('shop:POST /orders', 'g-6');

-- Two-phase commit: PREPARE refuses an unfinished claim ...
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-7', '{}');
PREPARE TRANSACTION 'idem-g7';
\echo :SQLSTATE
-- ... and a completed one keeps its key locked while prepared: a duplicate
-- waits for the prepared transaction (here at most 100ms) ...
BEGIN;
SELECT outcome FROM idem_claim('shop:POST /orders', 'g-7', '{}');
INSERT INTO orders (key) VALUES ('g-7');
SELECT idem_succeed('shop:POST /orders', 'g-7', 201);
PREPARE TRANSACTION 'idem-g7';
SET idempotency.wait_timeout = '100ms';
BEGIN;
SELECT outcome, retry_after FROM idem_claim('shop:POST /orders', 'g-7', '{}');
COMMIT;
RESET idempotency.wait_timeout;
-- ... and replays it once it is committed.
COMMIT PREPARED 'idem-g7';
SELECT outcome, status FROM idem_claim('shop:POST /orders', 'g-7', '{}');

-- One order per completed key, none for the others.
SELECT key, count(*) FROM orders GROUP BY key ORDER BY key;
DROP FUNCTION place_order(text);
DROP TABLE orders;
