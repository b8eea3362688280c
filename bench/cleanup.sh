#!/usr/bin/env bash
# Cleanup benchmark: does the background worker keep up, and does the
# foreground notice it?  On a throwaway cluster (synchronous_commit=off, so
# CPU cost shows rather than fsync), BENCH_CYCLES times in a row (default 3):
#
#   1. load a backlog of BENCH_ROWS expired records (default 3 million);
#   2. run the create load with pgbench (2 clients, the five-statement flow:
#      BEGIN; idem_claim; INSERT INTO a domain table; idem_succeed; COMMIT;
#      a new key every time) and, during that one run, let the worker
#      alternate between idle blocks (a 10 s pause between batches) and busy
#      blocks (its default pace) until the backlog is gone; compare the create
#      TPS of the idle and the busy seconds, and count the rows deleted per
#      busy second;
#   3. VACUUM (plain, what autovacuum does; not FULL) and record the size of
#      idempotency.records with its indexes.
#
# Targets: create TPS during cleanup within 10% of the idle figure; rows
# deleted per second at least the creates per second (each create inserts one
# record), so that a sustained peak never outgrows cleanup; the size of the
# table with its indexes per live record not growing from cycle to cycle (the
# creates add live records every cycle; a backlog's space must be reused).
#
# Environment: BENCH_ROWS (backlog size), BENCH_BLOCK (seconds per idle or
# busy block, default 5), BENCH_PORT (default 5655), BENCH_KEEP (keep the
# cluster directory, with pgbench's per-second progress, for inspection),
# IDEM_DESTDIR (see scripts/deps.sh).  Runs as root (PostgreSQL itself as the
# user "postgres"); about 5 minutes with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh

rows=${BENCH_ROWS:-3000000}
block=${BENCH_BLOCK:-5}
cycles=${BENCH_CYCLES:-3}
port=${BENCH_PORT:-5655}

idem_install_deps
idem_pg_env
echo "building and installing the extension ..."
idem_build_install

