/*-------------------------------------------------------------------------
 *
 * relay.c
 *	  The outbox relay: claim due deliveries, deliver them, record outcomes.
 *
 * One pass (relay_pass) does three steps:
 *
 *	1. Claim.  In a transaction, lock up to max_events due pending deliveries
 *	   of active destinations with FOR UPDATE SKIP LOCKED (so concurrent relays
 *	   share the work), skipping any whose key has an earlier delivery to the
 *	   same destination still undelivered (per-key order); then, behind each
 *	   keyed one, the deliveries of its key that follow it, which go out one
 *	   after the other in this pass (a chain: if one is not delivered, the
 *	   rest are given back unattempted).  Each claimed delivery's attempt
 *	   count goes up by one and its next_attempt_at becomes a visibility
 *	   deadline: if this relay dies, the delivery is claimed again after it.
 *	   The deadline is the same for every delivery of the batch: as many
 *	   waves of relay_max_in_flight requests as the batch may need, each as
 *	   long as the largest HTTP timeout, plus
 *	   idempotency.relay_visibility_margin.  A chain's webhooks go one after
 *	   the other, though, so a pass may run longer: then it renews its
 *	   claims, a window further each time, before half the window has gone
 *	   (relay_renew_claims, from the HTTP step).  visible_until records that
 *	   the outcome is outstanding, so a later claim knows the attempt was
 *	   interrupted and counts the repeat as a possible duplicate.
 *
 *	2. HTTP deliveries, outside any transaction when the pass manages its own
 *	   (relay_http.c: many requests in flight on kept-alive connections).
 *
 *	3. Record.  When the batch holds both webhooks and in-database
 *	   deliveries, the webhooks' outcomes are recorded first, in a short
 *	   transaction of their own (3a): function calls may take a while, and
 *	   nothing renews the claims meanwhile.  Then (3b), in another
 *	   transaction: NOTIFY and function
 *	   deliveries are made here, so that the effect and the mark "delivered"
 *	   commit together -- exactly once into the database.  The relay first
 *	   re-locks those deliveries and checks that its claim (the attempt
 *	   number) still stands; a function runs in a subtransaction, and a
 *	   failing one is rolled back and rescheduled.  Then one statement records
 *	   every outcome: delivered; or rescheduled at now + a random delay in
 *	   [0, min(cap, base * 2^(attempts-1))] (exponential backoff with full
 *	   jitter); or dead after the destination's max_attempts.  Per-destination
 *	   counters go up in the same statement.
 *
 * The per-database worker does not run passes: its loop (relay_loop.c)
 * keeps webhooks in flight across iterations and uses this file's claim,
 * in-database delivery and record steps; the per-destination endpoint state
 * (circuit, pacing, disabling) is relay_circuit.c's.
 *
 * A pass called outside any transaction (only the relay harness of the
 * test module test/modules/idem_test does so) runs the steps in
 * transactions of its own: the attempt count is committed before any
 * effect, and HTTP requests are made while no transaction is open.  idem_outbox_relay (SQL) runs in
 * the caller's transaction: the same code, the same statements, without the
 * commits.  Everything it does -- claims, NOTIFYs, function effects, outcomes
 * -- then commits or rolls back with the caller's transaction; HTTP requests
 * are made synchronously between claim and record, and if the transaction
 * does not commit they will be made again (at least once).
 *
 * All statements are prepared once per backend and saved.  They run as the
 * owner of the extension's tables with search_path pg_catalog, pg_temp;
 * destination functions run as the role that created the destination, with
 * its search_path, in a security-restricted operation.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>
#include <signal.h>

#include "access/xact.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "commands/dbcommands.h"
#include "commands/trigger.h"
#include "common/pg_prng.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/json.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timeout.h"
#include "utils/uuid.h"

#include "claims.h"
#include "compat.h"
#include "outbox.h"
#include "relay.h"
#include "relay_http.h"
#include "relay_internal.h"

/* NOTIFY payloads must be shorter than this (async.c's NOTIFY_PAYLOAD_MAX_LENGTH). */
#define RELAY_NOTIFY_MAX	(BLCKSZ - NAMEDATALEN - 128)


/* The saved statements. */
static SPIPlanPtr claim_plan = NULL;
static SPIPlanPtr rooms_plan = NULL;
static SPIPlanPtr followers_plan = NULL;
static SPIPlanPtr dests_plan = NULL;
static SPIPlanPtr lock_plan = NULL;
static SPIPlanPtr still_ours_plan = NULL;
static SPIPlanPtr renew_plan = NULL;
static SPIPlanPtr record_plan = NULL;
static SPIPlanPtr held_plan = NULL;
static SPIPlanPtr next_due_plan = NULL;
static SPIPlanPtr cleanup_deliveries_plan = NULL;
static SPIPlanPtr cleanup_orphans_plan = NULL;
static SPIPlanPtr cleanup_events_plan = NULL;
static SPIPlanPtr fold_stats_plan = NULL;

/* Whether a relay pass runs in this backend (a destination may not start another). */
bool		relay_pass_running = false;

/*
 * Telling a destination function's own errors from a cancel of the relay.
 * A function may raise query_canceled itself, and its timeout cancels it
 * the way statement_timeout does; neither must cancel the pass.  While
 * destination functions run, SIGINT (pg_cancel_backend, or the caller's
 * statement_timeout) goes through relay_sigint_handler, which notes that
 * the cancel is real; the function timeout's handler notes that it fired.
 * The handler is installed with sigaction(), not pqsignal(): PostgreSQL 18's
 * pqsignal no longer returns the handler it replaces, and from 17 on the
 * handler it installs is a wrapper that calls the one registered with it.
 */
static volatile sig_atomic_t relay_cancel_requested = false;
static volatile sig_atomic_t relay_timeout_fired = false;
static struct sigaction relay_saved_sigint;
static bool relay_sigint_installed = false;
static bool relay_timeout_registered = false;
static TimeoutId relay_timeout_id;

/*
 * Prepare a statement once per backend and keep it: with a generic plan
 * (planned once, not at every execution) if generic, else planned as the
 * plan cache sees fit.  A generic plan is for the statements that run under
 * relay_plan_settings, shaped so that one plan suits every batch: under
 * plan_cache_mode "auto" the plan cache kept making a custom plan at every
 * execution of most of them -- at a few webhooks per iteration, more than a
 * quarter of the worker's CPU went to the planner.  The others (cleanup,
 * endpoint states) keep custom plans: a generic one chose, say, a merge
 * join over a whole primary key where the custom one probes a BRIN range.
 */
static SPIPlanPtr
relay_prepare_plan(SPIPlanPtr *plan, const char *sql, int nargs, Oid *argtypes, bool generic)
{
	if (*plan == NULL)
	{
		SPIPlanPtr	p = SPI_prepare_cursor(sql, nargs, argtypes,
										   generic ? CURSOR_OPT_GENERIC_PLAN : 0);

		if (p == NULL)
			elog(ERROR, "SPI_prepare_cursor failed: %s", SPI_result_code_string(SPI_result));
		if (SPI_keepplan(p) != 0)
			elog(ERROR, "SPI_keepplan failed");
		*plan = p;
	}
	return *plan;
}

/* Prepare a statement once per backend and keep it (see relay_prepare_plan). */
SPIPlanPtr
relay_prepare(SPIPlanPtr *plan, const char *sql, int nargs, Oid *argtypes)
{
	return relay_prepare_plan(plan, sql, nargs, argtypes, false);
}

/*
 * The same, with a generic plan, for a statement run under
 * relay_plan_settings (see relay_prepare_plan).
 */
static SPIPlanPtr
relay_prepare_shaped(SPIPlanPtr *plan, const char *sql, int nargs, Oid *argtypes)
{
	return relay_prepare_plan(plan, sql, nargs, argtypes, true);
}

/*
 * Settings for the relay's own statements (claim, relock, record, next due),
 * in a new GUC nest level that the caller ends with AtEOXact_GUC.  Those
 * statements must reach the rows of a batch through indexes or TIDs however
 * the tables' statistics look: statistics taken while the outbox was idle
 * describe a burst's backlog as an empty table, and a plan chosen for one
 * sorts the whole backlog on every pass, or reads it once per delivery of
 * the batch.  The statements are shaped for that (see CLAIM_UPDATE); these
 * settings take away the planner's remaining ways around it: no sequential
 * scans, no sorts, full or incremental (each destination's due deliveries
 * come from deliveries_due_by_destination in next_attempt_at order, and
 * the scan stops after its share of them), no bitmap scans, and no nested
 * loops but those a LATERAL lookup needs (it has no other plan): with them,
 * the UPDATEs' join to their batch (see CLAIM_UPDATE) was planned now by
 * hash, now as a TID scan per row, which asks the kernel for the table's
 * size on every row (about a tenth of a webhook's relay CPU).  A large
 * backlog also makes the estimates cross jit_above_cost, and compiling would cost more than these short statements
 * run: no JIT.  Destination functions never run under these settings.
 */
