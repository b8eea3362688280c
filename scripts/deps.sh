#!/usr/bin/env bash
# Installs the Debian packages that building and testing idempotency need, if
# any is missing, and builds and installs the extension.  Sourced by
# scripts/demo.sh and test/run.sh; runs as root (a fresh Debian 12 machine
# needs nothing else), or as a user who can already `make install`.

idem_packages=(
	gcc make libc6-dev
	postgresql-15 postgresql-server-dev-15 postgresql-15-pgtap
	libssl-dev libcurl4-openssl-dev libipc-run-perl
	libasan8 libubsan1
)

idem_install_deps() {
	local missing=()
	for p in "${idem_packages[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	# Installing postgresql-15 would otherwise create and start a permanent
	# cluster on port 5432; the project only ever uses throwaway ones.
	if [ ! -d /etc/postgresql/15 ] && [ "$(id -u)" -eq 0 ]; then
		mkdir -p /etc/postgresql-common/createcluster.d
		echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/idempotency.conf
	fi
	if [ "$(id -u)" -ne 0 ]; then
		echo "missing packages: ${missing[*]}; run as root to install them" >&2
		return 1
	fi
	echo "installing: ${missing[*]} (a minute or two on a bare machine)"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The PostgreSQL 15 tools, whatever pg_config is first on PATH.
# IDEM_DESTDIR (optional): install into this staging copy of the installation
# instead of the system one, and run its binaries, e.g. IDEM_DESTDIR=/tmp/pg4
# after `cp -a /usr/lib/postgresql /tmp/pg4/usr/lib/` (and /usr/share/postgresql
# to /tmp/pg4/usr/share/): PostgreSQL finds its share and lib directories
# relative to its bin directory; the copy is made here if it is missing.
# Unset, everything is as before.
idem_pg_env() {
	export PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
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

# Run a command as the unprivileged user "postgres" when we are root:
# PostgreSQL refuses to run as root.
idem_as_pg() {
	if [ "$(id -u)" -eq 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}
