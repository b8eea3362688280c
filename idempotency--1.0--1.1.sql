/* idempotency--1.0--1.1.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

/*
 * Every function and operator is schema-qualified (pg_catalog.now(),
 * OPERATOR(pg_catalog.=)): this script runs with the extension's schema on
 * the search_path, where another role may have planted look-alikes.
 */

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
	   pg_catalog.now() OPERATOR(pg_catalog.-) coalesce(claimed_at, created_at) AS owner_age,
	   pg_catalog.now() OPERATOR(pg_catalog.-) lease_expires_at AS lease_expired_for,
	   lease_expires_at, created_at
  FROM idempotency.records
 WHERE state OPERATOR(pg_catalog.=) 'processing'
   AND lease_expires_at OPERATOR(pg_catalog.<)
	   (pg_catalog.now() OPERATOR(pg_catalog.-)
		coalesce(pg_catalog.current_setting('idempotency.stuck_after', true), '5min')::pg_catalog.interval);

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

-- Transactional outbox and relay

/*
 * Events written by idem_publish in the publisher's transaction.  seq orders
 * events: publishers of the same key take the key's lock before drawing it,
 * so same-key events commit in seq order.  The C code writes these tables
 * directly (heap and index access), without CHECK constraints, foreign keys
 * or triggers; column order matters to src/outbox.h.
 */
CREATE SEQUENCE idempotency.outbox_seq;

CREATE TABLE idempotency.outbox (
	event_id		uuid PRIMARY KEY,	-- UUIDv7, the id every consumer deduplicates on
	seq				int8 NOT NULL,
	topic			text NOT NULL,
	key				text COLLATE "C",	-- per-key ordering; NULL: unordered
	payload			jsonb NOT NULL,
	headers			jsonb,				-- object of strings, or NULL
	published_at	timestamptz NOT NULL
);
-- Retention cleanup finds old events by publication time.
CREATE INDEX outbox_published_at_brin ON idempotency.outbox USING brin (published_at);

/*
 * Where events go.  Managed only through idem_destination_*(): options keeps
 * what is not secret (for display), secrets and headers (which may carry
 * credentials) are kept apart so that views never show them.  The relay reads
 * the normalised columns.  Deliveries refer to a destination by id, so that a
 * destination dropped and re-created under the same name never inherits its
 * predecessor's deliveries.
 */
CREATE SEQUENCE idempotency.destination_id_seq AS int4;

CREATE TABLE idempotency.destinations (
	id					int4 PRIMARY KEY
							DEFAULT pg_catalog.nextval('idempotency.destination_id_seq'::pg_catalog.regclass),
	name				text NOT NULL UNIQUE,
	kind				text NOT NULL,		-- 'notify' | 'function' | 'http'
	target				text NOT NULL,		-- channel, function signature, or URL
	topics				text[] NOT NULL,	-- 'x' exactly, 'x*' by prefix, '*' all
	func				regprocedure,		-- kind 'function': the function called
	run_as				regrole NOT NULL,	-- role that created it: functions run as this role
	search_path			text NOT NULL,		-- creator's search_path, for function calls
	options				jsonb NOT NULL,		-- the non-secret options as given
	secrets				text[],				-- kind 'http': whsec_ signing secrets
	headers				jsonb,				-- kind 'http': extra request headers
	max_attempts		int4 NOT NULL,
	backoff_base_ms		int8 NOT NULL,
	backoff_cap_ms		int8 NOT NULL,
	timeout_ms			int8 NOT NULL,
	paused				boolean NOT NULL DEFAULT false,
	disabled_at			timestamptz,		-- set when an http endpoint answered 410
	disabled_reason		text,
	created_at			timestamptz NOT NULL DEFAULT pg_catalog.now()
);
ALTER SEQUENCE idempotency.destination_id_seq OWNED BY idempotency.destinations.id;

/*
 * One row per (event, destination), written at publish time in the
 * publisher's transaction.  event_id leads the primary key so that retention
 * cleanup finds an event's remaining deliveries.  While a delivery is claimed,
 * next_attempt_at is its visibility deadline and visible_until says so; a
 * relay that dies leaves it to be claimed again after that deadline.
 */
