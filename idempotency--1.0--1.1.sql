/* idempotency--1.0--1.1.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- Background worker, inbox and statistics

/*
 * The consumer inbox: one mark per message taken into effect, kept until it
 * expires.  Like the records, it lives in the private schema and is reached
 * through idem_inbox_accept only (direct heap access, no privilege needed).
 * Column order matters to src/inbox.h (Anum_inbox_*).
 */
CREATE TABLE idempotency.inbox (
	source			text COLLATE "C" NOT NULL,
	message_id		text COLLATE "C" NOT NULL,
	accepted_at		timestamptz NOT NULL,
	expires_at		timestamptz NOT NULL,
	PRIMARY KEY (source, message_id)
);
CREATE INDEX inbox_expires_at_brin ON idempotency.inbox USING brin (expires_at);
SELECT pg_catalog.pg_extension_config_dump('idempotency.inbox', '');

-- Not STRICT: a NULL source or message id is an error (22004), not a NULL answer.
CREATE FUNCTION idem_inbox_accept(source text, message_id text, ttl interval DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_inbox_accept'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * One cleanup pass over this database in the caller's transaction, as the
 * background worker runs it in short transactions.  For DBAs and tests.
 */
CREATE FUNCTION idem_cleanup(batch_size int4 DEFAULT NULL)
RETURNS int8
AS 'MODULE_PATHNAME', 'idem_cleanup'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE EXECUTE ON FUNCTION idem_cleanup(int4) FROM PUBLIC;

/* Shared-memory counters, one row per database; needs shared_preload_libraries. */
CREATE FUNCTION idem_stats(
	OUT datname name,
	OUT claims int8,
	OUT replays int8,
	OUT mismatches int8,
	OUT in_progress int8,
	OUT takeovers int8,
	OUT fenced int8,
	OUT releases int8,
	OUT inbox_accepted int8,
	OUT inbox_duplicates int8,
	OUT cleanup_runs int8,
	OUT rows_deleted int8,
	OUT last_cleanup_at timestamptz,
	OUT last_cleanup_duration interval,
	OUT cleanup_lag interval,
	OUT expired_processing int8,
	OUT worker_pid int4,
	OUT stats_reset timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

-- Counters and database names only, nothing personal: readable by everyone.
CREATE VIEW idem_stats AS SELECT * FROM idem_stats();
GRANT SELECT ON idem_stats TO PUBLIC;

CREATE FUNCTION idem_stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE EXECUTE ON FUNCTION idem_stats_reset() FROM PUBLIC;
