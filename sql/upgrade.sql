--
-- The upgrade path: an installation of version 1.0 gets multi-phase
-- operations, the inbox, the statistics and idem_cleanup with ALTER
-- EXTENSION UPDATE to 1.1, then the 1.2 changes, keeping its records.  Runs
-- in a database of its own, since the test database already has the current
-- version.
--
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency';
\set origdb :DBNAME
CREATE DATABASE idem_upgrade;
\c idem_upgrade

CREATE EXTENSION idempotency VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
BEGIN;
SELECT outcome FROM idem_claim('upgrade:POST /x', 'k1', '{"a": 1}');
SELECT idem_succeed('upgrade:POST /x', 'k1', 201, '{"kept": true}');
COMMIT;
-- None of the 1.1 objects yet.
SELECT to_regprocedure('idem_inbox_accept(text, text, interval)') AS inbox_fn,
       to_regclass('idempotency.inbox') AS inbox_table,
       to_regclass('idem_stats') AS stats_view;

ALTER EXTENSION idempotency UPDATE TO '1.1';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- Every new object exists, belongs to the extension, and works.
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
   AND pg_describe_object(classid, objid, objsubid) ~ '(inbox|stats|cleanup)'
 ORDER BY 1;
SELECT outcome, body FROM idem_claim('upgrade:POST /x', 'k1', '{"a": 1}');
-- The 1.0 record has no claimed_at; calls written for 1.0 are still valid.
SELECT claimed_at IS NULL AS claimed_at_unknown FROM idempotency.records WHERE key = 'k1';
BEGIN;
SELECT outcome FROM idem_claim('upgrade:POST /x', 'k2', '{}', interval '1 hour');
SELECT idem_succeed('upgrade:POST /x', 'k2', 200, NULL, NULL);
COMMIT;
-- Multi-phase operations work.
SELECT outcome, token FROM idem_claim('upgrade:POST /x', 'k3', '{}', lease => '1 hour');
SELECT idem_checkpoint('upgrade:POST /x', 'k3', 1, 'step1');
SELECT idem_succeed('upgrade:POST /x', 'k3', 201, token => 1);
SELECT outcome, status FROM idem_claim('upgrade:POST /x', 'k3', '{}');
-- The records table has the column order of a fresh install (see below).
CREATE TABLE upgraded_columns AS
SELECT string_agg(attname, ',' ORDER BY attnum) AS columns
  FROM pg_attribute WHERE attrelid = 'idempotency.records'::regclass AND attnum > 0 AND NOT attisdropped;
SELECT idem_inbox_accept('upgrade-topic', 'm1'), idem_inbox_accept('upgrade-topic', 'm1');
SELECT claims, replays, inbox_accepted, inbox_duplicates
  FROM idem_stats WHERE datname = current_database();
-- A database new to the statistics: before its first cleanup pass, the
-- cleanup columns are NULL.
SELECT cleanup_runs, last_cleanup_at, last_cleanup_duration, cleanup_lag, expired_processing
  FROM idem_stats WHERE datname = current_database();
SELECT idem_cleanup();
SELECT cleanup_runs, last_cleanup_at IS NOT NULL AS has_last_cleanup, expired_processing
  FROM idem_stats WHERE datname = current_database();

-- Version 1.2.
ALTER EXTENSION idempotency UPDATE TO '1.2';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT outcome, body FROM idem_claim('upgrade:POST /x', 'k1', '{"a": 1}');

CREATE VIEW extension_objects AS
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency');
CREATE TABLE upgraded_objects AS SELECT * FROM extension_objects;
-- The privileges the install script sets.
SELECT has_function_privilege('public', 'idem_inbox_accept(text, text, interval)', 'EXECUTE') AS inbox_public,
       has_table_privilege('public', 'idem_stats', 'SELECT') AS stats_public,
       has_function_privilege('public', 'idem_stats_reset()', 'EXECUTE') AS reset_public,
       has_function_privilege('public', 'idem_cleanup(int4)', 'EXECUTE') AS cleanup_public;

-- A fresh install (1.0 then the upgrades) ends up with the same objects.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT count(*) > 0 AS has_objects FROM extension_objects;
SELECT u.columns = string_agg(attname, ',' ORDER BY attnum) AS same_record_columns
  FROM upgraded_columns u, pg_attribute
 WHERE attrelid = 'idempotency.records'::regclass AND attnum > 0 AND NOT attisdropped
 GROUP BY u.columns;
(SELECT 'only after the upgrade' AS difference, * FROM upgraded_objects
 EXCEPT SELECT 'only after the upgrade', * FROM extension_objects)
UNION ALL
(SELECT 'only in a fresh install', * FROM extension_objects
 EXCEPT SELECT 'only in a fresh install', * FROM upgraded_objects);

\c :origdb
DROP DATABASE idem_upgrade;
