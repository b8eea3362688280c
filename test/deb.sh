#!/usr/bin/env bash
# Builds the Debian package postgresql-NN-idempotency and tests it as a DBA
# would get it:
#
#   bash test/deb.sh trixie    # Debian 13, PostgreSQL 17
#   bash test/deb.sh sid       # Debian unstable, PostgreSQL 18
#   bash test/deb.sh host      # build on this machine only (Debian 12: 15)
#
# For a Debian suite: builds with `dpkg-buildpackage -us -uc` in a root of
# that suite made by scripts/debroot.sh (the cached working root
# $IDEM_ROOTS/SUITE), then installs the built package with `apt-get install
# ./postgresql-NN-idempotency_*.deb` into a clean root (a fresh copy of
# $IDEM_ROOTS/SUITE.base, $IDEM_ROOTS/SUITE-deb, removed afterwards), checks
# that the installed library and control file belong to the package
# (`dpkg -S`), and runs the whole suite there against the installed files:
# `IDEM_INSTALLED=1 IDEM_SANITIZE=0 bash test/run.sh` from a copy of the
# source, which builds and installs nothing of the extension in that mode
# (it does install the test tools: server headers, pgTAP, IPC::Run, and the
# test-only module test/modules/idem_test, built there with the installed
# PostgreSQL's pg_config).
#
# Every suite, "host" too, checks that each built package leaves the test
# module out: no idem_test file in it, and no relay harness in its
# idempotency.so.
#
# "host" builds in a scratch copy of the source on this machine and stops
# there (counted as one test, "1 passed, 0 failed"): installing the package
# would change the PostgreSQL that everyone on the machine shares.
#
# The build's output goes to test/results/deb-SUITE/build.log, the built
# packages to test/results/deb-SUITE/, the suite's diffs to
# test/results/deb-SUITE/results/.  Ends with test/run.sh's line
#   N passed, N failed
# (summed when the suite builds for several majors); exit status 0 only when
# the package built, installed and passed.  Runs as root.  IDEM_ROOTS
# (default /var/cache/idem-roots) is where debroot.sh keeps its roots.
set -uo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)

