--
-- The relay's statements reach each claimed delivery through an index or
-- its TID, whatever the planner statistics say.  Statistics taken while the
-- outbox was idle (here: ANALYZE when every row is dead) describe the
-- deliveries as an empty table; a burst then arrives, and a plan chosen for
-- an empty table could read the whole backlog once per claimed row -- a
-- pass over 200 deliveries of a 2000-row backlog would read some 400,000
-- rows.  The rows a pass reads are counted in pg_stat_xact_user_tables, in
-- the pass's own transaction, so the test needs no timing.
--
CREATE TABLE plan_sink (event_id uuid);
CREATE FUNCTION plan_sink(event jsonb) RETURNS void LANGUAGE sql AS $$
	INSERT INTO plan_sink VALUES ((event->>'id')::uuid)
$$;
SELECT idem_destination_create('plans', 'function', 'plan_sink(jsonb)', '{plans}');
-- Autovacuum must not refresh the statistics behind the test's back.
ALTER TABLE idempotency.deliveries SET (autovacuum_enabled = off);
ALTER TABLE idempotency.outbox SET (autovacuum_enabled = off);

-- An idle outbox: 2000 events delivered and removed, the rows dead but
-- still on their pages, and ANALYZE sees none alive.
SELECT count(idem_publish('plans', jsonb_build_object('n', g))) FROM generate_series(1, 2000) g;
SELECT idem_outbox_relay(2000);
SET idempotency.outbox_retention = 0;
SELECT idem_outbox_cleanup(10000);
RESET idempotency.outbox_retention;
ANALYZE idempotency.deliveries, idempotency.outbox;
SELECT reltuples, relpages > 0 AS has_pages FROM pg_class
 WHERE oid IN ('idempotency.deliveries'::regclass, 'idempotency.outbox'::regclass) ORDER BY relname;

-- The pass's reads of each table: the difference of
-- pg_stat_xact_user_tables across the pass, within one transaction (the
-- view also holds earlier transactions' counts not yet reported).
CREATE FUNCTION pass_reads(max_events int, OUT relname name, OUT seq_tup_read bigint,
						   OUT idx_tup_fetch bigint, OUT attempted bigint)
RETURNS SETOF record LANGUAGE plpgsql AS $$
BEGIN
	CREATE TEMP TABLE reads_before AS
		SELECT s.relid, s.seq_tup_read, s.idx_tup_fetch FROM pg_stat_xact_user_tables s;
	attempted := idem_outbox_relay(max_events);
	RETURN QUERY
		SELECT a.relname, a.seq_tup_read - b.seq_tup_read, a.idx_tup_fetch - b.idx_tup_fetch, attempted
		  FROM pg_stat_xact_user_tables a JOIN reads_before b USING (relid)
		 WHERE a.relid IN ('idempotency.deliveries'::regclass, 'idempotency.outbox'::regclass)
		 ORDER BY a.relname;
	DROP TABLE reads_before;
END $$;

-- A burst of 2000 events without keys: a pass of 200 reads a few rows per
-- delivery (a bad plan: some 400,000).
SELECT count(idem_publish('plans', jsonb_build_object('n', g))) FROM generate_series(1, 2000) g;
SELECT relname, seq_tup_read, idx_tup_fetch < 200 * 10 AS bounded_by_the_pass, attempted
  FROM pass_reads(200);

-- The same statistics again (an idle outbox), then a burst over ten keys: a
-- pass claims the head of each key, then the deliveries that follow the
-- heads.  Finding the heads reads the due backlog once, so the bound is the
-- backlog plus the pass, not their product.
SELECT idem_outbox_relay(2000);
SET idempotency.outbox_retention = 0;
SELECT idem_outbox_cleanup(10000);
RESET idempotency.outbox_retention;
ANALYZE idempotency.deliveries, idempotency.outbox;
SELECT count(idem_publish('plans', jsonb_build_object('n', g), 'k' || g % 10))
  FROM generate_series(1, 2000) g;
SELECT relname, seq_tup_read, idx_tup_fetch < (2000 + 200) * 5 AS bounded_by_backlog_and_pass, attempted
  FROM pass_reads(200);
SELECT count(*) AS delivered FROM plan_sink;

-- When a claim finds fewer heads than its shares, the next ones walk each
-- destination's due deliveries only as far as a window (four times its
-- share, at least 64 deliveries), and look beyond it at most once a second.
-- Nothing may hide behind that window for longer: 100 deliveries of key
-- 'held' wait behind their head, which is not due (a failed attempt's
-- backoff, here set by hand), and fill the window of a pass of 5; an event
-- without a key, published after them, goes in a pass a second later.
SELECT idem_outbox_relay(2000);
SELECT idem_outbox_relay(5) AS empty_pass;
SELECT count(idem_publish('plans', jsonb_build_object('n', g), 'held')) FROM generate_series(1, 100) g;
UPDATE idempotency.deliveries SET next_attempt_at = now() + interval '1 hour'
 WHERE key = 'held' AND seq = (SELECT min(seq) FROM idempotency.deliveries WHERE key = 'held');
