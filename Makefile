# idempotency: PGXS build.  EXTVERSION is the one source of truth for the
# extension version.
EXTENSION = idempotency
EXTVERSION = 1.4
MODULE_big = idempotency
# Only src/: the test-only module test/modules/idem_test has a Makefile of
# its own and is never built, installed or packaged from here.
OBJS = $(patsubst %.c,%.o,$(wildcard src/*.c))
DATA = $(wildcard $(EXTENSION)--*.sql)
PGFILEDESC = "idempotency - retried operations that take effect once"

PG_CPPFLAGS = -I$(srcdir)/src
PG_CFLAGS = -Wall -Wextra -Werror -Wno-unused-parameter \
	-Wno-missing-field-initializers -Wno-sign-compare
SHLIB_LINK += -lcrypto -lcurl

# Test inputs follow the contrib layout: sql/ and expected/ for pg_regress,
# specs/ for pg_isolation_regress, t/ for TAP.  test/run.sh runs them all on a
# throwaway cluster; REGRESS and ISOLATION also serve `make installcheck`.
REGRESS = canonical claim errors commit_guard expiry index_maintenance execute privileges ownership phases contract_tap
# Background worker, inbox and statistics
REGRESS += inbox stats
# Transactional outbox and relay
REGRESS += outbox outbox_errors outbox_privileges outbox_plans outbox_ssrf outbox_notify
# Extension scripts that cannot be hijacked: databases and a role of its own.
REGRESS += script_security
# Last: it re-creates the extension in a database of its own.
REGRESS += upgrade
ISOLATION = $(patsubst specs/%.spec,%,$(sort $(wildcard specs/*.spec)))

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# Every object depends on every header: a changed declaration rebuilds all.
$(OBJS): $(wildcard src/*.h)

# test/run.sh asks for the test lists.
print-%:
	@echo $($*)

# `make dist`: the release archive for PGXN, idempotency-X.Y.Z.zip, made by
# `git archive` of the committed HEAD (never of uncommitted changes) with
# every path under idempotency-X.Y.Z/.  PGXN wants a semantic version:
# EXTVERSION 1.2 is distribution 1.2.0, which META.json must state.
DISTVERSION = $(EXTVERSION)$(if $(word 3,$(subst ., ,$(EXTVERSION))),,.0)
DISTNAME = $(EXTENSION)-$(DISTVERSION)

dist:
	@grep -q '"version": "$(DISTVERSION)"' META.json || \
		{ echo "META.json does not give version $(DISTVERSION) (EXTVERSION $(EXTVERSION))" >&2; exit 1; }
	git archive --format=zip --prefix=$(DISTNAME)/ -o $(DISTNAME).zip HEAD
	@echo "$(DISTNAME).zip"

.PHONY: dist