int
relay_plan_settings(void)
{
	int			save_nestlevel = NewGUCNestLevel();

	(void) set_config_option("enable_seqscan", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("enable_sort", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("enable_incremental_sort", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("enable_bitmapscan", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("enable_nestloop", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("jit", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	return save_nestlevel;
}

/*
 * Begin a step: start a transaction if the pass manages its own (as
 * worker_spi does), then connect to SPI as the tables' owner.  Returns false,
 * with nothing begun, when the outbox is not installed in this database, or
 * -- for a step that may be skipped, in a transaction of its own -- when
 * someone holds a lock on the deliveries that a relay would wait for (DROP
 * EXTENSION, TRUNCATE, CREATE INDEX): the worker tries again later instead
 * of queueing behind it (as pg_net does).
 */
bool
relay_step_begin(RelayStep *step, const char *activity, bool skippable)
{
	if (step->own_xact)
	{
		step->caller_cxt = CurrentMemoryContext;
		SetCurrentStatementStartTimestamp();
		StartTransactionCommand();
		PushActiveSnapshot(GetTransactionSnapshot());
		pgstat_report_activity(STATE_RUNNING, activity);
	}
	if (!outbox_installed() ||
		(step->own_xact && skippable &&
		 !ConditionalLockRelationOid(outbox_relid("deliveries"), RowExclusiveLock)))
	{
		if (step->own_xact)
		{
			PopActiveSnapshot();
			CommitTransactionCommand();
			MemoryContextSwitchTo(step->caller_cxt);
			pgstat_report_activity(STATE_IDLE, NULL);
		}
		return false;
	}
	outbox_become_owner(&step->owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	return true;
}

/*
 * Whether the tables have the columns this library's relay uses (the
 * extension at version 1.3).  Once the library is upgraded, a database
 * still at 1.2 or older waits for ALTER EXTENSION idempotency UPDATE: the worker's
 * passes do nothing meanwhile (said once), a caller of idem_outbox_relay()
 * is told to update.
 */
bool
relay_schema_current(bool own_xact)
{
	static bool waiting_logged = false;

	if (get_attnum(outbox_relid("destinations"), "circuit") != InvalidAttrNumber)
		return true;
	if (!own_xact)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the outbox relay needs extension \"idempotency\" at version 1.3"),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));
	if (!waiting_logged)
		ereport(LOG,
				(errmsg("the outbox relay of database \"%s\" waits for extension \"idempotency\" version 1.3",
						get_database_name(MyDatabaseId)),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));
	waiting_logged = true;
	return false;
}

/* End a step: disconnect from SPI and, if the pass manages its own, commit. */
void
relay_step_end(RelayStep *step)
{
	SPI_finish();
	outbox_restore_user(&step->owner);
	if (step->own_xact)
	{
		PopActiveSnapshot();
		CommitTransactionCommand();
		/* Not TopMemoryContext, where the commit leaves us: the caller's. */
		MemoryContextSwitchTo(step->caller_cxt);
		pgstat_report_stat(false);
		pgstat_report_activity(STATE_IDLE, NULL);
	}
}

/* A text column of the current SPI row, copied, or NULL. */
static char *
spi_text(HeapTuple tuple, int col)
{
	return SPI_getvalue(tuple, SPI_tuptable->tupdesc, col);
}

/* A by-value column of the current SPI row, or def if NULL. */
Datum
spi_value(HeapTuple tuple, int col, Datum def)
{
	bool		isnull;
	Datum		d = SPI_getbinval(tuple, SPI_tuptable->tupdesc, col, &isnull);

	return isnull ? def : d;
}

/*
 * Load the destinations of the n claimed items into cxt: only those, so
 * that a claim costs the same however many destinations have nothing to
 * deliver.  Secrets are decoded once per claim and live only in the
 * claim's memory.
 */
List *
relay_load_dests(MemoryContext cxt, RelayItem **items, int n)
{
	List	   *dests = NIL;
	SPIPlanPtr	plan;
	Datum	   *ids;
	int			nids = 0;
	Oid			argtypes[1] = {INT4ARRAYOID};
	Datum		values[1];
	int			save_nestlevel;
	int			rc;

	if (n == 0)
		return NIL;
	ids = palloc(sizeof(Datum) * n);
	for (int i = 0; i < n; i++)
	{
		int			j;

		for (j = 0; j < nids; j++)
			if (DatumGetInt32(ids[j]) == items[i]->dest_id)
				break;
		if (j == nids)
			ids[nids++] = Int32GetDatum(items[i]->dest_id);
	}
	plan = relay_prepare_shaped(&dests_plan,
						 "SELECT id, name, kind, target, func, run_as, search_path, secrets,"
						 "       headers, max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms,"
						 "       options @> '{\"reference\": true}',"
						 "       max_in_flight, connect_timeout_ms, failure_threshold, disable_after_ms,"
						 "       circuit = 'open', consecutive_failures, paced_until"
						 "  FROM idempotency.destinations WHERE id = ANY ($1)",
						 1, argtypes);
	values[0] = relay_array(ids, NULL, nids, INT4OID);
	/* By primary key: a plan for a table without statistics reads them all. */
	save_nestlevel = relay_plan_settings();
	rc = SPI_execute_plan(plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox destinations");

	for (uint64 i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		MemoryContext old = MemoryContextSwitchTo(cxt);
		RelayDest  *d = palloc0(sizeof(RelayDest));
		bool		isnull;
		Datum		secrets;
		Datum		headers;

		d->id = DatumGetInt32(spi_value(tup, 1, 0));
		d->name = spi_text(tup, 2);
		d->kind = dest_kind_from_name(spi_text(tup, 3));
		d->target = spi_text(tup, 4);
		d->func = DatumGetObjectId(spi_value(tup, 5, ObjectIdGetDatum(InvalidOid)));
		d->run_as = DatumGetObjectId(spi_value(tup, 6, ObjectIdGetDatum(InvalidOid)));
		d->search_path = spi_text(tup, 7);
		secrets = SPI_getbinval(tup, SPI_tuptable->tupdesc, 8, &isnull);
		if (!isnull)
		{
			Datum	   *elems;
			bool	   *nulls;
			int			nsecrets;

			deconstruct_array(DatumGetArrayTypeP(secrets), TEXTOID, -1, false,
							  TYPALIGN_INT, &elems, &nulls, &nsecrets);
			for (int j = 0; j < nsecrets; j++)
				if (!nulls[j])
					d->secrets = lappend(d->secrets,
										 http_decode_secret(TextDatumGetCString(elems[j])));
		}
		headers = SPI_getbinval(tup, SPI_tuptable->tupdesc, 9, &isnull);
		d->headers = isnull ? NULL : DatumGetJsonbPCopy(headers);
		d->max_attempts = DatumGetInt32(spi_value(tup, 10, Int32GetDatum(DEST_DEFAULT_MAX_ATTEMPTS)));
		d->backoff_base_ms = DatumGetInt64(spi_value(tup, 11, Int64GetDatum(DEST_DEFAULT_BACKOFF_BASE)));
		d->backoff_cap_ms = DatumGetInt64(spi_value(tup, 12, Int64GetDatum(DEST_DEFAULT_BACKOFF_CAP)));
		d->timeout_ms = DatumGetInt64(spi_value(tup, 13, Int64GetDatum(DEST_DEFAULT_TIMEOUT)));
		d->reference = DatumGetBool(spi_value(tup, 14, BoolGetDatum(false)));
		d->max_in_flight = DatumGetInt32(spi_value(tup, 15, Int32GetDatum(DEST_DEFAULT_MAX_IN_FLIGHT)));
		d->connect_timeout_ms = DatumGetInt64(spi_value(tup, 16, Int64GetDatum(DEST_DEFAULT_CONNECT_TIMEOUT)));
		d->failure_threshold = DatumGetInt32(spi_value(tup, 17, Int32GetDatum(DEST_DEFAULT_FAILURE_THRESHOLD)));
		d->disable_after_ms = DatumGetInt64(spi_value(tup, 18, Int64GetDatum(DEST_DEFAULT_DISABLE_AFTER)));
		d->circuit_open = DatumGetBool(spi_value(tup, 19, BoolGetDatum(false)));
		d->consecutive_failures = DatumGetInt32(spi_value(tup, 20, Int32GetDatum(0)));
		/* Paced only while paced_until is ahead. */
		d->paced = DatumGetTimestampTz(spi_value(tup, 21, TimestampTzGetDatum(0))) >
			GetCurrentTimestamp();
		dests = lappend(dests, d);
		MemoryContextSwitchTo(old);
	}
	return dests;
}

/* The loaded destination with this id, or NULL. */
RelayDest *
relay_find_dest(List *dests, int32 id)
{
	ListCell   *lc;

	foreach(lc, dests)
	{
		RelayDest  *d = lfirst(lc);

		if (d->id == id)
			return d;
	}
	return NULL;
}

/* Order claimed deliveries by seq, so a batch goes out in publish order. */
static int
relay_item_cmp(const void *a, const void *b)
{
	const RelayItem *x = *(RelayItem *const *) a;
	const RelayItem *y = *(RelayItem *const *) b;

	return (x->seq > y->seq) - (x->seq < y->seq);
}

/*
 * What the claim statements set and return: the claim itself (attempt,
 * visibility deadline) and what delivering needs.  $1 is now, $3 the
 * visibility margin, $4 the number of waves of requests a delivery may wait
 * for (1 in the worker's loop, which claims only what it can send at once);
 * each delivery's deadline is $3 plus $4 times its own destination's
 * timeout.  The statement defines "picked" (the deliveries to claim: tid,
 * their current row version; destination_id; and interrupted: whether the
 * previous attempt's outcome was never recorded).  Each delivery's
 * destination is looked up by id too: a join would read every destination
 * for every claim.
 *
 * Every access to the deliveries and the outbox goes through a row's TID or
 * a lookup by key in a LATERAL subquery with LIMIT 1, which the planner can
 * only run as an index lookup per row.  Plain joins would let it pick, on
 * statistics taken while the outbox was small or idle, a plan that reads the
 * whole table for every claimed row.  A head that another transaction
 * updated between the statement's snapshot and picked's lock is locked but
 * not updated (picked returns the newest version's TID, which the UPDATE's
 * snapshot cannot see): it is skipped for this pass, never claimed twice.
 * The UPDATEs here and in the record and renewal statements find their rows
 * with one TID scan of all the TIDs (ctid = ANY), joined to them by hash:
 * a TID scan per row, as a plain join gets, asks the kernel for the
 * table's size on every row (about a tenth of a webhook's relay work).
 */
#define CLAIM_UPDATE \
	" , claimed AS (" \
	" UPDATE idempotency.deliveries d" \
	"    SET attempts = d.attempts + 1," \
	"        claims = d.claims + 1," \
	"        next_attempt_at = $1 + ($3 + $4 * t.timeout_ms) * interval '1 ms'," \
	"        visible_until = $1 + ($3 + $4 * t.timeout_ms) * interval '1 ms'," \
	"        first_attempt_at = coalesce(d.first_attempt_at, $1)," \
	"        last_attempt_at = $1" \
	"   FROM picked, LATERAL (SELECT t.timeout_ms FROM idempotency.destinations t" \
	"                          WHERE t.id = picked.destination_id LIMIT 1) t" \
	"  WHERE d.ctid = ANY (ARRAY(SELECT p.tid FROM picked p))" \
	"    AND d.ctid = picked.tid" \
	" RETURNING d.event_id, d.destination_id, d.attempts, d.seq, picked.interrupted, d.key," \
	"           d.claims, d.next_attempt_at AS claimed_until)" \
	" SELECT c.event_id, c.destination_id, c.attempts, c.seq, c.interrupted," \
	"        x.topic, x.published_at, x.body, x.envelope, x.headers, c.key," \
	"        c.claimed_until, c.claims, t.kind = 'http'" \
	"   FROM claimed c," \
	"   LATERAL (SELECT t.kind, t.options FROM idempotency.destinations t" \
	"             WHERE t.id = c.destination_id LIMIT 1) t," \
	"   LATERAL (" \
	"    SELECT o.topic, o.published_at," \
	"      CASE WHEN t.kind = 'http' THEN o.payload::text" \
	"        WHEN t.kind = 'notify' AND NOT t.options @> '{\"reference\": true}'" \
	"        THEN jsonb_build_object('id', o.event_id, 'topic', o.topic," \
	"          'key', o.key, 'payload', o.payload, 'headers', o.headers," \
	"          'published_at', o.published_at)::text END AS body," \
	"      CASE t.kind WHEN 'function' THEN jsonb_build_object('id', o.event_id," \
	"          'topic', o.topic, 'key', o.key, 'payload', o.payload," \
	"          'headers', o.headers, 'published_at', o.published_at) END AS envelope," \
	"      CASE t.kind WHEN 'http' THEN o.headers END AS headers" \
	"      FROM idempotency.outbox o WHERE o.event_id = c.event_id LIMIT 1) x"

/* Append the rows a claim statement returned to items, copied into cxt. */
static int
relay_read_claimed(MemoryContext cxt, RelayItem **items, int n)
{
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		MemoryContext old = MemoryContextSwitchTo(cxt);
		RelayItem  *it = palloc0(sizeof(RelayItem));
		bool		isnull;
		Datum		d;

		memcpy(&it->event_id, DatumGetUUIDP(spi_value(tup, 1, 0)), sizeof(pg_uuid_t));
		it->dest_id = DatumGetInt32(spi_value(tup, 2, 0));
		it->attempts = DatumGetInt32(spi_value(tup, 3, 0));
		it->seq = DatumGetInt64(spi_value(tup, 4, 0));
		it->interrupted = DatumGetBool(spi_value(tup, 5, BoolGetDatum(false)));
		it->topic = spi_text(tup, 6);
		it->published_at = DatumGetTimestampTz(spi_value(tup, 7, 0));
		it->body = spi_text(tup, 8);
		d = SPI_getbinval(tup, SPI_tuptable->tupdesc, 9, &isnull);
		it->envelope = isnull ? NULL : DatumGetJsonbPCopy(d);
		d = SPI_getbinval(tup, SPI_tuptable->tupdesc, 10, &isnull);
		it->event_headers = isnull ? NULL : DatumGetJsonbPCopy(d);
		it->key = spi_text(tup, 11);
		it->claimed_until = DatumGetTimestampTz(spi_value(tup, 12, 0));
		it->claim = DatumGetInt64(spi_value(tup, 13, 0));
		it->is_http = DatumGetBool(spi_value(tup, 14, BoolGetDatum(false)));
		it->retry_after_ms = -1;
		it->outcome = RELAY_PENDING;
		MemoryContextSwitchTo(old);
		items[n++] = it;
	}
	return n;
}

/*
 * Claiming the heads of keys: the due deliveries that may go now, no
 * earlier delivery of their key to their destination being undelivered.
 *
 * A claim works destination by destination, so that a destination that may
 * take nothing costs nothing: neither a paused or disabled one, nor one
 * paced by Retry-After or whose open circuit waits for its probe time, nor
 * one whose requests are all in flight -- however large its backlog.  First
 * one statement (ROOMS_SQL) reads, for each destination with room, how many
 * deliveries are due, up to its room, and when the oldest of them became
 * due: one short walk of deliveries_due_by_destination each.  Then
 * relay_takes shares out the claim's bounds (max_events; for webhooks, the
 * room left below idempotency.relay_max_in_flight) between them, and one
 * statement (CLAIM_HEADS) takes, for each destination, at most its share of
 * heads, oldest first, through the same index, locking with FOR UPDATE
 * SKIP LOCKED only the rows it takes (LIMIT sits above the lock).
 *
 * Finding heads means walking past the due deliveries that wait behind an
 * earlier one of their key.  When a destination's backlog sits on few keys
 * that is nearly all of it.  So after a claim that found fewer heads than
 * its shares, the next ones walk each destination's due deliveries only as
 * far as HEADS_WINDOW times its share (windowed), and at most once every
 * HEADS_BEYOND_MS a claim looks beyond the window (see relay_claim); while
 * heads are plentiful, the window (which costs a walk of its own) is left
 * out.  Whether an earlier delivery of the key is undelivered is asked
 * backwards from the delivery's seq (a scalar subquery: EXISTS would drop
 * the ORDER BY): a waiting delivery finds its predecessor at once, instead
 * of walking first past the index entries its key's delivered deliveries
 * left behind.
 */
#define HEADS_WINDOW	4

/* The shortest window, in deliveries per destination. */
#define HEADS_WINDOW_MIN	64

/* How often a windowed claim also looks beyond the window, at the longest. */
#define HEADS_BEYOND_MS	1000

/*
 * The destinations that have pending deliveries, as a recursive CTE "busy":
 * one descent of deliveries_due_by_destination per such destination (a
 * loose index scan), so that what a claim or the schedule reads grows with
 * the destinations that have something to deliver, not with all of them:
 * with 1,000 idle destinations, visiting each one cost a claim more than
 * the webhook it sent.  Statements that use it reach each destination's row
 * through a LATERAL lookup by id.
 */
#define BUSY_DESTS \
	"WITH RECURSIVE busy(id) AS (" \
	" SELECT (SELECT d.destination_id FROM idempotency.deliveries d" \
	"          WHERE d.state = 'pending' ORDER BY d.destination_id LIMIT 1)" \
	" UNION ALL" \
	" SELECT (SELECT d.destination_id FROM idempotency.deliveries d" \
	"          WHERE d.state = 'pending' AND d.destination_id > b.id" \
	"          ORDER BY d.destination_id LIMIT 1)" \
	"   FROM busy b WHERE b.id IS NOT NULL)"

/*
 * Each destination that may take deliveries now (of those with pending
 * deliveries, BUSY_DESTS): its room ($2 for in-database
 * destinations and, when $3 is false, for webhooks too; one request while
 * its circuit is open; else its max_in_flight; less the chains the caller
 * holds, $4 and $5), the number of its due deliveries up to one more than
 * that room (more: a backlog), and when the oldest of those became due.  A
 * destination without room reads nothing (LIMIT 0).
 */
#define ROOMS_SQL \
	BUSY_DESTS \
	" SELECT r.id, r.http, r.room, o.avail, o.oldest FROM busy b, LATERAL (" \
	" SELECT t.id, t.kind = 'http' AS http," \
	"        CASE WHEN t.kind <> 'http' THEN $2 WHEN t.circuit = 'open' THEN 1" \
	"             WHEN $3 THEN t.max_in_flight ELSE $2 END" \
	"        - coalesce((SELECT a.n FROM unnest($4::int4[], $5::int4[]) AS a(id, n)" \
	"                     WHERE a.id = t.id LIMIT 1), 0) AS room" \
	"   FROM idempotency.destinations t" \
	"  WHERE t.id = b.id AND NOT t.paused AND t.disabled_at IS NULL" \
	"    AND (t.paced_until IS NULL OR t.paced_until <= $1)" \
	"    AND (t.circuit <> 'open' OR t.next_probe_at <= $1) LIMIT 1) r," \
	" LATERAL (SELECT count(*)::int4 AS avail, min(w.next_attempt_at) AS oldest FROM (" \
	"   SELECT d.next_attempt_at FROM idempotency.deliveries d" \
	"    WHERE d.destination_id = r.id AND d.state = 'pending' AND d.next_attempt_at <= $1" \
	"    ORDER BY d.next_attempt_at, d.seq" \
	"    LIMIT CASE WHEN r.room > 0 THEN r.room + 1 ELSE 0 END) w) o" \
	" WHERE r.room > 0 AND o.avail > 0"

/*
 * Take, for each destination $5[i], at most $6[i] heads of keys, oldest
 * first (see the comment above HEADS_WINDOW), each walk bounded by its
 * window (HEADS_WINDOW_JOIN).
 */
#define CLAIM_HEADS \
	"WITH takes AS MATERIALIZED (" \
	" SELECT k.id, k.take, coalesce(w.at, $1) AS win_at," \
	"        coalesce(w.seq, 9223372036854775807) AS win_seq" \
	"   FROM unnest($5::int4[], $6::int4[]) AS k(id, take)" \
	HEADS_WINDOW_JOIN "),"\
	" picked AS MATERIALIZED (" \
	" SELECT c.tid, c.destination_id, c.interrupted FROM takes k, LATERAL (" \
	"   SELECT d.ctid AS tid, d.destination_id, d.visible_until IS NOT NULL AS interrupted" \
	"     FROM idempotency.deliveries d" \
	"    WHERE d.destination_id = k.id AND d.state = 'pending' AND d.next_attempt_at <= $1" \
	"      AND (d.next_attempt_at, d.seq) <= (k.win_at, k.win_seq)" \
	"      AND (d.key IS NULL OR (" \
	"            SELECT e.seq FROM idempotency.deliveries e" \
	"             WHERE e.destination_id = d.destination_id AND e.key = d.key" \
	"               AND e.seq < d.seq AND e.state <> 'delivered'" \
	"             ORDER BY e.seq DESC LIMIT 1) IS NULL)" \
	"    ORDER BY d.next_attempt_at, d.seq" \
	"    LIMIT k.take" \
	"      FOR UPDATE OF d SKIP LOCKED) c)" \
	CLAIM_UPDATE

/*
 * The window: a destination's walk stops at its ($2 times its share, at least
 * HEADS_WINDOW_MIN)-th due delivery in (next_attempt_at, seq) order, an index
 * bound; no bound when it has fewer, or when $2 is 0 (a claim that is not
 * windowed: nothing is read for it).
 */
#define HEADS_WINDOW_JOIN \
	" LEFT JOIN LATERAL (" \
	"   SELECT w.next_attempt_at AS at, w.seq FROM idempotency.deliveries w" \
	"    WHERE $2 > 0 AND w.destination_id = k.id AND w.state = 'pending'" \
	"      AND w.next_attempt_at <= $1" \
	"    ORDER BY w.next_attempt_at, w.seq" \
	"   OFFSET greatest(k.take * $2, " CppAsString2(HEADS_WINDOW_MIN) ") LIMIT 1) w ON true"

/* The entry of destination id in rooms, added (with nothing held) if missing. */
static int
relay_rooms_slot(RelayRooms *rooms, int32 id)
{
	int			j;

	for (j = 0; j < rooms->n; j++)
		if (rooms->ids[j] == id)
			return j;
	if (rooms->n == rooms->size)
	{
		rooms->size = Max(16, rooms->size * 2);
		rooms->ids = rooms->ids ? repalloc(rooms->ids, sizeof(int32) * rooms->size)
			: palloc(sizeof(int32) * rooms->size);
		rooms->active = rooms->active ? repalloc(rooms->active, sizeof(int32) * rooms->size)
			: palloc(sizeof(int32) * rooms->size);
	}
	rooms->ids[j] = id;
	rooms->active[j] = 0;
	rooms->n++;
	return j;
}

/* One more chain (or in-database delivery) held for destination id, in rooms. */
void
relay_rooms_count(RelayRooms *rooms, int32 id)
{
	int			j = relay_rooms_slot(rooms, id);	/* may move rooms->active */

	rooms->active[j]++;
}

/* Destination id takes nothing in this claim: rooms says it has no room. */
void
relay_rooms_block(RelayRooms *rooms, int32 id)
{
	int			j = relay_rooms_slot(rooms, id);	/* may move rooms->active */

	rooms->active[j] = PG_INT32_MAX / 2;
}

/*
 * Count the heads just claimed (items[first .. n - 1]) against rooms: the
 * 'http' ones per destination and in all, the others against the loop's
 * room for in-database deliveries.
 */
void
relay_rooms_take(RelayRooms *rooms, RelayItem **items, int first, int n)
{
	for (int i = first; i < n; i++)
	{
		if (!items[i]->is_http)
		{
			if (rooms->limit)
				rooms->local_room--;
			continue;
		}
		rooms->http_room--;
		relay_rooms_count(rooms, items[i]->dest_id);
	}
}

/* The chains held for destination id, per rooms. */
static int32
relay_rooms_active(RelayRooms *rooms, int32 id)
{
	for (int j = 0; j < rooms->n; j++)
		if (rooms->ids[j] == id)
			return rooms->active[j];
	return 0;
}

/* A destination with room, as ROOMS_SQL reads it, and its share of the claim. */
typedef struct RelayShare
{
	int32		id;
	bool		http;
	int32		room;			/* deliveries it may take */
	int32		avail;			/* due deliveries, up to its room + 1 */
	TimestampTz oldest;			/* when the oldest of them became due */
	int32		active;			/* chains the caller holds */
	TimestampTz ready_at;		/* since when it has waited for room */
	int32		take;			/* its share */
} RelayShare;

/*
 * When each destination's last webhook sent by this relay process finished
 * (0: none).  A destination waits for room since then, or since its oldest
 * due delivery became due if that is later; among destinations with as
 * many requests in flight, the one that has waited longest comes first.  So
 * a slow endpoint's backlog, however old, waits its turn from when its last
 * request finished, and a new event of another destination goes ahead of
 * the requests the slow ones would start after it.
 */
typedef struct RelayServed
{
	int32		id;				/* hash key */
	TimestampTz at;
} RelayServed;

static HTAB *relay_served = NULL;

/* Entries kept at most: past that the table starts again (all "never"). */
#define RELAY_SERVED_MAX	100000

/* The entry of destination id in relay_served, created (none finished) if missing. */
static RelayServed *
relay_served_entry(int32 id)
{
	RelayServed *e;
	bool		found;

	if (relay_served != NULL && hash_get_num_entries(relay_served) >= RELAY_SERVED_MAX)
	{
		hash_destroy(relay_served);
		relay_served = NULL;
	}
	if (relay_served == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(int32);
		ctl.entrysize = sizeof(RelayServed);
		ctl.hcxt = TopMemoryContext;
		relay_served = hash_create("outbox relay destinations served", 64, &ctl,
								   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	e = hash_search(relay_served, &id, HASH_ENTER, &found);
	if (!found)
		e->at = 0;
	return e;
}

/*
 * Order shares for the claim's bounds: in the worker's loop webhooks first
 * (in-database deliveries never take their room), the destinations with
 * the fewest requests in flight first (a destination with a long backlog
 * cannot keep the others below idempotency.relay_max_in_flight out), then
 * the one waiting for room longest (see RelayServed), then oldest first; in
 * a pass, oldest first.
 */
static bool relay_shares_loop_order;

static int
relay_share_cmp(const void *a, const void *b)
{
	const RelayShare *x = a;
	const RelayShare *y = b;

	if (relay_shares_loop_order)
	{
		if (x->http != y->http)
			return x->http ? -1 : 1;
		if (x->active != y->active)
			return x->active < y->active ? -1 : 1;
		if (x->ready_at != y->ready_at)
			return x->ready_at < y->ready_at ? -1 : 1;
	}
	if (x->oldest != y->oldest)
		return x->oldest < y->oldest ? -1 : 1;
	return (x->id > y->id) - (x->id < y->id);
}

/*
 * Read each destination's room and due deliveries (ROOMS_SQL) and share out
 * max_events -- and rooms->http_room among webhooks -- in share order.
 * Returns the destinations given a share, in shares (allocated here); sets
 * *wanted to the sum of the shares, and *backlog if a destination has more
 * deliveries due than its share.
 */
static int
relay_takes(int max_events, RelayRooms *rooms, TimestampTz now, RelayShare **shares,
			int *wanted, bool *backlog)
{
	Oid			argtypes[5] = {TIMESTAMPTZOID, INT4OID, BOOLOID, INT4ARRAYOID, INT4ARRAYOID};
	Datum		values[5];
	Datum	   *ids = palloc(sizeof(Datum) * Max(rooms->n, 1));
	Datum	   *active = palloc(sizeof(Datum) * Max(rooms->n, 1));
	SPIPlanPtr	plan;
	int			left = max_events;
	int			http_left = Max(rooms->http_room, 0);
	int			local_left = Max(rooms->local_room, 0);
	int			n = 0;

	*wanted = 0;
	*shares = NULL;
	plan = relay_prepare_shaped(&rooms_plan, ROOMS_SQL, 5, argtypes);
	for (int i = 0; i < rooms->n; i++)
	{
		ids[i] = Int32GetDatum(rooms->ids[i]);
		active[i] = Int32GetDatum(rooms->active[i]);
	}
	values[0] = TimestampTzGetDatum(now);
	values[1] = Int32GetDatum(max_events);
	values[2] = BoolGetDatum(rooms->limit);
	values[3] = relay_array(ids, NULL, rooms->n, INT4OID);
	values[4] = relay_array(active, NULL, rooms->n, INT4OID);
	/* Not read-only: a new snapshot sees the outcomes this step recorded. */
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox destinations' rooms");
	if (SPI_processed == 0)
		return 0;

	*shares = palloc(sizeof(RelayShare) * SPI_processed);
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		RelayShare *s = &(*shares)[i];

		s->id = DatumGetInt32(spi_value(tup, 1, 0));
		s->http = DatumGetBool(spi_value(tup, 2, BoolGetDatum(false)));
		s->room = DatumGetInt32(spi_value(tup, 3, 0));
		s->avail = DatumGetInt32(spi_value(tup, 4, 0));
		s->oldest = DatumGetTimestampTz(spi_value(tup, 5, 0));
		s->active = relay_rooms_active(rooms, s->id);
		s->ready_at = rooms->limit && s->http ?
			Max(relay_served_entry(s->id)->at, s->oldest) : 0;
		s->take = 0;
	}
	relay_shares_loop_order = rooms->limit;
	qsort(*shares, SPI_processed, sizeof(RelayShare), relay_share_cmp);

	/*
	 * In the loop, webhooks (first in share order) get their room in turns,
	 * one delivery per destination and turn, so that when the room left
	 * below idempotency.relay_max_in_flight is short it goes to as many
	 * destinations as it can, not to the first one's whole backlog.
	 */
	if (rooms->limit)
	{
		bool		more = true;

		http_left = Min(http_left, left);
		while (more && http_left > 0)
		{
			more = false;
			for (uint64 i = 0; i < SPI_processed && http_left > 0; i++)
			{
				RelayShare *s = &(*shares)[i];

				if (!s->http || s->take >= Min(s->avail, s->room))
					continue;
				s->take++;
				http_left--;
				left--;
				more = true;
			}
		}
	}
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		RelayShare *s = &(*shares)[i];

		if (!(s->http && rooms->limit))
		{
			s->take = Min(Min(s->avail, s->room), left);
			if (s->http)
			{
				s->take = Min(s->take, http_left);
				http_left -= s->take;
			}
			else if (rooms->limit)
			{
				s->take = Min(s->take, local_left);
				local_left -= s->take;
			}
			left -= s->take;
		}
		*wanted += s->take;
		/*
		 * A backlog that relay helpers could share: more due than this
		 * claim took (the relay loops share a destination's room, so they
		 * never open more than its max_in_flight together).
		 */
		if (s->take < s->avail)
			*backlog = true;
		if (s->take > 0)
			(*shares)[n++] = *s;
	}
	return n;
}

/*
 * Claim the heads of keys that may go now (see the comment above
 * HEADS_WINDOW), at most max_events, appended to items after the first n;
 * returns the new count, adds the sum of the shares to *wanted, and sets
 * *backlog as relay_takes does.
 */
static int
relay_claim_heads(int max_events, bool windowed, int waves, RelayRooms *rooms,
				  TimestampTz now, MemoryContext cxt, RelayItem **items, int n,
				  int *wanted, bool *backlog)
{
	Oid			argtypes[6] = {TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID,
		INT4ARRAYOID, INT4ARRAYOID};
	Datum		values[6];
	RelayShare *shares;
	Datum	   *ids;
	Datum	   *takes;
	SPIPlanPtr	plan;
	int			nshares;
	int			want;
	int			first = n;

	nshares = relay_takes(max_events, rooms, now, &shares, &want, backlog);
	*wanted += want;
	if (nshares == 0)
		return n;
	ids = palloc(sizeof(Datum) * nshares);
	takes = palloc(sizeof(Datum) * nshares);
	for (int i = 0; i < nshares; i++)
	{
		ids[i] = Int32GetDatum(shares[i].id);
		takes[i] = Int32GetDatum(shares[i].take);
	}
	plan = relay_prepare_shaped(&claim_plan, CLAIM_HEADS, 6, argtypes);
	values[0] = TimestampTzGetDatum(now);
	values[1] = Int32GetDatum(windowed ? HEADS_WINDOW : 0);
	values[2] = Int32GetDatum(relay_visibility_margin);
	values[3] = Int32GetDatum(waves);
	values[4] = relay_array(ids, NULL, nshares, INT4OID);
	values[5] = relay_array(takes, NULL, nshares, INT4OID);
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not claim outbox deliveries");
	n = relay_read_claimed(cxt, items, n);
	relay_rooms_take(rooms, items, first, n);
	return n;
}

/* Which heads a claim of followers follows. */
typedef enum RelayHeads
{
	HEADS_ALL,
	HEADS_HTTP,
	HEADS_LOCAL,				/* function and notify */
} RelayHeads;

/*
 * Claim, behind each keyed head just claimed, the following deliveries of
 * its key to its destination, in seq order, as long as they are pending and
 * due: this relay then delivers them one after the other, so that a busy key
 * is not held to one event per pass.  No other relay can take them: their
 * head is claimed, so for everyone else an earlier delivery of their key is
 * undelivered.  At most room in all, shared out evenly between the keys.
 * The heads are those of items[first .. last - 1] that which selects;
 * appends the followers after items[n - 1] and returns the new count.
 * waves sizes the visibility deadline (see CLAIM_UPDATE).
 */
static int
relay_claim_followers(int room, int waves, TimestampTz now, MemoryContext cxt,
					  RelayItem **items, int first, int last, int n, RelayHeads which)
{
	Oid			argtypes[8] = {TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID,
		INT4ARRAYOID, TEXTARRAYOID, INT8ARRAYOID, INT4OID};
	Datum		values[8];
	Datum	   *dests = palloc(sizeof(Datum) * n);
	Datum	   *keys = palloc(sizeof(Datum) * n);
	Datum	   *seqs = palloc(sizeof(Datum) * n);
	int			nheads = 0;
	SPIPlanPtr	plan;

	for (int i = first; i < last; i++)
		if (items[i]->key != NULL &&
			(which == HEADS_ALL || (which == HEADS_HTTP) == items[i]->is_http))
		{
			dests[nheads] = Int32GetDatum(items[i]->dest_id);
			keys[nheads] = CStringGetTextDatum(items[i]->key);
			seqs[nheads] = Int64GetDatum(items[i]->seq);
			nheads++;
		}
	if (nheads == 0 || room <= 0)
		return n;

	plan = relay_prepare_shaped(&followers_plan,
						 "WITH heads AS ("
						 " SELECT * FROM unnest($5::int4[], $6::text[], $7::int8[])"
						 "   AS h(destination_id, key, seq)),"
						 " chained AS ("
						 " SELECT f.tid, f.destination_id, f.interrupted, f.pos,"
						 "        bool_and(f.due) OVER (PARTITION BY f.destination_id, f.key"
						 "                              ORDER BY f.seq) AS unbroken"
						 "   FROM heads h, LATERAL ("
						 "        SELECT e.tid, e.destination_id, e.key, e.seq,"
						 "               e.visible_until IS NOT NULL AS interrupted,"
						 "               e.state = 'pending' AND e.next_attempt_at <= $1 AS due,"
						 "               row_number() OVER (ORDER BY e.seq) AS pos"
						 "          FROM (SELECT e.ctid AS tid, e.* FROM idempotency.deliveries e"
						 "                 WHERE e.destination_id = h.destination_id"
						 "                   AND e.key = h.key COLLATE \"C\""
						 "                   AND e.seq > h.seq AND e.state <> 'delivered'"
						 "                 ORDER BY e.seq LIMIT $8) e) f),"
						 " picked AS MATERIALIZED ("
						 " SELECT tid, destination_id, interrupted FROM chained"
						 "  WHERE unbroken ORDER BY pos LIMIT $2)"
						 CLAIM_UPDATE,
						 8, argtypes);

	values[0] = TimestampTzGetDatum(now);
	values[1] = Int32GetDatum(room);
	values[2] = Int32GetDatum(relay_visibility_margin);
	values[3] = Int32GetDatum(waves);
	values[4] = relay_array(dests, NULL, nheads, INT4OID);
	values[5] = relay_array(keys, NULL, nheads, TEXTOID);
	values[6] = relay_array(seqs, NULL, nheads, INT8OID);
	values[7] = Int32GetDatum((room + nheads - 1) / nheads);
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not claim outbox deliveries");
	return relay_read_claimed(cxt, items, n);
}

/*
 * Chain the deliveries of each key to each destination, in seq order: a
 * delivery waits for its predecessor in the batch (chain_held) and is
 * released, not attempted, if the predecessor is not delivered.
 */
static void
relay_link_chains(RelayItem **items, int n)
{
	HASHCTL		ctl;
	HTAB	   *last;

	ctl.keysize = NAMEDATALEN + OUTBOX_MAX_NAME_LEN + 16;
	ctl.entrysize = ctl.keysize + sizeof(RelayItem *);
	ctl.hcxt = CurrentMemoryContext;
	last = hash_create("outbox relay chains", Max(n, 16), &ctl,
					   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		char		key[NAMEDATALEN + OUTBOX_MAX_NAME_LEN + 16];
		char	   *entry;
		bool		found;

		if (it->key == NULL)
			continue;
		memset(key, 0, sizeof(key));
		snprintf(key, sizeof(key), "%d/%s", it->dest_id, it->key);
		entry = hash_search(last, key, HASH_ENTER, &found);
		if (found)
		{
			RelayItem  *prev;

			memcpy(&prev, entry + ctl.keysize, sizeof(RelayItem *));
			prev->chain_next = it;
			it->chain_held = true;
		}
		memcpy(entry + ctl.keysize, &it, sizeof(RelayItem *));
	}
	hash_destroy(last);
}

/* A delivery was not delivered: the rest of its chain is released. */
void
relay_release_chain(RelayItem *it)
{
	for (RelayItem *next = it->chain_next; next != NULL; next = next->chain_next)
		if (next->outcome == RELAY_PENDING)
			next->outcome = RELAY_RELEASED;
}

/*
 * Step 1: claim up to max_events deliveries: the heads of their keys, then
 * the deliveries that follow them.  Returns the claimed items (allocated in
 * cxt), in seq order and chained, in *items; *backlog says that some
 * destination had more deliveries due than it could take (relay helpers
 * could take them).
 */
int
relay_claim(int max_events, int waves, RelayRooms *rooms, TimestampTz now,
			MemoryContext cxt, RelayItem ***items, bool *backlog)
{
	/* Whether this backend's last claim found fewer heads than its shares. */
	static bool heads_sparse = false;
	/* When this backend last looked for heads beyond the window. */
	static TimestampTz beyond_at = 0;
	int			n;
	int			heads;
	int			wanted = 0;
	int			save_nestlevel = relay_plan_settings();

	*items = MemoryContextAlloc(cxt, sizeof(RelayItem *) * Max(max_events, 1));
	*backlog = false;
	n = relay_claim_heads(max_events, heads_sparse, waves, rooms, now, cxt, *items, 0,
						  &wanted, backlog);
	heads = n;

	/*
	 * At least once every HEADS_BEYOND_MS a windowed claim that found fewer
	 * heads than it could take also looks beyond the window, before the
	 * followers: a key with a long backlog at the front of a destination
	 * would otherwise hold up its destination's other keys until it drained.
	 */
	if (heads_sparse && n < wanted && n < max_events &&
		TimestampDifferenceExceeds(beyond_at, now, HEADS_BEYOND_MS))
	{
		int			more = 0;

		n = relay_claim_heads(max_events - n, false, waves, rooms, now, cxt, *items, n,
							  &more, backlog);
		beyond_at = now;
	}
	if (!heads_sparse)
		beyond_at = now;
	heads_sparse = heads < wanted;
	if (!rooms->limit)
		n = relay_claim_followers(max_events - n, waves, now, cxt, *items, 0, n, n, HEADS_ALL);
	else
	{
		/* In the loop, in-database followers within its room for them. */
		int			nheads = n;

		n = relay_claim_followers(max_events - n, waves, now, cxt, *items, 0, nheads, n,
								  HEADS_HTTP);
		n = relay_claim_followers(Min(max_events - n, rooms->local_room),
								  waves, now, cxt, *items, 0, nheads, n, HEADS_LOCAL);
	}
	AtEOXact_GUC(true, save_nestlevel);
	qsort(*items, n, sizeof(RelayItem *), relay_item_cmp);
	relay_link_chains(*items, n);
	return n;
}

/* An array datum of n values of type typid. */
Datum
relay_array(Datum *values, bool *nulls, int n, Oid typid)
{
	int16		typlen;
	bool		typbyval;
	char		typalign;
	int			dims[1] = {n};
	int			lbs[1] = {1};

	get_typlenbyvalalign(typid, &typlen, &typbyval, &typalign);
	return PointerGetDatum(construct_md_array(values, nulls, 1, dims, lbs, typid,
											  typlen, typbyval, typalign));
}

/*
 * Of the n items skipped (not sent or made), mark row_held those whose
 * claim still stands: another session held the row, and they are to be
 * given back once it is free, not left to be taken for interrupted attempts.
 */
static void
relay_mark_held(RelayItem **items, int n)
{
	Oid			argtypes[3] = {UUIDARRAYOID, INT4ARRAYOID, INT8ARRAYOID};
	Datum		values[3];
	Datum	   *ids;
	Datum	   *dests;
	Datum	   *claims;
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;

	if (n == 0)
		return;
	ids = palloc(sizeof(Datum) * n);
	dests = palloc(sizeof(Datum) * n);
	claims = palloc(sizeof(Datum) * n);
	for (int i = 0; i < n; i++)
	{
		ids[i] = UUIDPGetDatum(&items[i]->event_id);
		dests[i] = Int32GetDatum(items[i]->dest_id);
		claims[i] = Int64GetDatum(items[i]->claim);
	}
	plan = relay_prepare_shaped(&still_ours_plan,
						 "SELECT r.n"
						 "  FROM unnest($1::uuid[], $2::int4[], $3::int8[]) WITH ORDINALITY"
						 "       AS r(event_id, destination_id, claims, n)"
						 " WHERE (SELECT e.claims FROM idempotency.deliveries e"
						 "         WHERE e.event_id = r.event_id AND e.destination_id = r.destination_id"
						 "           AND e.state = 'pending' LIMIT 1) = r.claims",
						 3, argtypes);
	values[0] = relay_array(ids, NULL, n, UUIDOID);
	values[1] = relay_array(dests, NULL, n, INT4OID);
	values[2] = relay_array(claims, NULL, n, INT8OID);
	save_nestlevel = relay_plan_settings();
	rc = SPI_execute_plan(plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not read claimed outbox deliveries");
	for (uint64 i = 0; i < SPI_processed; i++)
		items[DatumGetInt64(spi_value(SPI_tuptable->vals[i], 1, 0)) - 1]->row_held = true;
}

/*
 * Step 3a: lock the in-database deliveries again and drop those whose claim
 * no longer stands (a relay that took over after our visibility deadline, or
 * a delivery that is no longer pending) or whose row another session holds
 * (never waited for: the worker's loop would stall for every destination).
 * Those held while our claim stands are marked row_held: they were not
 * attempted, and the loop gives them back once the row is free (a claim
 * left to run out would count as an interrupted attempt, and dead-letter a
 * delivery on its last attempt that was never made).  In the caller's
 * transaction the rows are still ours and this finds them all.
 */
void
relay_relock(RelayItem **items, int n, bool *any)
{
	Oid			argtypes[3] = {UUIDARRAYOID, INT4ARRAYOID, INT8ARRAYOID};
	Datum	   *ids = palloc(sizeof(Datum) * n);
	Datum	   *dests = palloc(sizeof(Datum) * n);
	Datum	   *claims = palloc(sizeof(Datum) * n);
	RelayItem **mine = palloc(sizeof(RelayItem *) * n);
	int			m = 0;
	int			k;
	Datum		values[3];
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;

	*any = false;
	for (int i = 0; i < n; i++)
	{
		if (items[i]->outcome != RELAY_PENDING || items[i]->dest->kind == DEST_HTTP)
			continue;
		ids[m] = UUIDPGetDatum(&items[i]->event_id);
		dests[m] = Int32GetDatum(items[i]->dest->id);
		claims[m] = Int64GetDatum(items[i]->claim);
		mine[m++] = items[i];
	}
	if (m == 0)
		return;
	*any = true;

	plan = relay_prepare_shaped(&lock_plan,
						 "SELECT r.n"
						 "  FROM unnest($1::uuid[], $2::int4[], $3::int8[]) WITH ORDINALITY"
						 "       AS r(event_id, destination_id, claims, n),"
						 "  LATERAL (SELECT d.state, d.claims FROM idempotency.deliveries d"
						 "            WHERE d.event_id = r.event_id AND d.destination_id = r.destination_id"
						 "            LIMIT 1 FOR UPDATE SKIP LOCKED) x"
						 " WHERE x.state = 'pending' AND x.claims = r.claims",
						 3, argtypes);
	values[0] = relay_array(ids, NULL, m, UUIDOID);
	values[1] = relay_array(dests, NULL, m, INT4OID);
	values[2] = relay_array(claims, NULL, m, INT8OID);
	save_nestlevel = relay_plan_settings();
	rc = SPI_execute_plan(plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not lock claimed outbox deliveries");

	/*
	 * Everything not found is someone else's now, and what follows it in
	 * its key's chain must not go before it.
	 */
	for (int i = 0; i < m; i++)
		mine[i]->outcome = RELAY_SKIPPED;
	for (uint64 i = 0; i < SPI_processed; i++)
		mine[DatumGetInt64(spi_value(SPI_tuptable->vals[i], 1, 0)) - 1]->outcome = RELAY_PENDING;
	k = 0;
	for (int i = 0; i < m; i++)
		if (mine[i]->outcome == RELAY_SKIPPED)
		{
			relay_release_chain(mine[i]);
			mine[k++] = mine[i];
		}
	relay_mark_held(mine, k);
}

/*
 * Renew the claims of a pass that runs longer than a claim's window (see
 * RelayLease): every delivery still ours -- pending, with the attempt number
 * we claimed it with, whatever became of it in this pass so far -- stays
 * hidden from other relays for another window from now.  One that is no
 * longer ours (its deadline passed after all and another relay claimed it,
 * or its destination was dropped) is not sent if it has not been, nor is
 * the rest of its chain; nor is one whose row another session holds
 * (an operator's SELECT ... FOR UPDATE): waiting for it would stall the
 * worker's loop for every destination (it is marked row_held, see
 * relay_mark_held).  Runs in a short transaction of its own; called
 * while no transaction is open, with requests in flight (http_deliver).
 */
void
relay_renew_claims(RelayItem **items, int n, RelayLease *lease)
{
	MemoryContext cxt = CurrentMemoryContext;
	Oid			argtypes[4] = {UUIDARRAYOID, INT4ARRAYOID, INT8ARRAYOID, TIMESTAMPTZARRAYOID};
	Datum		values[4];
	Datum	   *ids;
	Datum	   *dests;
	Datum	   *claims;
	Datum	   *untils;
	TimestampTz now = GetCurrentTimestamp();
	RelayItem **mine;
	bool	   *renewed;
	TimestampTz *before;		/* the deadlines they had */
	int			m = 0;
	int			k;
	RelayStep	step;
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;

	Assert(lease->renewable && !IsTransactionState());
	step.own_xact = true;
	if (!relay_step_begin(&step, "idempotency relay: renew claims", false))
	{
		MemoryContextSwitchTo(cxt);
		lease->renew_at = GetCurrentTimestamp() + Max(lease->window_us / 2, 1000);
		return;
	}

	/* Allocated in the step's memory, gone at its end. */
	ids = palloc(sizeof(Datum) * n);
	dests = palloc(sizeof(Datum) * n);
	claims = palloc(sizeof(Datum) * n);
	untils = palloc(sizeof(Datum) * n);
	mine = palloc(sizeof(RelayItem *) * n);
	renewed = palloc0(sizeof(bool) * n);
	before = palloc(sizeof(TimestampTz) * n);
	for (int i = 0; i < n; i++)
	{
		TimestampTz until;

		if (items[i]->outcome == RELAY_SKIPPED)
			continue;
		/* A window (a pass's), or the delivery's own timeout and the margin (the loop's). */
		if (lease->window_us > 0)
			until = now + lease->window_us;
		else
			until = now + ((int64) relay_visibility_margin +
						   (items[i]->dest ? items[i]->dest->timeout_ms : DEST_DEFAULT_TIMEOUT)) * 1000;
		ids[m] = UUIDPGetDatum(&items[i]->event_id);
		dests[m] = Int32GetDatum(items[i]->dest_id);
		claims[m] = Int64GetDatum(items[i]->claim);
		untils[m] = TimestampTzGetDatum(until);
		before[m] = items[i]->claimed_until;
		items[i]->claimed_until = until;
		mine[m++] = items[i];
	}
	if (m > 0)
	{
		plan = relay_prepare_shaped(&renew_plan,
							 "WITH r AS ("
							 " SELECT * FROM unnest($1::uuid[], $2::int4[], $3::int8[], $4::timestamptz[])"
							 "   WITH ORDINALITY AS r(event_id, destination_id, claims, until, n)),"
							 " found AS MATERIALIZED ("
							 " SELECT r.n, r.claims, r.until, x.tid FROM r,"
							 "   LATERAL (SELECT d.ctid AS tid FROM idempotency.deliveries d"
							 "             WHERE d.event_id = r.event_id"
							 "               AND d.destination_id = r.destination_id"
							 "             LIMIT 1 FOR UPDATE SKIP LOCKED) x)"
							 " UPDATE idempotency.deliveries d"
							 "    SET next_attempt_at = f.until, visible_until = f.until"
							 "   FROM found f"
							 "  WHERE d.ctid = ANY (ARRAY(SELECT g.tid FROM found g))"
							 "    AND d.ctid = f.tid AND d.state = 'pending' AND d.claims = f.claims"
							 " RETURNING f.n",
							 4, argtypes);
		values[0] = relay_array(ids, NULL, m, UUIDOID);
		values[1] = relay_array(dests, NULL, m, INT4OID);
		values[2] = relay_array(claims, NULL, m, INT8OID);
		values[3] = relay_array(untils, NULL, m, TIMESTAMPTZOID);
		save_nestlevel = relay_plan_settings();
		rc = SPI_execute_plan(plan, values, NULL, false, 0);
		AtEOXact_GUC(true, save_nestlevel);
		if (rc != SPI_OK_UPDATE_RETURNING)
			elog(ERROR, "could not renew claimed outbox deliveries");
		for (uint64 i = 0; i < SPI_processed; i++)
			renewed[DatumGetInt64(spi_value(SPI_tuptable->vals[i], 1, 0)) - 1] = true;

		k = 0;
		for (int j = 0; j < m; j++)
			if (!renewed[j] && mine[j]->outcome == RELAY_PENDING && !mine[j]->sent)
			{
				/*
				 * Its claim runs out when it did: until a give-back is
				 * recorded, the loop must not claim it again after that.
				 */
				mine[j]->claimed_until = before[j];
				mine[j]->outcome = RELAY_SKIPPED;
				relay_release_chain(mine[j]);
				mine[k++] = mine[j];
			}
		relay_mark_held(mine, k);
	}
	relay_step_end(&step);
	MemoryContextSwitchTo(cxt);
	lease->renew_at = GetCurrentTimestamp() + Max(lease->window_us / 2, 1000);
}

/* The message of a failed delivery, in the pass's memory. */
void
relay_fail(RelayItem *it, MemoryContext cxt, int32 status, const char *error)
{
	it->outcome = RELAY_FAILED;
	it->status = status;
	it->error = MemoryContextStrdup(cxt, error);
	it->finished_at = GetCurrentTimestamp();
}

/*
 * NOTIFY the destination's channel: the envelope, or a reference (the event
 * id and topic) if the destination asks for one or the envelope is too
 * large.
 */
void
relay_notify(RelayItem *it)
{
	const char *payload = it->body;

	if (it->dest->reference || payload == NULL || strlen(payload) >= RELAY_NOTIFY_MAX)
	{
		StringInfoData buf;

		initStringInfo(&buf);
		appendStringInfo(&buf, "{\"id\": \"%s\", \"topic\": ",
						 DatumGetCString(DirectFunctionCall1(uuid_out,
															 UUIDPGetDatum(&it->event_id))));
		escape_json(&buf, it->topic);
		appendStringInfoString(&buf, ", \"reference\": true}");
		payload = buf.data;
	}
	Async_Notify(it->dest->target, payload);
	it->outcome = RELAY_DELIVERED;
	it->finished_at = GetCurrentTimestamp();
}

/* SIGINT while destination functions run: the cancel is real; then what the process does. */
static void
relay_sigint_handler(int signo)
{
	relay_cancel_requested = true;
	if (relay_saved_sigint.sa_handler != SIG_IGN &&
		relay_saved_sigint.sa_handler != SIG_DFL &&
		relay_saved_sigint.sa_handler != NULL)
		(*relay_saved_sigint.sa_handler) (signo);
}

/* Route SIGINT through relay_sigint_handler while destination functions run. */
void
relay_watch_cancel(void)
{
	struct sigaction act;

	if (relay_sigint_installed)
		return;
	relay_cancel_requested = false;
	memset(&act, 0, sizeof(act));
	act.sa_handler = relay_sigint_handler;
	sigemptyset(&act.sa_mask);
	act.sa_flags = SA_RESTART;
	if (sigaction(SIGINT, &act, &relay_saved_sigint) < 0)
		elog(ERROR, "could not install a SIGINT handler: %m");
	relay_sigint_installed = true;
}

/* Give SIGINT back to the process's own handler. */
void
relay_unwatch_cancel(void)
{
	if (!relay_sigint_installed)
		return;
	(void) sigaction(SIGINT, &relay_saved_sigint, NULL);
	relay_sigint_installed = false;
}

/*
 * A destination function's timeout has passed: cancel what runs, as
 * statement_timeout does, but remember that it was the timeout.  Runs in
 * the SIGALRM handler; the timeout module sets the latch.
 */
static void
relay_function_timeout_handler(void)
{
	relay_timeout_fired = true;
	QueryCancelPending = true;
	InterruptPending = true;
}

/*
 * Call a destination function with the event's envelope, in a
 * subtransaction, as the role that created the destination and with its
 * search_path, in a security-restricted operation, for at most the
 * destination's timeout.  Whatever the function does wrong -- raise any
 * error, query_canceled included; run past its timeout; leave an
 * idempotency claim unfinished or be fenced from a key (IK001, caught or
 * not), either of which would make the commit fail -- rolls
 * the subtransaction back and makes this delivery fail, to be retried or
 * dead-lettered.  Only a cancel of the relay itself (pg_cancel_backend, or
 * the caller's statement_timeout) cancels the pass.
 */
void
relay_call_function(RelayItem *it, MemoryContext cxt)
{
	RelayDest  *d = it->dest;
	MemoryContext oldcxt = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	bool		claims_before = claims_pending();
	bool		fenced_before = claims_fenced_noted();

	if (!relay_timeout_registered)
	{
		relay_timeout_id = RegisterTimeout(USER_TIMEOUT, relay_function_timeout_handler);
		relay_timeout_registered = true;
	}
	relay_timeout_fired = false;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcxt);

	PG_TRY();
	{
		LOCAL_FCINFO(callinfo, 1);
		Oid			save_userid;
		int			save_sec_context;
		int			save_nestlevel;

		if (!SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(d->run_as)))
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_OBJECT),
					 errmsg("the role that created destination \"%s\" no longer exists", d->name)));
		if (object_aclcheck(ProcedureRelationId, d->func, d->run_as, ACL_EXECUTE) != ACLCHECK_OK)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("permission denied for function %s", d->target),
					 errdetail("Destination \"%s\" calls it as role \"%s\".",
							   d->name, GetUserNameFromId(d->run_as, false))));
		if (!d->flinfo_ready)
		{
			fmgr_info_cxt(d->func, &d->flinfo, cxt);
			d->flinfo_ready = true;
		}

		GetUserIdAndSecContext(&save_userid, &save_sec_context);
		SetUserIdAndSecContext(d->run_as, save_sec_context |
							   SECURITY_LOCAL_USERID_CHANGE |
							   SECURITY_RESTRICTED_OPERATION);
		save_nestlevel = NewGUCNestLevel();
		(void) set_config_option("search_path", d->search_path,
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);

		InitFunctionCallInfoData(*callinfo, &d->flinfo, 1, InvalidOid, NULL, NULL);
		callinfo->args[0].value = JsonbPGetDatum(it->envelope);
		callinfo->args[0].isnull = false;
		enable_timeout_after(relay_timeout_id, (int) d->timeout_ms);
		(void) FunctionCallInvoke(callinfo);
		disable_timeout(relay_timeout_id, false);

		/* A cancel of the relay that the function swallowed still cancels. */
		if (relay_cancel_requested)
			ereport(ERROR,
					(errcode(ERRCODE_QUERY_CANCELED),
					 errmsg("canceling statement due to user request")));
		/* The timeout fired as the function returned: it returned in time. */
		if (relay_timeout_fired)
			QueryCancelPending = false;
		/* The commit guard would fail the relay's transaction: fail the call. */
		if (!claims_before && claims_pending())
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_TRANSACTION_STATE),
					 errmsg("destination function left an idempotency claim unfinished"),
					 errhint("Finish every claim the function makes with idem_succeed() or idem_release().")));
		/* So would a token call the function was fenced in (and caught). */
		if (!fenced_before && claims_fenced_noted())
			ereport(ERROR,
					(errcode(ERRCODE_IDEM_FENCED),
					 errmsg("destination function was fenced from an idempotency key"),
					 errdetail("A token call of the function failed with IK001, and its writes must not take effect.")));

		AtEOXact_GUC(true, save_nestlevel);
		SetUserIdAndSecContext(save_userid, save_sec_context);

		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
		it->outcome = RELAY_DELIVERED;
		it->finished_at = GetCurrentTimestamp();
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		disable_timeout(relay_timeout_id, false);
		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		/* Also restores the user, the security context and the settings. */
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
		/* The function's writes are gone: a fence in it holds the relay no more. */
		if (!fenced_before)
			claims_forget_fenced();
		if (relay_cancel_requested)
			ReThrowError(edata);
		if (relay_timeout_fired && edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
			relay_fail(it, cxt, 0,
					   psprintf("the function did not return within the destination's timeout of %lld ms",
								(long long) d->timeout_ms));
		else
			relay_fail(it, cxt, 0, edata->message);
		FreeErrorData(edata);
	}
	PG_END_TRY();
}

