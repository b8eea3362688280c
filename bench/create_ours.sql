-- create, OURS: claim, domain insert, store the response, in one transaction.
\set n random(1, 1000000000000000)
BEGIN;
SELECT outcome FROM idem_claim('bench:POST /orders', 'k:client_id-:n', '{"amount": 42, "key": "k:client_id-:n"}');
INSERT INTO bench_orders (key, amount) VALUES ('k:client_id-:n', 42);
SELECT idem_succeed('bench:POST /orders', 'k:client_id-:n', 201, '{"order_id": 1}', '{"Location": "/orders/1"}');
COMMIT;