SELECT idem_publish('plans', '{"late": true}') IS NOT NULL AS published;
SELECT pg_sleep(1.1);
SELECT idem_outbox_relay(5) AS attempted;
SELECT count(*) FILTER (WHERE o.payload ? 'late') AS late_delivered,
	   count(*) FILTER (WHERE o.key = 'held') AS held_delivered
  FROM idempotency.deliveries x JOIN idempotency.outbox o USING (event_id)
 WHERE x.state = 'delivered' AND (o.key = 'held' OR o.payload ? 'late');

-- Nor may a key whose long backlog fills the window hold back the keys and
-- events behind it: at least once a second a windowed pass also takes heads
-- from beyond the window (with the rest of its room).  1000 deliveries of
-- key 'hot', then five later events (two of key 'cold', three without a
-- key); after a second, a pass of 10 takes the later ones along: the head of
-- 'hot' in the window, then beyond it the head of 'cold' and the three
-- without a key, then the followers of 'hot' (three) and of 'cold' (one).
DELETE FROM idempotency.deliveries WHERE key = 'held';
SELECT count(idem_publish('plans', jsonb_build_object('n', g), 'hot')) FROM generate_series(1, 1000) g;
SELECT count(idem_publish('plans', jsonb_build_object('later', g), CASE WHEN g <= 2 THEN 'cold' END))
  FROM generate_series(1, 5) g;
SELECT pg_sleep(1.1);
SELECT idem_outbox_relay(10) AS attempted;
SELECT count(*) FILTER (WHERE o.payload ? 'later') > 0 AS later_ones_delivered,
	   count(*) FILTER (WHERE o.key = 'hot') > 0 AS hot_ones_delivered
  FROM idempotency.deliveries x JOIN idempotency.outbox o USING (event_id)
 WHERE x.state = 'delivered' AND (o.key = 'hot' OR o.payload ? 'later');

-- A pass reads the destinations that have something to deliver, not every
-- destination: with 300 more destinations to which no event goes, a pass
-- of 20 deliveries to 'plans' reads the row of 'plans' by primary key a
-- few times per delivery, not the 300 others (reading each destination
-- cost a claim with 1,000 idle destinations more than the webhook it sent).
SELECT idem_outbox_relay(2000);
SELECT count(idem_destination_create('idle' || g, 'function', 'plan_sink(jsonb)', ARRAY['idle' || g]))
  FROM generate_series(1, 300) g;
SELECT count(idem_publish('plans', jsonb_build_object('n', g))) FROM generate_series(1, 20) g;
CREATE FUNCTION destination_reads(max_events int, OUT reads bigint, OUT attempted bigint)
LANGUAGE plpgsql AS $$
DECLARE
	before bigint;
BEGIN
	SELECT s.seq_tup_read + coalesce(s.idx_tup_fetch, 0) INTO before
	  FROM pg_stat_xact_user_tables s WHERE s.relid = 'idempotency.destinations'::regclass;
	attempted := idem_outbox_relay(max_events);
	SELECT s.seq_tup_read + coalesce(s.idx_tup_fetch, 0) - before INTO reads
	  FROM pg_stat_xact_user_tables s WHERE s.relid = 'idempotency.destinations'::regclass;
END $$;
SELECT reads < 100 AS not_every_destination, attempted FROM destination_reads(100);
SELECT count(idem_destination_drop('idle' || g)) FROM generate_series(1, 300) g;
DROP FUNCTION destination_reads(int);

ALTER TABLE idempotency.deliveries RESET (autovacuum_enabled);
ALTER TABLE idempotency.outbox RESET (autovacuum_enabled);
SELECT idem_destination_drop('plans');
TRUNCATE idempotency.outbox, idempotency.deliveries;
DROP TABLE plan_sink;
DROP FUNCTION pass_reads(int);
DROP FUNCTION plan_sink(jsonb);