/*
 * Step 3: record every outcome in one statement, and append the pass's
 * counts to each destination's counters (a row of increments, which no
 * other relay waits for).  A failure is rescheduled with
 * exponential backoff and full jitter, or dead after max_attempts; an
 * attempt that the endpoint rescheduled (a 429, or a Retry-After), one that
 * failed while its circuit was open, and a probe (whose attempt was given
 * back when claimed, and counts only if delivered) use up none; a result
 * is recorded only while the claim stands, a success even after another
 * relay took the delivery over.  Each row is found by key at the
 * statement's snapshot and updated by TID: a row that another relay updates
 * meanwhile (an HTTP delivery is not locked between claim and record) is
 * left alone.  The successes left alone so are returned in missed (which
 * may be items itself), for the caller to record again with a new snapshot.
 */
static int
relay_record(RelayItem **items, int n, RelayItem **missed)
{
	Oid			argtypes[11] = {UUIDARRAYOID, INT4ARRAYOID, INT8ARRAYOID, TEXTARRAYOID,
		TIMESTAMPTZARRAYOID, INT4ARRAYOID, TEXTARRAYOID, INT8ARRAYOID, BOOLARRAYOID,
	BOOLARRAYOID, INT4ARRAYOID};
	Datum	   *cols[11];
	bool	   *status_nulls = palloc(sizeof(bool) * n);
	bool	   *error_nulls = palloc(sizeof(bool) * n);
	Datum		values[11];
	RelayItem **mine = palloc(sizeof(RelayItem *) * n);
	bool	   *recorded;
	int			m = 0;
	int			nmissed = 0;
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;

	for (int c = 0; c < 11; c++)
		cols[c] = palloc(sizeof(Datum) * n);

	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		RelayDest  *d = it->dest;
		const char *state;
		TimestampTz next_at = it->finished_at;

		if (it->outcome != RELAY_DELIVERED && it->outcome != RELAY_FAILED &&
			it->outcome != RELAY_RELEASED && it->outcome != RELAY_ABANDONED)
			continue;
		if (it->sent && d->kind == DEST_HTTP)
		{
			RelayServed *e = relay_served_entry(d->id);

			e->at = Max(e->at, it->finished_at);
		}
		if (it->outcome == RELAY_RELEASED)
		{
			/* Not attempted: pending again at once, its attempt given back. */
			state = "pending";
			next_at = it->finished_at = GetCurrentTimestamp();
		}
		else if (it->outcome == RELAY_ABANDONED)
			state = "dead";		/* not attempted either: its attempt given back */
		else if (it->outcome == RELAY_DELIVERED)
			state = "delivered";
		else if (it->while_open)
		{
			/* Its endpoint's circuit is open: waits for it, attempt not counted. */
			state = "pending";
			next_at = Max(it->retry_at, it->finished_at);
		}
		else if (it->attempts >= d->max_attempts && !it->rescheduled)
			state = "dead";
		else if (it->retry_at != 0)
		{
			/* Retry-After: no earlier than the endpoint asked (capped). */
			state = "pending";
			next_at = it->retry_at;
		}
		else
		{
			/*
			 * Full jitter: uniform in [0, min(cap, base * 2^(attempts-1))].
			 * A 429 without Retry-After uses up no attempt: its window grows
			 * with the claims of the delivery instead, which every attempt
			 * counts, so that an endpoint answering 429 is asked less and
			 * less often.
			 */
			int64		tries = it->rescheduled ? Max(it->claim, 1) : it->attempts;
			double		window = (double) d->backoff_base_ms *
				pow(2.0, (double) Min(tries - 1, 60));

			if (window > (double) d->backoff_cap_ms)
				window = (double) d->backoff_cap_ms;
			state = "pending";
			next_at += (int64) (pg_prng_double(&pg_global_prng_state) * window * 1000.0);
		}
		cols[0][m] = UUIDPGetDatum(&it->event_id);
		cols[1][m] = Int32GetDatum(d->id);
		cols[2][m] = Int64GetDatum(it->claim);
		cols[3][m] = CStringGetTextDatum(state);
		cols[4][m] = TimestampTzGetDatum(next_at);
		cols[5][m] = Int32GetDatum(it->status);
		status_nulls[m] = (it->status == 0);
		cols[6][m] = it->error ? CStringGetTextDatum(it->error) : (Datum) 0;
		error_nulls[m] = (it->error == NULL);
		cols[7][m] = Int64GetDatum(it->finished_at - it->published_at);
		cols[8][m] = BoolGetDatum(it->interrupted);
		cols[9][m] = BoolGetDatum(it->outcome == RELAY_RELEASED ||
								  it->outcome == RELAY_ABANDONED);
		/* What the attempt claimed counts: a probe's was given back already. */
		if (it->outcome == RELAY_RELEASED || it->outcome == RELAY_ABANDONED ||
			(it->outcome == RELAY_FAILED && (it->while_open || it->rescheduled)))
			cols[10][m] = Int32GetDatum(it->probe ? 0 : -1);
		else
			cols[10][m] = Int32GetDatum(it->probe && it->outcome == RELAY_DELIVERED ? 1 : 0);
		mine[m++] = it;
	}
	if (m == 0)
		return 0;

	plan = relay_prepare_shaped(&record_plan,
						 "WITH r AS ("
						 " SELECT * FROM unnest($1::uuid[], $2::int4[], $3::int8[], $4::text[],"
						 "                      $5::timestamptz[], $6::int4[], $7::text[], $8::int8[],"
						 "                      $9::bool[], $10::bool[], $11::int4[]) WITH ORDINALITY"
						 "   AS r(event_id, destination_id, claims, state, at, status, error,"
						 "        latency_us, interrupted, given_back, counted, n)),"
						 " found AS MATERIALIZED ("
						 " SELECT r.*, r.given_back AND r.state = 'pending' AS released,"
						 "        x.tid, 'pending'::text AS pending FROM r,"
						 "   LATERAL (SELECT d.ctid AS tid, d.state AS current_state"
						 "              FROM idempotency.deliveries d"
						 "             WHERE d.event_id = r.event_id AND d.destination_id = r.destination_id"
						 "             LIMIT 1) x"
						 "  WHERE x.current_state = 'pending'),"
						 " u AS ("
						 " UPDATE idempotency.deliveries d"
						 "    SET state = r.state,"
						 "        next_attempt_at = r.at,"
						 "        visible_until = CASE WHEN r.released AND r.interrupted"
						 "                             THEN d.visible_until END,"
						 "        delivered_at = CASE WHEN r.state = 'delivered' THEN r.at END,"
						 "        attempts = d.attempts + r.counted,"
						 "        first_attempt_at = CASE WHEN r.released AND d.attempts = 1"
						 "                                THEN NULL ELSE d.first_attempt_at END,"
						 "        last_status = CASE WHEN r.released THEN d.last_status ELSE r.status END,"
						 "        last_error = CASE WHEN r.released THEN d.last_error ELSE r.error END"
						 "   FROM found r"
						 "  WHERE d.ctid = ANY (ARRAY(SELECT f.tid FROM found f))"
						 "    AND d.ctid = r.tid AND d.state = r.pending"
						 "    AND (r.state = 'delivered' OR d.claims = r.claims)"
						 " RETURNING r.*),"
						 " s AS ("
						 " INSERT INTO idempotency.destination_stats"
						 "  (destination_id, delivered, retried, dead_lettered, redelivered,"
						 "   latency_sum_us, last_latency_us, last_delivered_at)"
						 " SELECT destination_id,"
						 "        count(*) FILTER (WHERE state = 'delivered'),"
						 "        count(*) FILTER (WHERE state = 'pending' AND NOT released),"
						 "        count(*) FILTER (WHERE state = 'dead'),"
						 "        count(*) FILTER (WHERE interrupted AND NOT given_back),"
						 "        coalesce(sum(latency_us) FILTER (WHERE state = 'delivered'), 0),"
						 "        (array_agg(latency_us ORDER BY n DESC) FILTER (WHERE state = 'delivered'))[1],"
						 "        max(at) FILTER (WHERE state = 'delivered')"
						 "   FROM u GROUP BY destination_id)"
						 " SELECT n FROM u",
						 11, argtypes);

	values[0] = relay_array(cols[0], NULL, m, UUIDOID);
	values[1] = relay_array(cols[1], NULL, m, INT4OID);
	values[2] = relay_array(cols[2], NULL, m, INT8OID);
	values[3] = relay_array(cols[3], NULL, m, TEXTOID);
	values[4] = relay_array(cols[4], NULL, m, TIMESTAMPTZOID);
	values[5] = relay_array(cols[5], status_nulls, m, INT4OID);
	values[6] = relay_array(cols[6], error_nulls, m, TEXTOID);
	values[7] = relay_array(cols[7], NULL, m, INT8OID);
	values[8] = relay_array(cols[8], NULL, m, BOOLOID);
	values[9] = relay_array(cols[9], NULL, m, BOOLOID);
	values[10] = relay_array(cols[10], NULL, m, INT4OID);
	save_nestlevel = relay_plan_settings();
	rc = SPI_execute_plan(plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not record outbox delivery outcomes");

	/* Which rows were recorded, and whether a success was missed. */
	recorded = palloc0(sizeof(bool) * m);
	for (uint64 i = 0; i < SPI_processed; i++)
		recorded[DatumGetInt64(spi_value(SPI_tuptable->vals[i], 1, 0)) - 1] = true;
	for (int j = 0; j < m; j++)
		if (!recorded[j] && mine[j]->outcome == RELAY_DELIVERED)
			missed[nmissed++] = mine[j];
	return nmissed;
}


