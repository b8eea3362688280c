-- contended create, OURS: many clients retry the same key at once; only the
-- claimant executes, the others get the replay (or in_progress).
\set n random(1, 100)
SELECT 'ho' || (extract(epoch from clock_timestamp()) * 10)::bigint || '-' || :n AS k \gset
BEGIN;
SELECT outcome = 'claimed' AS mine FROM idem_claim('bench:POST /orders', ':k', '{"amount": 42, "key": ":k"}') \gset
\if :mine
INSERT INTO bench_orders (key, amount) VALUES (':k', 42);
SELECT idem_succeed('bench:POST /orders', ':k', 201, '{"order_id": 1}', '{"Location": "/orders/1"}');
\endif
COMMIT;
