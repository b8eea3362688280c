--
-- Transactional outbox: idem_publish writes in the caller's transaction, the
-- relay (one pass = idem_outbox_relay()) delivers what committed to 'notify'
-- and 'function' destinations, in per-key order, with retries, dead letters
-- and redrive.  Event ids and times vary from run to run, so only their
-- shape is shown.
--
CREATE TABLE sink (n serial PRIMARY KEY, via text, topic text, key text, payload jsonb, event_id uuid, runner text);
CREATE FUNCTION to_sink(event jsonb) RETURNS void LANGUAGE sql AS $$
	INSERT INTO sink (via, topic, key, payload, event_id, runner)
	VALUES ('to_sink', event->>'topic', event->>'key', event->'payload', (event->>'id')::uuid, current_user)
$$;
-- Fails while the flag says so, else delivers.
CREATE TABLE flaky_flag (fail boolean);
INSERT INTO flaky_flag VALUES (true);
CREATE FUNCTION flaky(event jsonb) RETURNS int LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO sink (via, topic, key, payload) VALUES ('flaky', event->>'topic', event->>'key', event->'payload');
	IF (SELECT fail FROM flaky_flag) THEN
		RAISE EXCEPTION 'flaky is down for %', event->>'topic';
	END IF;
	RETURN 1;
END $$;

-- Destinations: every topic, a prefix, a list.
SELECT idem_destination_create('all', 'function', 'to_sink(jsonb)');
SELECT idem_destination_create('orders', 'function', 'flaky(jsonb)', '{order.*}',
	'{"max_attempts": 3, "backoff_base": "1ms", "backoff_cap": 0.001}');
SELECT idem_destination_create('chan', 'notify', 'outbox_events', '{order.created,big}');
SELECT name, kind, target, topics, options, header_names, secret_count, paused, disabled_at
  FROM idem_destinations ORDER BY name;

-- Nothing is written to deliver unless the publishing transaction commits.
BEGIN;
SELECT idem_publish('order.created', '{"order": 1}', 'order-1') IS NOT NULL AS published;
ROLLBACK;
BEGIN;
SAVEPOINT s;
SELECT idem_publish('order.created', '{"order": 1}', 'order-1') IS NOT NULL AS published;
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT count(*) AS events, (SELECT count(*) FROM idempotency.deliveries) AS deliveries
  FROM idempotency.outbox;

-- A committed event: a UUIDv7 id, one delivery per matching destination.
SELECT idem_publish('order.created', '{"order": 1}', 'order-1',
					'{"traceparent": "00-abc-def-01"}') AS e1 \gset
SELECT substr(:'e1', 15, 1) AS uuid_version,
	   substr(:'e1', 20, 1) IN ('8', '9', 'a', 'b') AS rfc_variant;
SELECT d.name, x.state, x.attempts, x.key, x.seq > 0 AS has_seq
  FROM idempotency.deliveries x JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE x.event_id = :'e1' ORDER BY d.name;
SELECT idem_publish('user.created', '{"user": 7}') IS NOT NULL AS published;
SELECT idem_publish('big', jsonb_build_object('blob', repeat('x', 9000))) AS big \gset
SELECT o.topic, array_agg(d.name ORDER BY d.name) AS destinations
  FROM idempotency.outbox o
  JOIN idempotency.deliveries x USING (event_id)
  JOIN idempotency.destinations d ON d.id = x.destination_id
 GROUP BY o.topic ORDER BY o.topic;

-- The envelope, as function destinations get it and NOTIFY consumers read it back.
SELECT jsonb_build_object('topic', e->'topic', 'key', e->'key', 'payload', e->'payload',
						  'headers', e->'headers') AS envelope,
	   e->>'id' = :'e1' AS same_id, (e->>'published_at')::timestamptz <= now() AS published_at
  FROM idem_outbox_event(:'e1') e;
SELECT idem_outbox_event('00000000-0000-0000-0000-000000000000') IS NULL AS unknown_is_null;

