#!/usr/bin/env bash
# A narrated walkthrough of idempotency on a throwaway cluster:
# double click, lost response and retry, concurrent duplicates, mismatch,
# idem_execute.  Installs what it needs (as root), builds and installs the
# extension, starts PostgreSQL as the unprivileged user "postgres", and removes
# the cluster at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh

idem_install_deps
idem_pg_env
echo "building and installing the extension ..."
idem_build_install

dir=$(mktemp -d /tmp/idempotency-demo.XXXXXX)
[ "$(id -u)" -eq 0 ] && chown postgres: "$dir"
# Work from there: the server's user may not enter the clone (say, under /root).
cd "$dir"
port=${DEMO_PORT:-5488}
cleanup() {
	idem_as_pg "$PG_BINDIR/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
	rm -rf "$dir"
}
trap cleanup EXIT

idem_as_pg "$PG_BINDIR/initdb" -D "$dir/data" -A trust -U postgres -E UTF8 --no-locale >/dev/null
cat >>"$dir/data/postgresql.conf" <<EOF
port = $port
unix_socket_directories = '$dir'
listen_addresses = ''
shared_preload_libraries = 'idempotency'
EOF
idem_as_pg "$PG_BINDIR/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null

psql_demo() { idem_as_pg "$PG_BINDIR/psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres "$@"; }
if [ -t 1 ]; then
	say() { printf '\n\033[1m%s\033[0m\n' "$*"; }
else
	say() { printf '\n== %s\n' "$*"; }
fi
show() {
	# Echo the SQL, then run it.
	printf '%s\n' "$1" | sed 's/^/    /'
	psql_demo -c "$1" 2>&1 | sed 's/^/    /'
}

say "1. Install: CREATE EXTENSION idempotency, and a domain table"
show "CREATE EXTENSION idempotency;"
show "CREATE TABLE payments (id serial PRIMARY KEY, amount int, idem_key text);"

say "2. The first request: claim the key, write, store the response, commit - one transaction"
show "BEGIN;
SELECT outcome, token FROM idem_claim('tenant-42:POST /payments', 'a1b2', '{\"amount\": 10}');
INSERT INTO payments (amount, idem_key) VALUES (10, 'a1b2');
SELECT idem_succeed('tenant-42:POST /payments', 'a1b2', 201, '{\"payment_id\": 1}', '{\"Location\": \"/payments/1\"}');
COMMIT;"

say "3. Double click / lost response: the client retries with the same key"
echo "   The retry gets the stored response back; the payment is not written again."
show "SELECT outcome, status, headers, body FROM idem_claim('tenant-42:POST /payments', 'a1b2', '{\"amount\": 10}');"
echo "   Key order, whitespace and number spelling do not make it a different request:"
show "SELECT outcome, status FROM idem_claim('tenant-42:POST /payments', 'a1b2', '{ \"amount\" : 10.0 }');"
show "SELECT count(*) AS payments FROM payments;"

say "4. Same key, different request: 'mismatch' (answer 422), never someone else's response"
show "SELECT outcome, status, body FROM idem_claim('tenant-42:POST /payments', 'a1b2', '{\"amount\": 99}');"

say "5. Concurrent duplicates: the second attempt waits for the first, then replays it"
echo "   Session A claims 'c3d4' and takes 2 seconds before it commits;"
echo "   session B sends the same request 0.5 s later."
psql_demo -c "BEGIN;
SELECT outcome AS a_outcome FROM idem_claim('tenant-42:POST /payments', 'c3d4', '{\"amount\": 20}');
INSERT INTO payments (amount, idem_key) VALUES (20, 'c3d4');
SELECT pg_sleep(2);
SELECT idem_succeed('tenant-42:POST /payments', 'c3d4', 201, '{\"payment_id\": 2}');
COMMIT;" >"$dir/a.out" 2>&1 &
a_pid=$!
sleep 0.5
start=$(date +%s%N)
psql_demo -c "BEGIN;
SELECT outcome AS b_outcome, status, body FROM idem_claim('tenant-42:POST /payments', 'c3d4', '{\"amount\": 20}');
COMMIT;" | sed 's/^/    B: /'
end=$(date +%s%N)
wait $a_pid
sed 's/^/    A: /' "$dir/a.out"
echo "   B waited $(( (end - start) / 1000000 )) ms for A (idempotency.wait_timeout is 5s), then replayed A's response."
show "SELECT idem_key, count(*) FROM payments GROUP BY idem_key ORDER BY idem_key;"

say "6. A duplicate that outlives wait_timeout gets 'in_progress' (answer 409 with Retry-After)"
psql_demo -c "BEGIN;
SELECT outcome AS a_outcome FROM idem_claim('tenant-42:POST /payments', 'e5f6', '{}');
SELECT pg_sleep(1.5);
SELECT idem_release('tenant-42:POST /payments', 'e5f6');
COMMIT;" >/dev/null &
a_pid=$!
sleep 0.3
show "SET idempotency.wait_timeout = '500ms';
BEGIN;
SELECT outcome, retry_after FROM idem_claim('tenant-42:POST /payments', 'e5f6', '{}');
COMMIT;"
wait $a_pid
echo "   A released the key (a transient failure), so the next retry executes:"
show "BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'e5f6', '{}');
SELECT idem_release('tenant-42:POST /payments', 'e5f6');
COMMIT;"

say "7. A claim cannot be committed without its response"
show "BEGIN;
SELECT outcome FROM idem_claim('tenant-42:POST /payments', 'g7h8', '{}');
INSERT INTO payments (amount, idem_key) VALUES (30, 'g7h8');
COMMIT;" 2>&1 || true
show "SELECT count(*) AS payments_for_g7h8 FROM payments WHERE idem_key = 'g7h8';"

say "8. idem_execute: the whole flow in one call, HTTP-ready answers"
show "CREATE FUNCTION create_payment(request jsonb) RETURNS idem_response LANGUAGE sql AS \$\$
  INSERT INTO payments (amount, idem_key) VALUES ((request->>'amount')::int, 'exec')
  RETURNING ROW(201, jsonb_build_object('Location', '/payments/' || id),
                jsonb_build_object('payment_id', id))::idem_response
\$\$;"
show "SELECT * FROM idem_execute('tenant-42:POST /payments', 'i9j0', '{\"amount\": 40}', 'create_payment(jsonb)');"
echo "   The retry is a replay, marked with Idempotent-Replayed:"
show "SELECT * FROM idem_execute('tenant-42:POST /payments', 'i9j0', '{\"amount\": 40}', 'create_payment(jsonb)');"
echo "   Another request with the same key is a 422 problem:"
show "SELECT status, headers, body->>'title' AS title FROM idem_execute('tenant-42:POST /payments', 'i9j0', '{\"amount\": 41}', 'create_payment(jsonb)');"

say "9. The fingerprint: SHA-256 over canonical JSON (RFC 8785 where numbers fit a double)"
show "SELECT idem_canonical('{\"b\": [1.0, 2e0], \"a\": \"x\"}') AS canonical,
       encode(idem_fingerprint('{\"b\": [1.0, 2e0], \"a\": \"x\"}'), 'hex') AS sha256;"

say "Done. Every payment was written once:"
show "SELECT idem_key, count(*) FROM payments GROUP BY idem_key ORDER BY idem_key;"
