#!/usr/bin/env bash
# Relay benchmark, in one run on a throwaway cluster:
#
# 1. Delivery latency (issue 11): the time from an event's commit to its
#    receipt by a healthy endpoint (a local nginx answering 204), at a steady
#    BENCH_LATENCY_RATE events per second (default 1000, one event per
#    transaction, published by pgbench --rate: a Poisson schedule of that
#    mean), p50 and p99, (a) alone and (b) while a second destination's
#    endpoint takes 5 s to answer each request and a third blackholes
#    (accepts connections, never answers) -- both with a backlog, both with
#    the default options -- side by side, with the ratio p99(b) / p99(a).
#    The commit time is the transaction's commit timestamp
#    (track_commit_timestamp, from the event's xmin), the receipt time
#    nginx's $msec in its access log (millisecond resolution).
#    Targets: ratio <= 1.5, p99(b) < 100 ms.
#
# 2. Throughput: how many events per second the relay delivers through
#    'function', 'notify' and 'http' destinations, with the HTTP figure set
#    against bench/curl_floor.c (the relay's requests -- same body, same
#    headers, a signature-sized webhook-signature -- sent with libcurl
#    alone, no database work, in as many processes; target >= 0.7) and, for
#    information, against what wrk gets from the same nginx.
#
#   bash bench/relay.sh                          # about 8 minutes (the http drains are slow)
#   BENCH_EVENTS=20000 BENCH_ROUNDS=1 BENCH_LATENCY_SECONDS=5 bash bench/relay.sh   # smoke run
#   BENCH_PARTS=throughput BENCH_KINDS=hook bash bench/relay.sh   # webhook throughput only
#
# 3. Many destinations (BENCH_PARTS=destinations, not run by default): the
#    worker's CPU time per webhook at a steady BENCH_DESTS_RATE events/s
#    (default 200) to one healthy destination, (a) with the destinations
#    above only and (b) with BENCH_IDLE_DESTS (default 1000) more http
#    destinations that are active but have nothing to deliver, side by
#    side in alternating rounds, with the ratio (b) / (a): what idle
#    destinations cost the relay's claims.
#
# BENCH_PARTS (default "latency throughput") and BENCH_KINDS (default "hook
# fn chan": http, function and notify) choose what runs; BENCH_PERF=DIR
# records a perf profile of the relay processes during each http drain
# and each steady phase of part 3 into DIR (perf from Debian's linux-perf).
#
# Runs as root: installs nginx-light and wrk if missing (Debian packages),
# builds and installs the extension (IDEM_DESTDIR=/tmp/x installs it into a
# staging copy of PostgreSQL instead of the system one, and the benchmark
# runs that copy's binaries; PG_CONFIG or IDEM_PG_VERSION choose the
# PostgreSQL, see scripts/deps.sh), then runs PostgreSQL, nginx and wrk as
# the unprivileged user "postgres" on loopback ports, in a temp dir removed
# at the end.  The misbehaving endpoints are bench/neighbour.pl.
#
# Each throughput measurement publishes BENCH_EVENTS events (1000 per
# transaction, the publish rate is reported too) to a paused destination,
# resumes it, and times how long the background worker takes to deliver all
# of them, with idempotency.relay_workers at 1 (the worker alone) and 2 (the
# worker and a helper it may start for the backlog; the most relay processes
# seen during the measurement are shown).  The HTTP destination, wrk and
# curl_floor use the same number of concurrent requests
# (idempotency.relay_max_in_flight and the destination's max_in_flight, wrk
# -c, curl_floor's IN_FLIGHT) and the same body and headers.  Measurements
# alternate within each of BENCH_ROUNDS rounds, so load that comes and goes
# on a shared machine hits both sides of a ratio alike.
set -euo pipefail

EVENTS=${BENCH_EVENTS:-50000}
ROUNDS=${BENCH_ROUNDS:-2}
WRK_SECS=${BENCH_WRK_SECONDS:-8}
IN_FLIGHT=${BENCH_IN_FLIGHT:-64}
LAT_RATE=${BENCH_LATENCY_RATE:-1000}
LAT_SECS=${BENCH_LATENCY_SECONDS:-15}
LAT_ROUNDS=${BENCH_LATENCY_ROUNDS:-1}
BACKLOG=${BENCH_NEIGHBOUR_BACKLOG:-2000}
PARTS=${BENCH_PARTS:-latency throughput}
KINDS=${BENCH_KINDS:-hook fn chan}
PERF_DIR=${BENCH_PERF:-}
IDLE_DESTS=${BENCH_IDLE_DESTS:-1000}
DESTS_RATE=${BENCH_DESTS_RATE:-200}
DESTS_SECS=${BENCH_DESTS_SECONDS:-10}
SLOW_SECS=5
PORT=${BENCH_PORT:-5760}
HERE=$(cd "$(dirname "$0")" && pwd)

