--
-- The upgrade path: an installation of version 1.0 gets multi-phase
-- operations, the inbox, the statistics and idem_cleanup with ALTER
-- EXTENSION UPDATE to 1.1, then record owners, tokens that never repeat and
-- the lock key with 1.2, keeping its records and marks; 1.3 adds the
-- relay's per-destination options and endpoint state, 1.4 the Citus setup.
-- The library refuses to work on SQL objects older than itself, with a
-- clear error, until ALTER EXTENSION UPDATE has run.  Runs in a database of
-- its own, since the test database already has the current version.
--
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency';
\set origdb :DBNAME
CREATE DATABASE idem_upgrade;
\c idem_upgrade

CREATE EXTENSION idempotency VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
-- A record as version 1.0 wrote it.
INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
								 created_at, completed_at, expires_at)
VALUES ('upgrade:POST /x', 'k1', 'completed', idem_fingerprint('{"a": 1}'), 201,
		'{"kept": true}', 1, now(), now(), now() + interval '1 day');
-- The current library does not work on 1.0's tables: 55000, and what to do.
SELECT outcome, body FROM idem_claim('upgrade:POST /x', 'k1', '{"a": 1}');
\echo :SQLSTATE
-- None of the 1.1 objects yet.
SELECT to_regprocedure('idem_inbox_accept(text, text, interval)') AS inbox_fn,
       to_regclass('idempotency.inbox') AS inbox_table,
       to_regclass('idem_stats') AS stats_view;

ALTER EXTENSION idempotency UPDATE TO '1.1';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- Every new object exists and belongs to the extension.  (Not listed: the
-- row types of its tables and views, which PostgreSQL 17 and later record
-- as members too.)
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
   AND classid <> 'pg_type'::regclass
   AND pg_describe_object(classid, objid, objsubid) ~ '(inbox|stats|cleanup)'
 ORDER BY 1;
-- A multi-phase operation as 1.1 wrote it (token 1, its owner's lease
-- expired, one recovery point), and an inbox mark.
INSERT INTO idempotency.records (scope, key, state, fingerprint, token, recovery_point,
								 lease_expires_at, created_at, expires_at, claimed_at)
VALUES ('upgrade:POST /x', 'k3', 'processing', idem_fingerprint('{}'), 1, 'step1',
		now() - interval '1 minute', now() - interval '1 hour', now() + interval '1 day',
		now() - interval '1 hour');
INSERT INTO idempotency.inbox (source, message_id, accepted_at, expires_at)
VALUES ('upgrade-topic', 'm1', now(), now() + interval '1 day');
-- Still older than the library.
SELECT idem_inbox_accept('upgrade-topic', 'm1');
\echo :SQLSTATE
SELECT claims FROM idem_stats;
\echo :SQLSTATE
SELECT idem_cleanup();
\echo :SQLSTATE

ALTER EXTENSION idempotency UPDATE TO '1.2';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- Records and marks written before 1.2 have no owner, and stay open to
-- every role until they expire.
SELECT key, state, owner FROM idempotency.records ORDER BY key;
SELECT outcome, body FROM idem_claim('upgrade:POST /x', 'k1', '{"a": 1}');
SELECT idem_inbox_accept('upgrade-topic', 'm1');
-- The 1.0 record has no claimed_at.
SELECT claimed_at IS NULL AS claimed_at_unknown FROM idempotency.records WHERE key = 'k1';
-- The operation of 1.1 is taken over with a token above every token 1.1
-- handed out, so its old owner's token 1 is fenced.
SELECT outcome, token AS k3_token, token > 4294967295 AS above_1_1_tokens, recovery_point
  FROM idem_claim('upgrade:POST /x', 'k3', '{}', lease => '1 hour') \gset
SELECT :'outcome' AS outcome, :'above_1_1_tokens' AS above_1_1_tokens, :'recovery_point' AS recovery_point;
\set VERBOSITY sqlstate
SELECT idem_checkpoint('upgrade:POST /x', 'k3', 1, 'late');
\set VERBOSITY default
SELECT idem_succeed('upgrade:POST /x', 'k3', 201, token => :k3_token);
SELECT outcome, status FROM idem_claim('upgrade:POST /x', 'k3', '{}');
-- New records and marks remember their role.
BEGIN;
SELECT outcome FROM idem_claim('upgrade:POST /x', 'k2', '{}', interval '1 hour');
SELECT idem_succeed('upgrade:POST /x', 'k2', 200, NULL, NULL);
COMMIT;
SELECT idem_inbox_accept('upgrade-topic', 'm2'), idem_inbox_accept('upgrade-topic', 'm2');
SELECT key, owner = current_user::regrole AS mine FROM idempotency.records WHERE key = 'k2';
SELECT message_id, owner = current_user::regrole AS mine
  FROM idempotency.inbox ORDER BY message_id;
