/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  Background cleanup of expired records and inbox marks.
 *
 * Deduplication lasts as long as a record, and the records must not pile up
 * without bound.  With the library in shared_preload_libraries, a launcher
 * (one static background worker, started once recovery has finished, so
 * never on a hot standby, and after a promotion without a restart) starts one
 * cleanup worker per database listed in idempotency.databases, and starts it
 * again if it exits.  Each worker makes a pass over idempotency.records and
 * idempotency.inbox every idempotency.cleanup_interval.
 *
 * A pass walks a table once in physical order and deletes what had expired
 * when the pass started, in batches of at most idempotency.cleanup_batch_size
 * rows, each batch its own short transaction.  A batch reads a window of
 * blocks with a TID range scan that starts where the previous batch stopped,
 * so the dead rows earlier batches left behind are not read again and a
 * backlog of millions of rows costs one pass, not one pass per batch.  The
 * worker pauses idempotency.cleanup_delay after each batch, so that working
 * through a backlog does not take the foreground's CPU: deleting runs some
 * fifty times faster than creating, and a paced pass still keeps up with a
 * sustained peak of creates.
 *
 * For each expired row the pass takes the key's claim lock (claims.c) or the
 * message's inbox lock (inbox.c) without waiting, then deletes the row
 * through the heap, again without waiting; if either is held by someone else
 * the row is left for the next pass.  A claim in flight deletes an expired
 * record itself while holding that lock, so it never sees the record vanish
 * between its two lookups, and a replay reads with its own snapshot, which a
 * delete does not disturb.  Records in state 'processing' are never deleted:
 * they are counted and reported instead.  Only one advisory lock is held at a
 * time, so a large batch does not fill the shared lock table.
 *
 * idem_cleanup() runs the same pass in the caller's transaction; the tests
 * use it to race a retry against cleanup deterministically.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_database.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/bufmgr.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/proc.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "claims.h"
#include "inbox.h"
#include "outbox.h"
#include "relay.h"
#include "shards.h"
#include "stats.h"
#include "worker.h"

/* What pg_stat_activity shows as backend_type and application_name. */
#define IDEM_LAUNCHER_TYPE	"idempotency launcher"
#define IDEM_WORKER_TYPE	"idempotency cleanup"

/* Blocks one batch reads at most: bounds a batch's time where little expired. */
#define CLEANUP_WINDOW_BLOCKS	4096

/* How long the launcher waits before starting an exited worker again. */
#define WORKER_RESTART_DELAY_MS 10000
/* How often the launcher looks again for a listed database that is missing. */
#define DATABASE_RECHECK_MS		60000
/* The launcher's longest sleep; worker exits wake it earlier. */
#define LAUNCHER_NAP_MS			10000

/*
 * How soon a worker looks again for an extension that was not installed (or
 * older than the library), so that cleanup starts soon after CREATE (or
 * ALTER) EXTENSION, whatever cleanup_interval is.
 */
#define EXTENSION_RECHECK_MS	5000

/* The relay's share of the worker before cleanup gets a turn. */
#define RELAY_SLICE_MS			1000

/*
 * After an error, the relay waits this long before its next pass, twice as
 * long after each further error in a row, up to RELAY_MAX_BACKOFF_MS.
 */
#define RELAY_MIN_BACKOFF_MS	1000
#define RELAY_MAX_BACKOFF_MS	60000

int			idem_cleanup_interval = 60;
int			idem_cleanup_batch_size = 1000;
int			idem_cleanup_delay = 10;
char	   *idem_databases = NULL;

/* One table the pass cleans. */
typedef void (*CleanupLockTag) (LOCKTAG *tag, text *a, text *b);

typedef struct CleanupTarget
{
	const char *relname;		/* in schema idempotency */
	const char *query;			/* expired rows of a TID window, FROM %s */
	const char *activity;		/* for pg_stat_activity */
	CleanupLockTag locktag;		/* the lock a claim or delivery holds */
	int			natts;			/* its columns in this version of the extension */
	SPIPlanPtr	plan;			/* saved on first use, for plan_relid */
	Oid			plan_relid;		/* the table, or one of its Citus shards */
} CleanupTarget;

/*
 * $1 and $2 bound the TID window, $3 is the pass's start, $4 the batch size.
 * Operators are schema-qualified because idem_cleanup() runs under the
 * caller's search_path.
 */
#define CLEANUP_WINDOW_SQL \
	" WHERE ctid OPERATOR(pg_catalog.>) $1 AND ctid OPERATOR(pg_catalog.<) $2" \
	" AND expires_at OPERATOR(pg_catalog.<) $3 LIMIT $4"

static CleanupTarget cleanup_targets[] = {
	{
		"records",
		"SELECT ctid, scope, key, state OPERATOR(pg_catalog.=) 'processing', expires_at,"
		"       lease_expires_at OPERATOR(pg_catalog.>=) $3"
		" FROM %s" CLEANUP_WINDOW_SQL,
		"deleting expired rows of idempotency.records",
		claim_locktag, Natts_records, NULL, InvalidOid
	},
	{
		"inbox",
		"SELECT ctid, source, message_id, false, expires_at, false"
		" FROM %s" CLEANUP_WINDOW_SQL,
		"deleting expired rows of idempotency.inbox",
		inbox_locktag, Natts_inbox, NULL, InvalidOid
	},
};

#define NUM_CLEANUP_TARGETS lengthof(cleanup_targets)

