--
-- Upgrade path: a database created at 1.0 keeps its records and behaves like
-- a fresh install after ALTER EXTENSION idempotency UPDATE.  Runs last: it
-- drops and re-creates the extension.
--
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
RESET client_min_messages;
CREATE EXTENSION idempotency VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- The 1.0 functions work with the current library.
BEGIN;
SELECT outcome, token FROM idem_claim('up:POST /x', 'k1', '{"a": 1}');
SELECT idem_succeed('up:POST /x', 'k1', 201, '{"v": 1}');
COMMIT;
SELECT outcome, status, body FROM idem_claim('up:POST /x', 'k1', '{"a": 1}');

ALTER EXTENSION idempotency UPDATE TO '1.1';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- The 1.0 record survived and still replays; its claimed_at is unknown.
SELECT outcome, status, body FROM idem_claim('up:POST /x', 'k1', '{"a": 1}');
SELECT claimed_at IS NULL AS claimed_at_unknown FROM idempotency.records WHERE key = 'k1';
-- Calls written for 1.0 are still valid, and 1.1's multi-phase functions work.
BEGIN;
SELECT outcome FROM idem_claim('up:POST /x', 'k2', '{}', interval '1 hour');
SELECT idem_succeed('up:POST /x', 'k2', 200, NULL, NULL);
COMMIT;
SELECT outcome, token FROM idem_claim('up:POST /x', 'k3', '{}', lease => '1 hour');
SELECT idem_checkpoint('up:POST /x', 'k3', 1, 'step1');
SELECT idem_succeed('up:POST /x', 'k3', 201, token => 1);
SELECT outcome, status FROM idem_claim('up:POST /x', 'k3', '{}');

-- An upgraded installation has exactly the objects of a fresh one.
CREATE TEMP TABLE upgraded AS
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency');
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
RESET client_min_messages;
CREATE EXTENSION idempotency;
CREATE TEMP TABLE fresh AS
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency');
SELECT count(*) > 20 AS many_objects FROM fresh;
(SELECT 'only upgraded' AS side, object FROM upgraded EXCEPT SELECT 'only upgraded', object FROM fresh)
UNION ALL
(SELECT 'only fresh', object FROM fresh EXCEPT SELECT 'only fresh', object FROM upgraded)
ORDER BY 1, 2;
-- Same columns, in the same order, in the records table.
SELECT string_agg(attname, ',' ORDER BY attnum) AS columns
  FROM pg_attribute WHERE attrelid = 'idempotency.records'::regclass AND attnum > 0 AND NOT attisdropped;