/*
 * Which of the deliveries in items another transaction holds (held[i]):
 * each row is locked FOR UPDATE SKIP LOCKED, so the outcomes of the others
 * can be recorded without waiting, and those held left for later.  A row
 * that is gone is not held (its outcome has nothing left to update).
 */
void
relay_outcomes_held(RelayItem **items, int n, bool *held)
{
	Oid			argtypes[2] = {UUIDARRAYOID, INT4ARRAYOID};
	Datum	   *ids = palloc(sizeof(Datum) * Max(n, 1));
	Datum	   *dests = palloc(sizeof(Datum) * Max(n, 1));
	Datum		values[2];
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;

	for (int i = 0; i < n; i++)
	{
		ids[i] = UUIDPGetDatum(&items[i]->event_id);
		dests[i] = Int32GetDatum(items[i]->dest_id);
		held[i] = false;
	}
	if (n == 0)
		return;
	plan = relay_prepare_shaped(&held_plan,
						 "SELECT r.n FROM unnest($1::uuid[], $2::int4[]) WITH ORDINALITY"
						 "       AS r(event_id, destination_id, n),"
						 "  LATERAL (SELECT d.ctid FROM idempotency.deliveries d"
						 "            WHERE d.event_id = r.event_id AND d.destination_id = r.destination_id"
						 "            LIMIT 1) e"
						 "  LEFT JOIN LATERAL (SELECT d.ctid FROM idempotency.deliveries d"
						 "            WHERE d.event_id = r.event_id AND d.destination_id = r.destination_id"
						 "            LIMIT 1 FOR UPDATE SKIP LOCKED) l ON true"
						 " WHERE l.ctid IS NULL",
						 2, argtypes);
	values[0] = relay_array(ids, NULL, n, UUIDOID);
	values[1] = relay_array(dests, NULL, n, INT4OID);
	save_nestlevel = relay_plan_settings();
	rc = SPI_execute_plan(plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not lock outbox deliveries");
	for (uint64 i = 0; i < SPI_processed; i++)
		held[DatumGetInt64(spi_value(SPI_tuptable->vals[i], 1, 0)) - 1] = true;
}

/* Record the outcomes of items, and again those of successes a race made us miss. */
void
relay_record_all(RelayItem **items, int n, RelayItem **missed)
{
	int			nmissed;

	relay_endpoint_states(items, n);
	nmissed = relay_record(items, n, missed);

	for (int retry = 0; nmissed > 0 && retry < 2; retry++)
		nmissed = relay_record(missed, nmissed, missed);
}

/*
 * Claimed deliveries whose last allowed attempt was interrupted before its
 * outcome was recorded (the relay died, or its transaction failed at
 * commit): perhaps a poison event, dead without another attempt.  Called
 * in the claiming transaction, before relay_claim_probes: a probe's attempt
 * is given back when it is claimed, so an interrupted probe used none and
 * never makes its delivery dead here.
 */
void
relay_abandon_interrupted(RelayItem **items, int n, MemoryContext cxt)
{
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		char		why[160];

		if (it->dest == NULL || it->outcome != RELAY_PENDING || !it->interrupted ||
			it->attempts <= it->dest->max_attempts)
			continue;
		snprintf(why, sizeof(why),
				 "not attempted again: its last attempt (%d of max_attempts %d) was interrupted before its outcome was recorded",
				 it->attempts - 1, it->dest->max_attempts);
		relay_fail(it, cxt, 0, why);
		it->outcome = RELAY_ABANDONED;
		relay_release_chain(it);
	}
}

