--
-- The core contract of idem_claim / idem_succeed / idem_release / idem_replay
-- in one session.  Concurrency is in specs/.
--
CREATE TABLE payments (id serial PRIMARY KEY, amount int NOT NULL);

-- A first request: claimed with token 1; the domain write and the response
-- commit together.
BEGIN;
SELECT * FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"amount": 10, "currency": "EUR"}'::jsonb);
INSERT INTO payments (amount) VALUES (10);
SELECT idem_succeed('tenant-42:POST /payments', 'key-1', 201,
                    '{"payment_id": 1}', '{"Location": "/payments/1"}');
COMMIT;

-- The retry (a lost response): the stored response, nothing executed.
SELECT * FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"amount": 10, "currency": "EUR"}'::jsonb);
-- Key order, whitespace and number spelling do not make a different request.
SELECT outcome, status FROM idem_claim('tenant-42:POST /payments', 'key-1', '{ "currency":"EUR",  "amount": 10.0 }'::jsonb);
-- The text overload (what an untyped literal resolves to) parses the same JSON.
SELECT outcome, status FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"currency":"EUR","amount":1e1}');
-- Same key, different request: mismatch, never the unrelated response.
SELECT * FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"amount": 11, "currency": "EUR"}'::jsonb);
SELECT count(*) AS payments FROM payments;

-- A replay writes nothing and needs no transaction block of its own: no claim
-- is held, so the implicit commit is allowed.
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"amount": 10, "currency": "EUR"}');

-- Scopes are fully isolated: the same key in another scope is a new operation.
BEGIN;
SELECT outcome, token FROM idem_claim('tenant-43:POST /payments', 'key-1', '{"amount": 99}');
SELECT idem_succeed('tenant-43:POST /payments', 'key-1', 201, '{"payment_id": 2}');
COMMIT;
SELECT outcome, body FROM idem_claim('tenant-42:POST /payments', 'key-1', '{"amount": 10, "currency": "EUR"}');
SELECT outcome, body FROM idem_claim('tenant-43:POST /payments', 'key-1', '{"amount": 99}');

-- A business rejection is a final outcome too: 402 is stored and replayed.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-2', '{"amount": 1000000}');
SELECT idem_succeed('tenant-42:POST /payments', 'key-2', 402, '{"error": "insufficient funds"}');
COMMIT;
SELECT outcome, status, body FROM idem_claim('tenant-42:POST /payments', 'key-2', '{"amount": 1000000}');

-- A response without body or headers (204) replays as NULLs.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:DELETE /payments/1', 'key-3', '{}');
SELECT idem_succeed('tenant-42:DELETE /payments/1', 'key-3', 204);
COMMIT;
SELECT * FROM idem_claim('tenant-42:DELETE /payments/1', 'key-3', '{}');

-- idem_release: a transient failure gives the key up; the retry executes.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-4', '{"amount": 5}');
SELECT idem_release('tenant-42:POST /payments', 'key-4');
COMMIT;
SELECT count(*) FROM idem_replay('tenant-42:POST /payments', 'key-4');
BEGIN;
SELECT outcome, token FROM idem_claim('tenant-42:POST /payments', 'key-4', '{"amount": 5}');
SELECT idem_succeed('tenant-42:POST /payments', 'key-4', 201, '{"payment_id": 3}');
COMMIT;

-- Claim, release and claim again in one transaction.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-5', '{}');
SELECT idem_release('tenant-42:POST /payments', 'key-5');
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-5', '{}');
SELECT idem_succeed('tenant-42:POST /payments', 'key-5', 200, '"ok"');
-- Later statements of the same transaction see the stored response.
SELECT outcome, body FROM idem_claim('tenant-42:POST /payments', 'key-5', '{}');
COMMIT;

-- The bytea overload: the caller hashes its own request bytes.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:PUT /avatar', 'key-6', sha256('raw bytes of the upload'::bytea));
SELECT idem_succeed('tenant-42:PUT /avatar', 'key-6', 200);
COMMIT;
SELECT outcome, status FROM idem_claim('tenant-42:PUT /avatar', 'key-6', sha256('raw bytes of the upload'::bytea));
SELECT outcome FROM idem_claim('tenant-42:PUT /avatar', 'key-6', sha256('other bytes'::bytea));
-- A jsonb claim stores idem_fingerprint(request), so both forms meet.
SELECT outcome FROM idem_claim('tenant-42:PUT /avatar', 'key-6', '{"a": 1}'::jsonb);
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /x', 'key-7', idem_fingerprint('{"b": [1, 2], "a": "x"}'));
SELECT idem_succeed('tenant-42:POST /x', 'key-7', 201);
COMMIT;
SELECT outcome FROM idem_claim('tenant-42:POST /x', 'key-7', '{"a": "x", "b": [1.0, 2]}'::jsonb);

-- idem_replay: the "what happened to my request?" lookup.
SELECT state, status, headers, body,
       completed_at >= created_at AS completed_after_created,
       expires_at - completed_at AS ttl
  FROM idem_replay('tenant-42:POST /payments', 'key-1');
SELECT count(*) FROM idem_replay('tenant-42:POST /payments', 'no-such-key');
SELECT count(*) FROM idem_replay('tenant-99:POST /payments', 'key-1');

-- Keys at the limits: 255 printable ASCII characters, every printable byte.
BEGIN;
SELECT outcome FROM idem_claim('s', repeat('k', 255), '{}');
SELECT outcome FROM idem_claim('s', ' !"#$%&''()*+,-./0123456789:;<=>?@AZ[\]^_`az{|}~', '{}');
SELECT idem_succeed('s', repeat('k', 255), 200);
SELECT idem_succeed('s', ' !"#$%&''()*+,-./0123456789:;<=>?@AZ[\]^_`az{|}~', 200);
COMMIT;
-- Keys compare exactly: case and trailing spaces matter.
BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'KEY-1', '{"amount": 10, "currency": "EUR"}');
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'key-1 ', '{"amount": 10, "currency": "EUR"}');
ROLLBACK;

-- What was stored: one row per operation, token 1, the default TTL of 1 day.
SELECT scope, left(key, 20) AS key, length(key), state, status, token, expires_at - completed_at AS ttl
  FROM idempotency.records ORDER BY scope, key;
SELECT count(*) AS payments FROM payments;
DROP TABLE payments;
