-- create, FLOOR: the claim replaced by one plain insert of the finished
-- record (same sizes as ours), the succeed by a no-op round trip.
\set n random(1, 1000000000000000)
BEGIN;
INSERT INTO floor_records VALUES ('bench:POST /orders', 'k:client_id-:n', 'completed', '\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08', 201, '{"Location": "/orders/1"}', '{"order_id": 1}', 1, NULL, NULL, now(), now(), now() + interval '1 day', now(), '10');
INSERT INTO bench_orders (key, amount) VALUES ('k:client_id-:n', 42);
SELECT 1;
COMMIT;