[ "$(id -u)" -eq 0 ] || { echo "run as root (the servers run as user postgres)" >&2; exit 1; }

cd "$HERE/.."
. scripts/deps.sh
idem_install_deps
idem_pg_env
echo "building and installing the extension${IDEM_DESTDIR:+ into $IDEM_DESTDIR} ..."
idem_build_install
BIN=$PG_BINDIR
[ -x "$BIN/pgbench" ] || { echo "$BIN/pgbench not found" >&2; exit 1; }

# nginx and wrk from Debian.  Installing nginx must not start a system-wide
# nginx on port 80: a policy-rc.d that refuses service starts, only if there
# is none already, removed again afterwards.
if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
	echo "installing nginx-light and wrk ..."
	made_policy=0
	if [ ! -e /usr/sbin/policy-rc.d ]; then
		printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
		chmod +x /usr/sbin/policy-rc.d
		made_policy=1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends nginx-light wrk >/dev/null
	[ "$made_policy" -eq 1 ] && rm -f /usr/sbin/policy-rc.d
fi

as_pg() { runuser -u postgres -- "$@"; }

WORK=$(mktemp -d /tmp/idem-relay-bench.XXXXXX)
chmod 755 "$WORK"
cd "$WORK"
DATA=$WORK/data
PG_STARTED=0
NGINX_STARTED=0
cleanup() {
	local rc=$?
	[ "$NGINX_STARTED" -eq 1 ] && kill "$(cat "$WORK/nginx/nginx.pid" 2>/dev/null)" 2>/dev/null || true
	# The neighbours lead process groups of their own (their connections' processes).
	for f in "$WORK"/neighbour-*.pid; do
		[ -s "$f" ] && kill -- "-$(cat "$f")" 2>/dev/null || true
	done
	if [ "$PG_STARTED" -eq 1 ]; then
		as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null 2>&1 \
			|| as_pg "$BIN/pg_ctl" -D "$DATA" -m immediate -w stop >/dev/null 2>&1 || true
	fi
	rm -rf "$WORK"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Free loopback ports: PostgreSQL's (socket only, but its lock file must be
# free), nginx's and the two misbehaving neighbours'.
free_port() {
	local p=$1
	while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || [ -e "/tmp/.s.PGSQL.$p.lock" ] \
		|| [ -e "/var/run/postgresql/.s.PGSQL.$p.lock" ]; do
		p=$((p + 1))
	done
	echo "$p"
}
PORT=$(free_port "$PORT")
HTTP_PORT=$(free_port $((PORT + 1)))
SLOW_PORT=$(free_port $((HTTP_PORT + 1)))
BLACK_PORT=$(free_port $((SLOW_PORT + 1)))

# ---------------------------------------------------------------- nginx
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 1000; }
http {
	access_log off;
	# The latency destination's receipts: event id and arrival time.
	log_format receipt '\$http_webhook_id \$msec';
	client_body_temp_path $WORK/nginx/body;
	proxy_temp_path $WORK/nginx/proxy;
	fastcgi_temp_path $WORK/nginx/fastcgi;
	uwsgi_temp_path $WORK/nginx/uwsgi;
	scgi_temp_path $WORK/nginx/scgi;
	keepalive_requests 10000000;
	server {
		listen 127.0.0.1:$HTTP_PORT;
		location /lat { access_log $WORK/nginx/receipts.log receipt; return 204; }
		location / { return 204; }
	}
}
EOF
# What the relay sends, for wrk: the payload the events carry, and headers
# of the same sizes as the relay's.
cat >"$WORK/nginx/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"amount": 10, "currency": "EUR", "order": 123456}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["webhook-id"] = "01a2270b-7091-7000-8000-000000000000"
wrk.headers["webhook-timestamp"] = "1800000000"
wrk.headers["webhook-signature"] = "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="
wrk.headers["User-Agent"] = "idempotency-relay/1.1"
EOF
cc -O2 -o "$WORK/curl_floor" "$HERE/curl_floor.c" -lcurl
chown -R postgres: "$WORK"
as_pg nginx -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" -e "$WORK/nginx/error.log"
NGINX_STARTED=1

