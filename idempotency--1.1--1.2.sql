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

-- (end of records section)

-- ---------------------------------------------------------------------------
-- Inbox.
-- ---------------------------------------------------------------------------

-- (end of inbox section)

-- ---------------------------------------------------------------------------
-- Outbox and relay.
-- ---------------------------------------------------------------------------

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

CREATE OR REPLACE VIEW idem_stuck AS
SELECT scope, key, token, recovery_point,
	   pg_catalog.now() OPERATOR(pg_catalog.-) coalesce(claimed_at, created_at) AS owner_age,
	   pg_catalog.now() OPERATOR(pg_catalog.-) lease_expires_at AS lease_expired_for,
	   lease_expires_at, created_at
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