/* See relay.h. */
int64
relay_pass(int max_events)
{
	RelayStep	step;
	MemoryContext entrycxt = CurrentMemoryContext;
	MemoryContext passcxt;
	volatile int64 attempted = 0;

	if (max_events < 1 || max_events > RELAY_MAX_BATCH)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_events must be between 1 and %d", RELAY_MAX_BATCH),
				 errdetail("The max_events given was %d.", max_events)));
	if (relay_pass_running)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("a relay pass cannot run inside another"),
				 errdetail("A destination function called idem_outbox_relay().")));
	if (RecoveryInProgress())
		return 0;
	/* A server made read-only on purpose gets no writes from us either. */
	if (!IsTransactionState() && DefaultXactReadOnly)
		return 0;

	step.own_xact = !IsTransactionState();
	passcxt = AllocSetContextCreate(step.own_xact ? TopMemoryContext : CurrentMemoryContext,
									"outbox relay pass", ALLOCSET_DEFAULT_SIZES);
	relay_pass_running = true;
	PG_TRY();
	{
		List	   *dests;
		RelayItem **items;
		RelayItem **missed;
		RelayItem **http_items;
		RelayItem **local_items;
		int			n;
		int			nhttp = 0;
		int			nlocal = 0;
		bool		split;
		bool		any_local;
		TimestampTz claimed_at = GetCurrentTimestamp();
		TimestampTz claimed_until = 0;
		RelayLease	lease;
		RelayRooms	rooms;
		bool		backlog;

		/* Step 1: claim. */
		if (!relay_step_begin(&step, "idempotency relay: claim", true))
			goto done;
		if (!relay_schema_current(step.own_xact))
		{
			relay_step_end(&step);
			goto done;
		}
		memset(&rooms, 0, sizeof(rooms));
		rooms.http_room = max_events;
		/* HTTP requests go out in waves of http_max_in_flight(). */
		n = relay_claim(max_events, (max_events + http_max_in_flight() - 1) / http_max_in_flight(),
						&rooms, claimed_at, passcxt, &items, &backlog);
		dests = relay_load_dests(passcxt, items, n);
		for (int i = 0; i < n; i++)
			items[i]->dest = relay_find_dest(dests, items[i]->dest_id);
		relay_abandon_interrupted(items, n, passcxt);
		relay_claim_probes(items, n, claimed_at);
		relay_step_end(&step);
		if (n == 0)
			goto done;
		http_items = MemoryContextAlloc(passcxt, sizeof(RelayItem *) * n);
		local_items = MemoryContextAlloc(passcxt, sizeof(RelayItem *) * n);
		for (int i = 0; i < n; i++)
		{
			RelayItem  *it = items[i];

			/* Dropped since: its deliveries are gone with it. */
			if (it->dest == NULL)
				it->outcome = RELAY_SKIPPED;
			else if (it->outcome == RELAY_RELEASED)
				http_items[nhttp++] = it;	/* a probe given back */
			else if (it->dest->kind == DEST_HTTP)
				http_items[nhttp++] = it;
			else
				local_items[nlocal++] = it;
			if (claimed_until == 0 || it->claimed_until < claimed_until)
				claimed_until = it->claimed_until;
		}

		/*
		 * Step 2: HTTP, outside any transaction of ours, renewing the claims
		 * when the requests take longer than they allowed for.
		 */
		if (nhttp > 0)
		{
			MemoryContext old = MemoryContextSwitchTo(passcxt);

			lease.renewable = step.own_xact;
			lease.window_us = Max(claimed_until - claimed_at, 0);
			lease.renew_at = claimed_at + lease.window_us / 2;
			http_deliver(items, n, &lease);
			MemoryContextSwitchTo(old);
		}
		missed = MemoryContextAlloc(passcxt, sizeof(RelayItem *) * n);

		/*
		 * Step 3a, when in-database deliveries follow webhooks in a pass of
		 * our own: the webhooks' outcomes first, in a transaction of their
		 * own.  Function calls may take a while (each up to its timeout),
		 * and meanwhile nothing would keep the webhooks' claims hidden.
		 */
		split = step.own_xact && nhttp > 0 && nlocal > 0;
		if (split)
		{
			if (!relay_step_begin(&step, "idempotency relay: record", false))
				goto done;
			relay_record_all(http_items, nhttp, missed);
			relay_disable(dests);
			relay_step_end(&step);
		}

		/* Step 3b: in-database deliveries, then the outcomes, in one transaction. */
		if (!relay_step_begin(&step, "idempotency relay: record", false))
			goto done;
		relay_relock(items, n, &any_local);
		if (any_local)
			relay_watch_cancel();
		if (any_local && step.own_xact)
		{
			/*
			 * Deferred constraints are checked as each function's statements
			 * end, not at our commit: a function that violates one fails its
			 * own delivery, not the transaction that records every outcome.
			 */
			ConstraintsSetStmt *immediate = makeNode(ConstraintsSetStmt);

			immediate->constraints = NIL;
			immediate->deferred = false;
			AfterTriggerSetState(immediate);
		}
		for (int i = 0; any_local && i < n; i++)
		{
			RelayItem  *it = items[i];

			CHECK_FOR_INTERRUPTS();
			if (it->outcome != RELAY_PENDING)
				continue;
			if (it->dest->kind == DEST_NOTIFY)
				relay_notify(it);
			else if (it->dest->kind == DEST_FUNCTION)
				relay_call_function(it, passcxt);
			/* A key's later deliveries never go before an earlier one. */
			if (it->outcome != RELAY_DELIVERED)
				relay_release_chain(it);
		}
		relay_unwatch_cancel();
		if (split)
			relay_record_all(local_items, nlocal, missed);
		else
		{
			relay_record_all(items, n, missed);
			relay_disable(dests);
		}
		relay_step_end(&step);

		for (int i = 0; i < n; i++)
			if (items[i]->outcome == RELAY_DELIVERED || items[i]->outcome == RELAY_FAILED)
				attempted++;
done:
		;
	}
	PG_FINALLY();
	{
		relay_unwatch_cancel();
		relay_pass_running = false;
		MemoryContextSwitchTo(entrycxt);
		MemoryContextDelete(passcxt);
	}
	PG_END_TRY();

	return attempted;
}