# The neighbours: one answers after SLOW_SECS, one never answers.
perl "$HERE/neighbour.pl" "$SLOW_PORT" slow "$SLOW_SECS" "$WORK/neighbour-slow.pid" &
perl "$HERE/neighbour.pl" "$BLACK_PORT" blackhole "$WORK/neighbour-black.pid" &
for f in slow black; do
	for _ in $(seq 50); do [ -s "$WORK/neighbour-$f.pid" ] && break; sleep 0.1; done
	[ -s "$WORK/neighbour-$f.pid" ] || { echo "the $f neighbour did not start" >&2; exit 1; }
done

# ---------------------------------------------------------------- PostgreSQL
as_pg "$BIN/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --no-locale >"$WORK/initdb.log" 2>&1 \
	|| { cat "$WORK/initdb.log"; exit 1; }
cat >>"$DATA/postgresql.conf" <<EOF

# idempotency relay benchmark
port = $PORT
listen_addresses = ''
unix_socket_directories = '$WORK'
shared_preload_libraries = 'idempotency'
synchronous_commit = off        # measure CPU cost, not fsync latency (as bench/run.sh)
shared_buffers = 256MB
max_wal_size = 8GB
checkpoint_timeout = 30min
log_min_messages = warning
track_commit_timestamp = on     # commit -> receipt latency
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'   # the worker relays; cleanup runs at its start only
idempotency.relay_max_in_flight = $IN_FLIGHT
idempotency.relay_allowed_networks = '127.0.0.1'   # nginx listens on loopback
EOF
as_pg "$BIN/pg_ctl" -D "$DATA" -l "$WORK/server.log" -w start >/dev/null \
	|| { cat "$WORK/server.log"; exit 1; }
PG_STARTED=1

sql() { as_pg "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$WORK" -p "$PORT" -U postgres -d postgres "$@"; }

sql >/dev/null <<EOF
CREATE EXTENSION idempotency;
-- What a function destination typically does: write the event elsewhere.
CREATE TABLE inbox (event_id uuid PRIMARY KEY, topic text, payload jsonb);
CREATE FUNCTION to_inbox(event jsonb) RETURNS void LANGUAGE sql AS \$\$
	INSERT INTO inbox VALUES ((event->>'id')::uuid, event->>'topic', event->'payload')