suite=${1:-}
if [ -z "$suite" ] || [ $# -ne 1 ]; then
	echo "usage: bash test/deb.sh SUITE   (a Debian suite such as trixie or sid, or host)" >&2
	exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "test/deb.sh runs as root (it builds roots and installs packages)" >&2
	exit 2
fi

out=$top/test/results/deb-$suite
rm -rf "$out"
mkdir -p "$out"
log=$out/build.log
: >"$log"

say() { echo "deb.sh: $suite: $*"; }

# Ends the run as failed, with the last lines of the build log.
fail() {
	say "$*"
	if [ -s "$log" ]; then
		echo "--- last lines of $log:"
		tail -n 25 "$log"
	fi
	echo
	echo "0 passed, 1 failed"
	exit 1
}

# Prints each built package (not the debug symbols) with its size, and copies
# it to $out.  $1: the directory dpkg-buildpackage wrote the packages to.
report_packages() {
	local dir=$1 deb
	debs=()
	for deb in "$dir"/postgresql-*-idempotency_*.deb; do
		[ -f "$deb" ] || continue
		cp "$deb" "$out/"
		debs+=("$(basename "$deb")")
		say "built $(basename "$deb") ($(stat -c %s "$deb") bytes)"
		check_no_test_module "$deb"
	done
	[ ${#debs[@]} -gt 0 ] || fail "dpkg-buildpackage made no postgresql-NN-idempotency package"
}

# Fails the run if a built package ships test-only code: the module
# test/modules/idem_test, or the relay harness compiled into idempotency.so
# (where it once was).  Reads the .deb with this machine's dpkg-deb, so
# that it needs nothing in the root.  $1: the package file.  grep -c, not
# grep -q: under pipefail, a grep that quits at its first match would end
# the pipeline with the writer's SIGPIPE, and the check would pass.
check_no_test_module() {
	local deb=$1 files lib
	files=$(dpkg-deb -c "$deb" | awk '{print $NF}')
	if [ "$(echo "$files" | grep -c 'idem_test')" -gt 0 ]; then
		fail "$(basename "$deb") ships the test module idem_test"
	fi
	lib=$(echo "$files" | grep -E '/lib/idempotency\.so$' | head -n1)
	[ -n "$lib" ] || fail "$(basename "$deb") has no idempotency.so"
	if [ "$(dpkg-deb --fsys-tarfile "$deb" | tar -xOf - "$lib" | grep -ac 'idem_relay_harness')" -gt 0 ]; then
		fail "the idempotency.so of $(basename "$deb") contains the relay harness"
	fi
	say "$(basename "$deb"): no test module, no relay harness in idempotency.so"
}

# The Build-Depends of debian/control and dpkg-dev, if any is missing.
host_build_deps() {
	local p missing=()
	for p in dpkg-dev debhelper postgresql-server-dev-all libssl-dev libcurl4-openssl-dev gcc make; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	say "installing ${missing[*]}"
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >>"$log" 2>&1
}

if [ "$suite" = host ]; then
	scratch=$(mktemp -d /tmp/idempotency-deb.XXXXXX)
	trap 'rm -rf "$scratch"' EXIT
	host_build_deps || fail "could not install the build dependencies"
	# A copy of the tracked files, so that the packages land in the
	# scratch directory rather than beside the clone.
	mkdir "$scratch/idempotency"
	git ls-files -z --cached --others --exclude-standard |
		tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$scratch/idempotency" -xf -
	say "dpkg-buildpackage -us -uc (log: $log)"
	(cd "$scratch/idempotency" && dpkg-buildpackage -us -uc) >>"$log" 2>&1 ||
		fail "dpkg-buildpackage failed"
	report_packages "$scratch"
	say "not installed: the host's PostgreSQL is shared; bash test/deb.sh trixie (or sid) installs and tests the package"
	# One check ran: the package built.
	echo
	echo "1 passed, 0 failed"
	exit 0
fi

. scripts/debroot.sh
mkdir -p "$IDEM_ROOTS"
# One run at a time in a suite's roots.
idem_root_lock "$suite"

clean=$IDEM_ROOTS/$suite-deb
build_root=
cleanup() {
	[ -n "$build_root" ] && idem_root_umount "$build_root"
	idem_root_remove "$clean"
}
trap cleanup EXIT

# 1. Build in the suite's working root.
say "preparing the build root"
build_root=$(idem_root_prepare "$suite") || fail "could not prepare the root of $suite (see $IDEM_ROOTS/$suite.debootstrap.log)"
idem_root_copy_source "$build_root" "$top"
rm -f "$build_root"/work/*.deb "$build_root"/work/*.changes "$build_root"/work/*.buildinfo \
	"$build_root"/work/*.dsc "$build_root"/work/*.tar.*
say "installing the build dependencies (apt-get build-dep)"
idem_root_run "$build_root" sh -c 'apt-get update -qq &&
	DEBIAN_FRONTEND=noninteractive apt-get build-dep -y -qq /work/idempotency &&
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev' >>"$log" 2>&1 ||
	fail "could not install the build dependencies"
say "dpkg-buildpackage -us -uc (log: $log)"
idem_root_run "$build_root" sh -c 'cd /work/idempotency && dpkg-buildpackage -us -uc' >>"$log" 2>&1 ||
	fail "dpkg-buildpackage failed"
report_packages "$build_root/work"
idem_root_umount "$build_root"
build_root=

# 2. Install into a clean root: a fresh copy of the suite's debootstrap.
say "installing into a clean root ($clean)"
idem_root_remove "$clean" || fail "could not remove the old $clean"
cp -a "$IDEM_ROOTS/$suite.base" "$clean"
idem_root_mount "$clean"
mkdir -p "$clean/tmp/debs"
for deb in "${debs[@]}"; do
	cp "$out/$deb" "$clean/tmp/debs/"
done
install_args=()
for deb in "${debs[@]}"; do
	install_args+=("./$deb")
done
idem_root_run "$clean" sh -c 'cd /tmp/debs && apt-get update -qq &&
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"' sh "${install_args[@]}" >>"$log" 2>&1 ||
	fail "apt-get install ${install_args[*]} failed"

# 3. For each major built: the installed files belong to the package, and the
# suite passes against them.
passed=0
failed=0
idem_root_copy_source "$clean" "$top"
for deb in "${debs[@]}"; do
	pkg=${deb%%_*}
	v=$(echo "$pkg" | sed -nE 's/^postgresql-([0-9]+)-idempotency$/\1/p')
	[ -n "$v" ] || fail "cannot tell the PostgreSQL version of $deb"
	for f in "/usr/lib/postgresql/$v/lib/idempotency.so" "/usr/share/postgresql/$v/extension/idempotency.control"; do
		owner=$(idem_root_run "$clean" dpkg -S "$f" 2>>"$log")
		if [ "$owner" != "$pkg: $f" ]; then
			fail "$f does not belong to $pkg (dpkg -S: ${owner:-no package})"
		fi
		say "dpkg -S: $owner"
	done
	say "test/run.sh against the installed $pkg"
	idem_root_run "$clean" env IDEM_INSTALLED=1 IDEM_SANITIZE=0 IDEM_INSTALLED_FROM="$pkg" \
		PG_CONFIG="/usr/lib/postgresql/$v/bin/pg_config" \
		bash /work/idempotency/test/run.sh 2>&1 | tee "$out/suite-$v.log"
	if [ -d "$clean/work/idempotency/test/results" ]; then
		mkdir -p "$out/results-$v"
		cp -r "$clean/work/idempotency/test/results/." "$out/results-$v/"
	fi
	line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$out/suite-$v.log" | tail -n1)
	if [ -z "$line" ]; then
		say "test/run.sh printed no result line"
		failed=$((failed + 1))
		continue
	fi
	passed=$((passed + ${line%% passed*}))
	n=${line#*, }
	failed=$((failed + ${n%% failed}))
done

echo
if [ ${#debs[@]} -gt 1 ]; then
	say "all majors: $passed passed, $failed failed"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
