-- replay, OURS: the retry of a completed key gets the stored response.
\set n random(1, :nkeys)
SELECT status, headers, body FROM idem_claim('bench:POST /orders', 'r:n', '{"amount": 42, "key": "r:n"}');
