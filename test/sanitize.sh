#!/usr/bin/env bash
# Runs the test suites against a build of the extension instrumented with
# AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   bash test/sanitize.sh                 # pg_regress, isolation, and the TAP
#                                         # tests of hostile input (about 3 min)
#   bash test/sanitize.sh --regress-only  # pg_regress only
#   bash test/sanitize.sh claim t/040     # only the tests matching these patterns
#
# What runs: every pg_regress and isolation test (their expected files must
# still match), and the TAP tests in $sanitize_tap below, which feed the
# extension hostile input and cancel it mid-work.
#
# The extension is built in a scratch copy of the sources with
# -fsanitize=address,undefined -fno-omit-frame-pointer and installed into a
# staging copy of PostgreSQL of its own, ${IDEM_DESTDIR:-/tmp/idempotency}-sanitize
# (never into the system installation).  PostgreSQL itself is Debian's
# uninstrumented build.  In that copy, bin/postgres is replaced by a wrapper
# that starts the real server with the ASan runtime of Debian's gcc preloaded
# (LD_PRELOAD): malloc() and the string and memory functions are then checked
# in the whole server, loads and stores in the extension's code only, and
# the client programs (psql, pg_regress, perl) run uninstrumented.
#
# PostgreSQL's palloc() carves its chunks out of blocks it malloc()s, and is
# not instrumented (no USE_VALGRIND-style redzones here), so ASan sees an
# overrun of a palloc'd chunk only when it runs past the end of the malloc'd
# block: small overruns into a neighbouring chunk go unseen.  Leak detection
# is off: PostgreSQL frees memory by resetting memory contexts, not free().
#
# ASan aborts the process at its first report (the postmaster then restarts
# as after any crash); UBSan reports and continues.
# Reports land in ASan's log directory or, for UBSan (whose runtime, when it
# comes with ASan, ignores UBSAN_OPTIONS' log_path) and for ASan after UBSan
# has written, on the server's stderr: both places are searched.
# PostgreSQL compiles with -fwrapv, so signed overflow is defined behaviour
# there and not reported.
#
# The run fails if a test fails or if there is any sanitizer report at all.
# Reports are copied to test/results/sanitizer/.  Ends with a line
#   sanitizers: N reports (M in the extension's code)
set -uo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
. scripts/deps.sh

# Neither uses the test-only module test/modules/idem_test, so it is not
# installed into the staging copy; a test added here that declares its
# functions would need idem_test_module_install (scripts/deps.sh) after the
# build below.
sanitize_tap="t/040_hostile_input.pl t/041_fingerprint_interrupts.pl"

regress_only=0
filters=()
for arg in "$@"; do
	case $arg in
		--regress-only) regress_only=1 ;;
		*) filters+=("$arg") ;;
	esac
done

idem_install_deps || exit 1
export IDEM_DESTDIR="${IDEM_DESTDIR:-/tmp/idempotency}-sanitize"
idem_pg_env

