#!/usr/bin/env bash
# Citus benchmark (issue 13, item 6): what idempotency costs a request that
# a Citus coordinator delegates to the worker holding its tenant's shard,
# set against the same delegated request without idempotency (the FLOOR).
#
# Delegation is how the extension is meant to be used on Citus: the
# application calls a PL/pgSQL function distributed by its tenant argument
# and colocated with the tenant tables (here orders, distributed by
# tenant_id bigint), so that the claim, the domain write and the stored
# response run and commit in one local transaction of that worker, against
# its local shards of orders and of idempotency.records (distributed by
# idem_citus_distribute('orders')).  Every call pays the coordinator's
# planning, its round trip to the worker and the worker's Citus planning of
# each statement; the question is what idempotency adds to that.  Measured
# with pgbench on the coordinator, each call a top-level
# `SELECT f(:tenant, :key, 42)` (which Citus delegates):
#
#   create  OURS   create_order(): idem_claim + INSERT INTO orders +
#                  idem_succeed, a new key each call;
#           FLOOR  create_order_floor(): the same INSERT INTO orders of an
#                  equally sized row, nothing else.
#   execute OURS   idem_citus.idem_execute(:tenant, key, request,
#                  'order_handler(jsonb)'), the same create in one call: the
#                  handler does the same INSERT; FLOOR as for create.
#   replay  OURS   create_order() again with keys it completed before: the
#                  claim replays the stored response, nothing is inserted;
#           FLOOR  replay_order_floor(): a primary-key SELECT of the same
#                  stored response from floor_records, a distributed table
#                  with the columns, primary key and rows of the records.
#   BENCH_DECOMPOSE=1 adds, for information (no target), two steps between
#   the floor and create, each against the floor: create_order_glue() is
#   the floor plus what create_order() does besides the extension's calls
#   (the request jsonb built and tested, one more PERFORM of a builtin), and
#   create_order_claim() claims and releases the key around the INSERT,
#   writing no record: what the function's own statements cost, then the
#   claim, then (create itself) the stored response.
#   BENCH_RECORD_FLOOR=1 adds, for information (no target), create against
#   a floor that also writes the record: create_order_floor_record() does
#   the INSERT INTO orders and a plain INSERT of a completed record into
#   floor_records, the least a durable idempotency layer must write, in SQL.
#
# Target (issue 13): the median of the per-round ratios ours/floor >= 0.9.
# Every slice also measures the CPU time per call of the coordinator's and
# the workers' backends (from /proc), a figure that the machine's other load
# disturbs less than throughput: its ratio floor/ours approximates the
# throughput ratio on a machine of our own where these backends' CPU is the
# bottleneck (left out: pgbench's CPU, the same on both sides, and the
# background processes', e.g. the WAL writer's, which ours gives more to do).
#
#   bash bench/citus.sh                     # full run, about 4 minutes
#   BENCH_SMOKE=1 bash bench/citus.sh       # smoke run, about 1.5 minutes
#   BENCH_CLIENTS=8 BENCH_SECONDS=15 BENCH_ROUNDS=6 bash bench/citus.sh
#
# BENCH_CLIENTS (default 4) pgbench clients, BENCH_SECONDS (default 10) per
# slice, BENCH_ROUNDS (default 4) ours/floor pairs per comparison, even, so
# that each side goes first equally often; BENCH_SMOKE=1 makes the defaults
# 2 clients, 3 s, 2 rounds and 2,000 replay keys.  BENCH_TENANTS (1000) and
# BENCH_REPLAY_KEYS (10000) size the data, BENCH_SHARDS (32) the shard
# count, BENCH_PORT (5900) the first port tried (three are used),
# BENCH_PROTOCOL (simple) pgbench's query protocol (-M).  BENCH_NODE_CONF
# is appended to every node's postgresql.conf, for experiments (e.g.
# "idempotency.store_server_errors = on": execute without its subtransaction).
# BENCH_PERF=DIR adds, after each comparison's rounds, a slice of each side
# that is not measured but profiled: perf record of the workers' backends
# into DIR (BENCH_PERF_ARGS, default -g; "--call-graph dwarf -F 999" gives
# call graphs through Debian's postgres, which has no frame pointers), with
# their CPU time per call by shared object.
#
# Runs as root, like bench/relay.sh: builds and installs the extension
# (IDEM_DESTDIR=/tmp/x installs it into a staging copy of PostgreSQL, whose
# binaries then run the benchmark; PG_CONFIG or IDEM_PG_VERSION choose the
# PostgreSQL, see scripts/deps.sh) and Citus (scripts/citus.sh, from the
# source tarball, cached), then runs a coordinator and two workers as user
# "postgres" in a temp dir removed at the end, on Unix sockets only (the
# nodes name each other by that directory, as t/CitusCluster.pm does).
# As in bench/run.sh: synchronous_commit=off (CPU cost, not fsync), rounds
# of ours and the floor alternate, which goes first alternating too, with
# VACUUM + CHECKPOINT before every slice (and an uncounted 3-s warm-up
# slice of each side first), and the target is judged by the median of the
# per-round ratios, since the machine is shared and its throughput swings
# between slices; the summary says when the rounds disagree by more than
# a quarter.
set -euo pipefail

