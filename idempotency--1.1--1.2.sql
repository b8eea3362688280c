/* idempotency--1.1--1.2.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * Version 1.2: the trust release.  Every function and operator below is
 * schema-qualified (PostgreSQL's "Security Considerations for Extension
 * Scripts"): this script runs with the extension's schema first on the
 * search_path, where another role may have planted look-alikes.
 */

-- ---------------------------------------------------------------------------
-- Records, claims and multi-phase operations: owners, fencing tokens that
-- never repeat, the lock key.
-- ---------------------------------------------------------------------------

/*
 * The role that claimed a record (current_user at the claim): only it, the
 * roles that have its privileges, and superusers may replay, complete,
 * checkpoint, extend, release or take over the record.  Records written
 * before 1.2 have none and stay open to every role until they expire.
 * regrole, so that pg_dump writes the role's name, not its OID.  Column
 * order matters to src/records.h (Anum_records_*).
 */
ALTER TABLE idempotency.records ADD COLUMN owner pg_catalog.regrole;

/*
 * Fencing tokens of multi-phase operations, for the whole database: a token
 * is never handed out twice for a key, even after its record expired and was
 * deleted.  Version 1.1 counted tokens per key from 1; starting above 2^32
 * keeps every token it handed out from coming back.  Dumped, so that a
 * restore goes on from where the tokens were.
 */
CREATE SEQUENCE idempotency.tokens AS pg_catalog.int8 START WITH 4294967296;
SELECT pg_catalog.pg_extension_config_dump('idempotency.tokens', '');

/*
 * The key of the hash that maps a key to its advisory lock (src/lockhash.c):
 * 128 random bits, so that nobody outside can compute which keys share a
 * lock.  Not dumped: a restored database draws a new one, which is as good.
 */
CREATE TABLE idempotency.lock_key (
	key		pg_catalog.bytea NOT NULL
);
INSERT INTO idempotency.lock_key
SELECT pg_catalog.substring(
		 pg_catalog.sha256(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
						   OPERATOR(pg_catalog.||)
						   pg_catalog.uuid_send(pg_catalog.gen_random_uuid())),
		 1, 16);

/* The audit names the role a resolution ran as, and who had logged in. */
ALTER TABLE idempotency.audit ADD COLUMN session_actor pg_catalog.text;
CREATE OR REPLACE VIEW idem_audit AS
SELECT at, actor, action, scope, key, token_before, token_after, status, note,
	   session_actor
  FROM idempotency.audit;

/* idem_stats gains the count of calls refused another role's key (42501). */
DROP VIEW @extschema@.idem_stats;
DROP FUNCTION @extschema@.idem_stats();
CREATE FUNCTION idem_stats(
	OUT datname name,
	OUT claims int8,
	OUT replays int8,
	OUT mismatches int8,
	OUT in_progress int8,
	OUT takeovers int8,
	OUT fenced int8,
	OUT denied int8,
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
CREATE VIEW idem_stats AS SELECT * FROM @extschema@.idem_stats();
GRANT SELECT ON @extschema@.idem_stats TO PUBLIC;

-- (end of records section)

-- ---------------------------------------------------------------------------
-- Inbox.
-- ---------------------------------------------------------------------------

/* The role that accepted a message; NULL for marks written before 1.2. */
ALTER TABLE idempotency.inbox ADD COLUMN owner pg_catalog.regrole;

-- (end of inbox section)

-- ---------------------------------------------------------------------------
-- Outbox and relay.
-- ---------------------------------------------------------------------------

/*
 * How many times a delivery was claimed, ever: a claim's fencing token.  A
 * relay records its outcome, renews its claim or re-locks the delivery only
 * while the counter is still the one its claim set.  attempts could not
 * serve: a redrive resets it and a claim given back unattempted takes its
 * attempt back, so a relay whose claim was lost long ago could find its
 * number current again and record a stale outcome over a newer claim.
 */
ALTER TABLE idempotency.deliveries ADD COLUMN claims int8 NOT NULL DEFAULT 0;

-- (end of outbox section)

-- ---------------------------------------------------------------------------
-- Views of 1.1 re-created with schema-qualified functions and operators, so
-- that an installation made before 1.2 no longer binds look-alikes.
-- ---------------------------------------------------------------------------

/*
 * The scripts of 1.1 called some functions and operators unqualified with
 * argument types that pg_catalog's do not match exactly (make_interval(secs
 * numeric), cardinality(text[]), array_agg(text), numeric > int4,
 * nextval(unknown)): a role allowed to create objects in the extension's
 * schema could have planted better matches there before the installation,
 * and the views and the column default bound them.  These are the same
 * definitions as idempotency--1.0--1.1.sql has now, every name qualified;
 * their columns and results are unchanged.  idem_audit and idem_stats call
 * nothing of pg_catalog, and the index predicates compare text with text,
 * which nothing in another schema can match better: nothing to repair there.
 */
ALTER TABLE idempotency.destinations
	ALTER COLUMN id SET DEFAULT pg_catalog.nextval('idempotency.destination_id_seq'::pg_catalog.regclass),
	ALTER COLUMN created_at SET DEFAULT pg_catalog.now();

-- idem_stuck also shows whose operation is stuck (the owner column of 1.2).
CREATE OR REPLACE VIEW idem_stuck AS
SELECT scope, key, token, recovery_point,
	   pg_catalog.now() OPERATOR(pg_catalog.-) coalesce(claimed_at, created_at) AS owner_age,
	   pg_catalog.now() OPERATOR(pg_catalog.-) lease_expires_at AS lease_expired_for,
	   lease_expires_at, created_at, owner
  FROM idempotency.records
 WHERE state OPERATOR(pg_catalog.=) 'processing'
   AND lease_expires_at OPERATOR(pg_catalog.<)
	   (pg_catalog.now() OPERATOR(pg_catalog.-)
		coalesce(pg_catalog.current_setting('idempotency.stuck_after', true), '5min')::pg_catalog.interval);

CREATE OR REPLACE VIEW idem_destinations AS
SELECT name, kind, target, topics, options,
	   (SELECT pg_catalog.array_agg(h ORDER BY h) FROM pg_catalog.jsonb_object_keys(headers) h) AS header_names,
	   coalesce(pg_catalog.cardinality(secrets), 0) AS secret_count,
	   paused, disabled_at, disabled_reason, created_at
  FROM idempotency.destinations;

CREATE OR REPLACE VIEW idem_outbox_stats AS
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

CREATE OR REPLACE VIEW idem_outbox_dead AS
SELECT d.name AS destination, x.event_id, o.topic, o.key, x.attempts, x.last_status,
	   x.last_error, x.first_attempt_at, x.last_attempt_at, o.published_at
  FROM idempotency.deliveries x
  JOIN idempotency.destinations d ON d.id OPERATOR(pg_catalog.=) x.destination_id
  JOIN idempotency.outbox o ON o.event_id OPERATOR(pg_catalog.=) x.event_id
 WHERE x.state OPERATOR(pg_catalog.=) 'dead';

-- (end of views section)