/* The progress of one pass. */
typedef struct CleanupPass
{
	TimestampTz started_at;		/* rows that expired before this are due */
	int			batch_size;
	int64		deleted;
	int64		processing;		/* due 'processing' records left in place */
	TimestampTz oldest_left;	/* oldest due row left to a claim in flight, or 0 */
	/*
	 * The relations of the target being cleaned: the table itself, or its
	 * local Citus shards (shards.c); cleanup_target_begin's buffer.
	 */
	Oid		   *relids;
	int			nrelids;
	int			rel_index;		/* the one being cleaned */
	/* the relation being cleaned */
	BlockNumber nblocks;		/* its size when its scan began */
	ItemPointerData cursor;		/* rows after this one are still to be seen */
	bool		rel_done;		/* walked to its end */
	bool		table_done;		/* every relation of the target is done */
} CleanupPass;

/* What happened to one due row. */
typedef enum CleanupRowResult
{
	ROW_DELETED,
	ROW_LEFT,					/* a claim or delivery in flight holds it */
	ROW_GONE					/* deleted or replaced by someone else */
} CleanupRowResult;

/* The worker's database, from bgw_extra. */
static char worker_dbname[NAMEDATALEN];

/*
 * The relay as the worker drives it, between cleanup batches too: what the
 * last slice found out, a wakeup seen meanwhile, and the backoff after
 * errors.
 */
static struct
{
	TimestampTz due;			/* when the relay next has work, or 0 */
	bool		more;			/* the last slice ran out with work left */
	bool		woken;			/* the latch was set, or requests completed */
	TimestampTz retry_at;		/* backing off after an error until then */
	int			errors;			/* errors in a row */
	char		context[NAMEDATALEN + 64];	/* for the error context */
} relay_state;

static void worker_relay_between_batches(void);

/*
 * Check hook of idempotency.databases: a comma-separated list of database
 * names (double-quoted where they contain commas or spaces), each at most
 * NAMEDATALEN - 1 bytes, none twice.
 */
static bool
check_databases(char **newval, void **extra, GucSource source)
{
	char	   *raw = pstrdup(*newval);
	List	   *names;
	ListCell   *lc;
	bool		ok = true;

	if (!SplitGUCList(raw, ',', &names))
	{
		GUC_check_errdetail("List syntax is invalid.");
		ok = false;
	}
	else
	{
		foreach(lc, names)
		{
			const char *name = lfirst(lc);

			if (strlen(name) >= NAMEDATALEN)
			{
				GUC_check_errdetail("Database name \"%s\" is longer than %d bytes.",
									name, NAMEDATALEN - 1);
				ok = false;
				break;
			}
			for (ListCell *prev = list_head(names); prev != lc; prev = lnext(names, prev))
			{
				if (strcmp(lfirst(prev), name) == 0)
				{
					GUC_check_errdetail("Database \"%s\" is listed more than once.", name);
					ok = false;
					break;
				}
			}
			if (!ok)
				break;
		}
	}
	list_free(names);
	pfree(raw);
	return ok;
}

/*
 * The names in idempotency.databases, pointing into *raw; both palloc'd in
 * the current memory context.
 */
static List *
databases_list(char **raw)
{
	List	   *names = NIL;

	/* The check hook accepted the value, so it parses. */
	*raw = pstrdup(idem_databases ? idem_databases : "");
	(void) SplitGUCList(*raw, ',', &names);
	return names;
}

/* Whether dbname is listed in idempotency.databases. */
static bool
database_listed(const char *dbname)
{
	char	   *raw;
	List	   *names = databases_list(&raw);
	ListCell   *lc;
	bool		found = false;

	foreach(lc, names)
	{
		if (strcmp(lfirst(lc), dbname) == 0)
		{
			found = true;
			break;
		}
	}
	list_free(names);
	pfree(raw);
	return found;
}