\$\$;
SELECT idem_destination_create('fn', 'function', 'to_inbox(jsonb)', '{fn.*}');
SELECT idem_destination_create('chan', 'notify', 'bench_events', '{chan.*}');
-- Throughput: as many requests in flight to nginx as wrk and curl_floor keep.
SELECT idem_destination_create('hook', 'http', 'http://127.0.0.1:$HTTP_PORT/hook', '{hook.*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "max_in_flight": $IN_FLIGHT}');
-- Latency: a healthy endpoint and two misbehaving neighbours, default options.
SELECT idem_destination_create('lat', 'http', 'http://127.0.0.1:$HTTP_PORT/lat', '{lat.*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
SELECT idem_destination_create('slow', 'http', 'http://127.0.0.1:$SLOW_PORT/hook', '{slow.*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
SELECT idem_destination_create('black', 'http', 'http://127.0.0.1:$BLACK_PORT/hook', '{black.*}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
SELECT idem_destination_pause('slow');
SELECT idem_destination_pause('black');
CREATE TABLE receipts (event_id uuid, at_epoch numeric);
EOF

worker_up() { sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'"; }
for _ in $(seq 50); do [ "$(worker_up)" = 1 ] && break; sleep 0.2; done
[ "$(worker_up)" = 1 ] || { echo "the idempotency worker is not running" >&2; exit 1; }

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)

now() { date +%s.%N; }

# publish DEST: EVENTS events to destination DEST, paused first, 1000 per
# transaction; prints seconds.
publish() {
	local t0 t1
	sql >/dev/null -c "SELECT idem_destination_pause('$1')"
	t0=$(now)
	sql >/dev/null -c "DO \$\$
		BEGIN
			FOR i IN 1 .. ceil($EVENTS / 1000.0) LOOP
				PERFORM idem_publish('$1.created', jsonb_build_object('order', 100000 + g, 'amount', 10, 'currency', 'EUR'))
				   FROM generate_series(1, least(1000, $EVENTS - (i - 1) * 1000)) g;
				COMMIT;
			END LOOP;
		END \$\$"
	t1=$(now)
	awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }'
}

# Garbage of one measurement must not slow the next one down.
settle() {
	sql -c "TRUNCATE inbox" -c "SET idempotency.outbox_retention = 0" -c "SELECT idem_outbox_cleanup(100000)" >/dev/null
	sql -c "VACUUM ANALYZE idempotency.outbox, idempotency.deliveries, idempotency.destination_stats" -c "CHECKPOINT" >/dev/null
}

# relay_workers N: set idempotency.relay_workers; the idle worker rereads it at once.
relay_workers() {
	sql -c "ALTER SYSTEM SET idempotency.relay_workers = $1" -c "SELECT pg_reload_conf()" >/dev/null
	sleep 0.5
}

# drain DEST: resume DEST and wait until the worker has delivered all EVENTS
# events; prints seconds, the most relay processes (the worker and its
# helpers) seen meanwhile, and the worker's own CPU time per event in µs
# (from /proc; the helpers' is not counted, so it means most with 1
# relay process).  The poller is one psql session sending a short
# statement every 5 ms: a loop inside one statement (a DO block) would hold
# its snapshot's xmin all along, so that no dead row version of the outbox
# could be cleaned up while the relay works, which is not how an outbox
# lives.
drain() {
	local q base got procs most=0 t0 t1 wpid c0 c1
	q="SELECT coalesce(sum(s.delivered), 0) FROM idempotency.destination_stats s
	     JOIN idempotency.destinations t ON t.id = s.destination_id WHERE t.name = '$1'"
	base=$(sql -c "$q")
	wpid=$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'")
	c0=$(worker_ticks "$wpid")
	coproc POLL { as_pg "$BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$WORK" -p "$PORT" -U postgres -d postgres; }
	sql -c "SELECT idem_destination_resume('$1')" >/dev/null    # its commit wakes the worker
	t0=$EPOCHREALTIME
	perf_start "$1"
	while :; do
		echo "SELECT pg_sleep(0.005), ($q), (SELECT count(*) FROM pg_stat_activity
			WHERE backend_type IN ('idempotency cleanup', 'idempotency relay'));" >&"${POLL[1]}"
		IFS='|' read -r _ got procs <&"${POLL[0]}" || { echo "!! the poller failed" >&2; kill "$POLL_PID"; return 1; }
		((procs > most)) && most=$procs
		((got >= base + EVENTS)) && break
		((${EPOCHREALTIME/./} - ${t0/./} > 600000000)) \
			&& { echo "!! not delivered after 10 minutes" >&2; kill "$POLL_PID"; return 1; }
	done
	t1=$EPOCHREALTIME
	c1=$(worker_ticks "$wpid")
	perf_stop
	exec {POLL[1]}>&-
	wait "$POLL_PID" 2>/dev/null || true
	awk -v a="$t0" -v b="$t1" -v p="$most" -v c="$((c1 - c0))" -v n="$EVENTS" -v hz="$(getconf CLK_TCK)" \
		'BEGIN { printf "%.3f %d %.1f", b - a, p, c * 1e6 / hz / n }'
}

# worker_ticks PID: user and system CPU time of process PID, in clock ticks.
worker_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

# perf_start DEST: with BENCH_PERF, profile the relay processes while an
# http destination drains (the helpers that start later are not followed).
PERF_PID=
perf_start() {
	[ -n "$PERF_DIR" ] && [ "$1" != fn ] && [ "$1" != chan ] || return 0
	local pids
	pids=$(sql -c "SELECT string_agg(pid::text, ',') FROM pg_stat_activity
		WHERE backend_type IN ('idempotency cleanup', 'idempotency relay')")
	mkdir -p "$PERF_DIR"
	perf record -q -g -p "$pids" -o "$PERF_DIR/perf-$(date +%H%M%S).data" >/dev/null 2>&1 &
	PERF_PID=$!
}
perf_stop() {
	[ -n "$PERF_PID" ] || return 0
	kill -INT "$PERF_PID" 2>/dev/null
	wait "$PERF_PID" 2>/dev/null || true
	PERF_PID=
}

check_delivered() {
	local left
	left=$(sql -c "SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		ON t.id = d.destination_id WHERE d.state <> 'delivered' AND t.name NOT IN ('slow', 'black')")
	[ "$left" = 0 ] || { echo "!! $left deliveries not delivered" >&2; exit 1; }
}

declare -A SECS=() COUNT=()
add() { # add KEY SECONDS COUNT
	SECS[$1]=$(awk -v a="${SECS[$1]:-0}" -v b="$2" 'BEGIN { print a + b }')
	COUNT[$1]=$(( ${COUNT[$1]:-0} + $3 ))
}

# measure DEST WORKERS: publish to DEST, deliver with WORKERS relay processes.
measure() {
	local dest=$1 workers=$2 ps s procs
	settle
	relay_workers "$workers"
	ps=$(publish "$dest")
	add publish "$ps" "$EVENTS"
	read -r s procs cpu <<<"$(drain "$dest")"
	((workers == 1)) || cpu=-    # helpers' CPU is not counted
	[ -n "$s" ] || { echo "!! $dest: delivery did not finish" >&2; exit 1; }
	check_delivered
	add "$dest-w$workers" "$s" "$EVENTS"
	printf '   %-8s %-6s %7d events in %6.2fs: %8.0f events/s   (published at %.0f events/s; relay processes: %d; worker CPU %s us/event)\n' \
		"$dest" "w$workers" "$EVENTS" "$s" "$(awk -v n="$EVENTS" -v s="$s" 'BEGIN { print n / s }')" \
		"$(awk -v n="$EVENTS" -v s="$ps" 'BEGIN { print n / s }')" "$procs" "$cpu"
}

# wrk against the same nginx, IN_FLIGHT connections.
run_wrk() {
	local threads=$1 out req n s
	out=$(as_pg wrk -t"$threads" -c"$IN_FLIGHT" -d"${WRK_SECS}s" -s "$WORK/nginx/post.lua" \
		"http://127.0.0.1:$HTTP_PORT/hook")
	req=$(echo "$out" | sed -n 's/^ *\([0-9]*\) requests in \([0-9.]*\)s.*/\1 \2/p')
	read -r n s <<<"$req"
	add "wrk-t$threads" "$s" "$n"
	printf '   %-8s %-6s %7d requests in %6.2fs: %8.0f requests/s\n' "wrk" "-t$threads" "$n" "$s" \
		"$(awk -v n="$n" -v s="$s" 'BEGIN { print n / s }')"
}

# libcurl alone, as the relay uses it, in PROCS processes at once (as many
# as relay processes), each sending as many requests as a measurement has
# events; the rate is all requests over the time until the last one is done.
run_floor() {
	local procs=$1 t0 t1 s n=$((EVENTS * $1)) pids=()
	rm -f "$WORK"/floor-*.out
	t0=$(now)
	for ((p = 0; p < procs; p++)); do
		as_pg "$WORK/curl_floor" "http://127.0.0.1:$HTTP_PORT/hook" "$EVENTS" "$IN_FLIGHT" >"$WORK/floor-$p.out" &
		pids+=($!)
	done
	wait "${pids[@]}"    # not the neighbours, which run until the end
	t1=$(now)
	s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
	add "floor-p$procs" "$s" "$n"
	printf '   %-8s %-6s %7d requests in %6.2fs: %8.0f requests/s   (CPU per request: %s us)\n' "libcurl" "x$procs" "$n" "$s" \
		"$(awk -v n="$n" -v s="$s" 'BEGIN { print n / s }')" \
		"$(sed -n 's/^cpu \([0-9.]*\) us per request/\1/p' "$WORK"/floor-*.out | paste -sd/)"
}

# ---------------------------------------------------------------- latency

# in_flight DEST: the deliveries to DEST claimed and not recorded yet.
in_flight() {
	sql -c "SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		ON t.id = d.destination_id WHERE t.name = '$1' AND d.state = 'pending'
		AND d.visible_until IS NOT NULL AND d.next_attempt_at > now()"
}

# wait_until DESCRIPTION SECONDS COMMAND...: poll COMMAND every 0.1 s until it succeeds.
wait_until() {
	local what=$1 secs=$2
	shift 2
	for ((i = 0; i < secs * 10; i++)); do
		"$@" && return 0
		sleep 0.1
	done
	echo "!! $what: not after ${secs}s" >&2
	exit 1
}
lat_delivered() {
	[ "$(sql -c "SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		ON t.id = d.destination_id WHERE t.name = 'lat' AND d.state <> 'delivered'")" = 0 ]
}
neighbours_busy() { (($(in_flight slow) >= 16 && $(in_flight black) >= 1)); }
neighbours_quiet() { (($(in_flight slow) == 0 && $(in_flight black) == 0)); }

# neighbours on|off: resume the misbehaving destinations (their circuits
# closed, as resume leaves them) with BACKLOG events each, and wait until
# both have requests in flight; or pause them and wait until none has.
neighbours() {
	if [ "$1" = on ]; then
		sql >/dev/null -c "SELECT idem_publish(p || '.created', jsonb_build_object('order', g, 'amount', 10, 'currency', 'EUR'))
			FROM unnest('{slow,black}'::text[]) p, generate_series(1, $BACKLOG) g"
		sql >/dev/null -c "SELECT idem_destination_resume('slow'), idem_destination_resume('black')"
		wait_until "neighbours busy" 30 neighbours_busy
	else
		sql >/dev/null -c "SELECT idem_destination_pause('slow'), idem_destination_pause('black')"
		wait_until "neighbours quiet" 60 neighbours_quiet
	fi
}

# latency PHASE: LAT_SECS seconds of LAT_RATE events/s to 'lat', one per
# transaction (pgbench --rate, 4 clients), topic lat.PHASE; waits until all
# are delivered.
latency() {
	local phase=$1 out
	echo "SELECT idem_publish('lat.$phase', '{\"amount\": 10, \"currency\": \"EUR\", \"order\": 123456}'::jsonb);" \
		>"$WORK/lat.sql"
	chown postgres: "$WORK/lat.sql"
	out=$(as_pg "$BIN/pgbench" -n -M prepared -R "$LAT_RATE" -T "$LAT_SECS" -c 4 -j 2 \
		-h "$WORK" -p "$PORT" -U postgres -f "$WORK/lat.sql" postgres 2>&1) \
		|| { echo "$out" >&2; exit 1; }
	wait_until "latency events delivered" 120 lat_delivered
	printf '   %-10s published %s events at %s events/s (pgbench; schedule lag %s)\n' "$phase" \
		"$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')" \
		"$(echo "$out" | sed -n 's/^tps = \([0-9.]*\).*/\1/p' | head -n1 | cut -d. -f1)" \
		"$(echo "$out" | sed -n 's/^rate limit schedule lag: //p')"
}

# The neighbours' state as idem_outbox_stats shows it.
neighbour_stats() {
	sql -F ' ' -c "SELECT format('   %-6s %-8s circuit %-6s consecutive_failures %3s  delivered %4s  retried %4s  backlog %5s',
		destination, status, circuit, consecutive_failures, delivered, retried, backlog)
		FROM idem_outbox_stats WHERE destination IN ('slow', 'black') ORDER BY destination DESC"
}

# Percentiles of commit -> receipt, in ms, per phase: "p50 p99 max n published".
declare -A P50=() P99=() PMAX=() NREC=() NPUB=()
latency_results() {
	local phase p50 p99 pmax n pub
	sql -c "TRUNCATE receipts" -c "\\copy receipts FROM '$WORK/nginx/receipts.log' WITH (DELIMITER ' ')"
	while read -r phase p50 p99 pmax n pub; do
		P50[$phase]=$p50 P99[$phase]=$p99 PMAX[$phase]=$pmax NREC[$phase]=$n NPUB[$phase]=$pub
	done < <(sql -F ' ' -c "
		WITH r AS (SELECT event_id, min(at_epoch) AS at_epoch FROM receipts GROUP BY event_id),
		l AS (SELECT substr(o.topic, 5) AS phase,
		             (r.at_epoch - extract(epoch FROM pg_xact_commit_timestamp(o.xmin))) * 1000 AS ms
		        FROM idempotency.outbox o JOIN r ON r.event_id = o.event_id
		       WHERE o.topic LIKE 'lat.%')
		SELECT phase, round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1),
		       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1),
		       round(max(ms), 1), count(*),
		       (SELECT count(*) FROM idempotency.outbox o WHERE o.topic = 'lat.' || phase)
		  FROM l GROUP BY phase")
}