dir=$(mktemp -d /tmp/idempotency-bench-cleanup.XXXXXX)
[ "$(id -u)" -eq 0 ] && chown postgres: "$dir"
cleanup() {
	idem_as_pg "$PG_BINDIR/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
	if [ -n "${BENCH_KEEP:-}" ]; then echo "kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT

idem_as_pg "$PG_BINDIR/initdb" -D "$dir/data" -A trust -U postgres -E UTF8 --no-locale >/dev/null
cat >>"$dir/data/postgresql.conf" <<EOF
port = $port
unix_socket_directories = '$dir'
listen_addresses = ''
shared_preload_libraries = 'idempotency'
synchronous_commit = off
shared_buffers = 1GB
max_wal_size = 8GB
checkpoint_timeout = 30min
idempotency.cleanup_interval = '1h'
EOF
idem_as_pg "$PG_BINDIR/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null
idem_as_pg "$PG_BINDIR/createdb" -h "$dir" -p "$port" -U postgres bench

q() { idem_as_pg "$PG_BINDIR/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U postgres -d bench -c "$1"; }
now() { date +%s.%N; }

q "CREATE EXTENSION idempotency"
# List the database now that it exists; its worker makes one (empty) pass
# and then sleeps for the hour.
q "ALTER SYSTEM SET idempotency.databases = 'bench'" >/dev/null
q "SELECT pg_reload_conf()" >/dev/null
until [ "$(q "SELECT cleanup_runs FROM idem_stats WHERE datname = 'bench'")" = 1 ]; do sleep 0.2; done
q "CREATE TABLE bench_orders (id bigserial PRIMARY KEY, key text NOT NULL, amount int NOT NULL)"

cat >"$dir/create.sql" <<'EOF'
\set n random(1, 1000000000000000)
BEGIN;
SELECT outcome FROM idem_claim('bench:POST /orders', 'k:client_id-:n', '{"amount": 42}');
INSERT INTO bench_orders (key, amount) VALUES ('k:client_id-:n', 42);
SELECT idem_succeed('bench:POST /orders', 'k:client_id-:n', 201, '{"order_id": 1}', '{"Location": "/orders/1"}');
COMMIT;
EOF
chown postgres: "$dir/create.sql" 2>/dev/null || true

deleted() { q "SELECT rows_deleted FROM idem_stats WHERE datname = 'bench'"; }
# The server's clock and rows_deleted, read together.
progress_mark() {
	q "SELECT extract(epoch FROM clock_timestamp()) || ' $1 ' || rows_deleted FROM idem_stats WHERE datname = 'bench'"
}
size_mb() { q "SELECT round(pg_total_relation_size('idempotency.records') / 1048576.0)"; }
heap_mb() { q "SELECT round(pg_relation_size('idempotency.records') / 1048576.0)"; }

# Pace the worker: 'busy' is the default pause (idempotency.cleanup_delay),
# 'idle' a pause of 10 s between batches, which leaves it all but asleep in
# the middle of its pass.  A reload wakes it, so a switch takes effect at once.
pace() {
	if [ "$1" = busy ]; then
		q "ALTER SYSTEM RESET idempotency.cleanup_delay" >/dev/null
	else
		q "ALTER SYSTEM SET idempotency.cleanup_delay = '10s'" >/dev/null
	fi
	q "SELECT pg_reload_conf()" >/dev/null
}

load_backlog() {
	local cycle=$1 t0 before
	t0=$(now)
	before=$(size_mb)
	q "INSERT INTO idempotency.records (scope, key, state, fingerprint, status, headers, body, token,
	                                     created_at, completed_at, expires_at)
	   SELECT 'bench:POST /orders', 'backlog$cycle-' || g, 'completed',
	          sha256(('backlog$cycle-' || g)::bytea), 201, '{\"Location\": \"/orders/1\"}', '{\"order_id\": 1}', 1,
	          now() - interval '2 days', now() - interval '2 days',
	          now() - interval '1 day' + g * (interval '1 hour' / $rows)
	     FROM generate_series(1, $rows) g"
	q "VACUUM ANALYZE idempotency.records"
	q "CHECKPOINT"
	backlog_mb=$(($(size_mb) - before))
	printf '  backlog: %d expired records loaded in %.0f s; table and indexes %s MB (+%s MB)\n' \
		"$rows" "$(echo "$(now) - $t0" | bc)" "$(size_mb)" "$backlog_mb"
}

# One cycle: a backlog, one pgbench run during which the worker alternates
# between idle and busy blocks of $block seconds until the backlog is gone,
# then VACUUM and the size.  Alternating in one run puts both figures under
# the same conditions (cache, table size, autovacuum, whatever else the
# machine is doing); the first second of each block is left out.
cycle() {
	local c=$1 rd0 mode=idle n t0
	echo
	echo "== cycle $c"
	load_backlog "$c"
	rd0=$(deleted)

	pace idle
	q "ALTER SYSTEM SET idempotency.cleanup_interval = 1" >/dev/null
	q "SELECT pg_reload_conf()" >/dev/null
	# Long enough for any backlog; stopped (SIGTERM) once the backlog is gone.
	# runuser passes the signal on to pgbench.
	if [ "$(id -u)" -eq 0 ]; then
		runuser -u postgres -- "$PG_BINDIR/pgbench" -n -h "$dir" -p "$port" -U postgres -c 2 -j 2 -T 900 \
			-P 1 --progress-timestamp -f "$dir/create.sql" bench >"$dir/pgbench.$c" 2>"$dir/progress.$c" &
	else
		"$PG_BINDIR/pgbench" -n -h "$dir" -p "$port" -U postgres -c 2 -j 2 -T 900 \
			-P 1 --progress-timestamp -f "$dir/create.sql" bench >"$dir/pgbench.$c" 2>"$dir/progress.$c" &
	fi
	local pgbench_pid=$!
	sleep 2
	: >"$dir/blocks.$c"
	t0=$(now)
	while :; do
		progress_mark "$mode" >>"$dir/blocks.$c"
		# Poll every half second in both modes alike; stop when the backlog is gone.
		for n in $(seq $((block * 2))); do
			sleep 0.5
			[ $(($(deleted) - rd0)) -ge "$rows" ] && break 2
		done
		if [ "$mode" = idle ]; then mode=busy; else mode=idle; fi
		pace "$mode"
		if [ "$(echo "$(now) - $t0 > 600" | bc)" = 1 ]; then
			echo "  (stopped after 10 minutes: the backlog is not gone)"
			break
		fi
	done
	progress_mark end >>"$dir/blocks.$c"
	kill -TERM "$pgbench_pid" 2>/dev/null || true
	wait "$pgbench_pid" 2>/dev/null || true

	q "ALTER SYSTEM SET idempotency.cleanup_interval = '1h'" >/dev/null
	pace busy
	q "VACUUM idempotency.records"
	live=$(q "SELECT count(*) FROM idempotency.records")

	# Per-second tps by the block it fell in; rows deleted per busy second.
	awk -v out="$dir/result.$c" '
		FNR == NR { bt[++nb] = $1; bm[nb] = $2; bd[nb] = $3; next }
		/^progress:/ {
			t = $2 + 0
			for (i = 1; i < nb; i++)
				if (t - 1 >= bt[i] + 1 && t <= bt[i + 1]) { s[bm[i]] += $4; k[bm[i]]++ }
		}
		END {
			for (i = 1; i < nb; i++) if (bm[i] == "busy") { dt += bt[i + 1] - bt[i]; dd += bd[i + 1] - bd[i] }
			printf "%.0f %.0f %d %d %.0f %.1f\n", k["idle"] ? s["idle"] / k["idle"] : 0,
				k["busy"] ? s["busy"] / k["busy"] : 0, k["idle"], k["busy"], dt ? dd / dt : 0, dt > out
		}' "$dir/blocks.$c" "$dir/progress.$c"
	read -r tps_idle tps_busy n_idle n_busy rate busy_s <"$dir/result.$c"
	if [ "$n_idle" -lt 3 ] || [ "$n_busy" -lt 3 ]; then
		echo "  (fewer than 3 seconds of a kind: raise BENCH_ROWS or BENCH_BLOCK for figures worth reading)"
		[ "$tps_idle" -gt 0 ] || tps_idle=1
	fi

	printf '  create TPS, worker idle:                 %8s   (%s seconds)\n' "$tps_idle" "$n_idle"
	printf '  create TPS, worker deleting the backlog: %8s   (%s seconds)   ratio %.3f (target >= 0.90)\n' \
		"$tps_busy" "$n_busy" "$(echo "$tps_busy / $tps_idle" | bc -l)"
	printf '  rows deleted per second while busy:      %8s   %.1f x the creates per second (target >= 1)\n' \
		"$rate" "$(echo "$rate / $tps_idle" | bc -l)"
	printf '  the backlog took %s s of busy blocks\n' "$busy_s"
	printf '  after VACUUM: idempotency.records %s MB (heap %s MB, indexes %s MB), %s live records\n' \
		"$(size_mb)" "$(heap_mb)" "$(($(size_mb) - $(heap_mb)))" "$live"
	summary+=("$(printf '  cycle %d: create TPS busy/idle %.3f; deleted/s over creates/s %.1f; %5s MB for %8s live records (%s bytes per live record)' \
		"$c" "$(echo "$tps_busy / $tps_idle" | bc -l)" "$(echo "$rate / $tps_idle" | bc -l)" \
		"$(size_mb)" "$live" "$(q "SELECT pg_total_relation_size('idempotency.records') / $live")")")
}

summary=()
echo "cleanup benchmark: backlog $rows expired records, $cycles cycles, create load of 2 pgbench clients, blocks of $block s"
for c in $(seq "$cycles"); do
	cycle "$c"
done

echo
echo "== summary (targets: busy/idle >= 0.90; deleted/s over creates/s >= 1; size per live record not growing)"
printf '%s\n' "${summary[@]}"