-- The lock key: 16 random bytes.
SELECT count(*) AS keys, min(length(key)) AS bytes FROM idempotency.lock_key;
-- The records table has the column order of a fresh install (see below).
CREATE TABLE upgraded_columns AS
SELECT string_agg(attname, ',' ORDER BY attnum) AS columns
  FROM pg_attribute WHERE attrelid = 'idempotency.records'::regclass AND attnum > 0 AND NOT attisdropped;
SELECT columns FROM upgraded_columns;
SELECT claims, replays, takeovers, inbox_accepted, inbox_duplicates, denied
  FROM idem_stats WHERE datname = current_database();
-- A database new to the statistics: before its first cleanup pass, the
-- cleanup columns are NULL.
SELECT cleanup_runs, last_cleanup_at, last_cleanup_duration, cleanup_lag, expired_processing
  FROM idem_stats WHERE datname = current_database();
SELECT idem_cleanup();
SELECT cleanup_runs, last_cleanup_at IS NOT NULL AS has_last_cleanup, expired_processing
  FROM idem_stats WHERE datname = current_database();
CREATE VIEW extension_objects AS
SELECT classid, pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency');
-- On to the current version: 1.3 (the relay's options), then 1.4 (the Citus
-- setup, and schema idem_citus: the functions that take the scope as a bigint
-- or uuid tenant).
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT object FROM extension_objects
 WHERE object ~ '^(function idem_citus|schema idem_citus|function idem_destination_sync)'
 ORDER BY 1;
-- The scope as a tenant id names the same record as its text.
BEGIN;
SELECT outcome FROM idem_claim('42', 'k-tenant', '{}');
SELECT idem_citus.idem_succeed(42, 'k-tenant', 200, '{"tenant": true}');
COMMIT;
SELECT outcome, body FROM idem_citus.idem_claim(42, 'k-tenant', '{}');
CREATE TABLE upgraded_objects AS SELECT * FROM extension_objects;
-- The objects 1.2 added (row types aside, as above).
SELECT object FROM upgraded_objects
 WHERE object ~ '(lock_key|tokens)' AND classid <> 'pg_type'::regclass ORDER BY 1;
-- The privileges the install scripts set.
SELECT has_function_privilege('public', 'idem_inbox_accept(text, text, interval)', 'EXECUTE') AS inbox_public,
       has_table_privilege('public', 'idem_stats', 'SELECT') AS stats_public,
       has_function_privilege('public', 'idem_stats_reset()', 'EXECUTE') AS reset_public,
       has_function_privilege('public', 'idem_cleanup(int4)', 'EXECUTE') AS cleanup_public;

-- A fresh install (1.0 then the upgrades) ends up with the same objects,
-- and a lock key of its own.
SELECT key AS old_lock_key FROM idempotency.lock_key \gset
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT key <> :'old_lock_key'::bytea AS new_lock_key FROM idempotency.lock_key;
SELECT count(*) > 0 AS has_objects FROM extension_objects;
SELECT u.columns = string_agg(attname, ',' ORDER BY attnum) AS same_record_columns
  FROM upgraded_columns u, pg_attribute
 WHERE attrelid = 'idempotency.records'::regclass AND attnum > 0 AND NOT attisdropped
 GROUP BY u.columns;
CREATE VIEW install_differences AS
(SELECT 'only after the upgrade' AS difference, object FROM upgraded_objects
 EXCEPT SELECT 'only after the upgrade', object FROM extension_objects)
UNION ALL
(SELECT 'only in a fresh install', object FROM extension_objects
 EXCEPT SELECT 'only in a fresh install', object FROM upgraded_objects);
SELECT * FROM install_differences;

-- Every released version updates to the current one with one ALTER
-- EXTENSION UPDATE, to the same objects.
SELECT source, target, path FROM pg_extension_update_paths('idempotency')
 WHERE target = (SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency')
 ORDER BY source;
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.0';
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT * FROM install_differences;
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.1';
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT * FROM install_differences;
-- 1.2 to 1.3: a destination made at 1.2 gets the defaults of the options
-- 1.3 added, and a closed circuit.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.2';
-- (Written as 1.2 wrote it: this library's functions need 1.3's columns.)
INSERT INTO idempotency.destinations (name, kind, target, topics, run_as, search_path, options,
                                      max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms)
VALUES ('old_ui', 'notify', 'old_events', '{*}', current_user::regrole, 'public', '{}',
        10, 1000, 3600000, 10000);
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT * FROM install_differences;
SELECT name, max_in_flight, connect_timeout_ms, failure_threshold, disable_after_ms, circuit,
       consecutive_failures, failing_since, next_probe_at, paced_until
  FROM idempotency.destinations;
SELECT destination, status, circuit, consecutive_failures, next_probe_at, paced_until
  FROM idem_outbox_stats;

\c :origdb
DROP DATABASE idem_upgrade;