echo "relay benchmark: $EVENTS events per measurement, $ROUNDS rounds, $IN_FLIGHT requests in flight"
echo "PostgreSQL $(sql -c 'SHOW server_version' | cut -d' ' -f1), $(nproc) cores, load average at start: $LOAD_START"
echo "== latency: $LAT_RATE events/s to a healthy endpoint for ${LAT_SECS}s per phase;" \
	"neighbours: ${SLOW_SECS}s per request, blackhole, $BACKLOG events of backlog each"
[[ " $PARTS " == *" latency "* ]] || LAT_ROUNDS=0
for ((round = 1; round <= LAT_ROUNDS; round++)); do
	if ((round % 2)); then
		latency alone
		neighbours on
		latency neighbours
		neighbour_stats
		neighbours off
	else
		neighbours on
		latency neighbours
		neighbour_stats
		neighbours off
		latency alone
	fi
done
((LAT_ROUNDS == 0)) || latency_results
# The neighbours and their backlog leave; the throughput measurements start clean.
sql >/dev/null -c "SELECT idem_destination_drop('slow'), idem_destination_drop('black')"

echo "== throughput"
[[ " $PARTS " == *" throughput "* ]] || ROUNDS=0
# measure_kind DEST WORKERS: measure, if DEST is among BENCH_KINDS.
measure_kind() { [[ " $KINDS " == *" $1 "* ]] && measure "$@" || true; }
for ((round = 1; round <= ROUNDS; round++)); do
	echo "== round $round"
	if ((round % 2)); then
		measure_kind hook 1; measure_kind hook 2; run_floor 1; run_floor 2; run_wrk 1; run_wrk 2
	else
		run_wrk 2; run_wrk 1; run_floor 2; run_floor 1; measure_kind hook 2; measure_kind hook 1
	fi
	measure_kind fn 1
	measure_kind fn 2
	measure_kind chan 1
	measure_kind chan 2
