--
-- 'notify' destinations and who can read what they send.  PostgreSQL has no
-- privilege on LISTEN: every role that can connect to the database can
-- listen on any channel, so a destination that sends whole events shows
-- them to all of those roles.  With the option "reference": true the
-- notification carries only the event's id and topic, and the consumer
-- reads the event with idem_outbox_event(id), which is revoked from PUBLIC
-- and granted to the roles that may read events.
--
-- psql prints the notifications this session receives once the relay's
-- transaction has committed; they go to a file, read back with ids, PIDs
-- and times masked.
--
CREATE ROLE idem_listener;
SELECT idem_destination_create('full', 'notify', 'full_events', '{secret.*}');
SELECT idem_destination_create('ref', 'notify', 'ref_events', '{secret.*}', '{"reference": true}');
SELECT name, kind, target, options FROM idem_destinations ORDER BY name;

-- The option is a boolean, of 'notify' destinations only.
SELECT idem_destination_create('bad', 'notify', 'c', '{*}', '{"reference": "yes"}');
\echo :SQLSTATE
SELECT idem_destination_create('bad', 'notify', 'c', '{*}', '{"retries": 1}');
\echo :SQLSTATE
CREATE FUNCTION sink_fn(event jsonb) RETURNS void LANGUAGE sql AS $$ SELECT $$;
SELECT idem_destination_create('bad', 'function', 'sink_fn(jsonb)', '{*}', '{"reference": true}');
\echo :SQLSTATE
DROP FUNCTION sink_fn(jsonb);

SELECT idem_publish('secret.salary', '{"employee": 7, "salary": 123456}', 'emp-7') IS NOT NULL AS published;

-- A role without any privilege listens on both channels.
SET ROLE idem_listener;
LISTEN full_events;
LISTEN ref_events;
RESET ROLE;
SELECT '/tmp/idem_outbox_notify_ref_' || pg_backend_pid() || '.out' AS notify_file \gset
\o :notify_file
SELECT idem_outbox_relay() AS attempted;
\o
UNLISTEN *;
SELECT regexp_replace(regexp_replace(regexp_replace(pg_read_file(:'notify_file'),
		'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', '<id>', 'g'),
		'PID [0-9]+', 'PID <pid>', 'g'),
		'"published_at": "[^"]*"', '"published_at": "<time>"', 'g') AS psql_output;
-- The id in the reference is the event's.
SELECT substring(pg_read_file(:'notify_file')
				 FROM 'ref_events" with payload "\{"id": "([0-9a-f-]{36})"') AS ref_id \gset
\setenv NOTIFY_FILE :notify_file
\! rm -f "$NOTIFY_FILE"
SELECT count(*) AS matching_events FROM idempotency.outbox WHERE event_id = :'ref_id';

-- The listener cannot read the event the reference points to ...
SET ROLE idem_listener;
SELECT idem_outbox_event(:'ref_id');
\echo :SQLSTATE
RESET ROLE;
-- ... until it is granted idem_outbox_event.
GRANT EXECUTE ON FUNCTION idem_outbox_event(uuid) TO idem_listener;
SET ROLE idem_listener;
SELECT e->'topic' AS topic, e->'key' AS key, e->'payload' AS payload FROM idem_outbox_event(:'ref_id') e;
RESET ROLE;

-- Leave nothing behind.
REVOKE EXECUTE ON FUNCTION idem_outbox_event(uuid) FROM idem_listener;
DROP ROLE idem_listener;
SELECT idem_destination_drop(name) FROM idem_destinations ORDER BY name;
TRUNCATE idempotency.outbox, idempotency.deliveries, idempotency.destination_stats;
