/* idempotency--1.0--1.1.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- Multi-phase operations: leases, fencing tokens, recovery points, takeover

/*
 * When the current token was handed out (first claim or takeover): the owner's
 * age in idem_stuck.  Rows written by 1.0 leave it NULL and read as created_at.
 */
ALTER TABLE idempotency.records ADD COLUMN claimed_at timestamptz;

/*
 * idem_claim gains a lease: with one, the claim is multi-phase and is
 * committed on its own as a 'processing' record.  Dropping and re-creating
 * keeps every existing call valid (the new argument has a default).
 */
DROP FUNCTION idem_claim(text, text, jsonb, interval);
DROP FUNCTION idem_claim(text, text, text, interval);
DROP FUNCTION idem_claim(text, text, bytea, interval);

CREATE FUNCTION idem_claim(scope text, key text, request jsonb,
						   ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_jsonb'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- The request as JSON text; an untyped literal resolves to this one.
CREATE FUNCTION idem_claim(scope text, key text, request text,
						   ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_text'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_claim(scope text, key text, fingerprint bytea,
						   ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_bytea'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* idem_succeed gains a token: with one, it completes a multi-phase operation. */
DROP FUNCTION idem_succeed(text, text, int4, jsonb, jsonb);

CREATE FUNCTION idem_succeed(scope text, key text, status int4,
							 body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL,
							 token bigint DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_succeed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Gives a multi-phase operation up: the next claim takes it over at once. */
CREATE FUNCTION idem_release(scope text, key text, token bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release_token'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Commits a phase's progress, in the phase's own transaction. */
CREATE FUNCTION idem_checkpoint(scope text, key text, token bigint, recovery_point text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Heartbeat: the lease now lasts until now() + lease; returns the new expiry. */
CREATE FUNCTION idem_extend(scope text, key text, token bigint, lease interval)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* The idempotency key to send to an external provider for one step. */
CREATE FUNCTION idem_downstream_key(scope text, key text, label text)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_downstream_key'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

/* Who resolved which stuck operation, how, and when. */
CREATE TABLE idempotency.audit (
	at				timestamptz NOT NULL,
	actor			text NOT NULL,		-- session user
	action			text NOT NULL,		-- 'complete' | 'release'
	scope			text COLLATE "C" NOT NULL,
	key				text COLLATE "C" NOT NULL,
	token_before	int8 NOT NULL,
	token_after		int8 NOT NULL,
	status			int4,
	note			text
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.audit', '');

/*
 * Operations whose owner stopped renewing its lease more than
 * idempotency.stuck_after ago and that no retry has taken over.
 */
CREATE VIEW idem_stuck AS
SELECT scope, key, token, recovery_point,
	   now() - coalesce(claimed_at, created_at) AS owner_age,
	   now() - lease_expires_at AS lease_expired_for,
	   lease_expires_at, created_at
  FROM idempotency.records
 WHERE state = 'processing'
   AND lease_expires_at < now() - coalesce(current_setting('idempotency.stuck_after', true), '5min')::interval;

CREATE VIEW idem_audit AS
SELECT * FROM idempotency.audit;

/* Store a final response found by reconciliation; fences the old owner. */
CREATE FUNCTION idem_resolve_complete(scope text, key text, status int4,
									  body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL,
									  note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Release a stuck operation so the next retry takes it over; fences the old owner. */
CREATE FUNCTION idem_resolve_release(scope text, key text, note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Operations staff only: GRANT these to a role of your choice.
REVOKE ALL ON idem_stuck, idem_audit FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_resolve_complete(text, text, int4, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_resolve_release(text, text, text) FROM PUBLIC;

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