done

echo "== many destinations: $DESTS_RATE events/s for ${DESTS_SECS}s to one destination, with and without $IDLE_DESTS idle ones"
declare -A DCPU=() DN=()
# idle_dests N: make the number of idle http destinations N (created active,
# no event ever routed to them; dropped again for N = 0).
idle_dests() {
	if (($1 > 0)); then
		sql >/dev/null -c "SELECT idem_destination_create('idle' || g, 'http',
			'http://127.0.0.1:$HTTP_PORT/idle/' || g, ARRAY['idle' || g || '.*'],
			'{\"secret\": \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"}')
			FROM generate_series(1, $1) g"
	else
		sql >/dev/null -c "SELECT idem_destination_drop(name) FROM idempotency.destinations WHERE name LIKE 'idle%'"
	fi
	settle
}
# steady PHASE: DESTS_RATE events/s to 'few' for DESTS_SECS s (pgbench
# --rate), until all are delivered; adds the worker's CPU time to PHASE.
steady() {
	local wpid c0 c1 out n
	wpid=$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'")
	echo "SELECT idem_publish('few.$1', '{\"amount\": 10, \"currency\": \"EUR\", \"order\": 123456}'::jsonb);" \
		>"$WORK/few.sql"
	chown postgres: "$WORK/few.sql"
	c0=$(worker_ticks "$wpid")
	perf_start "$1"
	out=$(as_pg "$BIN/pgbench" -n -M prepared -R "$DESTS_RATE" -T "$DESTS_SECS" -c 2 -j 2 \
		-h "$WORK" -p "$PORT" -U postgres -f "$WORK/few.sql" postgres 2>&1) \
		|| { echo "$out" >&2; exit 1; }
	wait_until "steady events delivered" 120 few_delivered
	c1=$(worker_ticks "$wpid")
	perf_stop
	n=$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')
	DCPU[$1]=$(( ${DCPU[$1]:-0} + c1 - c0 ))
	DN[$1]=$(( ${DN[$1]:-0} + n ))
	printf '   %-10s %6d events, worker CPU %7.1f us/event\n' "$1" "$n" \
		"$(awk -v c="$((c1 - c0))" -v n="$n" -v hz="$(getconf CLK_TCK)" 'BEGIN { print c * 1e6 / hz / n }')"
}
few_delivered() {
	[ "$(sql -c "SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		ON t.id = d.destination_id WHERE t.name = 'few' AND d.state <> 'delivered'")" = 0 ]
}
if [[ " $PARTS " == *" destinations "* ]]; then
	sql >/dev/null -c "SELECT idem_destination_create('few', 'http', 'http://127.0.0.1:$HTTP_PORT/few', '{few.*}',
		'{\"secret\": \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"}')"
	relay_workers 1
	for ((round = 1; round <= 2; round++)); do
		if ((round % 2)); then
			steady alone; idle_dests "$IDLE_DESTS"; steady idle; idle_dests 0
		else
			idle_dests "$IDLE_DESTS"; steady idle; idle_dests 0; steady alone
		fi
	done
