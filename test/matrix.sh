#!/usr/bin/env bash
# The CI matrix: the whole suite on every PostgreSQL version tested here,
# one after the other (the machine has two cores), from this work tree:
#   15  on the host (Debian 12), with the sanitizer run and the Node.js
#       package's tests; then the Debian
#       package built on the host (test/deb.sh host);
#   17  in a Debian 13 "trixie" root, from source as the README says, the
#       Citus tests included (scripts/citus.sh builds Citus there, as on
#       the host), then as installed from the Debian package built there
#       (test/deb.sh);
#   18  in a Debian "sid" root, from source (no Citus: 13.2 does not
#       support PostgreSQL 18).
# Roots come from scripts/debroot.sh (made from nothing or reused from
# /var/cache/idem-roots).  Ends with the line
#   N passed, N failed (PostgreSQL 15: p/f, 17: p/f, ...)
# whose first two numbers sum every run.  Exit status 0 only when nothing
# failed.  IDEM_MATRIX="15 17" (say) runs only those entries; entries are
# 15, 15-deb, 17, 17-deb and 18.
set -uo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
. scripts/debroot.sh

entries=${IDEM_MATRIX:-15 15-deb 17 17-deb 18}
logs=$top/test/results-matrix
rm -rf "$logs"
mkdir -p "$logs"

total_passed=0
total_failed=0
summary=()

# Add the last "N passed, N failed" line of a log to the totals.
tally() {
	local name=$1 log=$2 line p f
	line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n1)
	if [ -z "$line" ]; then
		echo "$name: no result line (see $log)"
		p=0
		f=1
	else
		p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
		f=$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
	fi
	total_passed=$((total_passed + p))
	total_failed=$((total_failed + f))
	summary+=("${name#PostgreSQL }: $p/$f")
	printf '== %s: %s passed, %s failed (%s s)\n' "$name" "$p" "$f" "$SECONDS"
}

# The suite from source in a root of a Debian suite; citus (1 or 0) says
# whether the Citus tests run there.  With 1 the Citus tarball is copied in
# and scripts/citus.sh builds Citus in the root, into the root's own
# /var/cache/idem-citus: the root is kept between runs (debroot.sh), so the
# build is made once per root and PostgreSQL minor version.
run_in_root() {
	local suite=$1 name=$2 log=$3 citus=$4 r
	idem_root_lock "$suite"
	r=$(idem_root_prepare "$suite") || { echo "0 passed, 1 failed" >"$log"; idem_root_unlock; return; }
	trap 'idem_root_umount "$r"' EXIT
	idem_root_copy_source "$r" "$top"
	[ "$citus" = 1 ] && idem_root_copy_citus "$r"
	idem_root_run "$r" env IDEM_SANITIZE=0 IDEM_NODE=0 IDEM_CITUS="$citus" bash -c 'cd /work/idempotency && bash test/run.sh' >"$log" 2>&1
	rm -rf "$logs/$name-results"
	cp -r "$r/work/idempotency/test/results" "$logs/$name-results" 2>/dev/null
	idem_root_umount "$r"
	trap - EXIT
	idem_root_unlock
}

for entry in $entries; do
	log=$logs/$entry.log
	echo "== PostgreSQL $entry: started at $(date -u +%H:%M:%S)"
	case $entry in
	15) bash test/run.sh >"$log" 2>&1 ;;
	15-deb) bash test/deb.sh host >"$log" 2>&1 ;;
	17) run_in_root trixie "$entry" "$log" 1 ;;
	17-deb) bash test/deb.sh trixie >"$log" 2>&1 ;;
	18) run_in_root sid "$entry" "$log" 0 ;;
	*)
		echo "unknown matrix entry $entry" >"$log"
		;;
	esac
	grep -E '^(not ok|ok) |\.\.\. (FAILED|failed)|^t/.*(Dubious|Failed)|^[0-9]+ passed' "$log" | grep -vE '^ok |\.\.\. ok' | sed 's/^/   /'
	tally "PostgreSQL $entry" "$log"
done

echo
echo "logs: $logs"
joined=$(printf '%s, ' "${summary[@]}")
echo "$total_passed passed, $total_failed failed (PostgreSQL ${joined%, })"
[ "$total_failed" -eq 0 ]
