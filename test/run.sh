#!/usr/bin/env bash
# Runs the whole idempotency test suite on throwaway clusters:
#   pg_regress (sql/, expected/), pg_isolation_regress (specs/), TAP (t/).
# Installs what it needs first (as root), builds and installs the extension,
# runs the servers as the unprivileged user "postgres", and ends with a line
#   N passed, N failed
# Exit status 0 only when nothing failed.
#
# IDEM_INSTALLED=1 tests the extension already installed for this PostgreSQL
# (by the Debian package, say) instead of building and installing it.
#
# In every mode it builds and installs the test-only module
# test/modules/idem_test (the relay harness of the TAP tests), which the
# extension's build and package leave out; with IDEM_INSTALLED=1 that is
# the only thing it builds and installs.
#
# Arguments, if any, are extended regular expressions: only the tests whose
# name (e.g. "claim", "phases_fencing", "t/020_outbox_http.pl") matches one
# of them run.  For development; CI runs everything.
#
# The Citus tests (TAP tests whose name matches "citus") need Citus, which
# scripts/citus.sh builds once from the source tarball, caches and installs
# for this PostgreSQL before the TAP tests run.  IDEM_CITUS=0 leaves that
# out and the Citus tests skip, as they do where Citus does not support the
# PostgreSQL version (18) and, with IDEM_INSTALLED=1 (which installs
# nothing), unless Citus is already installed.  A skipped test counts as
# neither passed nor failed; a failed install of Citus counts as one failure.
#
# Then "node": test/node.sh tests the npm package clients/node and runs the
# chaos test of examples/payments, each of its tests counted.
#
# Last comes the test "sanitize": test/sanitize.sh runs the pg_regress and
# isolation suites and the hostile-input TAP tests once more against a build
# instrumented with ASan and UBSan (in its own staging copy of PostgreSQL),
# and passes if they pass with no sanitizer report.
set -uo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
. scripts/deps.sh
. scripts/citus.sh

idem_install_deps || exit 1
idem_pg_env
if [ "${IDEM_INSTALLED:-0}" = 1 ]; then
	# Test the extension as installed (e.g. from the Debian package):
	# build and install nothing of it (the test module comes below).
	installed_lib="$("$PG_CONFIG" --pkglibdir)/idempotency.so"
	if [ ! -f "$installed_lib" ]; then
		echo "IDEM_INSTALLED=1 but $installed_lib is not installed"
		echo "0 passed, 1 failed"
		exit 1
	fi
	echo "testing the installed extension: $installed_lib${IDEM_INSTALLED_FROM:+ (from $IDEM_INSTALLED_FROM)}"
	sanitize_only_from_source=1
else
	idem_build_install || { echo "build failed"; echo "0 passed, 1 failed"; exit 1; }
fi
# The TAP tests load the test module; no package ships it, so it is built
# here for this PostgreSQL in either case.
idem_test_module_install || { echo "build of test/modules/idem_test failed"; echo "0 passed, 1 failed"; exit 1; }

# A work directory the server's user can write; results are copied back.
work=$(mktemp -d /tmp/idempotency-test.XXXXXX)
cp -r sql expected specs t test "$work"/
[ "$(id -u)" -eq 0 ] && chown -R postgres: "$work"
rm -rf "$top/test/results"; mkdir -p "$top/test/results"
log="$top/test/results/run.log"
: >"$log"

