--
-- An ordinary role with no privileges on the extension's tables can use every
-- function, but cannot read or change the stored records directly; handlers
-- run with the caller's privileges, never more.
--
CREATE ROLE idem_app LOGIN;
CREATE TABLE app_orders (id serial PRIMARY KEY, key text);
GRANT INSERT ON app_orders TO idem_app;
GRANT USAGE ON SEQUENCE app_orders_id_seq TO idem_app;
CREATE TABLE audit_log (note text);   -- idem_app has no privilege here

CREATE FUNCTION app_handler(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$
	INSERT INTO app_orders (key) VALUES (request->>'k');
	SELECT ROW(201, NULL, jsonb_build_object('ok', true))::idem_response;
$$;
CREATE FUNCTION sneaky_handler(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$
	INSERT INTO audit_log VALUES ('written by ' || current_user);
	SELECT ROW(201, NULL, NULL)::idem_response;
$$;
CREATE FUNCTION private_handler(request jsonb) RETURNS idem_response
LANGUAGE sql AS $$ SELECT ROW(200, NULL, NULL)::idem_response $$;
REVOKE EXECUTE ON FUNCTION private_handler(jsonb) FROM PUBLIC;
-- A SECURITY DEFINER handler in a schema idem_app may not use: EXECUTE
-- stays with PUBLIC (the default), the schema keeps it out of reach.
CREATE SCHEMA idem_hidden;
CREATE TABLE idem_hidden.secrets (v text);
INSERT INTO idem_hidden.secrets VALUES ('top secret');
CREATE FUNCTION idem_hidden.reveal(request jsonb) RETURNS idem_response
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $$
	SELECT ROW(200, NULL, to_jsonb((SELECT v FROM idem_hidden.secrets)))::public.idem_response;
$$;
SELECT 'idem_hidden.reveal(jsonb)'::regprocedure::oid AS hidden_handler \gset

SET ROLE idem_app;

-- Every function works.
BEGIN;
SELECT outcome, token FROM idem_claim('app:POST /orders', 'p-1', '{"k": "p-1"}');
INSERT INTO app_orders (key) VALUES ('p-1');
SELECT idem_succeed('app:POST /orders', 'p-1', 201, '{"id": 1}');
COMMIT;
SELECT outcome, status, body FROM idem_claim('app:POST /orders', 'p-1', '{"k": "p-1"}');
SELECT state, status FROM idem_replay('app:POST /orders', 'p-1');
BEGIN;
SELECT outcome FROM idem_claim('app:POST /orders', 'p-2', '{}'::jsonb);
SELECT idem_release('app:POST /orders', 'p-2');
COMMIT;
SELECT status, replayed FROM idem_execute('app:POST /orders', 'p-3', '{"k": "p-3"}', 'app_handler(jsonb)');
SELECT status, replayed FROM idem_execute('app:POST /orders', 'p-3', '{"k": "p-3"}', 'app_handler(jsonb)');
SELECT idem_canonical('{"b": 1, "a": 2}'), length(idem_fingerprint('{}'));

-- The stored records are out of reach: 42501.
SELECT * FROM idempotency.records;
\echo :SQLSTATE
DELETE FROM idempotency.records;
\echo :SQLSTATE
UPDATE idempotency.records SET status = 200;
\echo :SQLSTATE

-- idem_execute checks the caller's EXECUTE privilege on the handler before
-- claiming anything ...
SELECT * FROM idem_execute('app:POST /orders', 'p-4', '{}', 'private_handler(jsonb)');
\echo :SQLSTATE
-- ... and the handler runs as the caller: what the caller may not write, the
-- handler may not write either.
SELECT * FROM idem_execute('app:POST /orders', 'p-5', '{}', 'sneaky_handler(jsonb)');
\echo :SQLSTATE
-- ... and USAGE on the handler's schema, as calling it by name would: a
-- handler passed by its OID is no way around the schema.  (It used to run,
-- and answered 'top secret'.)
SELECT idem_hidden.reveal('{}');
\echo :SQLSTATE
SELECT * FROM idem_execute('app:POST /orders', 'p-6', '{}', :hidden_handler::oid::regprocedure);
\echo :SQLSTATE

RESET ROLE;
SELECT count(*) AS audit_rows FROM audit_log;
SELECT key, count(*) FROM app_orders GROUP BY key ORDER BY key;
SELECT key, status FROM idempotency.records WHERE scope = 'app:POST /orders' ORDER BY key;

-- Only the extension owner's schema holds the records; PUBLIC has no rights.
SELECT has_schema_privilege('idem_app', 'idempotency', 'USAGE') AS app_usage,
       has_table_privilege('idem_app', 'idempotency.records', 'SELECT') AS app_select;

DROP FUNCTION app_handler(jsonb), sneaky_handler(jsonb), private_handler(jsonb);
DROP SCHEMA idem_hidden CASCADE;
DROP TABLE app_orders, audit_log;
DROP ROLE idem_app;
