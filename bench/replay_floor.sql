-- replay, FLOOR: a primary-key select of the same stored response.
\set n random(1, :nkeys)
SELECT status, headers, body FROM floor_records WHERE scope = 'bench:POST /orders' AND key = 'r:n';