/* Define the GUCs and, when preloading, register the launcher; called from _PG_init. */
void
WorkerInit(void)
{
	BackgroundWorker worker;

	DefineCustomIntVariable("idempotency.cleanup_interval",
							"Time between two cleanup passes of a database.",
							"Each pass deletes the records and inbox marks that had expired when it started.",
							&idem_cleanup_interval,
							60, 1, INT_MAX / 1000,
							PGC_SIGHUP, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.cleanup_batch_size",
							"Most rows one cleanup transaction deletes.",
							NULL,
							&idem_cleanup_batch_size,
							1000, 1, 1000000,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.cleanup_delay",
							"Pause of the cleanup worker after each batch.",
							"It paces a large backlog so that the foreground keeps its CPU and I/O; 0 runs the batches back to back.",
							&idem_cleanup_delay,
							10, 0, 10000,
							PGC_SIGHUP, GUC_UNIT_MS,
							NULL, NULL, NULL);
	DefineCustomStringVariable("idempotency.databases",
							   "Databases whose expired records a background worker deletes.",
							   "A comma-separated list of database names; one cleanup worker runs per database. Needs idempotency in shared_preload_libraries.",
							   &idem_databases,
							   "",
							   PGC_SIGHUP, GUC_LIST_INPUT,
							   check_databases, NULL, NULL);

	if (!process_shared_preload_libraries_in_progress || IsBinaryUpgrade)
		return;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = WORKER_RESTART_DELAY_MS / 1000;
	strlcpy(worker.bgw_library_name, "idempotency", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_launcher_main", BGW_MAXLEN);
	strlcpy(worker.bgw_name, IDEM_LAUNCHER_TYPE, BGW_MAXLEN);
	strlcpy(worker.bgw_type, IDEM_LAUNCHER_TYPE, BGW_MAXLEN);
	RegisterBackgroundWorker(&worker);
}

/* The OID of idempotency.<relname> if the extension is installed, else InvalidOid. */
static Oid
cleanup_relid(const char *relname)
{
	Oid			nspid;

	if (!OidIsValid(get_extension_oid("idempotency", true)))
		return InvalidOid;
	nspid = get_namespace_oid("idempotency", true);
	if (!OidIsValid(nspid))
		return InvalidOid;
	return get_relname_relid(relname, nspid);
}

/*
 * Delete one due row, unless a claim or delivery of its key is in flight or
 * another transaction holds the row.  The key's lock is held only around the
 * delete.
 */
static CleanupRowResult
cleanup_row(CleanupTarget *target, Relation rel, ItemPointer tid, text *a, text *b)
{
	LOCKTAG		tag;
	LockAcquireResult res;
	TM_Result	result;
	TM_FailureData tmfd;

	target->locktag(&tag, a, b);
	res = LockAcquire(&tag, ExclusiveLock, false, true);
	if (res == LOCKACQUIRE_NOT_AVAIL)
		return ROW_LEFT;
	if (res != LOCKACQUIRE_OK)
	{
		/* This transaction claimed the key itself (idem_cleanup): leave it. */
		LockRelease(&tag, ExclusiveLock, false);
		return ROW_LEFT;
	}

	result = table_tuple_delete(rel, tid, GetCurrentCommandId(true),
								InvalidSnapshot, InvalidSnapshot,
								false, &tmfd, false);
	LockRelease(&tag, ExclusiveLock, false);

	switch (result)
	{
		case TM_Ok:
			return ROW_DELETED;
		case TM_BeingModified:
			return ROW_LEFT;
		case TM_Updated:
		case TM_Deleted:
		case TM_SelfModified:
			return ROW_GONE;
		default:
			elog(ERROR, "unexpected table_tuple_delete status: %u", result);
	}
	return ROW_GONE;			/* keep the compiler quiet */
}

/* Start the pass over a relation: from its first block to its current end. */
static void
cleanup_table_begin(CleanupPass *pass, Relation rel)
{
	pass->nblocks = RelationGetNumberOfBlocks(rel);
	ItemPointerSet(&pass->cursor, 0, 0);	/* offset 0: before the first row */
	pass->rel_done = false;
}

/*
 * Start the pass over a target: the relations that hold its rows on this
 * node, the table itself or its local shards.  relid is the table.
 */
static void
cleanup_target_begin(CleanupPass *pass, Oid relid)
{
	/* Kept from pass to pass: a pass that an error ends leaks nothing. */
	static Oid *relids_buf = NULL;
	static int	relids_size = 0;
	List	   *relids = shard_local_relids(relid);
	ListCell   *lc;

	if (relids_size < list_length(relids) || relids_buf == NULL)
	{
		relids_size = Max(list_length(relids), 16);
		relids_buf = relids_buf ? repalloc(relids_buf, sizeof(Oid) * relids_size)
			: MemoryContextAlloc(TopMemoryContext, sizeof(Oid) * relids_size);
	}
	pass->relids = relids_buf;
	pass->nrelids = 0;
	foreach(lc, relids)
		pass->relids[pass->nrelids++] = lfirst_oid(lc);
	pass->rel_index = 0;
	pass->rel_done = true;		/* begin the first relation at the next batch */
	pass->table_done = (pass->nrelids == 0);
}

/*
 * After a batch: once the relation is walked to its end, the next one is
 * begun at the next batch, and once there is none, the target is done.
 */
static void
cleanup_rel_next(CleanupPass *pass)
{
	if (!pass->rel_done)
		return;
	pass->rel_index++;
	if (pass->rel_index >= pass->nrelids)
		pass->table_done = true;
}

/*
 * One batch: read up to batch_size due rows of the next window of blocks
 * and delete them.  Runs as the table's owner, inside an SPI connection, in
 * whatever transaction the caller has open; returns the rows deleted.
 */
static int64
cleanup_batch(CleanupTarget *target, Relation rel, CleanupPass *pass)
{
	BlockNumber start = ItemPointerGetBlockNumberNoCheck(&pass->cursor);
	BlockNumber end;
	ItemPointerData end_tid;
	ItemPointerData last;
	Datum		args[4];
	int			ret;
	uint64		nrows;
	int64		deleted = 0;

	if (start >= pass->nblocks)
	{
		pass->rel_done = true;
		return 0;
	}
	end = (pass->nblocks - start > CLEANUP_WINDOW_BLOCKS) ?
		start + CLEANUP_WINDOW_BLOCKS : pass->nblocks;
	ItemPointerSet(&end_tid, end, 0);

	if (target->plan == NULL || target->plan_relid != RelationGetRelid(rel))
	{
		Oid			argtypes[4] = {TIDOID, TIDOID, TIMESTAMPTZOID, INT8OID};
		SPIPlanPtr	plan;
		char	   *query;

		if (target->plan != NULL)
			SPI_freeplan(target->plan);
		target->plan = NULL;
		query = psprintf(target->query,
						 quote_qualified_identifier(get_namespace_name(RelationGetNamespace(rel)),
													RelationGetRelationName(rel)));
		/* A generic plan keeps the TID range scan whatever the estimates. */
		plan = SPI_prepare_cursor(query, 4, argtypes, CURSOR_OPT_GENERIC_PLAN);
		if (plan == NULL)
			elog(ERROR, "SPI_prepare_cursor failed: %s", SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "SPI_keepplan failed");
		target->plan = plan;
		target->plan_relid = RelationGetRelid(rel);
		pfree(query);
	}

	args[0] = PointerGetDatum(&pass->cursor);
	args[1] = PointerGetDatum(&end_tid);
	args[2] = TimestampTzGetDatum(pass->started_at);
	args[3] = Int64GetDatum(pass->batch_size);
	ret = SPI_execute_plan(target->plan, args, NULL, false, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "cleanup query returned %s", SPI_result_code_string(ret));

	nrows = SPI_processed;
	last = pass->cursor;
	for (uint64 i = 0; i < nrows; i++)
	{
		HeapTuple	tuple = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		isnull;
		ItemPointerData tid;
		text	   *a;
		text	   *b;
		bool		processing;
		TimestampTz expires_at;

		CHECK_FOR_INTERRUPTS();
		tid = *(ItemPointer) DatumGetPointer(SPI_getbinval(tuple, desc, 1, &isnull));
		a = DatumGetTextPP(SPI_getbinval(tuple, desc, 2, &isnull));
		b = DatumGetTextPP(SPI_getbinval(tuple, desc, 3, &isnull));
		processing = DatumGetBool(SPI_getbinval(tuple, desc, 4, &isnull));
		expires_at = DatumGetTimestampTz(SPI_getbinval(tuple, desc, 5, &isnull));

		if (ItemPointerCompare(&tid, &last) > 0)
			last = tid;
		if (processing)
		{
			/* Stuck, unless its lease is live: a long operation still running. */
			Datum		lease_live = SPI_getbinval(tuple, desc, 6, &isnull);

			if (isnull || !DatumGetBool(lease_live))
				pass->processing++;
			continue;
		}
		switch (cleanup_row(target, rel, &tid, a, b))
		{
			case ROW_DELETED:
				deleted++;
				break;
			case ROW_LEFT:
				if (pass->oldest_left == 0 || expires_at < pass->oldest_left)
					pass->oldest_left = expires_at;
				break;
			case ROW_GONE:
				break;
		}
	}
	SPI_freetuptable(SPI_tuptable);

	/* A full batch may have more in this window; otherwise the window is done. */
	if (nrows >= (uint64) pass->batch_size)
		pass->cursor = last;
	else
		ItemPointerSet(&pass->cursor, end, 0);
	if (ItemPointerGetBlockNumberNoCheck(&pass->cursor) >= pass->nblocks)
		pass->rel_done = true;
	pass->deleted += deleted;
	return deleted;
}

/* Switch to the owner of rel for the pass's queries; *save keeps what to restore. */
static void
cleanup_become_owner(Relation rel, Oid *save_userid, int *save_sec_context)
{
	GetUserIdAndSecContext(save_userid, save_sec_context);
	SetUserIdAndSecContext(rel->rd_rel->relowner,
						   *save_sec_context | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
}

/* Note a finished pass in the statistics. */
static void
cleanup_report(const CleanupPass *pass)
{
	IdemCleanupReport report;

	report.started_at = pass->started_at;
	report.finished_at = GetCurrentTimestamp();
	report.oldest_left = pass->oldest_left;
	report.expired_processing = pass->processing;
	idem_stats_report_cleanup(&report);
}

PG_FUNCTION_INFO_V1(idem_cleanup);

/*
 * idem_cleanup(batch_size): one cleanup pass over this database, in the
 * caller's transaction; returns the number of rows deleted.  The worker runs
 * the same batches, each in its own transaction.
 */
Datum
idem_cleanup(PG_FUNCTION_ARGS)
{
	CleanupPass pass;

	memset(&pass, 0, sizeof(pass));
	pass.batch_size = PG_ARGISNULL(0) ? idem_cleanup_batch_size : PG_GETARG_INT32(0);
	if (pass.batch_size < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch_size must be positive"),
				 errdetail("The batch_size given was %d.", pass.batch_size)));
	PreventCommandIfReadOnly("idem_cleanup()");
	pass.started_at = GetCurrentTimestamp();

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	for (int t = 0; t < NUM_CLEANUP_TARGETS; t++)
	{
		CleanupTarget *target = &cleanup_targets[t];
		Oid			relid = cleanup_relid(target->relname);

		if (!OidIsValid(relid))
			idem_report_missing(target->relname);
		LockRelationOid(relid, RowExclusiveLock);
		/* The table, or on a Citus node its shards here. */
		cleanup_target_begin(&pass, relid);
		for (int r = 0; r < pass.nrelids; r++)
		{
			Relation	rel = table_open(pass.relids[r], RowExclusiveLock);
			Oid			save_userid;
			int			save_sec_context;

			records_check_columns(rel, target->natts);
			cleanup_become_owner(rel, &save_userid, &save_sec_context);
			cleanup_table_begin(&pass, rel);
			while (!pass.rel_done)
				(void) cleanup_batch(target, rel, &pass);
			SetUserIdAndSecContext(save_userid, save_sec_context);
			table_close(rel, NoLock);
		}
	}
	SPI_finish();

	idem_stats_add(IDEM_STAT_ROWS_DELETED, pass.deleted);
	cleanup_report(&pass);
	PG_RETURN_INT64(pass.deleted);
}

/*
 * The worker's reaction to SIGHUP: reread the configuration, and stop when
 * this database is no longer listed.
 */
static void
worker_reload_if_pending(void)
{
	if (!ConfigReloadPending)
		return;
	ConfigReloadPending = false;
	ProcessConfigFile(PGC_SIGHUP);
	if (!database_listed(worker_dbname))
	{
		ereport(LOG,
				(errmsg("idempotency cleanup worker for database \"%s\" is stopping", worker_dbname),
				 errdetail("The database is no longer listed in idempotency.databases.")));
		proc_exit(0);
	}
}

/*
 * Whether the extension is installed here, in the version of this library;
 * logs when that changes.  An installation older than the library (its
 * binaries were upgraded, ALTER EXTENSION UPDATE has not run yet) is left
 * alone: the library's lock tags need the newer objects.
 */
static bool
worker_extension_present(void)
{
	static bool absent_logged = false;
	static bool older_logged = false;
	bool		present;
	bool		current;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	present = OidIsValid(cleanup_relid("records"));
	current = present && OidIsValid(cleanup_relid("lock_key"));
	CommitTransactionCommand();

	if (present && !current)
	{
		if (!older_logged)
			ereport(LOG,
					(errmsg("extension \"idempotency\" in database \"%s\" is older than its library", worker_dbname),
					 errdetail("Its cleanup worker does nothing until the extension is updated."),
					 errhint("Run ALTER EXTENSION idempotency UPDATE in that database.")));
		older_logged = true;
		return false;
	}
	older_logged = false;

	if (!present && !absent_logged)
	{
		ereport(LOG,
				(errmsg("extension \"idempotency\" is not installed in database \"%s\"", worker_dbname),
				 errdetail("Its cleanup worker does nothing until the extension is created."),
				 errhint("Run CREATE EXTENSION idempotency in that database, or remove it from idempotency.databases.")));
		absent_logged = true;
	}
	else if (!present)
		elog(DEBUG1, "idempotency cleanup of database \"%s\" skipped: extension not installed",
			 worker_dbname);
	else if (absent_logged)
	{
		ereport(LOG,
				(errmsg("extension \"idempotency\" is now installed in database \"%s\"; cleanup starts",
						worker_dbname)));
		absent_logged = false;
	}
	return present;
}

typedef enum WorkerBatchResult
{
	BATCH_DONE,					/* the batch ran */
	BATCH_ABSENT,				/* the table does not exist */
	BATCH_BUSY					/* the table is locked (DROP, ALTER, TRUNCATE ...) */
} WorkerBatchResult;

/*
 * One batch of the relation the pass is at (the table relid, locked, or one
 * of its shards), then on to the next relation once it is done.  A shard
 * that is locked makes the pass give up, like the table; one that is gone
 * (moved away, and dropped) is passed over.
 */
static WorkerBatchResult
worker_batch_relation(CleanupTarget *target, CleanupPass *pass, Oid relid, int64 *deleted)
{
	Oid			rel_relid = pass->relids[pass->rel_index];

	if (rel_relid != relid && !ConditionalLockRelationOid(rel_relid, RowExclusiveLock))
		return BATCH_BUSY;
	if (!SearchSysCacheExists1(RELOID, ObjectIdGetDatum(rel_relid)))
		pass->rel_done = true;
	else
	{
		Relation	rel = table_open(rel_relid, NoLock);
		Oid			save_userid;
		int			save_sec_context;

		records_check_columns(rel, target->natts);
		cleanup_become_owner(rel, &save_userid, &save_sec_context);
		if (pass->rel_done)
			cleanup_table_begin(pass, rel);
		*deleted = cleanup_batch(target, rel, pass);
		SetUserIdAndSecContext(save_userid, save_sec_context);
		table_close(rel, NoLock);
	}
	cleanup_rel_next(pass);
	return BATCH_DONE;
}

/*
 * One batch of the worker's pass, in its own transaction, as worker_spi does
 * its work.  The table is locked without waiting: a DROP EXTENSION or a
 * TRUNCATE in progress makes the pass give up until the next interval.
 */
static WorkerBatchResult
worker_batch(CleanupTarget *target, CleanupPass *pass, bool first)
{
	WorkerBatchResult result = BATCH_DONE;
	int64		deleted = 0;
	Oid			relid;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, target->activity);

	relid = cleanup_relid(target->relname);
	if (!OidIsValid(relid))
		result = BATCH_ABSENT;
	else if (!ConditionalLockRelationOid(relid, RowExclusiveLock))
		result = BATCH_BUSY;
	else if (cleanup_relid(target->relname) != relid)
		result = BATCH_ABSENT;	/* dropped between the lookup and the lock */
	else
	{
		/* The table, or on a Citus node its shards here, one after the other. */
		if (first)
			cleanup_target_begin(pass, relid);
		if (!pass->table_done)
			result = worker_batch_relation(target, pass, relid, &deleted);
	}

	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	/* Counted once committed: a batch that failed deleted nothing. */
	idem_stats_add(IDEM_STAT_ROWS_DELETED, deleted);
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	return result;
}