fi

rate() { awk -v n="${COUNT[$1]:-0}" -v s="${SECS[$1]:-0}" 'BEGIN { if (s > 0) printf "%.0f", n / s; else printf "-" }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "-" && b != "-" && b > 0) printf "%.2f", a / b; else printf "-" }'; }
HTTP1=$(rate hook-w1)
HTTP2=$(rate hook-w2)
FLOOR1=$(rate floor-p1)
FLOOR2=$(rate floor-p2)
WRK1=$(rate wrk-t1)
WRK2=$(rate wrk-t2)
judge() { awk -v v="$1" -v op="$2" -v t="$3" 'BEGIN { ok = (op == "<=") ? v <= t : (op == ">=") ? v >= t : v < t; print (ok ? "ok" : "MISSED") }'; }
echo
echo "== summary (load average at end: $(cut -d' ' -f1-3 /proc/loadavg))"
if ((LAT_ROUNDS > 0)); then
	echo "delivery latency, commit -> receipt by nginx, $LAT_RATE events/s, one per transaction:"
	printf '   %-38s %8s %8s %8s %9s\n' "" "p50 ms" "p99 ms" "max ms" "received"
	printf '   %-38s %8s %8s %8s %9s\n' "(a) alone" "${P50[alone]:-?}" "${P99[alone]:-?}" "${PMAX[alone]:-?}" \
		"${NREC[alone]:-0}/${NPUB[alone]:-?}"
	printf '   %-38s %8s %8s %8s %9s\n' "(b) with a ${SLOW_SECS}-s and a blackhole neighbour" "${P50[neighbours]:-?}" \
		"${P99[neighbours]:-?}" "${PMAX[neighbours]:-?}" "${NREC[neighbours]:-0}/${NPUB[neighbours]:-?}"
	LAT_RATIO=$(ratio "${P99[neighbours]:-0}" "${P99[alone]:-1}")
	printf '   %-38s %8s   target <= 1.5   %s\n' "ratio p99(b) / p99(a)" "$LAT_RATIO" "$(judge "$LAT_RATIO" '<=' 1.5)"
	printf '   %-38s %8s   target < 100    %s\n' "p99(b), ms" "${P99[neighbours]:-?}" "$(judge "${P99[neighbours]:-1e9}" '<' 100)"