-- One relay pass, with this session listening on the 'notify' channel.  psql
-- prints notifications after the relay's transaction commits; they go to a
-- file with the query output, which is read back with ids, PIDs and times
-- masked.  The large event (over NOTIFY's 8000 bytes) is sent as a
-- reference, which the consumer reads back with idem_outbox_event.  The
-- 'orders' function fails (flaky_flag), so order.created is rescheduled there.
SELECT '/tmp/idem_outbox_notify_' || pg_backend_pid() || '.out' AS notify_file \gset
LISTEN outbox_events;
\o :notify_file
SELECT idem_outbox_relay() AS attempted;
\o
UNLISTEN *;
SELECT regexp_replace(regexp_replace(regexp_replace(pg_read_file(:'notify_file'),
		'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', '<id>', 'g'),
		'PID [0-9]+', 'PID <pid>', 'g'),
		'"published_at": "[^"]*"', '"published_at": "<time>"', 'g') AS psql_output;
\setenv NOTIFY_FILE :notify_file
\! rm -f "$NOTIFY_FILE"
SELECT length(idem_outbox_event(:'big')->'payload'->>'blob') AS blob_length_read_back;
SELECT via, topic, key, left(payload::text, 20) AS payload, event_id = :'e1' AS e1, runner
  FROM sink ORDER BY n;
SELECT d.name, x.state, x.attempts, x.last_error, x.visible_until IS NULL AS recorded,
	   x.delivered_at IS NOT NULL AS has_delivered_at
  FROM idempotency.deliveries x JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE x.event_id = :'e1' ORDER BY d.name;

-- Per-key order: order-1's second event waits while its first is undelivered
-- at 'orders' (the relay claims it behind the first, and gives the claim
-- back when the first fails: attempts 0); another key and an unkeyed event
-- are not held up.  (Each pg_sleep outlasts the 1ms backoff cap of
-- 'orders'.)  A failing call is rolled back: flaky's own insert into sink
-- leaves no row.
SELECT idem_publish('order.paid', '{"order": 1}', 'order-1') IS NOT NULL AS published;
SELECT idem_publish('order.created', '{"order": 2}', 'order-2') IS NOT NULL AS published;
SELECT idem_publish('order.note', '{"order": 0}') IS NOT NULL AS published;
SELECT pg_sleep(0.01);
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, key, payload FROM sink WHERE via = 'flaky' ORDER BY n;
SELECT o.topic, o.key, x.state, x.attempts, x.last_error
  FROM idempotency.deliveries x
  JOIN idempotency.outbox o USING (event_id)
  JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE d.name = 'orders' ORDER BY o.seq;
SELECT destination, delivered, retried, dead_lettered, dead, backlog,
	   oldest_pending_age > '0'::interval AS has_age
  FROM idem_outbox_stats WHERE destination = 'orders';

-- The third failure is order-1's first event's last attempt: it is dead.
SELECT pg_sleep(0.01);
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, key FROM sink WHERE via = 'flaky' ORDER BY n;
SELECT destination, topic, key, attempts, last_error FROM idem_outbox_dead;

-- 'orders' is back: order-2 and the unkeyed event go through, but order-1
-- stays blocked behind its dead letter.
UPDATE flaky_flag SET fail = false;
SELECT pg_sleep(0.01);
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, key FROM sink WHERE via = 'flaky' ORDER BY n;
SELECT pg_sleep(0.01);
SELECT idem_outbox_relay() AS attempted_while_blocked;
SELECT destination, delivered, retried, dead_lettered, dead, backlog
  FROM idem_outbox_stats WHERE destination = 'orders';

-- Redrive keeps the event id: the dead letter is delivered first, then the
-- event that waited behind it, in the same pass (a relay that claims the
-- first delivery of a key takes the ones that follow, in order).
SELECT idem_outbox_redrive(:'e1', 'orders') AS redriven;
SELECT idem_outbox_redrive(:'e1', 'orders') AS redriven_again;
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT idem_outbox_relay() AS attempted;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, key, payload FROM sink WHERE via = 'flaky' ORDER BY n;
SELECT o.topic, o.key, x.state, x.attempts, o.event_id = :'e1' AS e1
  FROM idempotency.deliveries x
  JOIN idempotency.outbox o USING (event_id)
  JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE d.name = 'orders' ORDER BY o.seq;
SELECT destination, delivered, retried, dead_lettered, dead, backlog, oldest_pending_age,
	   avg_latency > '0'::interval AS has_latency, redelivered
  FROM idem_outbox_stats ORDER BY destination;

-- A relay that died after its claim committed never recorded the outcome:
-- after the visibility deadline the delivery is claimed again, and the
-- repeat is counted as a possible duplicate ('redelivered').
SELECT idem_publish('user.deleted', '{"user": 7}') AS e2 \gset
UPDATE idempotency.deliveries
   SET attempts = 1, next_attempt_at = now() - '1 second'::interval,
	   visible_until = now() - '1 second'::interval
 WHERE event_id = :'e2';
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, event_id = :'e2' AS e2 FROM sink;
SELECT state, attempts, visible_until FROM idempotency.deliveries WHERE event_id = :'e2';
SELECT destination, delivered, redelivered FROM idem_outbox_stats WHERE destination = 'all';

-- A delivery whose last allowed attempt was interrupted too (its relay died,
-- or its transaction could not commit) is a poison event: the next claim
-- dead-letters it without another attempt, and gives that claim back.
SELECT idem_publish('user.deleted', '{"user": 8}') AS e3 \gset
UPDATE idempotency.deliveries
   SET attempts = 10, next_attempt_at = now() - '1 second'::interval,
	   visible_until = now() - '1 second'::interval
 WHERE event_id = :'e3';
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT count(*) AS calls FROM sink;
SELECT state, attempts, last_error, visible_until FROM idempotency.deliveries WHERE event_id = :'e3';
SELECT destination, delivered, redelivered, dead_lettered, dead FROM idem_outbox_stats WHERE destination = 'all';
SELECT idem_outbox_redrive(:'e3') AS redriven;
SELECT idem_outbox_relay() AS attempted;
SELECT count(*) AS calls FROM sink;

-- Dead letters with max_attempts = 1, redriven in bulk.
CREATE FUNCTION always_fails(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'no thanks'; END $$;
SELECT idem_destination_create('refuser', 'function', 'always_fails(jsonb)', '{refuse}',
	'{"max_attempts": 1}');
SELECT idem_publish('refuse', '{"n": 1}') IS NOT NULL AS published;
SELECT idem_publish('refuse', '{"n": 2}') IS NOT NULL AS published;
SELECT idem_outbox_relay() AS attempted;
SELECT topic, attempts, last_error FROM idem_outbox_dead WHERE destination = 'refuser' ORDER BY 1;
SELECT idem_outbox_redrive_dead('refuser', now() + '1 hour') AS redriven_since_future;
SELECT idem_outbox_redrive_dead('refuser') AS redriven;
-- A redrive gives back the attempts, not the claims counter: the fencing
-- token of the claims to come never repeats one of the past.
SELECT state, attempts, claims, count(*) FROM idempotency.deliveries x
  JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE d.name = 'refuser' GROUP BY 1, 2, 3;

-- Pause: events accumulate; resume: they go out.
SELECT idem_destination_pause('all');
SELECT idem_publish('paused.topic', '{}') IS NOT NULL AS published;
TRUNCATE sink;
SELECT idem_outbox_relay() AS attempted;
SELECT destination, status, backlog FROM idem_outbox_stats WHERE destination = 'all';
SELECT idem_destination_resume('all');
SELECT idem_outbox_relay() AS attempted;
SELECT via, topic FROM sink ORDER BY n;
SELECT destination, status, backlog FROM idem_outbox_stats WHERE destination = 'all';

-- The relay claims with SKIP LOCKED and needs a fresh snapshot per statement.
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT idem_outbox_relay();
ROLLBACK;
-- A pass in a transaction that published would claim the transaction's own
-- uncommitted events, and send them (to an http endpoint: for good) before
-- a rollback takes them back: refused (55000), whichever the destination.
-- An event published in a savepoint since rolled back is gone and counts
-- for nothing; one in a released savepoint counts.
TRUNCATE sink;
BEGIN;
SELECT idem_publish('own.event', '{}') IS NOT NULL AS published;
SELECT idem_outbox_relay();
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SAVEPOINT s;
SELECT idem_publish('own.event', '{}') IS NOT NULL AS published;
SAVEPOINT t;
SELECT idem_outbox_relay();
\echo :SQLSTATE
ROLLBACK TO s;
SELECT idem_outbox_relay() AS attempted_after_rollback_to_savepoint;
SAVEPOINT u;
SELECT idem_publish('own.event', '{}') IS NOT NULL AS published;
RELEASE u;
SELECT idem_outbox_relay();
\echo :SQLSTATE
ROLLBACK;
SELECT count(*) AS own_events_delivered FROM sink;
SELECT idem_outbox_relay(0);
-- At most 100000 per pass (it used to allocate room for any number up
-- front, and 2^27 or more failed with an internal error).
SELECT idem_outbox_relay(2147483647);
\echo :SQLSTATE
SELECT idem_outbox_relay(NULL);

-- Retention: delivered events older than idempotency.outbox_retention go;
-- dead letters (and their events) stay.
-- Cleanup also folds the statistics, one row of increments per relay pass
-- and destination, into one row per destination, without changing them.
SELECT count(*) AS events_before FROM idempotency.outbox;
SELECT count(*) > count(DISTINCT destination_id) AS several_rows_per_destination
  FROM idempotency.destination_stats;
CREATE TEMP TABLE stats_before AS
SELECT destination, delivered, retried, dead_lettered, redelivered, avg_latency, last_latency,
	   last_delivered_at FROM idem_outbox_stats;
SELECT idem_outbox_cleanup() AS removed_with_default_retention;
SELECT count(*) = count(DISTINCT destination_id) AS one_row_per_destination
  FROM idempotency.destination_stats;
(SELECT * FROM stats_before EXCEPT
 SELECT destination, delivered, retried, dead_lettered, redelivered, avg_latency, last_latency,
		last_delivered_at FROM idem_outbox_stats)
UNION ALL
(SELECT destination, delivered, retried, dead_lettered, redelivered, avg_latency, last_latency,
		last_delivered_at FROM idem_outbox_stats EXCEPT SELECT * FROM stats_before);
SET idempotency.outbox_retention = 0;
SELECT idem_outbox_cleanup(2) AS removed;
RESET idempotency.outbox_retention;
SELECT o.topic, x.state FROM idempotency.outbox o
  LEFT JOIN idempotency.deliveries x USING (event_id) ORDER BY o.seq;

-- Dropping a destination drops its deliveries and statistics; a new one of
-- the same name starts empty.
SELECT idem_destination_drop('refuser');
SELECT count(*) AS refuser_deliveries FROM idempotency.deliveries x
  WHERE NOT EXISTS (SELECT FROM idempotency.destinations d WHERE d.id = x.destination_id);
SELECT idem_destination_create('refuser', 'function', 'always_fails(jsonb)', '{refuse}');
SELECT destination, delivered, dead_lettered, dead, backlog FROM idem_outbox_stats WHERE destination = 'refuser';
SELECT idem_destination_drop('refuser');
SELECT idem_destination_drop('refuser');
SELECT idem_destination_pause('nowhere');
SELECT idem_outbox_redrive(:'e1', 'nowhere');

DROP FUNCTION always_fails(jsonb);

-- Leave nothing behind for the tests that follow.
SELECT idem_destination_drop(name) FROM idem_destinations ORDER BY name;
TRUNCATE idempotency.outbox, idempotency.deliveries;
DROP TABLE sink, flaky_flag;
DROP FUNCTION to_sink(jsonb), flaky(jsonb);