if [ "${BENCH_SMOKE:-0}" = 1 ]; then
	SECS=${BENCH_SECONDS:-3} ROUNDS=${BENCH_ROUNDS:-2} CLIENTS=${BENCH_CLIENTS:-2}
	REPLAY_KEYS=${BENCH_REPLAY_KEYS:-2000}
else
	SECS=${BENCH_SECONDS:-10} ROUNDS=${BENCH_ROUNDS:-4} CLIENTS=${BENCH_CLIENTS:-4}
	REPLAY_KEYS=${BENCH_REPLAY_KEYS:-10000}
fi
RECORD_FLOOR=${BENCH_RECORD_FLOOR:-0}
DECOMPOSE=${BENCH_DECOMPOSE:-0}
PROTOCOL=${BENCH_PROTOCOL:-simple}   # pgbench -M: simple (as bench/run.sh), extended or prepared
TENANTS=${BENCH_TENANTS:-1000}
SHARDS=${BENCH_SHARDS:-32}
PORT=${BENCH_PORT:-5900}
PERF_DIR=${BENCH_PERF:-}
PERF_ARGS=${BENCH_PERF_ARGS:--g}   # e.g. "--call-graph dwarf -F 999": Debian's postgres has no frame pointers
TARGET=0.9
HERE=$(cd "$(dirname "$0")" && pwd)

[ "$(id -u)" -eq 0 ] || { echo "run as root (the cluster runs as user postgres)" >&2; exit 1; }

# ---------------------------------------------------------------- install
cd "$HERE/.."
. scripts/deps.sh
. scripts/citus.sh
idem_install_deps
idem_pg_env
echo "building and installing the extension${IDEM_DESTDIR:+ into $IDEM_DESTDIR} ..."
idem_build_install
idem_citus_install || { echo "Citus is not available: ${IDEM_CITUS_REASON:-}" >&2; exit 1; }
BIN=$PG_BINDIR
[ -x "$BIN/pgbench" ] || { echo "$BIN/pgbench not found" >&2; exit 1; }
if [ -n "$PERF_DIR" ] && ! command -v perf >/dev/null; then
	echo "BENCH_PERF needs perf (Debian's linux-perf)" >&2
	exit 1
fi

# PostgreSQL refuses to run as root.
as_pg() { runuser -u postgres -- "$@"; }

# ---------------------------------------------------------------- cluster
WORK=$(mktemp -d /tmp/idem-citus-bench.XXXXXX)
chmod 755 "$WORK"
cd "$WORK"                        # nothing is written where we were called
STARTED=()                        # data directories of the running nodes

