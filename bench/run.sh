#!/usr/bin/env bash
# Benchmark of the idempotency extension against a FLOOR: the least any
# durable design must write (one record row with a primary key and an expiry
# index, in the caller's transaction).
#
#   bash bench/run.sh                                  # full run, about 5-6 minutes
#   BENCH_SECONDS=2 BENCH_ROUNDS=1 bash bench/run.sh   # smoke run
#
# Runs as root (the servers and pgbench run as user "postgres") on a throwaway
# cluster in a fresh temp dir, removed at the end.  Needs only PostgreSQL 15
# and the installed extension.
#
# Each comparison runs OURS and FLOOR side by side: BENCH_ROUNDS rounds of
# [ours BENCH_SECONDS s, floor BENCH_SECONDS s], alternating which goes first,
# with VACUUM + CHECKPOINT before every slice; TPS = all transactions / all
# measured time of that side.
set -euo pipefail

SECS=${BENCH_SECONDS:-7}          # length of one pgbench slice
ROUNDS=${BENCH_ROUNDS:-4}         # ours/floor pairs per comparison; even: each side
                                  # goes first equally often
PORT=${BENCH_PORT:-5499}          # first port tried
REPLAY_KEYS=10000                 # completed keys for the replay tests
HOT_KEYS=100                      # keys per 100-ms window, contended tests

BIN=/usr/lib/postgresql/15/bin
BENCH_DIR=$(cd "$(dirname "$0")" && pwd)
SCOPE='bench:POST /orders'

[ "$(id -u)" -eq 0 ] || { echo "run as root (the cluster runs as user postgres)" >&2; exit 1; }
[ -x "$BIN/pgbench" ] || { echo "$BIN/pgbench not found: install postgresql-15" >&2; exit 1; }

# PostgreSQL refuses to run as root.
as_pg() { runuser -u postgres -- "$@"; }

# ---------------------------------------------------------------- cluster
WORK=$(mktemp -d /tmp/idem-bench.XXXXXX)
chmod 755 "$WORK"
cd "$WORK"                        # nothing is written where we were called
DATA=$WORK/data
STARTED=0

