#!/usr/bin/env bash
# Makes Citus available to the PostgreSQL that scripts/deps.sh's idem_pg_env
# chooses, for the Citus tests and benchmarks.  Sourced after scripts/deps.sh
# (by test/run.sh, say):
#
#   . scripts/deps.sh; . scripts/citus.sh
#   idem_citus_install   # 0 installed, 2 not available here (why is printed
#                        # and in IDEM_CITUS_REASON), 1 failed
#
# Citus is not in Debian's packages and nothing may be downloaded, so it is
# built from the source tarball in IDEM_CITUS_DIR (default
# /work/shared/third_party/citus, see its README.md).  The build takes about
# two minutes on two cores, so it is kept in IDEM_CITUS_CACHE (default
# /var/cache/idem-citus), one per Citus version and full PostgreSQL version
# (e.g. 13.2.2-pg15.20): a new minor release of PostgreSQL gets a build of
# its own, and a later run only runs `make install` from the cached build,
# or nothing at all when the installed citus.so is already that build.
# IDEM_DESTDIR (see deps.sh): install into that staging copy only.
# Runs as root (to install the build's Debian packages), or as a user who
# can write the cache and the installation.

IDEM_CITUS_VERSION=13.2.2

# The Debian packages Citus's build needs beyond what deps.sh installs:
# those its README names, patch, and libicu-dev (Debian's PostgreSQL is built
# with ICU, so its pg_locale.h, which Citus includes, includes ICU's headers;
# the extension's own build never includes it).
IDEM_CITUS_BUILD_DEPS=(liblz4-dev libzstd-dev libkrb5-dev libcurl4-openssl-dev autoconf flex patch libicu-dev)

# 0 when Citus IDEM_CITUS_VERSION is installed for this PostgreSQL, 2 when
# Citus does not support its major version (nothing is changed then), 1 when
# something failed (the source tarball missing included).
idem_citus_install() {
	local srcdir=${IDEM_CITUS_DIR:-/work/shared/third_party/citus}
	local cache=${IDEM_CITUS_CACHE:-/var/cache/idem-citus}
	local v=$IDEM_CITUS_VERSION pg_version key build lib ext
	IDEM_CITUS_REASON=
	if [ -z "${PG_BINDIR:-}" ]; then
		idem_pg_env || { IDEM_CITUS_REASON="no PostgreSQL"; return 1; }
	fi
	case $IDEM_PG_MAJOR in
	15 | 16 | 17) ;;
	*)
		IDEM_CITUS_REASON="Citus $v supports PostgreSQL 15, 16 and 17, not $IDEM_PG_MAJOR"
		echo "citus: $IDEM_CITUS_REASON: not installed"
		return 2
		;;
	esac
	# The version of the headers the build compiles against, e.g. 15.20.
	pg_version=$("$PG_CONFIG" --version | sed -nE 's/^PostgreSQL ([^ ]+).*/\1/p')
	key=$v-pg$pg_version
	build=$cache/$key
	lib=${IDEM_DESTDIR:-}$("$PG_CONFIG" --pkglibdir)
	ext=${IDEM_DESTDIR:-}$("$PG_CONFIG" --sharedir)/extension
	if idem_citus_is_installed "$build" "$lib" "$ext"; then
		echo "citus: Citus $v already installed in $lib (the build for PostgreSQL $pg_version)"
		return 0
	fi
	if [ ! -f "$srcdir/citus-$v.tar.gz" ]; then
		IDEM_CITUS_REASON="no $srcdir/citus-$v.tar.gz (IDEM_CITUS_DIR)"
		echo "citus: $IDEM_CITUS_REASON"
		return 1
	fi
	mkdir -p "$cache" || { IDEM_CITUS_REASON="cannot create $cache"; return 1; }
	# One build and install of a key at a time: a second run waits here,
	# then finds the build done.
	(
		flock 9 || exit 1
		if [ ! -f "$build/src/backend/distributed/citus.so" ]; then
			idem_citus_build "$srcdir" "$cache" "$key" || exit 1
		fi
		# A run we waited for may have installed it already.
		idem_citus_is_installed "$build" "$lib" "$ext" && exit 0
		echo "citus: make install${IDEM_DESTDIR:+ DESTDIR=$IDEM_DESTDIR} (from $build)"
		make -C "$build" -s install ${IDEM_DESTDIR:+DESTDIR="$IDEM_DESTDIR"} >"$cache/$key.install.log" 2>&1 || {
			echo "citus: make install failed:"
			tail -n 20 "$cache/$key.install.log"
			exit 1
		}
	) 9>"$cache/$key.lock" || { IDEM_CITUS_REASON="the build or install of Citus $v failed"; return 1; }
	idem_citus_is_installed "$build" "$lib" "$ext" || {
		IDEM_CITUS_REASON="make install did not install $lib/citus.so"
		echo "citus: $IDEM_CITUS_REASON"
		return 1
	}
	echo "citus: Citus $v installed in $lib"
}

