/* idempotency--1.2--1.3.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.3'" to load this file. \quit

/*
 * Version 1.3: the relay isolates destinations.  Every function and operator
 * below is schema-qualified (PostgreSQL's "Security Considerations for
 * Extension Scripts").
 */

-- ---------------------------------------------------------------------------
-- Outbox and relay: per-destination concurrency, timeouts, Retry-After,
-- circuit breaking.
-- ---------------------------------------------------------------------------

/*
 * The options of an 'http' destination that 1.3 added, normalised like the
 * others (the relay reads these columns; options keeps what was given).
 * Destinations made before 1.3 get the defaults.
 */
ALTER TABLE idempotency.destinations
	ADD COLUMN max_in_flight		int4 NOT NULL DEFAULT 16,		-- requests open to the endpoint at once
	ADD COLUMN connect_timeout_ms	int8 NOT NULL DEFAULT 5000,		-- connecting, within timeout_ms
	ADD COLUMN failure_threshold	int4 NOT NULL DEFAULT 10,		-- consecutive failures that open the circuit
	ADD COLUMN disable_after_ms		int8 NOT NULL DEFAULT 259200000; -- failing this long while open: disabled

/*
 * The state of an 'http' destination's endpoint, kept here so that a restart
 * keeps it.  The relay writes it only when it changes: a healthy endpoint
 * costs no write.
 *   circuit				'closed' (deliveries flow) or 'open' (one probe at a
 *							time, at next_probe_at)
 *   consecutive_failures	failed attempts since the last success
 *   failing_since			the first of those failures
 *   next_probe_at			while open: when the next probe may go
 *   paced_until			a 429 or 503 with Retry-After asked to wait until then
 */
ALTER TABLE idempotency.destinations
	ADD COLUMN circuit				text NOT NULL DEFAULT 'closed',
	ADD COLUMN consecutive_failures	int4 NOT NULL DEFAULT 0,
	ADD COLUMN failing_since		timestamptz,
	ADD COLUMN next_probe_at		timestamptz,
	ADD COLUMN paced_until			timestamptz;

/* idem_outbox_stats shows the endpoint's state (new columns at the end). */
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
	   s.last_delivered_at,
	   d.circuit,
	   d.consecutive_failures,
	   d.failing_since,
	   d.next_probe_at,
	   d.paced_until
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
		   AND (x.state OPERATOR(pg_catalog.=) 'pending'
				OR x.state OPERATOR(pg_catalog.=) 'dead')) q ON true;

/*
 * The relay's "when next": each destination's earliest pending delivery,
 * one index probe per destination (in (next_attempt_at, seq) order, which
 * deliveries_due cannot give: the relay's statements run without sorts, so
 * the planner cannot take deliveries_due instead, whatever the statistics
 * say).  deliveries_due alone orders every
 * destination's deliveries together, and finding the earliest of those that
 * may be claimed meant walking past the whole due backlog of a destination
 * whose requests are all in flight, on every iteration of the relay's loop.
 */
CREATE INDEX deliveries_due_by_destination ON idempotency.deliveries (destination_id, next_attempt_at, seq)
	WHERE state OPERATOR(pg_catalog.=) 'pending';

/*
 * The relay claims destination by destination, through
 * deliveries_due_by_destination: nothing reads deliveries_due any more, and
 * every claim and every outcome recorded would still pay for its entries.
 */
DROP INDEX idempotency.deliveries_due;

/*
 * Per-key order asks "is an earlier delivery of this key undelivered?",
 * which only a keyed delivery asks.  deliveries_undelivered held every
 * undelivered delivery, and no claim is a HOT update (it moves
 * next_attempt_at), so each claim of a delivery without a key paid for an
 * entry nobody reads (about a tenth of the relay's work per webhook, and
 * of the WAL).  The keyed ones keep theirs; idem_outbox_stats counts the
 * backlog through deliveries_due_by_destination and the dead letters,
 * which are few, through deliveries_dead.
 */
DROP INDEX idempotency.deliveries_undelivered;
CREATE INDEX deliveries_undelivered ON idempotency.deliveries (destination_id, key, seq)
	WHERE key IS NOT NULL AND state OPERATOR(pg_catalog.<>) 'delivered';
CREATE INDEX deliveries_dead ON idempotency.deliveries (destination_id)
	WHERE state OPERATOR(pg_catalog.=) 'dead';

/*
 * Each delivery is updated twice (claimed, then its outcome recorded), and
 * a burst is published into full pages: every new row version went to a
 * new page at the end of the table, extended one page at a time.  Room left
 * in each page keeps the new versions on their page (where pruning frees
 * the dead ones again), and the table from growing through a burst.
 * Existing pages get it as they are rewritten or vacuumed.
 */
ALTER TABLE idempotency.deliveries SET (fillfactor = 70);

-- (end of outbox section)