/*
 * One pass over this database: every table, batch after batch, until each
 * has been walked to its end or the worker is asked to stop (SIGTERM ends
 * the process at the next CHECK_FOR_INTERRUPTS, rolling back the batch).
 * Returns false, without a pass, when the extension is not installed here
 * in the library's version, so that the worker looks again soon.
 */
static bool
worker_pass(void)
{
	static int64 processing_logged = 0;
	CleanupPass pass;

	if (!worker_extension_present())
		return false;
	/* A server made read-only on purpose gets no writes from us either. */
	if (DefaultXactReadOnly)
	{
		elog(DEBUG1, "idempotency cleanup of database \"%s\" skipped: default_transaction_read_only is on",
			 worker_dbname);
		return true;
	}

	memset(&pass, 0, sizeof(pass));
	pass.started_at = GetCurrentTimestamp();
	pass.batch_size = idem_cleanup_batch_size;

	for (int t = 0; t < NUM_CLEANUP_TARGETS; t++)
	{
		CleanupTarget *target = &cleanup_targets[t];
		bool		first = true;

		do
		{
			WorkerBatchResult result = worker_batch(target, &pass, first);

			if (result != BATCH_DONE)
			{
				elog(DEBUG1, "idempotency cleanup of database \"%s\" ends early: idempotency.%s is %s",
					 worker_dbname, target->relname,
					 result == BATCH_BUSY ? "locked" : "gone");
				return true;
			}
			first = false;
			/*
			 * Pace the pass, outside any transaction; SIGTERM cuts the pause
			 * short.  The relay's requests in flight and a publishing commit
			 * are heeded meanwhile: the relay goes on between batches.
			 */
			if (idem_cleanup_delay > 0 && !pass.table_done &&
				relay_loop_wait(idem_cleanup_delay, PG_WAIT_EXTENSION))
				relay_state.woken = true;
			CHECK_FOR_INTERRUPTS();
			worker_reload_if_pending();
			if (!pass.table_done)
				worker_relay_between_batches();
			pass.batch_size = idem_cleanup_batch_size;
		} while (!pass.table_done);
	}

	cleanup_report(&pass);
	elog(DEBUG1, "idempotency cleanup of database \"%s\": %lld rows deleted",
		 worker_dbname, (long long) pass.deleted);
	if (pass.processing != processing_logged)
	{
		if (pass.processing > 0)
			ereport(LOG,
					(errmsg("%lld expired records of database \"%s\" are still in state 'processing'",
							(long long) pass.processing, worker_dbname),
					 errdetail("Cleanup leaves them in place: an operation that never finished needs a look.")));
		processing_logged = pass.processing;
	}
	return true;
}