fi
echo
echo "throughput (all rounds):"
line() { printf '%-52s %10s  %s\n' "$@"; }
line "measurement" "events/s" "note"
line "publish (idem_publish, 1000 per transaction)" "$(rate publish)" ""
line "function destination, relay_workers = 1" "$(rate fn-w1)" "target >= 10000"
line "function destination, relay_workers = 2" "$(rate fn-w2)" "target >= 10000"
line "notify destination, relay_workers = 1" "$(rate chan-w1)" "target >= 10000"
line "notify destination, relay_workers = 2" "$(rate chan-w2)" "target >= 10000"
line "http destination (nginx 204), relay_workers = 1" "$HTTP1" ""
line "http destination (nginx 204), relay_workers = 2" "$HTTP2" ""
line "libcurl alone (bench/curl_floor.c), 1 process" "$FLOOR1" "requests/s, no database work"
line "libcurl alone (bench/curl_floor.c), 2 processes" "$FLOOR2" "requests/s, no database work"
line "wrk -t1 -c$IN_FLIGHT, same nginx" "$WRK1" "requests/s"
line "wrk -t2 -c$IN_FLIGHT, same nginx" "$WRK2" "requests/s"
R1=$(ratio "$HTTP1" "$FLOOR1")
R2=$(ratio "$HTTP2" "$FLOOR2")
line "ratio http (1 worker) / libcurl, 1 process" "$R1" "target >= 0.7  $(judge "$R1" '>=' 0.7)"
line "ratio http (2 workers) / libcurl, 2 processes" "$R2" "target >= 0.7  $(judge "$R2" '>=' 0.7)"
line "ratio http (1 worker) / wrk -t1" "$(ratio "$HTTP1" "$WRK1")" "information"
line "ratio http (2 workers) / wrk -t1" "$(ratio "$HTTP2" "$WRK1")" "information"
line "ratio http (2 workers) / wrk -t2" "$(ratio "$HTTP2" "$WRK2")" "information"
line "ratio libcurl alone, 1 process / wrk -t1" "$(ratio "$FLOOR1" "$WRK1")" "information"
line "ratio libcurl alone, 2 processes / wrk -t1" "$(ratio "$FLOOR2" "$WRK1")" "information"
if [[ " $PARTS " == *" destinations "* ]]; then
	hz=$(getconf CLK_TCK)
	per() { awk -v c="${DCPU[$1]}" -v n="${DN[$1]}" -v hz="$hz" 'BEGIN { printf "%.1f", c * 1e6 / hz / n }'; }
	echo
	echo "many destinations, worker CPU per webhook at $DESTS_RATE events/s (both rounds):"
	line "(a) one busy destination among $(sql -c "SELECT count(*) FROM idempotency.destinations WHERE name NOT LIKE 'idle%'")" "$(per alone)" "us/event"
	line "(b) the same with $IDLE_DESTS idle destinations more" "$(per idle)" "us/event"
	DR=$(ratio "$(per idle)" "$(per alone)")
	line "ratio (b) / (a)" "$DR" "target <= 1.5  $(judge "$DR" '<=' 1.5)"
fi