CREATE TABLE idempotency.deliveries (
	event_id			uuid NOT NULL,
	destination_id		int4 NOT NULL,
	seq					int8 NOT NULL,
	key					text COLLATE "C",
	state				text NOT NULL,		-- 'pending' | 'delivered' | 'dead'
	attempts			int4 NOT NULL,
	next_attempt_at		timestamptz NOT NULL,
	visible_until		timestamptz,		-- set while claimed: the outcome is not recorded yet
	first_attempt_at	timestamptz,
	last_attempt_at		timestamptz,
	delivered_at		timestamptz,
	last_status			int4,				-- HTTP status of the last attempt
	last_error			text,
	PRIMARY KEY (event_id, destination_id)
);
-- The relay's claim: due pending deliveries, oldest first.
CREATE INDEX deliveries_due ON idempotency.deliveries (next_attempt_at)
	WHERE state OPERATOR(pg_catalog.=) 'pending';
-- Per-key order: is an earlier delivery of this key still undelivered?  Also
-- each destination's backlog and dead letters, for idem_outbox_stats.
CREATE INDEX deliveries_undelivered ON idempotency.deliveries (destination_id, key, seq)
	WHERE state OPERATOR(pg_catalog.<>) 'delivered';
-- Retention cleanup.
CREATE INDEX deliveries_delivered_at ON idempotency.deliveries (delivered_at)
	WHERE state OPERATOR(pg_catalog.=) 'delivered';

/*
 * Counters of each destination since its creation.  Each relay pass appends
 * one row of increments per destination instead of updating a shared row, so
 * concurrent relays never wait for each other here; cleanup folds the rows
 * of a destination into one, and the view sums them.
 */
CREATE TABLE idempotency.destination_stats (
	destination_id		int4 NOT NULL,
	delivered			int8 NOT NULL DEFAULT 0,
	retried				int8 NOT NULL DEFAULT 0,	-- failed attempts rescheduled
	dead_lettered		int8 NOT NULL DEFAULT 0,
	redelivered			int8 NOT NULL DEFAULT 0,	-- attempts repeated after an interrupted one
	latency_sum_us		int8 NOT NULL DEFAULT 0,	-- publish to delivery, over delivered
	last_latency_us		int8,
	last_delivered_at	timestamptz
);
CREATE INDEX destination_stats_destination ON idempotency.destination_stats (destination_id);

SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_seq', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.destination_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.destinations', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.deliveries', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.destination_stats', '');

/* Writes an event in the caller's transaction; callable by every role. */
CREATE FUNCTION idem_publish(topic text, payload jsonb, key text DEFAULT NULL,
							 headers jsonb DEFAULT NULL)
RETURNS uuid
AS 'MODULE_PATHNAME', 'idem_publish'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_destination_create(name text, kind text, target text,
										topics text[] DEFAULT '{*}',
										options jsonb DEFAULT '{}')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_create'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Replaces the options of a destination (secret rotation, retry policy). */