/*
 * Drive the outbox's relay loop (relay_loop_run): iterations back to back
 * while each claims a full batch, for at most RELAY_SLICE_MS so that
 * cleanup gets its turn, starting relay helpers when one leaves a backlog; returns when the relay next has work, or 0 if
 * nothing is scheduled.  Webhooks stay in flight when it returns; the
 * worker's sleep (relay_loop_wait) wakes when one of them has news.  *more
 * says the slice ran out with work left: the worker must come back at
 * once, without a nap.
 */
static TimestampTz
worker_relay(bool *more)
{
	static bool read_only_logged = false;
	TimestampTz start = GetCurrentTimestamp();

	/*
	 * A server made read-only on purpose gets no writes from us either (a
	 * claim is an UPDATE); the reload that ends it wakes us.
	 */
	*more = false;
	if (DefaultXactReadOnly)
	{
		if (!read_only_logged)
			ereport(LOG,
					(errmsg("idempotency relay of database \"%s\" is paused: default_transaction_read_only is on",
							worker_dbname),
					 errdetail("Events are delivered again once it is off.")));
		read_only_logged = true;
		return 0;
	}
	if (read_only_logged)
	{
		ereport(LOG,
				(errmsg("idempotency relay of database \"%s\" resumes: default_transaction_read_only is off",
						worker_dbname)));
		read_only_logged = false;
	}

	for (;;)
	{
		TimestampTz wake_at;
		bool		full;
		bool		backlog;

		(void) relay_loop_run(relay_batch_size, &wake_at, &full, &backlog);
		/* Deliveries left due that the loop could not take: helpers share them. */
		if ((full || backlog) && relay_workers > 1)
			relay_start_helpers(worker_dbname);
		if (!full)
			return wake_at;
		CHECK_FOR_INTERRUPTS();
		worker_reload_if_pending();
		if (TimestampDifferenceExceeds(start, GetCurrentTimestamp(), RELAY_SLICE_MS))
		{
			*more = true;
			return GetCurrentTimestamp();
		}
	}
}

