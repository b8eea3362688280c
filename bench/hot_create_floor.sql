-- contended create, FLOOR: insert the record unless the key exists (waits
-- for a concurrent inserter like ours does); only the inserter executes.  The
-- floor does not even read the stored response on a duplicate.
\set n random(1, 100)
SELECT 'hf' || (extract(epoch from clock_timestamp()) * 10)::bigint || '-' || :n AS k \gset
BEGIN;
WITH r AS (INSERT INTO floor_records VALUES ('bench:POST /orders', ':k', 'completed', '\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08', 201, '{"Location": "/orders/1"}', '{"order_id": 1}', 1, NULL, NULL, now(), now(), now() + interval '1 day', now(), '10') ON CONFLICT DO NOTHING RETURNING 1) SELECT count(*) = 1 AS mine FROM r \gset
\if :mine
INSERT INTO bench_orders (key, amount) VALUES (':k', 42);
SELECT 1;
\endif
COMMIT;