CREATE FUNCTION idem_destination_alter(name text, options jsonb)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_alter'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_destination_drop(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_drop'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_destination_pause(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_pause'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_destination_resume(name text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_resume'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* One relay pass in the caller's transaction; returns the deliveries attempted. */
CREATE FUNCTION idem_outbox_relay(max_events int4 DEFAULT 1000)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_outbox_relay'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Removes delivered events older than idempotency.outbox_retention. */
CREATE FUNCTION idem_outbox_cleanup(batch int4 DEFAULT 10000)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_outbox_cleanup'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Dead letters back to pending, keeping their event id. */
CREATE FUNCTION idem_outbox_redrive(event_id uuid, destination text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_outbox_redrive'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_outbox_redrive_dead(destination text, since timestamptz DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_outbox_redrive_dead'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* The envelope of one event: how a NOTIFY consumer reads a reference back. */
CREATE FUNCTION idem_outbox_event(event_id uuid)
RETURNS jsonb
AS 'MODULE_PATHNAME', 'idem_outbox_event'
LANGUAGE C STABLE PARALLEL RESTRICTED;

/* Destinations as configured, without secrets or header values. */
CREATE VIEW idem_destinations AS
SELECT name, kind, target, topics, options,
	   (SELECT pg_catalog.array_agg(h ORDER BY h) FROM pg_catalog.jsonb_object_keys(headers) h) AS header_names,
	   coalesce(pg_catalog.cardinality(secrets), 0) AS secret_count,
	   paused, disabled_at, disabled_reason, created_at
  FROM idempotency.destinations;

/* Per-destination delivery statistics. */
CREATE VIEW idem_outbox_stats AS
SELECT d.name AS destination, d.kind,
	   CASE WHEN d.disabled_at IS NOT NULL THEN 'disabled'
			WHEN d.paused THEN 'paused' ELSE 'active' END AS status,
	   coalesce(s.delivered, 0) AS delivered,
	   coalesce(s.retried, 0) AS retried,
	   coalesce(s.dead_lettered, 0) AS dead_lettered,
	   q.dead,
	   q.backlog,
	   pg_catalog.now() OPERATOR(pg_catalog.-) q.oldest_pending AS oldest_pending_age,
	   coalesce(s.redelivered, 0) AS redelivered,
	   CASE WHEN s.delivered OPERATOR(pg_catalog.>) 0::pg_catalog.numeric
			THEN pg_catalog.make_interval(secs => ((s.latency_sum_us OPERATOR(pg_catalog./) s.delivered)
												   OPERATOR(pg_catalog./) 1e6)::pg_catalog.float8)
	   END AS avg_latency,
	   pg_catalog.make_interval(secs => (s.last_latency_us::pg_catalog.numeric
										 OPERATOR(pg_catalog./) 1e6)::pg_catalog.float8) AS last_latency,
	   s.last_delivered_at
  FROM idempotency.destinations d
  LEFT JOIN LATERAL (
		SELECT pg_catalog.sum(delivered) AS delivered, pg_catalog.sum(retried) AS retried,
			   pg_catalog.sum(dead_lettered) AS dead_lettered,
			   pg_catalog.sum(redelivered) AS redelivered,
			   pg_catalog.sum(latency_sum_us) AS latency_sum_us,
			   (pg_catalog.array_agg(last_latency_us
									 ORDER BY last_delivered_at DESC NULLS LAST))[1] AS last_latency_us,
			   pg_catalog.max(last_delivered_at) AS last_delivered_at
		  FROM idempotency.destination_stats
		 WHERE destination_id OPERATOR(pg_catalog.=) d.id) s ON true
  LEFT JOIN LATERAL (
		SELECT pg_catalog.count(*) FILTER (WHERE x.state OPERATOR(pg_catalog.=) 'pending') AS backlog,
			   pg_catalog.count(*) FILTER (WHERE x.state OPERATOR(pg_catalog.=) 'dead') AS dead,
			   pg_catalog.min(o.published_at)
				   FILTER (WHERE x.state OPERATOR(pg_catalog.=) 'pending') AS oldest_pending
		  FROM idempotency.deliveries x
		  JOIN idempotency.outbox o ON o.event_id OPERATOR(pg_catalog.=) x.event_id
		 WHERE x.destination_id OPERATOR(pg_catalog.=) d.id
		   AND x.state OPERATOR(pg_catalog.<>) 'delivered') q ON true;

/* Dead letters, for inspection before a redrive. */
CREATE VIEW idem_outbox_dead AS
SELECT d.name AS destination, x.event_id, o.topic, o.key, x.attempts, x.last_status,
	   x.last_error, x.first_attempt_at, x.last_attempt_at, o.published_at
  FROM idempotency.deliveries x
  JOIN idempotency.destinations d ON d.id OPERATOR(pg_catalog.=) x.destination_id
  JOIN idempotency.outbox o ON o.event_id OPERATOR(pg_catalog.=) x.event_id
 WHERE x.state OPERATOR(pg_catalog.=) 'dead';

-- Operators only: the extension owner grants these to a role of its choice.
REVOKE ALL ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_destination_alter(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_destination_drop(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_destination_pause(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_destination_resume(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_outbox_relay(int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_outbox_cleanup(int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_outbox_redrive(uuid, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_outbox_redrive_dead(text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_outbox_event(uuid) FROM PUBLIC;
REVOKE ALL ON idem_destinations, idem_outbox_stats, idem_outbox_dead FROM PUBLIC;