/* What a slice of relaying found out, for the worker's loop. */
typedef struct RelaySlice
{
	TimestampTz due;			/* when the relay next has work, or 0 */
	bool		more;			/* the slice ran out with work left */
} RelaySlice;

/* worker_relay, for bgworker_run_guarded. */
static void
worker_relay_slice(void *arg)
{
	RelaySlice *slice = arg;

	slice->due = worker_relay(&slice->more);
}

/*
 * One relay slice, guarded (bgworker_run_guarded): an error is logged and
 * the relay backs off, from RELAY_MIN_BACKOFF_MS doubling up to
 * RELAY_MAX_BACKOFF_MS, while cleanup goes on.  Updates relay_state.
 */
static void
worker_relay_step(void)
{
	RelaySlice	slice = {0, false};

	relay_state.due = 0;
	relay_state.more = false;
	relay_state.woken = false;
	if (RecoveryInProgress())
		return;
	if (GetCurrentTimestamp() < relay_state.retry_at)
		relay_state.due = relay_state.retry_at;	/* backing off after an error */
	else if (bgworker_run_guarded(relay_state.context, worker_relay_slice, &slice))
	{
		relay_state.errors = 0;
		relay_state.due = slice.due;
		relay_state.more = slice.more;
	}
	else
	{
		int64		backoff = RELAY_MIN_BACKOFF_MS;

		for (int i = 0; i < relay_state.errors && backoff < RELAY_MAX_BACKOFF_MS; i++)
			backoff *= 2;
		relay_state.errors++;
		relay_state.retry_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														   Min(backoff, RELAY_MAX_BACKOFF_MS));
		relay_state.due = relay_state.retry_at;
	}
}

/* One iteration of the relay loop that claims nothing, for bgworker_run_guarded. */
static void
worker_relay_collect(void *arg)
{
	TimestampTz wake_at;
	bool		full;
	bool		backlog;

	*(int64 *) arg = relay_loop_run(0, &wake_at, &full, &backlog);
}

/*
 * Between two batches of a cleanup pass: keep the relay going, so that a
 * long cleanup holds up no outcome and no delivery.  A full slice when a
 * commit woke the worker, when the relay has work due or left over, or when
 * requests completed since the last one (their destinations have room
 * again); else, while webhooks are in flight, only collect and record the
 * outcomes of those that completed (no transaction when none did).  The
 * pause between batches (idempotency.cleanup_delay) waits on the requests'
 * sockets as well as on the latch.
 */
static void
worker_relay_between_batches(void)
{
	if (RecoveryInProgress() || DefaultXactReadOnly)
		return;
	if (relay_state.woken || relay_state.more ||
		(relay_state.due != 0 && GetCurrentTimestamp() >= relay_state.due))
		worker_relay_step();
	else if (relay_loop_in_flight() > 0)
	{
		int64		attempted = 0;

		if (bgworker_run_guarded(relay_state.context, worker_relay_collect, &attempted) &&
			attempted > 0)
			relay_state.woken = true;	/* room again: claim at the next batch */
	}
}

