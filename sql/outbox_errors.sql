--
-- Outbox input validation: every bad argument gets a clear error with a
-- documented SQLSTATE (\echo :SQLSTATE after each), and nothing is written.
-- Secrets never appear in a message.
--
CREATE FUNCTION sink_fn(event jsonb) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION two_args(a jsonb, b int) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION set_fn(event jsonb) RETURNS SETOF int LANGUAGE sql AS $$ SELECT 1 $$;
CREATE PROCEDURE proc_fn(event jsonb) LANGUAGE sql AS $$ SELECT $$;

-- idem_publish: NULLs are 22004; empty, overlong or malformed values 22023;
-- events over idempotency.max_event_bytes 54000.
SELECT idem_publish(NULL, '{}');
\echo :SQLSTATE
SELECT idem_publish('t', NULL);
\echo :SQLSTATE
SELECT idem_publish('', '{}');
\echo :SQLSTATE
SELECT idem_publish(repeat('t', 256), '{}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', '');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', repeat('k', 256));
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '["x"]');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '"x"');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"x-count": 1}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"bad name": "x"}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"": "x"}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"x-injected": "a\r\nHost: evil"}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"Webhook-Signature": "v1,forged"}');
\echo :SQLSTATE
SELECT idem_publish('t', '{}', NULL, '{"host": "elsewhere"}');
\echo :SQLSTATE
SET idempotency.max_event_bytes = '1kB';
SELECT idem_publish('t', jsonb_build_object('blob', repeat('x', 2000)));
\echo :SQLSTATE
RESET idempotency.max_event_bytes;
BEGIN READ ONLY;
SELECT idem_publish('t', '{}');
\echo :SQLSTATE
ROLLBACK;
-- A valid event with headers, for contrast; and topic length at the limit.
SELECT idem_publish(repeat('t', 255), '{}', repeat('k', 255), '{"X-Trace": "a\tb"}') IS NOT NULL AS published;
SELECT count(*) AS events FROM idempotency.outbox;

-- Destinations: kind, target, topics and options.
SELECT idem_destination_create(NULL, 'notify', 'c');
\echo :SQLSTATE
SELECT idem_destination_create('d', NULL, 'c');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', NULL);
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', NULL);
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', NULL);
\echo :SQLSTATE
SELECT idem_destination_create('', 'notify', 'c');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'smtp', 'c');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', '');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', repeat('c', 64));
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'no_such_function(jsonb)');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'two_args(jsonb, int)');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'set_fn(jsonb)');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'proc_fn(jsonb)');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'length(text)');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'ftp://example.com/hook');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://user:pass@example.com/hook');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/a hook');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://[::1/hook');
\echo :SQLSTATE
-- libcurl's own words (newer versions: expected/outbox_errors_1.out).
SELECT idem_destination_create('d', 'http', 'http://:80/hook');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{a,NULL}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{""}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{a*b}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{{a},{b}}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '[]');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"retries": 3}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"timeout": "5s"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"max_attempts": 0}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"max_attempts": 2.5}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"max_attempts": "3"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"backoff_base": "soon"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"backoff_base": 0}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"backoff_base": true}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"backoff_base": "2s", "backoff_cap": "1s"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'notify', 'c', '{*}', '{"backoff_cap": "31 days"}');
\echo :SQLSTATE
-- function: a time limit per call, from 1 ms to an hour.
SELECT idem_destination_create('d', 'function', 'sink_fn(jsonb)', '{*}', '{"timeout": 0}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'sink_fn(jsonb)', '{*}', '{"timeout": "2h"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'function', 'sink_fn(jsonb)', '{*}', '{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
\echo :SQLSTATE
-- http: a signing secret is required, in the Standard Webhooks form.
SELECT idem_destination_create('d', 'http', 'http://example.com/hook');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "not-a-whsec-secret"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_not base64!"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_c2hvcnQ="}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": 42}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secrets": []}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "timeout": "2 hours"}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "headers": {"Content-Type": "text/plain"}}');
\echo :SQLSTATE
SELECT idem_destination_create('d', 'http', 'http://example.com/hook', '{*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "headers": ["Authorization: x"]}');
\echo :SQLSTATE
SELECT count(*) AS destinations FROM idempotency.destinations;

-- Valid ones, for contrast: durations as seconds or intervals, several
-- secrets during a rotation, extra headers (their values are not shown).
SELECT idem_destination_create('hook', 'http', 'https://example.com/hook', '{order.*}',
	'{"secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_c2VjcmV0LWtleS1udW1iZXItdHdvLTEyMzQ1Njc4"],
	  "timeout": 2.5, "backoff_base": "250ms", "backoff_cap": "P1D", "max_attempts": 5,
	  "headers": {"Authorization": "Bearer s3cr3t"}}');
SELECT name, kind, target, topics, options, header_names, secret_count FROM idem_destinations;
SELECT max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms FROM idempotency.destinations;
SELECT idem_destination_create('hook', 'notify', 'c');
\echo :SQLSTATE
-- Altering the options validates them against the kind.
SELECT idem_destination_alter('hook', '{"max_attempts": 5}');
\echo :SQLSTATE
SELECT idem_destination_alter('hook', '{"secret": "whsec_c2VjcmV0LWtleS1udW1iZXItdHdvLTEyMzQ1Njc4"}');
SELECT name, options, header_names, secret_count FROM idem_destinations;
SELECT max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms FROM idempotency.destinations;
SELECT idem_destination_alter('nowhere', '{}');
\echo :SQLSTATE
-- A name that no destination can have is a bad argument (22023, as in
-- create), not a missing destination (42704), in every function naming one.
SELECT idem_destination_alter('', '{}');
\echo :SQLSTATE
SELECT idem_destination_pause(repeat('n', 256));
\echo :SQLSTATE
SELECT idem_destination_resume('');
\echo :SQLSTATE
SELECT idem_destination_drop('');
\echo :SQLSTATE
SELECT idem_outbox_redrive_dead('');
\echo :SQLSTATE
SELECT idem_outbox_redrive_dead(repeat('n', 256), now());
\echo :SQLSTATE
SELECT idem_outbox_redrive(gen_random_uuid(), '');
\echo :SQLSTATE
SELECT idem_destination_drop('hook');

-- Redrive needs an event id; the bulk form a destination.
SELECT idem_outbox_redrive(NULL);
\echo :SQLSTATE
SELECT idem_outbox_redrive_dead(NULL);
\echo :SQLSTATE
SELECT idem_outbox_event(NULL);
\echo :SQLSTATE

TRUNCATE idempotency.outbox, idempotency.deliveries;
DROP FUNCTION sink_fn(jsonb), two_args(jsonb, int), set_fn(jsonb);
DROP PROCEDURE proc_fn(jsonb);