# Whether the citus.so in lib is the cached build (hence the right Citus
# version, built for this PostgreSQL version) and its control file is there.
idem_citus_is_installed() {
	local build=$1 lib=$2 ext=$3
	[ -f "$build/src/backend/distributed/citus.so" ] &&
		cmp -s "$build/src/backend/distributed/citus.so" "$lib/citus.so" &&
		[ -f "$ext/citus.control" ]
}

# Builds Citus for key in a directory of its own under cache, then points
# cache/key at it.  Called with the key's lock held.  The build's Makefiles
# name its directory by absolute path, so the directory cannot be renamed
# once configured: the atomic rename is of the symbolic link cache/key,
# which appears only once make has succeeded.  A build that died half way
# stays in a key.build.* directory, which no run takes for a finished one
# and the next build removes.
idem_citus_build() {
	local srcdir=$1 cache=$2 key=$3 tmp inc start=$SECONDS
	idem_citus_build_deps || return 1
	rm -rf "$cache/$key".build.* "$cache/$key.new"
	tmp=$(mktemp -d "$cache/$key.build.XXXXXX") || return 1
	echo "citus: building Citus $IDEM_CITUS_VERSION for PostgreSQL $IDEM_PG_MAJOR in $tmp (about 2 minutes; log: $tmp/build.log)"
	tar -xzf "$srcdir/citus-$IDEM_CITUS_VERSION.tar.gz" -C "$tmp" --strip-components=1 || return 1
	# Debian's PostgreSQL 15.20 exports have_createdb_privilege(), which
	# Citus 13.2.2 defines privately for 15 (16 and later declare it
	# themselves, and Citus uses theirs): rename Citus's copy then only.
	inc=$("$PG_CONFIG" --includedir-server)
	if [ "$IDEM_PG_MAJOR" = 15 ] && grep -rqsw --include='*.h' have_createdb_privilege "$inc/commands"; then
		echo "citus: $inc declares have_createdb_privilege(): applying pg15.20-compat.patch"
		(cd "$tmp" && patch -p1 --forward --quiet <"$srcdir/pg15.20-compat.patch") >>"$tmp/build.log" 2>&1 || {
			echo "citus: pg15.20-compat.patch does not apply"
			return 1
		}
	fi
	if ! (cd "$tmp" && ./configure PG_CONFIG="$PG_CONFIG" && make -j2) >>"$tmp/build.log" 2>&1; then
		echo "citus: the build failed (log: $tmp/build.log):"
		tail -n 20 "$tmp/build.log"
		return 1
	fi
	ln -s "$(basename "$tmp")" "$cache/$key.new" && mv -T "$cache/$key.new" "$cache/$key" || return 1
	echo "citus: built in $((SECONDS - start)) s"
}

# Installs IDEM_CITUS_BUILD_DEPS and what deps.sh installs, if any is missing.
idem_citus_build_deps() {
	local p missing=()
	idem_install_deps || return 1
	for p in "${IDEM_CITUS_BUILD_DEPS[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	if [ "$(id -u)" -ne 0 ]; then
		echo "citus: missing packages: ${missing[*]}; run as root to install them" >&2
		return 1
	fi
	echo "citus: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