/* See relay.h. */
bool
bgworker_run_guarded(const char *what, void (*unit) (void *arg), void *arg)
{
	MemoryContext cxt = CurrentMemoryContext;
	volatile bool ok = true;

	Assert(!IsTransactionState());
	PG_TRY();
	{
		unit(arg);
	}
	PG_CATCH();
	{
		/* As autovacuum does after an error on one table. */
		HOLD_INTERRUPTS();
		MemoryContextSwitchTo(cxt);
		errcontext("%s", what);
		EmitErrorReport();
		AbortOutOfAnyTransaction();
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
		pgstat_report_activity(STATE_IDLE, NULL);
		RESUME_INTERRUPTS();
		ok = false;
	}
	PG_END_TRY();
	return ok;
}

/*
 * See relay.h.  Only the destinations with pending deliveries are read
 * (BUSY_DESTS), and each one's earliest pending delivery is one probe of
 * deliveries_due_by_destination: a full destination's due backlog, however
 * large, is never walked.
 */
TimestampTz
relay_next_due_except(int32 *full, int nfull)
{
	RelayStep	step;
	TimestampTz due = 0;
	SPIPlanPtr	plan;
	int			save_nestlevel;
	int			rc;
	Oid			argtypes[2] = {TIMESTAMPTZOID, INT4ARRAYOID};
	Datum		values[2];
	Datum	   *ids;

	if (RecoveryInProgress())
		return 0;
	step.own_xact = !IsTransactionState();
	if (!relay_step_begin(&step, "idempotency relay: next due", true))
		return 0;
	plan = relay_prepare_shaped(&next_due_plan,
						 BUSY_DESTS
						 ", t AS MATERIALIZED ("
						 " SELECT x.* FROM busy b, LATERAL ("
						 "   SELECT t.id, t.paced_until, t.circuit, t.next_probe_at"
						 "     FROM idempotency.destinations t"
						 "    WHERE t.id = b.id AND NOT t.paused AND t.disabled_at IS NULL"
						 "      AND t.id <> ALL ($2) LIMIT 1) x)"
						 " SELECT least("
						 " (SELECT min(n.at)"
						 "    FROM t,"
						 "    LATERAL (SELECT d.next_attempt_at AS at FROM idempotency.deliveries d"
						 "              WHERE d.state = 'pending' AND d.destination_id = t.id"
						 "              ORDER BY d.next_attempt_at, d.seq LIMIT 1) n"
						 "   WHERE (t.paced_until IS NULL OR t.paced_until <= $1)"
						 "     AND (t.circuit <> 'open' OR t.next_probe_at <= $1)),"
						 " (SELECT min(greatest(t.paced_until,"
						 "                      CASE WHEN t.circuit = 'open' THEN t.next_probe_at END))"
						 "    FROM t"
						 "   WHERE t.paced_until > $1 OR (t.circuit = 'open' AND t.next_probe_at > $1)))",
						 2, argtypes);
	ids = palloc(sizeof(Datum) * Max(nfull, 1));
	for (int i = 0; i < nfull; i++)
		ids[i] = Int32GetDatum(full[i]);
	values[0] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[1] = relay_array(ids, NULL, nfull, INT4OID);
	save_nestlevel = relay_plan_settings();
	/*
	 * Not read-only: the step's snapshot predates the outcomes and claims
	 * this transaction recorded (a delivery just failed would still look
	 * claimed until its visibility deadline).
	 */
	rc = SPI_execute_plan(plan, values, NULL, false, 1);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox schedule");
	if (SPI_processed == 1)
		due = DatumGetTimestampTz(spi_value(SPI_tuptable->vals[0], 1, TimestampTzGetDatum(0)));
	relay_step_end(&step);
	return due;
}

