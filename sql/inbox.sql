--
-- idem_inbox_accept: true the first time a message is seen, false for every
-- redelivery; the mark commits or rolls back with the consumer's own writes.
-- Concurrent deliveries are in specs/inbox_concurrent.spec.
--
CREATE TABLE shipments (id serial PRIMARY KEY, order_id text NOT NULL);

-- A consumer applies a message only when idem_inbox_accept says so.
CREATE FUNCTION consume(source text, message_id text, order_id text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
	IF idem_inbox_accept(source, message_id) THEN
		INSERT INTO shipments (order_id) VALUES (order_id);
		RETURN true;
	END IF;
	RETURN false;
END $$;

-- First delivery: accepted and applied; the redelivery is a duplicate.
SELECT consume('orders-topic', 'msg-1', 'o-1') AS applied;
SELECT consume('orders-topic', 'msg-1', 'o-1') AS applied;
SELECT count(*) AS shipments FROM shipments;

-- The same message id from another source is another message.
SELECT idem_inbox_accept('billing-topic', 'msg-1');
-- A duplicate within the same transaction, and within the same statement.
BEGIN;
SELECT idem_inbox_accept('orders-topic', 'msg-2');
SELECT idem_inbox_accept('orders-topic', 'msg-2');
COMMIT;
SELECT idem_inbox_accept('orders-topic', m) FROM (VALUES ('msg-3'), ('msg-3'), ('msg-4')) v(m);

-- A consumer that rolls back leaves no mark: the redelivery is applied.
BEGIN;
SELECT consume('orders-topic', 'msg-5', 'o-5') AS applied;
ROLLBACK;
SELECT count(*) AS shipments_o5 FROM shipments WHERE order_id = 'o-5';
SELECT consume('orders-topic', 'msg-5', 'o-5') AS applied;
SELECT count(*) AS shipments_o5 FROM shipments WHERE order_id = 'o-5';

-- A savepoint rolled back takes its mark with it.
BEGIN;
SAVEPOINT s;
SELECT idem_inbox_accept('orders-topic', 'msg-6');
ROLLBACK TO SAVEPOINT s;
SELECT idem_inbox_accept('orders-topic', 'msg-6');
COMMIT;

-- Message ids are opaque: UUIDs, numbers, any printable text up to 255 bytes,
-- non-ASCII included.  Compared bytewise: case matters.
SELECT idem_inbox_accept('orders-topic', '7d444840-9dc0-11d1-b245-5ffdce74fad2'),
       idem_inbox_accept('orders-topic', '12345678901234567890'),
       idem_inbox_accept('orders-topic', 'Größe #1'),
       idem_inbox_accept('orders-topic', 'MSG-1'),
       idem_inbox_accept('orders-topic', repeat('m', 255)),
       idem_inbox_accept(repeat('s', 255), 'x');

-- ttl: default idempotency.default_ttl, an explicit one wins.
SET idempotency.default_ttl = '2h';
SELECT idem_inbox_accept('ttl-topic', 'default');
RESET idempotency.default_ttl;
SELECT idem_inbox_accept('ttl-topic', 'explicit', interval '7 days');
SELECT message_id, expires_at - accepted_at AS ttl
  FROM idempotency.inbox WHERE source = 'ttl-topic' ORDER BY message_id;

-- An expired mark behaves as new: the message is accepted again, and the old
-- mark is replaced, not duplicated.
SELECT idem_inbox_accept('orders-topic', 'msg-7', interval '100 milliseconds');
SELECT idem_inbox_accept('orders-topic', 'msg-7');
SELECT pg_sleep(0.2);
SELECT idem_inbox_accept('orders-topic', 'msg-7');
SELECT idem_inbox_accept('orders-topic', 'msg-7');
SELECT count(*) AS marks, bool_and(expires_at > now() + interval '1 hour') AS renewed
  FROM idempotency.inbox WHERE source = 'orders-topic' AND message_id = 'msg-7';

-- A duplicate answers on a read-only transaction (a hot standby too); a new
-- message needs a writable one.
BEGIN READ ONLY;
SELECT idem_inbox_accept('orders-topic', 'msg-1');
SELECT idem_inbox_accept('orders-topic', 'msg-new');
\echo :SQLSTATE
ROLLBACK;

-- Bad input: clear errors, nothing written.
SELECT count(*) AS marks_before FROM idempotency.inbox;
SELECT idem_inbox_accept(NULL, 'm');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', NULL);
\echo :SQLSTATE
SELECT idem_inbox_accept('', 'm');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', '');
\echo :SQLSTATE
SELECT idem_inbox_accept(repeat('s', 256), 'm');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', repeat('m', 256));
\echo :SQLSTATE
SELECT idem_inbox_accept('s', 'line' || chr(10) || 'break');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', 'del' || chr(127));
\echo :SQLSTATE
SELECT idem_inbox_accept('s', 'm', interval '0 seconds');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', 'm', interval '-1 day');
\echo :SQLSTATE
SELECT count(*) AS marks_after FROM idempotency.inbox;

-- A role without any privilege on the extension's schema can use the inbox,
-- but cannot read or change the marks directly.
CREATE ROLE idem_consumer LOGIN;
SET ROLE idem_consumer;
SELECT idem_inbox_accept('orders-topic', 'msg-8');
SELECT idem_inbox_accept('orders-topic', 'msg-8');
SELECT * FROM idempotency.inbox;
\echo :SQLSTATE
RESET ROLE;
SELECT has_table_privilege('idem_consumer', 'idempotency.inbox', 'SELECT') AS consumer_select;
DROP ROLE idem_consumer;

DROP FUNCTION consume(text, text, text);
DROP TABLE shipments;