cleanup() {
	local rc=$?
	local d
	for d in "${STARTED[@]}"; do
		as_pg "$BIN/pg_ctl" -D "$d" -m fast -w stop >/dev/null 2>&1 \
			|| as_pg "$BIN/pg_ctl" -D "$d" -m immediate -w stop >/dev/null 2>&1 || true
	done
	rm -rf "$WORK"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port nobody listens on (TCP) and whose socket lock is not taken.  The
# nodes listen only on Unix sockets in $WORK anyway.
free_port() {
	local p=$1
	while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || [ -e "/tmp/.s.PGSQL.$p.lock" ] \
		|| [ -e "/var/run/postgresql/.s.PGSQL.$p.lock" ]; do
		p=$((p + 1))
	done
	echo "$p"
}
COORD_PORT=$(free_port "$PORT")
W1_PORT=$(free_port $((COORD_PORT + 1)))
W2_PORT=$(free_port $((W1_PORT + 1)))

mkdir -p "$WORK/sql" "$WORK/out"
chown -R postgres: "$WORK"

# start_node NAME PORT: initdb and start one node.
start_node() {
	local name=$1 port=$2 data=$WORK/$1
	as_pg "$BIN/initdb" -D "$data" -U postgres -A trust -E UTF8 --no-locale >"$WORK/initdb-$name.log" 2>&1 \
		|| { cat "$WORK/initdb-$name.log"; exit 1; }
	cat >>"$data/postgresql.conf" <<EOF

# idempotency Citus benchmark
port = $port
listen_addresses = ''
unix_socket_directories = '$WORK'
shared_preload_libraries = 'citus,idempotency'   # citus first
synchronous_commit = off        # measure CPU cost, not fsync latency (as bench/run.sh)
fsync = on
shared_buffers = 256MB
max_connections = 200           # a coordinator backend keeps a connection to each worker
max_prepared_transactions = 100 # Citus's two-phase commits (its DDL and metadata)
autovacuum = on
max_wal_size = 8GB              # checkpoints only where the script asks
checkpoint_timeout = 30min
log_min_messages = warning
citus.local_hostname = '$WORK'  # how a node reaches itself (see t/CitusCluster.pm)
citus.enable_statistics_collection = off
citus.shard_count = $SHARDS
track_functions = pl            # where the benchmark's functions ran (calls_of)
${BENCH_NODE_CONF:-}
EOF
	as_pg "$BIN/pg_ctl" -D "$data" -l "$WORK/$name.log" -w start >/dev/null \
		|| { cat "$WORK/$name.log"; exit 1; }
	STARTED+=("$data")
	as_pg "$BIN/createdb" -h "$WORK" -p "$port" -U postgres bench
	# Before the node is added: citus_add_node syncs the metadata to it.
	sqlp "$port" -c 'CREATE EXTENSION citus'
}

# psql on node PORT's bench database: quiet, unaligned, stop at the first error.
sqlp() {
	local port=$1
	shift
	as_pg "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$WORK" -p "$port" -U postgres -d bench "$@"
}
sql() { sqlp "$COORD_PORT" "$@"; }   # on the coordinator

echo "starting a coordinator (port $COORD_PORT) and two workers ($W1_PORT, $W2_PORT) in $WORK ..."
start_node coordinator "$COORD_PORT"
start_node worker1 "$W1_PORT"
start_node worker2 "$W2_PORT"
sql -c "SELECT citus_set_coordinator_host('$WORK', $COORD_PORT)" \
	-c "SELECT citus_add_node('$WORK', $W1_PORT)" -c "SELECT citus_add_node('$WORK', $W2_PORT)" >/dev/null

# ---------------------------------------------------------------- schema
# Made on the coordinator; Citus propagates the extension, the tables'
# shards and the functions to the workers.
sql >/dev/null <<'EOF'
CREATE EXTENSION idempotency;

-- The tenant table: one row per executed order.  key holds the idempotency
-- key, so that orders and records can be counted against each other.
CREATE TABLE orders (
	tenant_id	bigint NOT NULL,
	id			bigserial,
	key			text NOT NULL,
	amount		int NOT NULL,
	created_at	timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (tenant_id, id)
);
SELECT create_distributed_table('orders', 'tenant_id');

-- Records (and inbox) colocated with orders; a bigint tenant gives them a
-- column "tenant" that they are distributed by.
SELECT idem_citus_distribute('orders');

-- OURS: the create flow of the README, delegated to the tenant's worker.
-- A retry of a completed key returns the stored response.
CREATE FUNCTION create_order(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	c		idem_claim_result;
	v_id	bigint;
	v_body	jsonb;
BEGIN
	c := idem_citus.idem_claim(p_tenant, p_key, jsonb_build_object('amount', p_amount, 'key', p_key));
	IF c.outcome = 'replay' THEN
		RETURN c.body;
	ELSIF c.outcome <> 'claimed' THEN
		RAISE EXCEPTION 'idem_claim(%, %): %', p_tenant, p_key, c.outcome;
	END IF;
	INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, p_amount)
	RETURNING id INTO v_id;
	v_body := jsonb_build_object('order_id', v_id);
	PERFORM idem_citus.idem_succeed(p_tenant, p_key, 201, v_body, '{"Location": "/orders"}');
	RETURN v_body;
END $$;
SELECT create_distributed_function('create_order(bigint, text, int)', '$1', colocate_with => 'orders');

-- FLOOR of create: the same function without idempotency.
CREATE FUNCTION create_order_floor(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	v_id	bigint;
BEGIN
	INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, p_amount)
	RETURNING id INTO v_id;
	RETURN jsonb_build_object('order_id', v_id);
END $$;
SELECT create_distributed_function('create_order_floor(bigint, text, int)', '$1', colocate_with => 'orders');

-- OURS, one call: idem_execute delegated to the tenant's worker, which
-- claims, calls this handler (the same INSERT as the floor's) in a
-- subtransaction and stores its response.
CREATE FUNCTION order_handler(request jsonb) RETURNS idem_response
LANGUAGE plpgsql AS $$
DECLARE
	v_id	bigint;
BEGIN
	INSERT INTO orders (tenant_id, key, amount)
	VALUES ((request->>'tenant')::bigint, request->>'key', (request->>'amount')::int)
	RETURNING id INTO v_id;
	RETURN ROW(201, '{"Location": "/orders"}'::jsonb, jsonb_build_object('order_id', v_id))::idem_response;
END $$;

-- FLOOR of replay: the stored response read by primary key, from a table
-- with the records' columns, primary key (scope, key, tenant) and indexes,
-- filled with copies of the replayed records.
CREATE TABLE floor_records (LIKE idempotency.records INCLUDING ALL);
SELECT create_distributed_table('floor_records', 'tenant', colocate_with => 'orders');
CREATE FUNCTION replay_order_floor(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	v_body	jsonb;
BEGIN
	SELECT body INTO v_body FROM floor_records
	 WHERE scope = p_tenant::text AND key = p_key AND tenant = p_tenant;
	IF NOT FOUND THEN
		RAISE EXCEPTION 'no stored response for %, %', p_tenant, p_key;
	END IF;
	RETURN v_body;
END $$;
SELECT create_distributed_function('replay_order_floor(bigint, text, int)', '$1', colocate_with => 'orders');

-- BENCH_DECOMPOSE: the floor plus create_order's statements that are not
-- the extension's (its request built, one more statement) ...
CREATE FUNCTION create_order_glue(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	c		jsonb;
	v_id	bigint;
	v_body	jsonb;
BEGIN
	c := jsonb_build_object('amount', p_amount, 'key', p_key);
	IF c IS NULL THEN
		RETURN NULL;
	END IF;
	INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, p_amount)
	RETURNING id INTO v_id;
	v_body := jsonb_build_object('order_id', v_id);
	PERFORM pg_catalog.jsonb_typeof('{"Location": "/orders"}'::jsonb);
	RETURN v_body;
END $$;
SELECT create_distributed_function('create_order_glue(bigint, text, int)', '$1', colocate_with => 'orders');

-- ... and create_order with a claim that is released, not completed: no record.
CREATE FUNCTION create_order_claim(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	c		idem_claim_result;
	v_id	bigint;
	v_body	jsonb;
BEGIN
	c := idem_citus.idem_claim(p_tenant, p_key, jsonb_build_object('amount', p_amount, 'key', p_key));
	IF c.outcome <> 'claimed' THEN
		RAISE EXCEPTION 'idem_claim(%, %): %', p_tenant, p_key, c.outcome;
	END IF;
	INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, p_amount)
	RETURNING id INTO v_id;
	v_body := jsonb_build_object('order_id', v_id);
	PERFORM idem_citus.idem_release(p_tenant, p_key);
	RETURN v_body;
END $$;
SELECT create_distributed_function('create_order_claim(bigint, text, int)', '$1', colocate_with => 'orders');

-- BENCH_RECORD_FLOOR: the floor of create plus the record a claim and
-- succeed leave (the sizes of ours: a SHA-256 fingerprint, the response),
-- written with SQL.
CREATE FUNCTION create_order_floor_record(p_tenant bigint, p_key text, p_amount int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
	v_id	bigint;
	v_body	jsonb;
BEGIN
	INSERT INTO orders (tenant_id, key, amount) VALUES (p_tenant, p_key, p_amount)
	RETURNING id INTO v_id;
	v_body := jsonb_build_object('order_id', v_id);
	INSERT INTO floor_records (scope, key, state, fingerprint, status, headers, body, token,
							   created_at, completed_at, expires_at, claimed_at, owner, tenant)
	VALUES (p_tenant::text, p_key, 'completed',
			'\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08', 201,
			'{"Location": "/orders"}', v_body, 1, now(), now(), now() + interval '1 day', now(),
			'10', p_tenant);
	RETURN v_body;
END $$;
SELECT create_distributed_function('create_order_floor_record(bigint, text, int)', '$1', colocate_with => 'orders');
EOF

# The pgbench scripts (readable by postgres).  Tenants are drawn from
# BENCH_TENANTS, spread over the shards of both workers; a replay key
# r<n> belongs to tenant n % BENCH_TENANTS + 1, as it was created.
cat >"$WORK/sql/create_ours.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT create_order(:tenant, 'k:client_id-:n', 42);
EOF
cat >"$WORK/sql/create_floor.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT create_order_floor(:tenant, 'f:client_id-:n', 42);
EOF
cat >"$WORK/sql/create_floor_record.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT create_order_floor_record(:tenant, 'g:client_id-:n', 42);
EOF
cat >"$WORK/sql/create_glue.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT create_order_glue(:tenant, 'h:client_id-:n', 42);
EOF
cat >"$WORK/sql/create_claim.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT create_order_claim(:tenant, 'c:client_id-:n', 42);
EOF
cat >"$WORK/sql/execute_ours.sql" <<'EOF'
\set tenant random(1, :ntenants)
\set n random(1, 1000000000000000)
SELECT status FROM idem_citus.idem_execute(:tenant, 'e:client_id-:n', jsonb_build_object('tenant', :tenant, 'key', 'e:client_id-:n', 'amount', 42), 'order_handler(jsonb)');
EOF
cat >"$WORK/sql/replay_ours.sql" <<'EOF'
\set n random(1, :nkeys)
\set tenant :n % :ntenants + 1
SELECT create_order(:tenant, 'r:n', 42);
EOF
cat >"$WORK/sql/replay_floor.sql" <<'EOF'
\set n random(1, :nkeys)
\set tenant :n % :ntenants + 1
SELECT replay_order_floor(:tenant, 'r:n', 42);
EOF
# pgbench sends :variables as parameters under the extended and prepared
# protocols, which a quoted literal cannot hold: build the keys in SQL then.
if [ "$PROTOCOL" != simple ]; then
	sed -i -E "s/'([a-z]):client_id-:n'/'\\1' || :client_id || '-' || :n/g; s/'r:n'/'r' || :n/" "$WORK"/sql/*.sql
fi
chown -R postgres: "$WORK/sql"

PG_VERSION=$(sql -c 'SHOW server_version' | cut -d' ' -f1)
CITUS_VERSION=$(sql -c "SELECT extversion FROM pg_extension WHERE extname = 'citus'")
IDEM_VERSION=$(sql -c "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'")
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)   # other work on the machine is noise

# ---------------------------------------------------------------- helpers

# Garbage of one slice must not slow the next one down.  VACUUM of a
# distributed table runs on its shards; CHECKPOINT on every node.
settle() {
	sql -c 'VACUUM ANALYZE orders, floor_records, idempotency.records'
	local p
	for p in "$COORD_PORT" "$W1_PORT" "$W2_PORT"; do sqlp "$p" -c 'CHECKPOINT'; done
}

# bench_run OUT SCRIPT [ARGS...]: pgbench, CLIENTS clients running SCRIPT on
# the coordinator, its output in directory OUT.
bench_run() {
	local out=$1 script=$2
	shift 2
	mkdir -p "$out"
	chown postgres: "$out"
	(cd "$out" && as_pg "$BIN/pgbench" -n -M "$PROTOCOL" -c "$CLIENTS" -j "$CLIENTS" \
		-h "$WORK" -p "$COORD_PORT" -U postgres -D ntenants="$TENANTS" -D nkeys="$REPLAY_KEYS" \
		-f "$WORK/sql/$script" "$@" bench) >"$out/stdout" 2>"$out/stderr"
}

# cpu_ticks PID...: "pid ticks" for each, its user + system CPU time so far
# in clock ticks (nothing for a process that is gone).
cpu_ticks() {
	local p
	for p in "$@"; do
		[ -r "/proc/$p/stat" ] && awk -v p="$p" '{ print p, $14 + $15 }' "/proc/$p/stat" 2>/dev/null || true
	done
}

# cpu_used BEFORE AFTER: the ticks between two cpu_ticks of the same
# processes, counting only those alive at both.
cpu_used() {
	awk 'NR == FNR { t0[$1] = $2; next } ($1 in t0) { used += $2 - t0[$1] } END { print used + 0 }' \
		<(echo "$1") <(echo "$2")
}

# backends PORT FILTER: the pids of node PORT's client backends in bench
# that match FILTER (an SQL condition on pg_stat_activity).
backends() {
	sqlp "$1" -c "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity
		WHERE backend_type = 'client backend' AND datname = 'bench' AND pid <> pg_backend_pid() AND $2"
}

# run_slice NAME SCRIPT SECONDS [PERF_FILE]: one pgbench slice; prints
# "transactions seconds failed errors coordinator-us workers-us".
# A client aborted by an error makes pgbench exit 2: counted, not fatal.
#
# The last two are the CPU time that one call costs the coordinator's
# backends (pgbench's connections) and the workers' (the coordinator's
# connections to them, "citus_internal gpid=..."), read from /proc over a
# window from 1 s after pgbench started (all connections are open by then,
# and found) to 1 s before its end, both counted from its launch, divided
# by the calls that completed in the window (pgbench's per-transaction log).
# What else runs on the machine changes it less than it changes
# throughput.  With PERF_FILE, perf records the workers' backends during
# the window, which then ends 3 s before the slice does (perf takes its
# time to start and to stop).  The window's end is a deadline, not a
# length: on a loaded machine finding the backends can take a second, and
# a window that ran past pgbench's end lost the backends that had exited,
# which printed per-call figures near 0 (seen 2026-12-05).  A figure whose
# backends were not all there at both ends is printed as -1 and left out
# of the medians.
run_slice() {
	local name=$1 script=$2 secs=$3 perf_file=${4:-}
	local out="$WORK/out/$name-$EPOCHREALTIME" window margin start
	local rc=0 bench_pid coord workers c0 c1 w0 w1 t0 t1 whole
	if [ -n "$perf_file" ]; then margin=3; else margin=1; fi
	start=$EPOCHREALTIME
	bench_run "$out" "$script" -T "$secs" -l --log-prefix="$out/lat" &
	bench_pid=$!
	sleep 1
	coord=$(backends "$COORD_PORT" "application_name = 'pgbench'")
	workers="$(backends "$W1_PORT" "application_name LIKE 'citus_internal gpid=%'") $(backends "$W2_PORT" "application_name LIKE 'citus_internal gpid=%'")"
	c0=$(cpu_ticks $coord) w0=$(cpu_ticks $workers) t0=$EPOCHREALTIME
	# Until the deadline, at least a tenth of a second.
	window=$(awk -v s="$start" -v d="$secs" -v m="$margin" -v n="$t0" 'BEGIN { w = s + d - m - n; printf "%.2f", (w > 0.1 ? w : 0.1) }')
	if [ -n "$perf_file" ]; then
		perf record -q $PERF_ARGS -p "$(echo $workers | tr ' ' ',')" -o "$perf_file" -- sleep "$window" >/dev/null 2>&1 || true
	else
		sleep "$window"
	fi
	c1=$(cpu_ticks $coord) w1=$(cpu_ticks $workers) t1=$EPOCHREALTIME
	# Backends found on both sides, every one present at both ends, or no figure.
	whole=$(( $(echo "$c0" | grep -c .) > 0 && $(echo "$w0" | grep -c .) > 0 &&
		$(echo "$c0" | grep -c .) == $(echo "$c1" | grep -c .) && $(echo "$w0" | grep -c .) == $(echo "$w1" | grep -c .) ))
	c1=$(cpu_used "$c0" "$c1") w1=$(cpu_used "$w0" "$w1")
	wait "$bench_pid" || rc=$?
	local txns tps failed errors calls
	txns=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out/stdout")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' "$out/stdout")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out/stdout")
	errors=$(grep -c -e 'ERROR' -e 'aborted' "$out/stderr" || true)
	if [ "$rc" -ne 0 ] || [ "${errors:-0}" -ne 0 ] || [ -z "$txns" ]; then
		echo "  !! $name: pgbench exit $rc; stderr:" >&2
		head -5 "$out/stderr" | sed 's/^/     /' >&2
		errors=$(( ${errors:-0} > 0 ? errors : 1 ))
	fi
	# Log columns 5 and 6: when a transaction completed (epoch seconds, microseconds).
	calls=$(cat "$out"/lat.* 2>/dev/null | awk -v a="$t0" -v b="$t1" '{ t = $5 + $6 / 1e6 } t >= a && t < b { n++ } END { print n + 0 }')
	rm -f "$out"/lat.*
	# Measured time as pgbench saw it: transactions / tps.
	awk -v t="${txns:-0}" -v r="${tps:-0}" -v f="${failed:-0}" -v e="$errors" -v n="$calls" \
		-v c="$c1" -v w="$w1" -v hz="$(getconf CLK_TCK)" -v whole="$whole" \
		'BEGIN { ok = n && whole; printf "%d %.6f %d %d %.1f %.1f\n", t, (r > 0 ? t / r : 0), f, e,
		         (ok ? c * 1e6 / hz / n : -1), (ok ? w * 1e6 / hz / n : -1) }'
}

# compare NAME OURS_SCRIPT FLOOR_SCRIPT: interleaved rounds; sets OURS_TPS
# FLOOR_TPS RATIO MEDIAN ROUND_RATIOS ERRORS, and CPU_MEDIAN (the median of
# the rounds' floor/ours ratios of CPU time per call, coordinator and
# workers together) and OURS_CPU FLOOR_CPU (the medians of each side's).
compare() {
	local name=$1 ours=$2 floor=$3
	local -A txns=([ours]=0 [floor]=0) secs=([ours]=0 [floor]=0) tps cpu cpus=([ours]="" [floor]="")
	local round side order t s f e c w script ratio cpu_ratio cpu_ratios=""
	ERRORS=0 ROUND_RATIOS=""
	echo "== $name, $CLIENTS clients, $ROUNDS x ${SECS}s per side"
	# Warm-up, not counted: the first slices after setup fill empty tables.
	for side in ours floor; do
		settle
		run_slice "$name-warmup-$side" "$([ $side = ours ] && echo "$ours" || echo "$floor")" 3 >/dev/null
	done
	for ((round = 1; round <= ROUNDS; round++)); do
		if ((round % 2)); then order="ours floor"; else order="floor ours"; fi
		for side in $order; do
			settle
			script=$ours
			[ "$side" = floor ] && script=$floor
			read -r t s f e c w < <(run_slice "$name-$side" "$script" "$SECS")
			tps[$side]=$(awk -v t="$t" -v s="$s" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')
			cpu[$side]=$(awk -v c="$c" -v w="$w" 'BEGIN { printf "%.1f", (c < 0 || w < 0 ? -1 : c + w) }')
			[ "${cpu[$side]}" = -1.0 ] || cpus[$side]+=" ${cpu[$side]}"
			printf '   round %d %-5s %8d tx  %8.1f tps  failed %d  errors %d   CPU us/call: coordinator %5.1f  workers %5.1f   (load %s)\n' \
				"$round" "$side" "$t" "${tps[$side]}" "$f" "$e" "$c" "$w" "$(cut -d' ' -f1 /proc/loadavg)"
			txns[$side]=$((txns[$side] + t))
			secs[$side]=$(awk -v a="${secs[$side]}" -v b="$s" 'BEGIN { print a + b }')
			ERRORS=$((ERRORS + f + e))
		done
		# The two slices of a round ran back to back: their ratio is the
		# least disturbed by load that comes and goes on a shared machine.
		ratio=$(awk -v a="${tps[ours]}" -v b="${tps[floor]}" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
		ROUND_RATIOS+=" $ratio"
		# (None for a round with a side's figure missing.)
		cpu_ratio=-
		[ "${cpu[ours]}" = -1.0 ] || [ "${cpu[floor]}" = -1.0 ] \
			|| cpu_ratio=$(awk -v a="${cpu[ours]}" -v b="${cpu[floor]}" 'BEGIN { printf "%.2f", (a > 0 ? b / a : 0) }')
		[ "$cpu_ratio" = - ] || cpu_ratios+=" $cpu_ratio"
		echo "   round $round ratio $ratio (CPU per call, floor/ours: $cpu_ratio)"
	done
	ROUND_RATIOS=${ROUND_RATIOS# }
	MEDIAN=$(median $ROUND_RATIOS)
	CPU_MEDIAN=$(median $cpu_ratios)
	OURS_CPU=$(median ${cpus[ours]} | awk '{ if ($1 == "-") print "-"; else printf "%.1f", $1 }')
	FLOOR_CPU=$(median ${cpus[floor]} | awk '{ if ($1 == "-") print "-"; else printf "%.1f", $1 }')
	OURS_TPS=$(awk -v t="${txns[ours]}" -v s="${secs[ours]}" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')
	FLOOR_TPS=$(awk -v t="${txns[floor]}" -v s="${secs[floor]}" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')
	RATIO=$(awk -v a="$OURS_TPS" -v b="$FLOOR_TPS" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
	echo "   => ours $OURS_TPS tps, floor $FLOOR_TPS tps, ratio $RATIO, median of the rounds' ratios $MEDIAN;" \
		"CPU per call: ours $OURS_CPU us, floor $FLOOR_CPU us, median of the rounds' floor/ours $CPU_MEDIAN"
	# Rounds that disagree by more than a quarter: the load swung meanwhile.
	NOISY=$(echo "$ROUND_RATIOS" | tr ' ' '\n' | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 }
		END { if (lo > 0 && hi / lo > 1.25) printf "  rounds %.2f-%.2f: load swung, see the CPU ratio", lo, hi }')
}

# median NUMBER...
median() {
	[ $# -gt 0 ] || { echo -; return; }
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) printf "%.2f", v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# profile_pair NAME OURS_SCRIPT FLOOR_SCRIPT: with BENCH_PERF, one more
# slice of each side (at least 6 s), not measured, with perf recording the
# workers' backends into DIR/NAME-SIDE.data; prints their CPU time per call
# by shared object.
profile_pair() {
	[ -n "$PERF_DIR" ] || return 0
	local name=$1 side t s f e c w
	local -A us
	mkdir -p "$PERF_DIR"
	echo "   profile (not measured; BENCH_PERF=$PERF_DIR): CPU time per call, microseconds"
	for side in ours floor; do
		settle
		read -r t s f e c w < <(run_slice "$name-$side-perf" "$([ $side = ours ] && echo "$2" || echo "$3")" \
			$((SECS > 6 ? SECS : 6)) "$PERF_DIR/$name-$side.data")
		printf '     %-5s  coordinator %6.1f   workers %6.1f, of which:\n' "$side" "$c" "$w"
		us[$side]=$w
		# The workers' time by shared object, the biggest first (as
		# percentages where the slice has no CPU figure).
		perf report -i "$PERF_DIR/$name-$side.data" --no-children -g none --sort dso -q 2>/dev/null \
			| awk -v w="$w" 'NF >= 2 && $1 ~ /%$/ { p = $1; sub(/%/, "", p); if (p >= 0.5) printf "            %6.1f%s  %s\n", (w < 0 ? p : p * w / 100), (w < 0 ? "%" : ""), $2 }'
	done
	echo "     workers: ours - floor = $(awk -v a="${us[ours]}" -v b="${us[floor]}" 'BEGIN { if (a < 0 || b < 0) printf "-"; else printf "%.1f", a - b }') us per call;" \
		"symbols: perf report -i $PERF_DIR/$name-ours.data --no-children"
}

# Summary rows, printed at the end.
SUMMARY=()
row() {
	local verdict
	verdict=$(awk -v r="$MEDIAN" -v t="$TARGET" 'BEGIN { print (r + 0 >= t + 0 ? "ok" : "BELOW") }')
	SUMMARY+=("$(printf '%-8s %7s %10s %11s %7s %7s   >= %s %-5s  %-20s %9s %9s %9s%s' "$1" "$CLIENTS" "$OURS_TPS" \
		"$FLOOR_TPS" "$RATIO" "$MEDIAN" "$TARGET" "$verdict" "$ROUND_RATIOS" "$OURS_CPU" "$FLOOR_CPU" "$CPU_MEDIAN" \
		"$( ((ERRORS)) && echo "  ERRORS $ERRORS")$NOISY")")
}

# Where the rows of TABLE whose key starts with PREFIX are: a count per
# worker port.
per_worker() {
	sql -c "SELECT string_agg(nodeport || ': ' || n, ', ' ORDER BY nodeport) FROM (
		SELECT nodeport, sum(result::bigint) AS n
		  FROM run_command_on_placements('$1', \$\$SELECT count(*) FROM %s WHERE key LIKE '$2%%'\$\$)
		 GROUP BY nodeport) w"
}

# calls_of FUNCTION: how many calls of FUNCTION ran on each node so far, as
# "coordinator N, workers N + N": a delegated call runs on a worker only.
calls_of() {
	local p n out=""
	sleep 1                       # the backends' statistics reach shared memory when they exit
	for p in "$COORD_PORT" "$W1_PORT" "$W2_PORT"; do
		n=$(sqlp "$p" -c "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE funcname = '$1'")
		case $p in
		"$COORD_PORT") out="coordinator $n, workers" ;;
		"$W1_PORT") out+=" $n" ;;
		*) out+=" + $n" ;;
		esac
	done
	echo "$out"
}

# ---------------------------------------------------------------- a. create
compare create create_ours.sql create_floor.sql
row create
profile_pair create create_ours.sql create_floor.sql
recs=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'k%' AND state = 'completed'")
orders=$(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'k%'")
floors=$(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'f%'")
echo "   ours: $orders orders, $recs completed records (by worker port: $(per_worker idempotency.records k));" \
	"floor: $floors orders"
echo "   calls so far of create_order: $(calls_of create_order); of create_order_floor: $(calls_of create_order_floor)"
[ "$recs" = "$orders" ] || echo "   !! ours: orders and completed records differ" >&2

# info_row NAME: a summary row for information (no target).
info_row() {
	SUMMARY+=("$(printf '%-8s %7s %10s %11s %7s %7s   %-13s %-20s %9s %9s %9s%s' "$1" "$CLIENTS" "$OURS_TPS" \
		"$FLOOR_TPS" "$RATIO" "$MEDIAN" "(info)" "$ROUND_RATIOS" "$OURS_CPU" "$FLOOR_CPU" "$CPU_MEDIAN" \
		"$( ((ERRORS)) && echo "  ERRORS $ERRORS")$NOISY")")
}

if [ "$DECOMPOSE" = 1 ]; then
	compare "create's own statements, no extension" create_glue.sql create_floor.sql
	info_row "(glue)"
	compare "create with a claim released, no record" create_claim.sql create_floor.sql
	info_row "(claim)"
	echo "   records of the released claims: $(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'c%'")" \
		"(0 expected), orders: $(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'c%'")"
fi

if [ "$RECORD_FLOOR" = 1 ]; then
	compare "create against a floor with the record" create_ours.sql create_floor_record.sql
	info_row "(record)"
	echo "   floor_records: $(sql -c "SELECT count(*) FROM floor_records WHERE key LIKE 'g%'") records," \
		"orders: $(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'g%'")"
fi

# ---------------------------------------------------------------- a2. execute
# The same create as one call of idem_execute, against the same floor.
compare execute execute_ours.sql create_floor.sql
row execute
profile_pair execute execute_ours.sql create_floor.sql
recs=$(sql -c "SELECT count(*) FROM idempotency.records WHERE key LIKE 'e%' AND state = 'completed'")
orders=$(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'e%'")
echo "   ours: $orders orders, $recs completed records; calls so far of order_handler: $(calls_of order_handler)"
[ "$recs" = "$orders" ] || echo "   !! execute: orders and completed records differ" >&2

# ---------------------------------------------------------------- b. replay
# REPLAY_KEYS keys created through create_order itself, from the
# coordinator (so delegated, as in the measurement), then their records
# copied into floor_records (a colocated INSERT ... SELECT, run on the shards).
echo "== populating $REPLAY_KEYS completed keys over $TENANTS tenants"
awk -v k="$REPLAY_KEYS" -v t="$TENANTS" \
	'BEGIN { for (n = 1; n <= k; n++) printf "SELECT create_order(%d, %c%s%c, 42);\n", n % t + 1, 39, "r" n, 39 }' \
	>"$WORK/sql/populate.sql"
chown postgres: "$WORK/sql/populate.sql"
sql -f "$WORK/sql/populate.sql" >/dev/null
sql -c "INSERT INTO floor_records SELECT * FROM idempotency.records WHERE key ~ '^r[0-9]+\$'"
FLOOR_ROWS=$(sql -c "SELECT count(*) FROM floor_records WHERE key ~ '^r[0-9]+\$'")
echo "   records $(sql -c "SELECT count(*) FROM idempotency.records WHERE key ~ '^r[0-9]+\$' AND state = 'completed'")" \
	"(by worker port: $(per_worker idempotency.records r)), floor_records $FLOOR_ROWS"
orders_before=$(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'r%'")
# (Each a top-level call of its own: only those does Citus delegate.)
echo "   create_order on a completed key: $(sql -c "SELECT create_order(1, 'r$TENANTS', 42)");" \
	"the floor: $(sql -c "SELECT replay_order_floor(1, 'r$TENANTS', 42)")"

compare replay replay_ours.sql replay_floor.sql
row replay
profile_pair replay replay_ours.sql replay_floor.sql
orders_after=$(sql -c "SELECT count(*) FROM orders WHERE key LIKE 'r%'")
echo "   orders of the replayed keys: $orders_before before, $orders_after after (a replay inserts nothing)"
echo "   calls so far of create_order: $(calls_of create_order); of replay_order_floor: $(calls_of replay_order_floor)"
[ "$orders_before" = "$orders_after" ] || echo "   !! replays inserted orders" >&2

# ---------------------------------------------------------------- summary
echo
echo "idempotency $IDEM_VERSION on Citus $CITUS_VERSION  $(date +%F)  ($(nproc) cores, PostgreSQL $PG_VERSION," \
	"coordinator + 2 workers on this machine, $SHARDS shards, synchronous_commit=off, pgbench -M $PROTOCOL," \
	"$ROUNDS x ${SECS}s per side)"
printf '%-8s %7s %10s %11s %7s %7s   %-13s %-20s %9s %9s %9s\n' test clients "ours tps" "floor tps" ratio median target \
	"round ratios" "ours us" "floor us" "CPU ratio"
echo "(ratio: all transactions of each side; median: of the per-round ratios, which the target is judged by;"
echo " us: CPU time of the coordinator's and the workers' backends per call, median of the rounds; CPU ratio:"
echo " median of the rounds' floor us / ours us, which the machine's other load changes less)"
printf '%s\n' "${SUMMARY[@]}"
echo "load average at start $LOAD_START, at end $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$PERF_DIR" ] && echo "perf profiles of the workers' backends: $PERF_DIR/*.data"
exit 0
