/* idempotency--1.0.sql */

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * Private storage.  The records live in their own schema that no role but the
 * extension's owner can enter: stored responses may hold personal data.  The C
 * functions reach the table directly (heap and index access), so a caller
 * needs no privilege on it.
 */
CREATE SCHEMA idempotency;
REVOKE ALL ON SCHEMA idempotency FROM PUBLIC;

/*
 * One row per operation (scope, key).  scope leads the primary key so that a
 * tenant-prefixed scope can serve as a distribution key.  Keys compare
 * bytewise (COLLATE "C"): they are opaque identifiers, and the C code scans
 * the primary key with C-collation scan keys.
 *
 * The C code writes rows without running CHECK constraints; it validates every
 * value itself, so none are declared here.  Column order matters to
 * src/records.h (Anum_records_*).
 */
CREATE TABLE idempotency.records (
	scope				text COLLATE "C" NOT NULL,
	key					text COLLATE "C" NOT NULL,
	state				text NOT NULL,		-- 'completed' (multi-phase adds 'processing')
	fingerprint			bytea NOT NULL,		-- SHA-256 of the canonical request, or the caller's hash
	status				int4,				-- stored response
	headers				jsonb,
	body				jsonb,
	token				int8 NOT NULL,		-- fencing token; 1 for a first claim
	recovery_point		text,				-- multi-phase progress
	lease_expires_at	timestamptz,		-- multi-phase lease
	created_at			timestamptz NOT NULL,
	completed_at		timestamptz,
	expires_at			timestamptz NOT NULL,
	PRIMARY KEY (scope, key)
);

/*
 * Records are written in roughly expires_at order, so a BRIN index finds the
 * expired ones for a fraction of a btree's insert cost.
 */
CREATE INDEX records_expires_at_brin ON idempotency.records USING brin (expires_at);

-- pg_dump keeps the records, so deduplication survives a dump and restore.
SELECT pg_catalog.pg_extension_config_dump('idempotency.records', '');

/* What idem_claim returns. */
CREATE TYPE idem_claim_result AS (
	outcome			text,		-- 'claimed' | 'replay' | 'in_progress' | 'mismatch'
	status			int4,		-- stored response (replay)
	headers			jsonb,
	body			jsonb,
	retry_after		int4,		-- seconds (in_progress), at least 1
	token			int8,		-- fencing token (claimed)
	recovery_point	text		-- last committed recovery point (multi-phase takeover)
);

/* What an idem_execute handler returns. */
CREATE TYPE idem_response AS (
	status		int4,
	headers		jsonb,
	body		jsonb
);

/* What idem_execute returns: an HTTP-ready answer. */
CREATE TYPE idem_execute_result AS (
	status		int4,
	headers		jsonb,
	body		jsonb,
	replayed	boolean
);

CREATE FUNCTION idem_canonical(request jsonb)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_canonical'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

CREATE FUNCTION idem_fingerprint(request jsonb)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idem_fingerprint'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

/*
 * The claim functions are not STRICT: a NULL argument is a caller's bug and
 * gets an error (22004), not a silent NULL row.
 */
CREATE FUNCTION idem_claim(scope text, key text, request jsonb, ttl interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_jsonb'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- The request as JSON text; an untyped literal resolves to this one.
CREATE FUNCTION idem_claim(scope text, key text, request text, ttl interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_text'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_claim(scope text, key text, fingerprint bytea, ttl interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_bytea'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_succeed(scope text, key text, status int4, body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_succeed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_release(scope text, key text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_replay(scope text, key text,
							OUT state text, OUT status int4, OUT headers jsonb, OUT body jsonb,
							OUT created_at timestamptz, OUT completed_at timestamptz,
							OUT expires_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_replay'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;

CREATE FUNCTION idem_execute(scope text, key text, request jsonb, handler regprocedure, ttl interval DEFAULT NULL)
RETURNS idem_execute_result
AS 'MODULE_PATHNAME', 'idem_execute'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
