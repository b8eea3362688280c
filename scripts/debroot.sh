#!/usr/bin/env bash
# Debian roots for testing idempotency on other PostgreSQL versions: a
# debootstrap'ed Debian 13 "trixie" (PostgreSQL 17) or "sid" (PostgreSQL 18)
# in which the project's own scripts then install what they need, exactly as
# on a bare machine of that distribution.  Sourced by test/matrix.sh and
# test/deb.sh; runs as root.
#
# Roots are cached between runs under IDEM_ROOTS (default
# /var/cache/idem-roots), outside any clone:
#   $IDEM_ROOTS/SUITE.base/   debootstrap's result, configured, never entered
#   $IDEM_ROOTS/SUITE/        a copy in which packages are installed and tests run
# Either is made from nothing when missing or older than IDEM_ROOT_MAX_DAYS
# (default 7).  A lock per suite (idem_root_lock) keeps two runs out of each
# other's roots.

IDEM_ROOTS=${IDEM_ROOTS:-/var/cache/idem-roots}
IDEM_ROOT_MAX_DAYS=${IDEM_ROOT_MAX_DAYS:-7}

# The Debian mirror this machine uses (its apt sources), for debootstrap.
idem_root_mirror() {
	local m
	m=$(grep -hsE '^URIs: ' /etc/apt/sources.list.d/*.sources | awk '{print $2}' |
		grep -v -e security -e nodesource -e google | head -n1)
	[ -n "$m" ] || m=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
		awk '{print $2}' | grep -v security | head -n1)
	echo "${m:-http://deb.debian.org/debian}"
}

# True when DIR exists, is complete (its stamp is there) and is fresh.
idem_root_fresh() {
	local stamp=$1/.idem-root
	[ -f "$stamp" ] && [ -z "$(find "$stamp" -mtime +"$IDEM_ROOT_MAX_DAYS")" ]
}

# Mount what a root needs to install packages and run PostgreSQL in it.
idem_root_mount() {
	local r=$1
	mountpoint -q "$r/proc" || mount -t proc proc "$r/proc"
	mountpoint -q "$r/dev" || mount --bind /dev "$r/dev"
	mountpoint -q "$r/dev/pts" || mount --bind /dev/pts "$r/dev/pts"
	mkdir -p "$r/dev/shm"
	mountpoint -q "$r/dev/shm" || mount -t tmpfs -o mode=1777,size=2g tmpfs "$r/dev/shm"
	cp /etc/resolv.conf "$r/etc/resolv.conf"
}

# Unmount everything under a root, innermost first.
idem_root_umount() {
	local r=$1 m
	for m in dev/shm dev/pts dev proc; do
		mountpoint -q "$r/$m" && umount "$r/$m"
	done
	# Whatever a test may have left mounted below the root, too.
	grep -F " $r/" /proc/mounts | awk '{print $2}' | sort -r | while read -r m; do
		umount -l "$m"
	done
	return 0
}

# Remove a root safely: never while anything is mounted inside it.
idem_root_remove() {
	local r=$1
	[ -d "$r" ] || return 0
	idem_root_umount "$r"
	if grep -qF " $r/" /proc/mounts; then
		echo "debroot: $r still has mounts; not removing it" >&2
		return 1
	fi
	rm -rf --one-file-system "$r"
}

# Make $IDEM_ROOTS/SUITE.base with debootstrap, configured so that packages
# start no service and create no cluster.
idem_root_base() {
	local suite=$1 base=$IDEM_ROOTS/$1.base
	idem_root_fresh "$base" && return 0
	idem_root_remove "$base" || return 1
	if ! command -v debootstrap >/dev/null; then
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
			{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } || return 1
	fi
	mkdir -p "$IDEM_ROOTS"
	echo "debroot: debootstrap $suite (about a minute)"
	debootstrap --variant=minbase "$suite" "$base.tmp" "$(idem_root_mirror)" >"$IDEM_ROOTS/$suite.debootstrap.log" 2>&1 ||
		{ tail -n 20 "$IDEM_ROOTS/$suite.debootstrap.log" >&2; idem_root_remove "$base.tmp"; return 1; }
	# No daemon may start inside the root, and installing PostgreSQL must not
	# create a cluster: tests start throwaway ones.
	printf '#!/bin/sh\nexit 101\n' >"$base.tmp/usr/sbin/policy-rc.d"
	chmod 755 "$base.tmp/usr/sbin/policy-rc.d"
	mkdir -p "$base.tmp/etc/postgresql-common/createcluster.d"
	echo 'create_main_cluster = false' >"$base.tmp/etc/postgresql-common/createcluster.d/idempotency.conf"
	# The mirror's copy of sid can be older than its Release file says is valid.
	echo 'Acquire::Check-Valid-Until "false";' >"$base.tmp/etc/apt/apt.conf.d/99idempotency"
	echo 'APT::Install-Recommends "false";' >>"$base.tmp/etc/apt/apt.conf.d/99idempotency"
	touch "$base.tmp/.idem-root"
	mv "$base.tmp" "$base"
}

# Wait for, then hold, the lock of a suite's roots (on file descriptor 9)
# until idem_root_unlock: test/deb.sh takes the same lock.
idem_root_lock() {
	mkdir -p "$IDEM_ROOTS"
	exec 9>"$IDEM_ROOTS/$1.lock"
	flock 9
}

# Release the lock of idem_root_lock.
idem_root_unlock() {
	exec 9>&-
}

# Make (or reuse) the working root $IDEM_ROOTS/SUITE; with "fresh", a new
# copy of the base (a clean machine).  Prints the root's path.
idem_root_prepare() {
	local suite=$1 mode=${2:-cached} r=$IDEM_ROOTS/$1
	idem_root_base "$suite" >&2 || return 1
	if [ "$mode" = fresh ] || ! idem_root_fresh "$r"; then
		idem_root_remove "$r" || return 1
		cp -a "$IDEM_ROOTS/$suite.base" "$r"
	fi
	idem_root_mount "$r"
	echo "$r"
}

# Run a command as root inside a root, with a clean environment.
idem_root_run() {
	local r=$1
	shift
	chroot "$r" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		CI="${CI:-}" "$@"
}

# Copy the project's tracked files (as committed or as in the work tree) into
# the root at /work/idempotency, owned by root.
idem_root_copy_source() {
	local r=$1 src=$2
	rm -rf "$r/work/idempotency"
	mkdir -p "$r/work/idempotency"
	(cd "$src" && git ls-files -z --cached --others --exclude-standard |
		tar --null --ignore-failed-read -T - -cf - 2>/dev/null) |
		tar -C "$r/work/idempotency" -xf -
}

# Copy the Citus source tarball's directory (IDEM_CITUS_DIR, see
# scripts/citus.sh) into the root at /work/shared/third_party/citus, where
# scripts/citus.sh looks for it by default: nothing can be downloaded in a
# root either.  A copy (8 MB), afresh each time, rather than a bind mount:
# nothing then stays mounted in the root, and the root cannot change the
# original.  When it is missing, so is the copy, and citus.sh says so.
idem_root_copy_citus() {
	local r=$1 src=${IDEM_CITUS_DIR:-/work/shared/third_party/citus}
	local dst=$r/work/shared/third_party/citus
	rm -rf "$dst"
	[ -d "$src" ] || return 0
	mkdir -p "$(dirname "$dst")"
	cp -a "$src" "$dst"
}
