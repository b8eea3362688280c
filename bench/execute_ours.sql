-- execute, OURS: claim + handler + store in one call.
\set n random(1, 1000000000000000)
SELECT * FROM idem_execute('bench:POST /orders', 'e:client_id-:n', '{"amount": 42, "key": "e:client_id-:n"}', 'bench_handler(jsonb)');