/*
 * A cleanup pass over the records and the inbox, for bgworker_run_guarded;
 * *arg (a bool) becomes false when the extension was not there to clean.
 */
static void
worker_cleanup_records(void *arg)
{
	*(bool *) arg = worker_pass();
}

/* Outbox retention, for bgworker_run_guarded; the relay goes on between its batches. */
static void
worker_cleanup_outbox(void *arg)
{
	(void) outbox_cleanup(idem_cleanup_batch_size, worker_relay_between_batches);
}

/*
 * Main function of a per-database cleanup worker: a pass at start, then one
 * every idempotency.cleanup_interval, and the outbox relay in between.  It
 * never holds a transaction open while it sleeps.  An error of a relay
 * slice or of a cleanup pass is logged and ends only that piece of work
 * (bgworker_run_guarded); the relay then backs off, from a second up to a
 * minute, and cleanup waits for its next interval.
 */
void
idem_worker_main(Datum main_arg)
{
	Oid			dbid = DatumGetObjectId(main_arg);
	TimestampTz last_pass = 0;
	TimestampTz recheck_at = 0;	/* look for the extension again, if set */
	char		cleanup_context[NAMEDATALEN + 64];
	int			registered;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	BackgroundWorkerInitializeConnectionByOid(dbid, InvalidOid, 0);
	strlcpy(worker_dbname, MyBgworkerEntry->bgw_extra, NAMEDATALEN);
	pgstat_report_appname(IDEM_WORKER_TYPE);
	pgstat_report_activity(STATE_IDLE, NULL);
	/* Our transactions are short and never wait: keep them plain. */
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);

	snprintf(relay_state.context, sizeof(relay_state.context),
			 "idempotency relay of database \"%s\"", worker_dbname);
	snprintf(cleanup_context, sizeof(cleanup_context),
			 "idempotency cleanup of database \"%s\"", worker_dbname);

	registered = idem_stats_register_worker();
	if (registered != 0 && registered != MyProcPid)
	{
		ereport(LOG,
				(errmsg("idempotency cleanup worker for database \"%s\" is already running with PID %d",
						worker_dbname, registered)));
		proc_exit(0);
	}
	ereport(LOG,
			(errmsg("idempotency cleanup worker started for database \"%s\"", worker_dbname),
			 errdetail("A pass every %d s, in batches of at most %d rows with a pause of %d ms after each.",
					   idem_cleanup_interval, idem_cleanup_batch_size, idem_cleanup_delay)));

	for (;;)
	{
		TimestampTz now;
		TimestampTz next;
		TimestampTz relay_due = 0;
		bool		relay_more = false;
		long		timeout;

		CHECK_FOR_INTERRUPTS();
		worker_reload_if_pending();

		/* The outbox first: a publishing commit set our latch. */
		worker_relay_step();
		relay_due = relay_state.due;
		relay_more = relay_state.more;

		now = GetCurrentTimestamp();
		next = TimestampTzPlusMilliseconds(last_pass, (int64) idem_cleanup_interval * 1000);
		if (recheck_at != 0 && recheck_at < next)
			next = recheck_at;
		if (last_pass == 0 || now >= next)
		{
			bool		present = true;

			last_pass = now;
			recheck_at = 0;
			if (RecoveryInProgress())
				elog(DEBUG1, "idempotency cleanup skipped: recovery is in progress");
			else
			{
				(void) bgworker_run_guarded(cleanup_context, worker_cleanup_records, &present);
				if (present)
					(void) bgworker_run_guarded(cleanup_context, worker_cleanup_outbox, NULL);
				else
					recheck_at = TimestampTzPlusMilliseconds(now, EXTENSION_RECHECK_MS);
			}
			continue;
		}
		/* The slice ran out with deliveries left: no nap. */
		if (relay_more)
			continue;

		timeout = TimestampDifferenceMilliseconds(now, next);
		if (relay_due != 0)
			timeout = Min(timeout, TimestampDifferenceMilliseconds(now, relay_due));

		/*
		 * Sleep until then, or until a webhook in flight has news, or a
		 * publishing commit (or a signal) sets our latch.
		 */
		(void) relay_loop_wait(timeout, PG_WAIT_EXTENSION);
	}
}

/* The launcher's view of one listed database. */
typedef struct LauncherEntry
{
	char		dbname[NAMEDATALEN];
	BackgroundWorkerHandle *handle; /* the worker we started, or NULL */
	TimestampTz next_start;		/* when to try to start one (again) */
	bool		listed;
	bool		missing_logged; /* "does not exist" was logged */
} LauncherEntry;

static List *launcher_entries = NIL;	/* in TopMemoryContext */

/*
 * The OID of a database by name, in a short transaction of the launcher.
 * Without a database of its own the launcher cannot use catalog indexes, so
 * it scans pg_database's heap, as the autovacuum launcher does.
 */
static Oid
launcher_database_oid(const char *dbname)
{
	MemoryContext cxt = CurrentMemoryContext;
	Oid			dbid = InvalidOid;
	Relation	rel;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tuple;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	rel = table_open(DatabaseRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_database_datname, BTEqualStrategyNumber,
				F_NAMEEQ, CStringGetDatum(dbname));
	scan = systable_beginscan(rel, DatabaseNameIndexId, false, NULL, 1, &key);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
		dbid = ((Form_pg_database) GETSTRUCT(tuple))->oid;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	CommitTransactionCommand();
	MemoryContextSwitchTo(cxt);
	return dbid;
}