cleanup() {
	local rc=$?
	if [ "$STARTED" -eq 1 ]; then
		as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null 2>&1 \
			|| as_pg "$BIN/pg_ctl" -D "$DATA" -m immediate -w stop >/dev/null 2>&1 || true
	fi
	rm -rf "$WORK"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port nobody listens on (TCP) and whose socket lock is not taken.  The
# server listens only on a Unix socket in $WORK anyway.
while (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null \
	|| [ -e "/tmp/.s.PGSQL.$PORT.lock" ] || [ -e "/var/run/postgresql/.s.PGSQL.$PORT.lock" ]; do
	PORT=$((PORT + 1))
done

# The pgbench scripts must be readable by postgres: work on a copy.
mkdir -p "$WORK/sql" "$WORK/out"
cp "$BENCH_DIR"/*.sql "$WORK/sql/"
chown -R postgres: "$WORK"

as_pg "$BIN/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --no-locale >"$WORK/initdb.log" 2>&1 \
	|| { cat "$WORK/initdb.log"; exit 1; }
cat >>"$DATA/postgresql.conf" <<EOF

# idempotency benchmark
port = $PORT
listen_addresses = ''
unix_socket_directories = '$WORK'
shared_preload_libraries = 'idempotency'
synchronous_commit = off        # measure CPU cost, not fsync latency
fsync = on
shared_buffers = 256MB
max_connections = 100
autovacuum = on
max_wal_size = 8GB              # checkpoints only where the script asks
checkpoint_timeout = 30min
log_min_messages = warning
EOF
as_pg "$BIN/pg_ctl" -D "$DATA" -l "$WORK/server.log" -w start >/dev/null \
	|| { cat "$WORK/server.log"; exit 1; }
STARTED=1
as_pg "$BIN/createdb" -h "$WORK" -p "$PORT" -U postgres bench

# psql on the bench database: quiet, unaligned, stop at the first error.
sql() { as_pg "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$WORK" -p "$PORT" -U postgres -d bench "$@"; }

sql -f "$WORK/sql/setup.sql"

# The floor must have exactly the columns of idempotency.records.
cols="SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod) || ' ' || attnotnull
                        || ' ' || attcollation, ', ' ORDER BY attnum)
        FROM pg_attribute WHERE attrelid = '%s'::regclass AND attnum > 0 AND NOT attisdropped"
if [ "$(sql -c "$(printf "$cols" idempotency.records)")" != "$(sql -c "$(printf "$cols" floor_records)")" ]; then
	echo "WARNING: floor_records does not have the columns of idempotency.records:" >&2
	sql -c "$(printf "$cols" idempotency.records)" >&2
fi

PG_VERSION=$(sql -c 'SHOW server_version' | cut -d' ' -f1)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)   # other work on the machine is noise

# ---------------------------------------------------------------- helpers

# Garbage of one slice must not slow the next one down.
settle() {
	sql -c 'VACUUM ANALYZE bench_orders, floor_records, idempotency.records' -c 'CHECKPOINT'
}

# run_slice NAME SCRIPT CLIENTS SECONDS [pgbench args...]
# Runs one pgbench slice; prints "transactions seconds failed errors maxlat_ms".
# A client aborted by an error makes pgbench exit 2: that is counted, not fatal.
SLICE=0
run_slice() {
	local name=$1 script=$2 clients=$3 secs=$4
	shift 4
	SLICE=$((SLICE + 1))
	local out="$WORK/out/$SLICE-$name"
	mkdir -p "$out"
	chown postgres: "$out"
	local rc=0
	(cd "$out" && as_pg "$BIN/pgbench" -n -M simple -T "$secs" -c "$clients" -j "$clients" \
		-h "$WORK" -p "$PORT" -U postgres -l --log-prefix="$out/lat" \
		-f "$WORK/sql/$script" "$@" bench) >"$out/stdout" 2>"$out/stderr" || rc=$?
	local txns tps failed errors maxlat
	txns=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out/stdout")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' "$out/stdout")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out/stdout")
	errors=$(grep -c -e 'ERROR' -e 'aborted' "$out/stderr" || true)
	# Per-transaction log: column 3 is the latency in microseconds.
	local logs=("$out"/lat.*)
	[ -e "${logs[0]}" ] || logs=(/dev/null)
	maxlat=$(awk 'BEGIN { m = 0 } $3 > m { m = $3 } END { printf "%.1f", m / 1000 }' "${logs[@]}")
	if [ "$rc" -ne 0 ] || [ "${errors:-0}" -ne 0 ] || [ -z "$txns" ]; then
		echo "  !! $name: pgbench exit $rc; stderr:" >&2
		head -5 "$out/stderr" | sed 's/^/     /' >&2
		errors=$(( ${errors:-0} > 0 ? errors : 1 ))
	fi
	rm -f "$out"/lat.*
	# Measured time as pgbench saw it: transactions / tps.
	awk -v t="${txns:-0}" -v r="${tps:-0}" -v f="${failed:-0}" -v e="$errors" -v m="$maxlat" \
		'BEGIN { printf "%d %.6f %d %d %s\n", t, (r > 0 ? t / r : 0), f, e, m }'
}

# compare NAME CLIENTS OURS_SCRIPT FLOOR_SCRIPT [pgbench args...]
# Interleaved rounds; sets OURS_TPS FLOOR_TPS RATIO OURS_FAILED OURS_ERRORS
# OURS_MAXLAT FLOOR_FAILED FLOOR_ERRORS FLOOR_MAXLAT.
compare() {
	local name=$1 clients=$2 ours=$3 floor=$4
	shift 4
	local -A txns=([ours]=0 [floor]=0) secs=([ours]=0 [floor]=0) failed=([ours]=0 [floor]=0) \
		errors=([ours]=0 [floor]=0) maxlat=([ours]=0 [floor]=0)
	local round side order t s f e m
	local -A round_tps
	local pair_ratios=""
	echo "== $name, $clients clients, $ROUNDS x ${SECS}s per side"
	for ((round = 1; round <= ROUNDS; round++)); do
		if ((round % 2)); then order="ours floor"; else order="floor ours"; fi
		for side in $order; do
			settle
			local script=$ours
			[ "$side" = floor ] && script=$floor
			read -r t s f e m < <(run_slice "$name-$side" "$script" "$clients" "$SECS" "$@")
			printf '   round %d %-5s %8d tx  %8.1f tps  failed %d  errors %d  max latency %s ms\n' \
				"$round" "$side" "$t" "$(awk -v t="$t" -v s="$s" 'BEGIN { print (s > 0 ? t / s : 0) }')" "$f" "$e" "$m"
			txns[$side]=$((txns[$side] + t))
			secs[$side]=$(awk -v a="${secs[$side]}" -v b="$s" 'BEGIN { print a + b }')
			failed[$side]=$((failed[$side] + f))
			errors[$side]=$((errors[$side] + e))
			maxlat[$side]=$(awk -v a="${maxlat[$side]}" -v b="$m" 'BEGIN { print (b > a ? b : a) }')
			round_tps[$side]=$(awk -v t="$t" -v s="$s" 'BEGIN { print (s > 0 ? t / s : 0) }')
		done
		# The two slices of a round ran back to back: their ratio is the
		# least disturbed by load that comes and goes on a shared machine.
		pair_ratios+=" $(awk -v a="${round_tps[ours]}" -v b="${round_tps[floor]}" 'BEGIN { printf "%.4f", (b > 0 ? a / b : 0) }')"
	done
	MEDIAN=$(echo $pair_ratios | tr ' ' '\n' | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) printf "%.2f", v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
	OURS_TPS=$(awk -v t="${txns[ours]}" -v s="${secs[ours]}" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')
	FLOOR_TPS=$(awk -v t="${txns[floor]}" -v s="${secs[floor]}" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')
	RATIO=$(awk -v a="$OURS_TPS" -v b="$FLOOR_TPS" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
	OURS_FAILED=${failed[ours]} OURS_ERRORS=${errors[ours]} OURS_MAXLAT=${maxlat[ours]}
	FLOOR_FAILED=${failed[floor]} FLOOR_ERRORS=${errors[floor]} FLOOR_MAXLAT=${maxlat[floor]}
	printf '   => ours %s tps, floor %s tps, ratio %s, median of the rounds'"'"' ratios %s\n' \
		"$OURS_TPS" "$FLOOR_TPS" "$RATIO" "$MEDIAN"
}

# The note of a summary row when any slice of the last comparison had errors.
errnote() {
	if ((OURS_ERRORS + OURS_FAILED + FLOOR_ERRORS + FLOOR_FAILED)); then
		echo "ERRORS: ours $((OURS_ERRORS + OURS_FAILED)), floor $((FLOOR_ERRORS + FLOOR_FAILED))"
	fi
}

# Summary rows, printed at the end.
SUMMARY=()
# row TEST CLIENTS TARGET NOTE
row() {
	local verdict=""
	if [ -n "$3" ]; then
		verdict=$(awk -v r="$MEDIAN" -v t="$3" 'BEGIN { print (r + 0 >= t + 0 ? "ok" : "BELOW") }')
	fi
	SUMMARY+=("$(printf '%-24s %7s %10s %11s %7s %7s   %-8s %-5s %s' "$1" "$2" "$OURS_TPS" "$FLOOR_TPS" \
		"$RATIO" "$MEDIAN" "${3:+>= $3}" "$verdict" "$4")")
}

# Check the substitution of pgbench variables inside quoted literals.
echo "== check: pgbench substitutes :variables inside quoted literals"
cat >"$WORK/sql/check_vars.sql" <<'EOF'
\set n random(7, 7)
INSERT INTO bench_orders (key, amount) VALUES ('k:client_id-:n', -1);
EOF
chown postgres: "$WORK/sql/check_vars.sql"
as_pg "$BIN/pgbench" -n -M simple -t 1 -c 1 -h "$WORK" -p "$PORT" -U postgres \
	-f "$WORK/sql/check_vars.sql" bench >/dev/null 2>&1 || true
got=$(sql -c "DELETE FROM bench_orders WHERE amount = -1 RETURNING key")
echo "   key written: $got"
[ "$got" = "k0-7" ] || { echo "pgbench did not substitute variables in literals" >&2; exit 1; }

# ---------------------------------------------------------------- a. create
compare "create" 2 create_ours.sql create_floor.sql
row "create (5 statements)" 2 0.95 "$(errnote)"
unfinished=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'k%' AND state <> 'completed'")
orders=$(sql -c "SELECT count(*) FROM bench_orders WHERE key LIKE 'k%'")
recs=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'k%'")
floors=$(sql -c "SELECT count(*) FROM floor_records WHERE key LIKE 'k%'")
echo "   records: ours $recs (unfinished $unfinished), floor $floors; orders $orders (expected $((recs + floors)))"

# ---------------------------------------------------------------- b. execute
compare "execute" 2 execute_ours.sql execute_floor.sql
row "execute (1 statement)" 2 0.95 "$(errnote)"

# ---------------------------------------------------------------- c. replay
# 10,000 completed keys, the same rows in both tables: claim + succeed pairs
# in one transaction, then a copy of the finished records into the floor.
echo "== populating $REPLAY_KEYS completed keys"
sql <<EOF
DO \$\$
BEGIN
	FOR i IN 1..$REPLAY_KEYS LOOP
		PERFORM idem_claim('$SCOPE', 'r' || i, format('{"amount": 42, "key": "r%s"}', i));
		PERFORM idem_succeed('$SCOPE', 'r' || i, 201, '{"order_id": 1}', '{"Location": "/orders/1"}');
	END LOOP;
END \$\$;
INSERT INTO floor_records SELECT * FROM idempotency.records WHERE key ~ '^r[0-9]+\$';
EOF
settle
echo "   ours $(sql -c "SELECT count(*) FROM idempotency.records WHERE key ~ '^r[0-9]+\$' AND state = 'completed'"), floor $(sql -c "SELECT count(*) FROM floor_records WHERE key ~ '^r[0-9]+\$'")"

outcome=$(sql -c "SELECT outcome || ' ' || status || ' ' || body::text FROM idem_claim('$SCOPE', 'r1', '{\"amount\": 42, \"key\": \"r1\"}')")
echo "   idem_claim on a completed key: $outcome"
[ "${outcome%% *}" = replay ] || echo "   !! expected outcome 'replay'" >&2

compare "replay" 2 replay_ours.sql replay_floor.sql -D nkeys=$REPLAY_KEYS
row "replay" 2 0.85 "$(errnote)"

# WAL written by replays: nothing else runs on this cluster; autovacuum off
# for the measurement.  A replay must not write (no xid, no row lock).
echo "== WAL written during a 2-second replay-only run (autovacuum off)"
sql -c 'ALTER SYSTEM SET autovacuum = off' -c 'SELECT pg_reload_conf()' >/dev/null
sleep 1
# wal_of SCRIPT|idle: prints "WAL-bytes transactions errors" of a 2-second run
# (or of 2 idle seconds), and leaves the WAL record kinds in $WORK/wal-SCRIPT.
wal_of() {
	sql -c 'CHECKPOINT'
	local before after t=0 s f=0 e=0 m
	before=$(sql -c 'SELECT pg_current_wal_insert_lsn()')
	if [ "$1" = idle ]; then
		sleep 2
	else
		read -r t s f e m < <(run_slice "wal-$1" "$1" 2 2 -D nkeys=$REPLAY_KEYS)
	fi
	after=$(sql -c 'SELECT pg_current_wal_insert_lsn()')
	# Which records: "rmgr/record count" of those written in between.
	as_pg "$BIN/pg_waldump" -p "$DATA/pg_wal" -s "$before" -e "$after" 2>/dev/null \
		| sed -n 's/^rmgr: \([A-Za-z0-9]*\) .*desc: \([A-Z_0-9+]*\).*/\1\/\2/p' \
		| sort | uniq -c | awk '{ printf "%s%s x%d", (NR > 1 ? ", " : ""), $2, $1 }' >"$WORK/wal-$1" || true
	echo "$(sql -c "SELECT pg_wal_lsn_diff('$after', '$before')::bigint") $t $((f + e))"
}
read -r WAL_IDLE wal_tx wal_err < <(wal_of idle)
echo "   idle:  $WAL_IDLE bytes of WAL in 2 idle seconds   [$(cat "$WORK/wal-idle")]"
read -r WAL_OURS wal_tx wal_err < <(wal_of replay_ours.sql)
echo "   ours:  $WAL_OURS bytes of WAL for $wal_tx replays (errors $wal_err)   [$(cat "$WORK/wal-replay_ours.sql")]"
read -r WAL_FLOOR wal_tx wal_err < <(wal_of replay_floor.sql)
echo "   floor: $WAL_FLOOR bytes of WAL for $wal_tx selects (errors $wal_err)   [$(cat "$WORK/wal-replay_floor.sql")]"
echo "   (up to a few hundred bytes can come from background activity, e.g. Standby/RUNNING_XACTS: noise)"
sql -c 'ALTER SYSTEM RESET autovacuum' -c 'SELECT pg_reload_conf()' >/dev/null

# ---------------------------------------------------------------- d. contended
# 16 clients, keys drawn from $HOT_KEYS per 100-ms window: duplicate-heavy.
compare "hot create" 16 hot_create_ours.sql hot_create_floor.sql
HOT_OURS_ERR=$((OURS_ERRORS + OURS_FAILED)) HOT_OURS_MAX=$OURS_MAXLAT
HOT_FLOOR_ERR=$((FLOOR_ERRORS + FLOOR_FAILED)) HOT_FLOOR_MAX=$FLOOR_MAXLAT
# Correctness: every hot key executed at most once, and exactly once per record.
dup_ours=$(sql -c "SELECT count(*) FROM (SELECT key FROM bench_orders WHERE key LIKE 'ho%' GROUP BY key HAVING count(*) > 1) d")
dup_floor=$(sql -c "SELECT count(*) FROM (SELECT key FROM bench_orders WHERE key LIKE 'hf%' GROUP BY key HAVING count(*) > 1) d")
keys_ours=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'ho%'")
unfinished=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'ho%' AND state <> 'completed'")
orphans=$(sql -c "SELECT count(*) FROM idempotency.records r WHERE key LIKE 'ho%'
	AND NOT EXISTS (SELECT FROM bench_orders o WHERE o.key = r.key)")
strays=$(sql -c "SELECT count(*) FROM (SELECT DISTINCT key FROM bench_orders o WHERE key LIKE 'ho%'
	AND NOT EXISTS (SELECT FROM idempotency.records r WHERE r.key = o.key)) s")
echo "   ours: $keys_ours hot keys, keys executed more than once $dup_ours, unfinished $unfinished," \
	"records without order $orphans, orders without record $strays"
echo "   ours: errors $HOT_OURS_ERR, max latency $HOT_OURS_MAX ms; floor: errors $HOT_FLOOR_ERR," \
	"duplicates $dup_floor, max latency $HOT_FLOOR_MAX ms"
row "create, $HOT_KEYS hot keys" 16 "" \
	"errors $HOT_OURS_ERR, duplicate executions $dup_ours, max latency $HOT_OURS_MAX ms (floor $HOT_FLOOR_MAX ms)"

compare "hot replay" 16 replay_ours.sql replay_floor.sql -D nkeys=$HOT_KEYS
row "replay, $HOT_KEYS hot keys" 16 "" "$(errnote)"

# ---------------------------------------------------------------- summary
echo
echo "idempotency benchmark  $(date +%F)  ($(nproc) cores, PostgreSQL $PG_VERSION, synchronous_commit=off," \
	"$ROUNDS x ${SECS}s per side)"
printf '%-24s %7s %10s %11s %7s %7s   %s\n' test clients "ours tps" "floor tps" ratio median target
echo "(ratio: all transactions of each side; median: of the per-round ratios, which the target is judged by)"
printf '%s\n' "${SUMMARY[@]}"
echo "load average at start $LOAD_START, at end $(cut -d' ' -f1-3 /proc/loadavg)"
echo "replay WAL in 2 s (2 clients): ours $WAL_OURS bytes, floor $WAL_FLOOR bytes, idle $WAL_IDLE bytes"