/* Run one cleanup statement with (cutoff, batch); returns the rows removed. */
static uint64
cleanup_batch(SPIPlanPtr *plan, const char *sql, TimestampTz cutoff, int batch)
{
	Oid			argtypes[2] = {TIMESTAMPTZOID, INT4OID};
	Datum		values[2];
	int			rc;
	int			save_nestlevel = NewGUCNestLevel();

	/* As for the claim: compiling would cost more than the statement. */
	(void) set_config_option("jit", "off", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	relay_prepare(plan, sql, 2, argtypes);
	values[0] = TimestampTzGetDatum(cutoff);
	values[1] = Int32GetDatum(batch);
	rc = SPI_execute_plan(*plan, values, NULL, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "outbox cleanup failed: %s", SPI_result_code_string(rc));
	return SPI_processed;
}

/* See relay.h. */
int64
outbox_cleanup(int batch, void (*between) (void))
{
	RelayStep	step;
	TimestampTz cutoff;
	int64		events = 0;
	uint64		n;

	if (batch < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch must be at least 1")));
	if (RecoveryInProgress())
		return 0;
	step.own_xact = !IsTransactionState();
	/* As for the relay: a server made read-only gets no writes from the worker. */
	if (step.own_xact && DefaultXactReadOnly)
		return 0;
	cutoff = GetCurrentTimestamp() - (int64) outbox_retention * USECS_PER_SEC;

	/* Delivered deliveries past the retention. */
	do
	{
		if (!relay_step_begin(&step, "idempotency relay: cleanup", true))
			return 0;
		n = cleanup_batch(&cleanup_deliveries_plan,
						  "DELETE FROM idempotency.deliveries WHERE ctid = ANY (ARRAY("
						  " SELECT ctid FROM idempotency.deliveries"
						  "  WHERE state = 'delivered' AND delivered_at < $1"
						  "  LIMIT $2 FOR UPDATE SKIP LOCKED))",
						  cutoff, batch);
		relay_step_end(&step);
		if (between != NULL && step.own_xact)
			between();
	} while (n >= (uint64) batch);

	/* Deliveries left behind by a destination dropped while an event was being published. */
	do
	{
		if (!relay_step_begin(&step, "idempotency relay: cleanup", true))
			return 0;
		n = cleanup_batch(&cleanup_orphans_plan,
						  "DELETE FROM idempotency.deliveries WHERE ctid = ANY (ARRAY("
						  " SELECT d.ctid FROM idempotency.deliveries d"
						  "  WHERE (d.state = 'pending' OR d.state = 'dead') AND d.next_attempt_at < $1"
						  "    AND NOT EXISTS (SELECT FROM idempotency.destinations t"
						  "                     WHERE t.id = d.destination_id)"
						  "  LIMIT $2 FOR UPDATE OF d SKIP LOCKED))",
						  cutoff, batch);
		relay_step_end(&step);
		if (between != NULL && step.own_xact)
			between();
	} while (n >= (uint64) batch);

	/*
	 * Fold each destination's rows of counter increments into one (and drop
	 * those of dropped destinations).  Rows a relay appends meanwhile are not
	 * seen by the delete, and stay.  Rows that another transaction holds
	 * stay too, to be folded next time: a drop of their destination that a
	 * Citus worker holds prepared until the coordinator's recovery, say,
	 * must not stop the cleanup and the relay that runs in its process.
	 * The deletes above skip such rows for the same reason.
	 */
	if (!relay_step_begin(&step, "idempotency relay: cleanup", true))
		return 0;
	relay_prepare(&fold_stats_plan,
				  "WITH gone AS (DELETE FROM idempotency.destination_stats WHERE ctid = ANY (ARRAY("
				  "    SELECT ctid FROM idempotency.destination_stats FOR UPDATE SKIP LOCKED))"
				  "  RETURNING *)"
				  " INSERT INTO idempotency.destination_stats"
				  " SELECT destination_id, sum(delivered), sum(retried), sum(dead_lettered),"
				  "        sum(redelivered), sum(latency_sum_us),"
				  "        (array_agg(last_latency_us ORDER BY last_delivered_at DESC NULLS LAST))[1],"
				  "        max(last_delivered_at)"
				  "   FROM gone"
				  "  WHERE EXISTS (SELECT FROM idempotency.destinations t WHERE t.id = gone.destination_id)"
				  "  GROUP BY destination_id",
				  0, NULL);
	if (SPI_execute_plan(fold_stats_plan, NULL, NULL, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not fold outbox statistics");
	relay_step_end(&step);

	/* Events past the retention that no delivery refers to any more. */
	do
	{
		if (!relay_step_begin(&step, "idempotency relay: cleanup", true))
			return events;
		n = cleanup_batch(&cleanup_events_plan,
						  "DELETE FROM idempotency.outbox WHERE event_id = ANY (ARRAY("
						  " SELECT o.event_id FROM idempotency.outbox o"
						  "  WHERE o.published_at < $1"
						  "    AND NOT EXISTS (SELECT FROM idempotency.deliveries d"
						  "                     WHERE d.event_id = o.event_id)"
						  "  LIMIT $2))",
						  cutoff, batch);
		relay_step_end(&step);
		events += n;
		if (between != NULL && step.own_xact)
			between();
	} while (n >= (uint64) batch);

	return events;
}

PG_FUNCTION_INFO_V1(idem_outbox_relay);
PG_FUNCTION_INFO_V1(idem_outbox_cleanup);

/*
 * idem_outbox_relay(max_events) returns bigint: one relay pass in the
 * caller's transaction (see the file header); the deliveries attempted.
 */
Datum
idem_outbox_relay(PG_FUNCTION_ARGS)
{
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("max_events must not be null")));
	if (IsolationUsesXactSnapshot())
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem_outbox_relay() must run at isolation level READ COMMITTED"),
				 errdetail("Claiming with SKIP LOCKED needs a fresh snapshot for each statement.")));
	PreventCommandIfReadOnly("idem_outbox_relay()");
	if (outbox_published())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_outbox_relay() cannot run in a transaction that published events"),
				 errdetail("The pass would claim this transaction's own events before they commit, and a webhook sent for one of them cannot be taken back if the transaction rolls back."),
				 errhint("Call idem_outbox_relay() after the commit, in a transaction of its own.")));
	PG_RETURN_INT64(relay_pass(PG_GETARG_INT32(0)));
}

/*
 * idem_outbox_cleanup(batch) returns bigint: outbox_cleanup in the caller's
 * transaction; the events removed.
 */
Datum
idem_outbox_cleanup(PG_FUNCTION_ARGS)
{
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("batch must not be null")));
	PreventCommandIfReadOnly("idem_outbox_cleanup()");
	PG_RETURN_INT64(outbox_cleanup(PG_GETARG_INT32(0), NULL));
}