libasan=$(gcc -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then
	echo "no libasan.so from gcc (Debian package libasan8, a dependency of gcc)" >&2
	exit 1
fi
libasan=$(readlink -f "$libasan")

work=$(mktemp -d /tmp/idempotency-sanitize.XXXXXX)
trap 'rm -rf "$work"' EXIT
results="$top/test/results/sanitizer"
rm -rf "$results"; mkdir -p "$results"

# Build in a copy, so that the worktree's objects stay uninstrumented.
mkdir "$work/build"
cp -r Makefile idempotency.control idempotency--*.sql src "$work/build/"
sanitize_flags="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined"
if ! make -C "$work/build" -s PG_CONFIG="$PG_CONFIG" COPT="$sanitize_flags" >"$work/build.log" 2>&1 ||
	! make -C "$work/build" -s PG_CONFIG="$PG_CONFIG" COPT="$sanitize_flags" \
		install DESTDIR="$IDEM_DESTDIR" >>"$work/build.log" 2>&1; then
	cat "$work/build.log"
	echo "sanitizer build failed"
	echo "sanitizers: 0 reports (0 in the extension's code)"
	exit 1
fi

# A preloaded ASan runtime initialises itself at the first malloc().  In
# PostgreSQL's programs that is one made by libgpg-error's constructor
# (loaded through libsystemd and libgcrypt) inside bindtextdomain(), which
# holds glibc's gettext lock; the initialisation then looks up the optional
# symbol "swift_demangle" with dlsym() and clears the failure with dlerror(),
# whose message translation takes the same lock and leaves it broken, so the
# next bindtextdomain() waits for ever (even `postgres -V` hangs).  A stub
# swift_demangle, which ASan would only call to demangle Swift names and
# which demangles nothing, makes that dlsym() succeed.
pglib="$IDEM_DESTDIR$("$PG_CONFIG" --pkglibdir)"
cat >"$work/swift_demangle_stub.c" <<'STUB'
#include <stddef.h>
#include <stdint.h>
char *swift_demangle(const char *name, size_t len, char *out, size_t *outlen, uint32_t flags);
char *swift_demangle(const char *name, size_t len, char *out, size_t *outlen, uint32_t flags)
{ (void) name; (void) len; (void) out; (void) outlen; (void) flags; return NULL; }
STUB
gcc -shared -fPIC -o "$pglib/swift_demangle_stub.so" "$work/swift_demangle_stub.c" || exit 1

# The server wrapper: the real binary moves to postgres.real once.
marker="idempotency sanitizer wrapper"
if ! grep -q "$marker" "$PG_BINDIR/postgres" 2>/dev/null; then
	mv "$PG_BINDIR/postgres" "$PG_BINDIR/postgres.real"
fi
cat >"$PG_BINDIR/postgres" <<WRAPPER
#!/bin/sh
# $marker (test/sanitize.sh): the server runs with the ASan runtime preloaded.
LD_PRELOAD="$libasan $pglib/swift_demangle_stub.so" exec "$PG_BINDIR/postgres.real" "\$@"
WRAPPER
chmod 755 "$PG_BINDIR/postgres"

select_tests() {
	local name pattern
	for name in "$@"; do
		if [ ${#filters[@]} -eq 0 ]; then echo "$name"; continue; fi
		for pattern in "${filters[@]}"; do
			if [[ $name =~ $pattern ]]; then echo "$name"; break; fi
		done
	done
}
regress_tests=$(select_tests $(make -s -f Makefile print-REGRESS 2>/dev/null))
isolation_tests=""
tap_tests=""
if [ $regress_only -eq 0 ]; then
	isolation_tests=$(select_tests $(make -s -f Makefile print-ISOLATION 2>/dev/null))
	tap_tests=$(select_tests $sanitize_tap)
fi

cp -r sql expected specs t test "$work"/
logs="$work/sanitizer-logs"
mkdir -p "$logs"
[ "$(id -u)" -eq 0 ] && chown -R postgres: "$work"

# The servers inherit these from pg_regress, pg_ctl and the TAP framework.
export ASAN_OPTIONS="detect_leaks=0:log_path=$logs/asan:halt_on_error=1:abort_on_error=1:disable_coredump=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=0"

failed=0
if [ -n "$regress_tests" ]; then
	(cd "$work" && idem_as_pg env ASAN_OPTIONS="$ASAN_OPTIONS" UBSAN_OPTIONS="$UBSAN_OPTIONS" \
		"$PGXS_DIR/src/test/regress/pg_regress" \
		--bindir="$PG_BINDIR" --inputdir=. --outputdir=regress \
		--temp-instance=tmp_regress --temp-config=test/idempotency.conf \
		--encoding=UTF8 --no-locale --load-extension=idempotency $regress_tests) >"$work/regress.out" 2>&1 || failed=1
	cat "$work/regress.out"
	[ -f "$work/regress/regression.diffs" ] && cp "$work/regress/regression.diffs" "$results/"
fi
if [ -n "$isolation_tests" ]; then
	(cd "$work" && idem_as_pg env ASAN_OPTIONS="$ASAN_OPTIONS" UBSAN_OPTIONS="$UBSAN_OPTIONS" \
		"$PGXS_DIR/src/test/isolation/pg_isolation_regress" \
		--bindir="$PG_BINDIR" --inputdir=. --outputdir=isolation \
		--temp-instance=tmp_isolation --temp-config=test/idempotency.conf \
		--encoding=UTF8 --no-locale --load-extension=idempotency $isolation_tests) >"$work/isolation.out" 2>&1 || failed=1
	cat "$work/isolation.out"
	[ -f "$work/isolation/regression.diffs" ] && cp "$work/isolation/regression.diffs" "$results/isolation.diffs"
fi
if [ -n "$tap_tests" ]; then
	(cd "$work" && idem_as_pg env ASAN_OPTIONS="$ASAN_OPTIONS" UBSAN_OPTIONS="$UBSAN_OPTIONS" \
		PATH="$PG_BINDIR:$PATH" TESTDIR="$work" \
		PG_REGRESS="$PGXS_DIR/src/test/regress/pg_regress" \
		prove -I "$PGXS_DIR/src/test/perl" -I . $tap_tests) >"$work/tap.out" 2>&1 || failed=1
	cat "$work/tap.out"
	[ -d "$work/tmp_check/log" ] && cp -r "$work/tmp_check/log" "$results/tap-logs"
fi

# Every sanitizer report, in ASan's log files and in the server logs, and
# how many of them have a frame in the extension (src/*.c or idempotency.so)
# among their first 40 lines.
count_reports() {
	awk '
		/runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer/ {
			if (open && mine) ours++
			reports++; open = 1; mine = 0; left = 40
		}
		open && left-- > 0 && /idempotency\.so|(^|[ \/])src\/[a-z_]+\.c:/ { mine = 1 }
		END { if (open && mine) ours++; print reports + 0, ours + 0 }' "$@"
}
report_files=()
for f in "$logs"/* "$work"/regress/log/*.log "$work"/isolation/log/*.log "$work"/tmp_check/log/*.log; do
	[ -e "$f" ] || continue
	read -r n _ < <(count_reports "$f")
	[ "$n" -eq 0 ] && continue
	report_files+=("$f")
	rel=${f#"$work"/}
	cp "$f" "$results/${rel//\//-}"
	echo "== $n sanitizer reports in $f"
	grep -A20 -E 'runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer' "$f" | head -60
done
read -r reports ours < <(if [ ${#report_files[@]} -gt 0 ]; then count_reports "${report_files[@]}"; else echo 0 0; fi)
[ "$reports" -gt 0 ] && failed=1

echo "sanitizers: $reports reports ($ours in the extension's code)"
[ "$failed" -eq 0 ]