regress_tests=$(make -s -f Makefile print-REGRESS 2>/dev/null)
isolation_tests=$(make -s -f Makefile print-ISOLATION 2>/dev/null)
tap_tests=$(ls t/*.pl 2>/dev/null)
node_tests=node
sanitize_tests=sanitize

# Keep only the names that match one of the arguments.
select_tests() {
	local name pattern
	for name in "$@"; do
		for pattern in "${filters[@]}"; do
			if [[ $name =~ $pattern ]]; then
				echo "$name"
				break
			fi
		done
	done
}
# IDEM_SANITIZE=0 leaves out the sanitizer run (CI does so in its roots of
# other PostgreSQL versions, where it would double the time).
# IDEM_INSTALLED=1 leaves it out too: it builds from source.
if [ "${IDEM_SANITIZE:-1}" = 0 ] || [ -n "${sanitize_only_from_source:-}" ]; then
	sanitize_tests=
fi
# IDEM_NODE=0 leaves out the Node.js package and chaos tests (test/node.sh),
# as CI does in its roots and when testing an installed package.
if [ "${IDEM_NODE:-1}" = 0 ] || [ -n "${sanitize_only_from_source:-}" ]; then
	node_tests=
fi
filters=("$@")
if [ ${#filters[@]} -gt 0 ]; then
	regress_tests=$(select_tests $regress_tests)
	isolation_tests=$(select_tests $isolation_tests)
	tap_tests=$(select_tests $tap_tests)
	node_tests=$(select_tests $node_tests)
	sanitize_tests=$(select_tests $sanitize_tests)
fi

passed=0
failed=0
skipped=0

# Count pg_regress's result lines: "test x ... ok" / "... FAILED" up to
# PostgreSQL 15, TAP-style "ok 1 - x" / "not ok 3 - x" (or "+" for a test of
# a parallel group) from 16 on.
tally_regress() {
	local out=$1
	local ok bad
	ok=$(grep -cE '^(test | +)[^ ].* \.\.\. ok|^ok [0-9]+ +[-+] ' "$out")
	bad=$(grep -cE '\.\.\. FAILED|\.\.\. failed|^not ok [0-9]+ +[-+] ' "$out")
	passed=$((passed + ok))
	failed=$((failed + bad))
}

section() { printf '\n== %s\n' "$1" | tee -a "$log"; }

if [ -n "$regress_tests" ]; then
section "pg_regress"
(cd "$work" && idem_as_pg "$PGXS_DIR/src/test/regress/pg_regress" \
	--bindir="$PG_BINDIR" --inputdir=. --outputdir=regress \
	--temp-instance=tmp_regress --temp-config=test/idempotency.conf \
	--encoding=UTF8 --no-locale --load-extension=idempotency $regress_tests) 2>&1 | tee -a "$log" >"$work/regress.out"
cat "$work/regress.out"
tally_regress "$work/regress.out"
[ -f "$work/regress/regression.diffs" ] && cp "$work/regress/regression.diffs" "$top/test/results/regression.diffs"
fi

if [ -n "$isolation_tests" ]; then
section "pg_isolation_regress"
(cd "$work" && idem_as_pg "$PGXS_DIR/src/test/isolation/pg_isolation_regress" \
	--bindir="$PG_BINDIR" --inputdir=. --outputdir=isolation \
	--temp-instance=tmp_isolation --temp-config=test/idempotency.conf \
	--encoding=UTF8 --no-locale --load-extension=idempotency $isolation_tests) 2>&1 | tee -a "$log" >"$work/isolation.out"
cat "$work/isolation.out"
tally_regress "$work/isolation.out"
[ -f "$work/isolation/regression.diffs" ] && cp "$work/isolation/regression.diffs" "$top/test/results/isolation.diffs"
fi

# Citus for the Citus tests, if any is selected.  Why they skip, if they do,
# goes to them in IDEM_CITUS_SKIP (t/CitusCluster.pm).
citus_skip=
if [[ $tap_tests =~ citus ]]; then
	section "Citus (scripts/citus.sh)"
	if [ "${IDEM_CITUS:-1}" = 0 ]; then
		citus_skip="IDEM_CITUS=0"
	elif [ -n "${sanitize_only_from_source:-}" ]; then
		echo "IDEM_INSTALLED=1: Citus is not built; the Citus tests run if it is installed"
	else
		echo "(a build from nothing takes about 2 minutes; then it is cached)"
		# Not in a pipeline: IDEM_CITUS_REASON must be set in this shell.
		idem_citus_install >"$work/citus.out" 2>&1
		citus_status=$?
		tee -a "$log" <"$work/citus.out"
		case $citus_status in
		0) ;;
		2) citus_skip=$IDEM_CITUS_REASON ;;
		*)
			citus_skip="the install of Citus failed: $IDEM_CITUS_REASON"
			echo "test citus-install ... FAILED" | tee -a "$log"
			failed=$((failed + 1))
			;;
		esac
	fi
	[ -n "$citus_skip" ] && echo "the Citus tests skip: $citus_skip" | tee -a "$log"
fi

if [ -n "$tap_tests" ]; then
	section "TAP"
	# Where the clusters and logs go: TESTDIR says it up to 15, TESTDATADIR
	# and TESTLOGDIR from 16 on (whose default for logs is "log").
	(cd "$work" && idem_as_pg env PATH="$PG_BINDIR:$PATH" TESTDIR="$work" \
		TESTDATADIR="$work/tmp_check" TESTLOGDIR="$work/tmp_check/log" \
		PG_REGRESS="$PGXS_DIR/src/test/regress/pg_regress" IDEM_CITUS_SKIP="$citus_skip" \
		prove -I "$PGXS_DIR/src/test/perl" -I . $tap_tests) 2>&1 | tee -a "$log" >"$work/tap.out"
	cat "$work/tap.out"
	ok=$(grep -cE '^t/.* ok$' "$work/tap.out")
	# prove's summary names every script that failed, died or exited
	# non-zero; one whose TODO checks passed unexpectedly is listed with
	# "Wstat: 0 ... Failed: 0" and has not failed.
	bad=$(grep -E '^t/[^ ]+ +\(Wstat: ' "$work/tap.out" | grep -cvE '\(Wstat: 0 Tests: [0-9]+ Failed: 0\)$')
	# A script that skipped (plan skip_all: "t/x.pl .. skipped: why") has
	# neither passed nor failed.
	skipped=$(grep -cE '^t/[^ ]+ \.+ skipped' "$work/tap.out")
	passed=$((passed + ok))
	failed=$((failed + bad))
	rm -rf "$top/test/results/tap-logs"; [ -d "$work/tmp_check/log" ] && cp -r "$work/tmp_check/log" "$top/test/results/tap-logs"
fi

if [ -n "$node_tests" ]; then
	section "Node.js: the npm package and the chaos test (test/node.sh)"
	# Its own staging copy of PostgreSQL in this run's work directory (removed
	# with it), so it never touches the one above nor another run's.
	mkdir -p "$work/node-pg"
	IDEM_DESTDIR="$work/node-pg" bash test/node.sh >"$work/node.out" 2>&1
	cat "$work/node.out" >>"$log"
	grep -E '^test |^  \[chaos\]' "$work/node.out"
	node_line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$work/node.out" | tail -n1)
	if [ -n "$node_line" ]; then
		passed=$((passed + ${node_line%% passed*}))
		node_failed=${node_line#*, }
		failed=$((failed + ${node_failed%% failed}))
	else
		echo "test node ... FAILED (no result line; see test/results/run.log)" | tee -a "$log"
		failed=$((failed + 1))
	fi
fi

if [ -n "$sanitize_tests" ]; then
	section "sanitizers (ASan + UBSan build: pg_regress, isolation, hostile-input TAP)"
	bash test/sanitize.sh >"$work/sanitize.out" 2>&1
	sanitize_status=$?
	cat "$work/sanitize.out" >>"$log"
	grep -E '\.\.\. |^t/|^== |sanitizers:' "$work/sanitize.out" | sed 's/^/  [sanitize] /'
	if [ $sanitize_status -eq 0 ]; then
		echo "test sanitize ... ok" | tee -a "$log"
		passed=$((passed + 1))
	else
		echo "test sanitize ... FAILED (see test/results/run.log and test/results/sanitizer/)" | tee -a "$log"
		failed=$((failed + 1))
	fi
fi

expected_count=$(( $(echo $regress_tests | wc -w) + $(echo $isolation_tests | wc -w) + $(echo $tap_tests | wc -w) + $(echo $node_tests | wc -w) + $(echo $sanitize_tests | wc -w) ))
if [ $((passed + failed + skipped)) -lt "$expected_count" ]; then
	echo "only $((passed + failed + skipped)) of $expected_count tests reported a result" | tee -a "$log"
	failed=$((failed + expected_count - passed - failed - skipped))
fi

rm -rf "$work"
echo
[ "$skipped" -gt 0 ] && echo "$skipped skipped (counted neither passed nor failed)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
