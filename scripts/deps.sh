#!/usr/bin/env bash
# Installs the Debian packages that building and testing idempotency need, if
# any is missing, and builds and installs the extension.  Sourced by
# scripts/demo.sh and test/run.sh; runs as root (a fresh Debian 12 or 13 machine
# needs nothing else), or as a user who can already `make install`.

# The PostgreSQL major version to build for and test on:
#   - the version of PG_CONFIG, if it is set;
#   - else IDEM_PG_VERSION, if it is set (e.g. IDEM_PG_VERSION=17);
#   - else the distribution's PostgreSQL: the one its "postgresql" package
#     depends on (15 on Debian 12, 17 on Debian 13, 16 on Ubuntu 24.04).
idem_pg_major() {
	local v
	if [ -n "${PG_CONFIG:-}" ]; then
		v=$("$PG_CONFIG" --version 2>/dev/null | sed -nE 's/^PostgreSQL ([0-9]+).*/\1/p')
		# Not installed yet: a Debian path names its version.
		[ -n "$v" ] || v=$(echo "$PG_CONFIG" | sed -nE 's|^/usr/lib/postgresql/([0-9]+)/bin/pg_config$|\1|p')
		[ -n "$v" ] || { echo "PG_CONFIG=$PG_CONFIG: not a pg_config" >&2; return 1; }
		echo "$v"
		return 0
	fi
	if [ -n "${IDEM_PG_VERSION:-}" ]; then
		echo "$IDEM_PG_VERSION"
		return 0
	fi
	v=$(idem_distro_pg_major)
	if [ -z "$v" ] && [ "$(id -u)" -eq 0 ]; then
		# A bare machine may have no package lists yet.
		apt-get update -qq >/dev/null 2>&1
		v=$(idem_distro_pg_major)
	fi
	[ -n "$v" ] || { echo "cannot tell which PostgreSQL this distribution ships; set PG_CONFIG or IDEM_PG_VERSION" >&2; return 1; }
	echo "$v"
}

# The major version of the distribution's "postgresql" package, if apt knows it.
idem_distro_pg_major() {
	apt-cache show --no-all-versions postgresql 2>/dev/null |
		sed -nE 's/^Depends:.*postgresql-([0-9]+).*/\1/p' | head -n1
}

# Installs what building and testing need, if anything is missing.
idem_install_deps() {
	local v missing=() p
	v=$(idem_pg_major) || return 1
	IDEM_PG_MAJOR=$v
	local packages=(gcc make libc6-dev libssl-dev libcurl4-openssl-dev libipc-run-perl)
	# A pg_config of one's own build needs no PostgreSQL packages; pgTAP must
	# then be installed into it by hand.
	case "${PG_CONFIG:-/usr/lib/postgresql/}" in
	/usr/lib/postgresql/*) packages+=("postgresql-$v" "postgresql-server-dev-$v" "postgresql-$v-pgtap") ;;
	esac
	for p in "${packages[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	if [ "$(id -u)" -ne 0 ]; then
		echo "missing packages: ${missing[*]}; run as root to install them" >&2
		return 1
	fi
	# Installing postgresql-NN would otherwise create and start a permanent
	# cluster on port 5432; the project only ever uses throwaway ones.
	if [ ! -d "/etc/postgresql/$v" ]; then
		mkdir -p /etc/postgresql-common/createcluster.d
		echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/idempotency.conf
	fi
	echo "installing: ${missing[*]} (a minute or two on a bare machine)"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The tools of the PostgreSQL chosen by idem_pg_major (PG_CONFIG, else
# /usr/lib/postgresql/N/bin/pg_config), whatever pg_config is first on PATH.
# IDEM_DESTDIR (optional): install into this staging copy of the installation
# instead of the system one, and run its binaries, e.g. IDEM_DESTDIR=/tmp/pg4
# after `cp -a /usr/lib/postgresql /tmp/pg4/usr/lib/` (and /usr/share/postgresql
# to /tmp/pg4/usr/share/): PostgreSQL finds its share and lib directories
# relative to its bin directory; the copy is made here if it is missing.
# Unset, everything is as before.
idem_pg_env() {
	IDEM_PG_MAJOR=${IDEM_PG_MAJOR:-$(idem_pg_major)} || return 1
	export PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config}
	export IDEM_PG_MAJOR
	if [ -n "${IDEM_DESTDIR:-}" ] && [ ! -d "$IDEM_DESTDIR/usr/lib/postgresql" ]; then
		mkdir -p "$IDEM_DESTDIR/usr/lib" "$IDEM_DESTDIR/usr/share"
		cp -a /usr/lib/postgresql "$IDEM_DESTDIR/usr/lib/"
		cp -a /usr/share/postgresql "$IDEM_DESTDIR/usr/share/"
	fi
	PG_BINDIR=${IDEM_DESTDIR:-}$("$PG_CONFIG" --bindir)
	PGXS_DIR=$(cd "$(dirname "$("$PG_CONFIG" --pgxs)")/../.." && pwd)
	export PG_BINDIR PGXS_DIR
}

idem_build_install() {
	make -s PG_CONFIG="$PG_CONFIG" >/dev/null
	make -s PG_CONFIG="$PG_CONFIG" install ${IDEM_DESTDIR:+DESTDIR="$IDEM_DESTDIR"} >/dev/null
}

# Builds and installs the test-only module test/modules/idem_test (the relay
# harness that t/023 and t/026 declare as 'idem_test') for PG_CONFIG, into
# IDEM_DESTDIR if set.  The extension's own build and package never include
# it, so test/run.sh installs it in every mode, IDEM_INSTALLED=1 too: there
# it is built against the installed PostgreSQL's pg_config and the
# extension itself is neither rebuilt nor reinstalled.  Cleaned first: the
# same tree may have built it for another major (test/deb.sh tests each
# major the package was built for from one copy of the source).
idem_test_module_install() {
	local dir=test/modules/idem_test
	make -s -C "$dir" PG_CONFIG="$PG_CONFIG" clean >/dev/null &&
		make -s -C "$dir" PG_CONFIG="$PG_CONFIG" >/dev/null &&
		make -s -C "$dir" PG_CONFIG="$PG_CONFIG" install ${IDEM_DESTDIR:+DESTDIR="$IDEM_DESTDIR"} >/dev/null
}

# Run a command as the unprivileged user "postgres" when we are root:
# PostgreSQL refuses to run as root.
idem_as_pg() {
	if [ "$(id -u)" -eq 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}