/* Start the cleanup worker of one listed database, or say why not and when to try again. */
static void
launcher_start_worker(LauncherEntry *e, TimestampTz now)
{
	BackgroundWorker worker;
	MemoryContext oldcxt;
	Oid			dbid = launcher_database_oid(e->dbname);
	bool		started;

	if (!OidIsValid(dbid))
	{
		if (!e->missing_logged)
			ereport(WARNING,
					(errmsg("database \"%s\" listed in idempotency.databases does not exist", e->dbname),
					 errdetail("No cleanup worker runs for it; the launcher looks for it again every %d s.",
							   DATABASE_RECHECK_MS / 1000)));
		e->missing_logged = true;
		e->next_start = TimestampTzPlusMilliseconds(now, DATABASE_RECHECK_MS);
		return;
	}
	e->missing_logged = false;

	/* A worker started before this launcher restarted still serves it. */
	if (idem_stats_worker_pid(dbid) != 0)
	{
		e->next_start = TimestampTzPlusMilliseconds(now, LAUNCHER_NAP_MS);
		return;
	}

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;	/* the launcher restarts it */
	strlcpy(worker.bgw_library_name, "idempotency", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_worker_main", BGW_MAXLEN);
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency cleanup for database %s", e->dbname);
	strlcpy(worker.bgw_type, IDEM_WORKER_TYPE, BGW_MAXLEN);
	worker.bgw_main_arg = ObjectIdGetDatum(dbid);
	strlcpy(worker.bgw_extra, e->dbname, BGW_EXTRALEN);
	worker.bgw_notify_pid = MyProcPid;

	oldcxt = MemoryContextSwitchTo(TopMemoryContext);
	started = RegisterDynamicBackgroundWorker(&worker, &e->handle);
	MemoryContextSwitchTo(oldcxt);
	if (!started)
	{
		e->handle = NULL;
		ereport(WARNING,
				(errmsg("could not start the idempotency cleanup worker for database \"%s\"", e->dbname),
				 errdetail("No background worker slot is free."),
				 errhint("Raise max_worker_processes: the launcher and one worker per listed database each need one.")));
		e->next_start = TimestampTzPlusMilliseconds(now, WORKER_RESTART_DELAY_MS);
	}
}

/*
 * Bring the running workers in line with idempotency.databases: start the
 * missing ones, start again those that exited (after a delay), forget the
 * unlisted ones (they stop themselves on the same reload).  Returns how long
 * the launcher may sleep.
 */
static long
launcher_sync(void)
{
	TimestampTz now = GetCurrentTimestamp();
	long		nap = LAUNCHER_NAP_MS;
	char	   *raw;
	List	   *names = databases_list(&raw);
	ListCell   *lc;

	foreach(lc, launcher_entries)
		((LauncherEntry *) lfirst(lc))->listed = false;
	foreach(lc, names)
	{
		const char *name = lfirst(lc);
		LauncherEntry *e = NULL;
		ListCell   *lc2;

		foreach(lc2, launcher_entries)
		{
			if (strcmp(((LauncherEntry *) lfirst(lc2))->dbname, name) == 0)
				e = lfirst(lc2);
		}
		if (e == NULL)
		{
			MemoryContext oldcxt = MemoryContextSwitchTo(TopMemoryContext);

			e = palloc0(sizeof(LauncherEntry));
			strlcpy(e->dbname, name, NAMEDATALEN);
			launcher_entries = lappend(launcher_entries, e);
			MemoryContextSwitchTo(oldcxt);
		}
		e->listed = true;
	}

	foreach(lc, launcher_entries)
	{
		LauncherEntry *e = lfirst(lc);

		if (!e->listed)
		{
			if (e->handle)
				pfree(e->handle);
			pfree(e);
			launcher_entries = foreach_delete_current(launcher_entries, lc);
			continue;
		}
		if (e->handle != NULL)
		{
			pid_t		pid;
			BgwHandleStatus status = GetBackgroundWorkerPid(e->handle, &pid);

			if (status == BGWH_POSTMASTER_DIED)
				proc_exit(1);
			if (status != BGWH_STOPPED)
				continue;
			pfree(e->handle);
			e->handle = NULL;
			e->next_start = TimestampTzPlusMilliseconds(now, WORKER_RESTART_DELAY_MS);
			ereport(LOG,
					(errmsg("idempotency cleanup worker for database \"%s\" exited; starting it again in %d s",
							e->dbname, WORKER_RESTART_DELAY_MS / 1000)));
		}
		if (now >= e->next_start)
			launcher_start_worker(e, now);
		if (e->handle == NULL)
			nap = Min(nap, Max(1, TimestampDifferenceMilliseconds(now, e->next_start)));
	}
	list_free(names);
	pfree(raw);
	return nap;
}

/*
 * Main function of the launcher.  It connects to no database (it reads only
 * the shared catalog pg_database) and never runs during recovery: the
 * postmaster starts it once the server accepts writes, so a promoted standby
 * starts cleaning without a restart.
 */
void
idem_launcher_main(Datum main_arg)
{
	MemoryContext cxt;
	bool		empty_logged = false;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	pgstat_report_appname(IDEM_LAUNCHER_TYPE);
	cxt = AllocSetContextCreate(TopMemoryContext, "idempotency launcher",
								ALLOCSET_DEFAULT_SIZES);

	for (;;)
	{
		long		nap;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}
		if (idem_databases == NULL || idem_databases[0] == '\0')
		{
			if (!empty_logged)
				ereport(LOG,
						(errmsg("idempotency.databases is empty: no idempotency cleanup worker runs"),
						 errdetail("Expired records are deleted only when their key is claimed again."),
						 errhint("List the databases that use the extension in idempotency.databases and reload.")));
			empty_logged = true;
		}
		else
			empty_logged = false;

		MemoryContextSwitchTo(cxt);
		nap = launcher_sync();
		MemoryContextSwitchTo(TopMemoryContext);
		MemoryContextReset(cxt);

		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 nap, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}
