#!/usr/bin/env bash
# Deterministic companion of bench/run.sh: CPU instructions per operation,
# ours against the floor, counted by valgrind (callgrind) in a single-user
# backend.  Instruction counts do not depend on what else the machine is
# doing, so these ratios are stable where pgbench's throughput is noisy; they
# leave out what both sides share outside the backend (client, network).
#
#   bash bench/instructions.sh              # 2000 operations per test, ~3 minutes
#   BENCH_OPS=500 bash bench/instructions.sh
#
# Ratio = floor instructions / our instructions, so, as with throughput,
# above 1 means cheaper than the floor.
set -euo pipefail

OPS=${BENCH_OPS:-2000}
BIN=/usr/lib/postgresql/15/bin
BENCH_DIR=$(cd "$(dirname "$0")" && pwd)

[ "$(id -u)" -eq 0 ] || { echo "run as root (the backend runs as user postgres)" >&2; exit 1; }
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }

WORK=$(mktemp -d /tmp/idem-instr.XXXXXX)
chown postgres: "$WORK"
cd "$WORK"
trap 'rm -rf "$WORK"' EXIT

as_pg() { runuser -u postgres -- "$@"; }
single() { as_pg "$BIN/postgres" --single "$@" -D "$WORK/data" postgres; }

as_pg "$BIN/initdb" -D "$WORK/data" -A trust -E UTF8 --no-locale >/dev/null
cat >>"$WORK/data/postgresql.conf" <<EOF
shared_preload_libraries = 'idempotency'
synchronous_commit = off
EOF
single -j <"$BENCH_DIR/setup.sql" >"$WORK/setup.log" 2>&1 || { cat "$WORK/setup.log" >&2; exit 1; }

# One statement per line, as the single-user backend reads them.
python3 - "$OPS" "$WORK" <<'EOF'
import sys
n, work = int(sys.argv[1]), sys.argv[2]
scope = "bench:POST /orders"
fp = r"\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
record = lambda k: (f"'{scope}', '{k}', 'completed', '{fp}', 201, '{{\"Location\": \"/orders/1\"}}', "
                    f"'{{\"order_id\": 1}}', 1, NULL, NULL, now(), now(), now() + interval '1 day', now(), '10'")
request = lambda k: f"'{{\"amount\": 42, \"key\": \"{k}\"}}'"
scripts = {
    "create_ours": lambda k: ["BEGIN;",
        f"SELECT outcome FROM idem_claim('{scope}', '{k}', {request(k)});",
        f"INSERT INTO bench_orders (key, amount) VALUES ('{k}', 42);",
        f"SELECT idem_succeed('{scope}', '{k}', 201, '{{\"order_id\": 1}}', '{{\"Location\": \"/orders/1\"}}');",
        "COMMIT;"],
    "create_floor": lambda k: ["BEGIN;",
        f"INSERT INTO floor_records VALUES ({record(k)});",
        f"INSERT INTO bench_orders (key, amount) VALUES ('{k}', 42);",
        "SELECT 1;", "COMMIT;"],
    "execute_ours": lambda k: [
        f"SELECT * FROM idem_execute('{scope}', 'e{k}', {request('e' + k)}, 'bench_handler(jsonb)');"],
    "execute_floor": lambda k: [
        f"WITH r AS (INSERT INTO floor_records VALUES ({record('e' + k)})) "
        f"INSERT INTO bench_orders (key, amount) VALUES ('e{k}', 42);"],
    # Replays of the keys the create tests stored, in both tables.
    "replay_ours": lambda k: [
        f"SELECT status, headers, body FROM idem_claim('{scope}', '{k}', {request(k)});"],
    "replay_floor": lambda k: [
        f"SELECT status, headers, body FROM floor_records WHERE scope = '{scope}' AND key = '{k}';"],
}
for name, make in scripts.items():
    with open(f"{work}/{name}.sql", "w") as f:
        for i in range(n):
            f.write("\n".join(make(f"k{i}")) + "\n")
open(f"{work}/empty.sql", "w").close()
EOF
chown postgres: "$WORK"/*.sql

# Instructions of one single-user run over a script.
count() {
	as_pg valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.$1" \
		"$BIN/postgres" --single -D "$WORK/data" postgres <"$WORK/$1.sql" >"$WORK/$1.log" 2>&1
	grep -q ERROR "$WORK/$1.log" && { echo "errors in $1:" >&2; grep -m3 ERROR "$WORK/$1.log" >&2; exit 1; }
	sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$WORK/$1.log"
}

base=$(count empty)
echo "idempotency instruction counts  $(date +%F)  (PostgreSQL $("$BIN/postgres" --version | awk '{print $3}'), $OPS operations each, single-user backend under callgrind)"
printf '%-10s %16s %16s %7s\n' test "ours instr/op" "floor instr/op" ratio
for t in create execute replay; do
	ours=$(( ($(count "${t}_ours") - base) / OPS ))
	floor=$(( ($(count "${t}_floor") - base) / OPS ))
	printf '%-10s %16d %16d %7s\n' "$t" "$ours" "$floor" \
		"$(awk -v o="$ours" -v f="$floor" 'BEGIN { printf "%.2f", f / o }')"
done
replays=$(grep -c 'status = "201"' "$WORK/replay_ours.log" || true)
echo "(replay_ours answered $replays stored responses of $OPS)"
