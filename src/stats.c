/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Shared-memory statistics behind the idem_stats view.
 *
 * With the library in shared_preload_libraries, an array of
 * idempotency.max_databases slots lives in shared memory, one per database
 * that has used the extension since the server started.  A backend finds its
 * database's slot once, under the LWLock, and remembers it; after that every
 * count is one lock-free atomic increment.  The cleanup worker of a database
 * writes the result of each pass into the same slot (under the slot's
 * spinlock) and registers its PID there, so that a database never gets two
 * workers.
 *
 * The counters live in shared memory only: a restart, or the reinitialisation
 * after a crash, starts them from zero (stats_reset tells when).  Without
 * preloading there is no shared memory; counting is then a no-op, the claim
 * functions work as before, and the view raises an error with a hint.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "commands/dbcommands.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "stats.h"

int			idem_max_databases = 64;

/* The statistics of one database. */
typedef struct IdemStatsSlot
{
	Oid			dbid;			/* InvalidOid: free; changed under the LWLock */
	int			worker_pid;		/* its cleanup worker, 0 if none; LWLock */
	pg_atomic_uint32 worker_procno; /* the worker's PGPROC number + 1, 0 if none */
	pg_atomic_uint64 counters[IDEM_STAT_NUM_COUNTERS];
	pg_atomic_uint64 dest_generation;	/* bumped when a destination changes */
	slock_t		mutex;			/* protects the fields below */
	TimestampTz stats_reset;
	bool		has_cleanup;	/* a cleanup pass has completed */
	IdemCleanupReport last_cleanup;
} IdemStatsSlot;

typedef struct IdemStatsShared
{
	LWLock	   *lock;			/* slot allocation, worker registration */
	bool		full_logged;	/* "no free slot" was logged; LWLock */
	int			nslots;
	IdemStatsSlot slots[FLEXIBLE_ARRAY_MEMBER];
} IdemStatsShared;

/* A copy of one slot, taken for the view. */
typedef struct IdemStatsCopy
{
	Oid			dbid;
	int			worker_pid;
	uint64		counters[IDEM_STAT_NUM_COUNTERS];
	TimestampTz stats_reset;
	bool		has_cleanup;
	IdemCleanupReport last_cleanup;
} IdemStatsCopy;

/* NULL unless the library was preloaded. */
static IdemStatsShared *stats = NULL;

/* This backend's slot, found on first use. */
static IdemStatsSlot *my_slot = NULL;
static bool my_slot_missing = false;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Bytes of shared memory the statistics need. */
static Size
stats_shmem_size(void)
{
	return add_size(offsetof(IdemStatsShared, slots),
					mul_size(idem_max_databases, sizeof(IdemStatsSlot)));
}

/* shmem_request_hook: reserve our shared memory and LWLock (PostgreSQL 15+). */
static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(stats_shmem_size());
	RequestNamedLWLockTranche("idempotency", 1);
}

/* Start a slot's life for dbid: zero counters, no cleanup yet. */
static void
stats_slot_init(IdemStatsSlot *slot, Oid dbid)
{
	slot->dbid = dbid;
	slot->worker_pid = 0;
	pg_atomic_write_u32(&slot->worker_procno, 0);
	for (int i = 0; i < IDEM_STAT_NUM_COUNTERS; i++)
		pg_atomic_write_u64(&slot->counters[i], 0);
	pg_atomic_write_u64(&slot->dest_generation, 0);
	SpinLockAcquire(&slot->mutex);
	slot->stats_reset = GetCurrentTimestamp();
	slot->has_cleanup = false;
	memset(&slot->last_cleanup, 0, sizeof(slot->last_cleanup));
	SpinLockRelease(&slot->mutex);
}

/* shmem_startup_hook: create (or, in EXEC_BACKEND builds, attach to) the slots. */
static void
stats_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats = ShmemInitStruct("idempotency statistics", stats_shmem_size(), &found);
	if (!found)
	{
		stats->lock = &(GetNamedLWLockTranche("idempotency"))->lock;
		stats->full_logged = false;
		stats->nslots = idem_max_databases;
		for (int i = 0; i < stats->nslots; i++)
		{
			IdemStatsSlot *slot = &stats->slots[i];

			slot->dbid = InvalidOid;
			slot->worker_pid = 0;
			pg_atomic_init_u32(&slot->worker_procno, 0);
			for (int c = 0; c < IDEM_STAT_NUM_COUNTERS; c++)
				pg_atomic_init_u64(&slot->counters[c], 0);
			pg_atomic_init_u64(&slot->dest_generation, 0);
			SpinLockInit(&slot->mutex);
		}
	}
	LWLockRelease(AddinShmemInitLock);
}

/*
 * When preloading, define the GUC and install the shared-memory hooks;
 * called from _PG_init.  A PGC_POSTMASTER setting cannot be defined by a
 * library loaded later, so without preloading there is no setting either.
 */
void
StatsInit(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;

	DefineCustomIntVariable("idempotency.max_databases",
							"Most databases whose idempotency statistics are kept.",
							"Each database that uses the extension takes one slot of shared memory until the server restarts.",
							&idem_max_databases,
							64, 1, 10000,
							PGC_POSTMASTER, 0,
							NULL, NULL, NULL);

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}

/* The slot of dbid, or NULL; the caller holds the LWLock. */
static IdemStatsSlot *
stats_find_slot(Oid dbid)
{
	for (int i = 0; i < stats->nslots; i++)
		if (stats->slots[i].dbid == dbid)
			return &stats->slots[i];
	return NULL;
}

/* The slot of dbid, taking a free one if it has none; NULL when all are taken. */
static IdemStatsSlot *
stats_slot_for_database(Oid dbid)
{
	IdemStatsSlot *slot;
	bool		log_full = false;

	LWLockAcquire(stats->lock, LW_SHARED);
	slot = stats_find_slot(dbid);
	LWLockRelease(stats->lock);
	if (slot != NULL)
		return slot;

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	slot = stats_find_slot(dbid);
	if (slot == NULL)
	{
		slot = stats_find_slot(InvalidOid);
		if (slot != NULL)
			stats_slot_init(slot, dbid);
		else if (!stats->full_logged)
			log_full = stats->full_logged = true;
	}
	LWLockRelease(stats->lock);

	if (log_full)
		ereport(LOG,
				(errmsg("idempotency statistics have no free slot for database with OID %u", dbid),
				 errdetail("All %d slots are taken; this database's calls are not counted and its cleanup worker is not registered.",
						   stats->nslots),
				 errhint("Raise idempotency.max_databases, or call idem_stats_reset() to free the slots of dropped databases.")));
	return slot;
}

/* This backend's slot, found once; NULL without preloading or when none is free. */
static IdemStatsSlot *
stats_my_slot(void)
{
	if (my_slot != NULL || my_slot_missing || stats == NULL)
		return my_slot;
	if (!OidIsValid(MyDatabaseId))
		return NULL;
	my_slot = stats_slot_for_database(MyDatabaseId);
	my_slot_missing = (my_slot == NULL);
	return my_slot;
}

/* Count one event of this database: one atomic increment, nothing without preloading. */
void
idem_stats_count(IdemStatCounter counter)
{
	IdemStatsSlot *slot = stats_my_slot();

	if (slot != NULL)
		pg_atomic_fetch_add_u64(&slot->counters[counter], 1);
}

/* Count n events of this database at once. */
void
idem_stats_add(IdemStatCounter counter, uint64 n)
{
	IdemStatsSlot *slot = stats_my_slot();

	if (slot != NULL && n > 0)
		pg_atomic_fetch_add_u64(&slot->counters[counter], n);
}

/* Record a complete cleanup pass of this database (rows_deleted is counted as it goes). */
void
idem_stats_report_cleanup(const IdemCleanupReport *report)
{
	IdemStatsSlot *slot = stats_my_slot();

	if (slot == NULL)
		return;
	pg_atomic_fetch_add_u64(&slot->counters[IDEM_STAT_CLEANUP_RUNS], 1);
	SpinLockAcquire(&slot->mutex);
	slot->has_cleanup = true;
	slot->last_cleanup = *report;
	SpinLockRelease(&slot->mutex);
}

/* before_shmem_exit callback: this worker no longer serves its database. */
static void
stats_unregister_worker(int code, Datum arg)
{
	IdemStatsSlot *slot = my_slot;

	if (slot == NULL || stats == NULL)
		return;
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	if (slot->worker_pid == MyProcPid)
	{
		slot->worker_pid = 0;
		pg_atomic_write_u32(&slot->worker_procno, 0);
	}
	LWLockRelease(stats->lock);
}

/*
 * Register this process as the cleanup worker of its database.  Returns
 * MyProcPid on success (cleared again at exit), the PID of the worker already
 * registered, or 0 when there are no statistics or no free slot.
 */
int
idem_stats_register_worker(void)
{
	IdemStatsSlot *slot = stats_my_slot();
	int			pid;

	if (slot == NULL)
		return 0;
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	if (slot->worker_pid == 0)
	{
		slot->worker_pid = MyProcPid;
		pg_atomic_write_u32(&slot->worker_procno, MyProcNumber + 1);
	}
	pid = slot->worker_pid;
	LWLockRelease(stats->lock);
	if (pid == MyProcPid)
		before_shmem_exit(stats_unregister_worker, (Datum) 0);
	return pid;
}

/*
 * Wake this database's worker, e.g. at the commit of a transaction that
 * published outbox events.  Lock-free: a process that just exited may leave
 * a stale number behind, and waking whoever holds that PGPROC now is
 * harmless; a worker that starts later finds the events on its first pass.
 */
void
idem_stats_wake_worker(void)
{
	IdemStatsSlot *slot = stats_my_slot();
	uint32		procno;

	if (slot == NULL)
		return;
	procno = pg_atomic_read_u32(&slot->worker_procno);
	if (procno != 0)
		SetLatch(&GetPGProcByNumber(procno - 1)->procLatch);
}

/*
 * A committed change of this database's destinations (paused, resumed,
 * altered, dropped, disabled): relay loops give back the chains they
 * claimed before it (see idem_stats_dest_generation).
 */
void
idem_stats_dest_changed(void)
{
	IdemStatsSlot *slot = stats_my_slot();

	if (slot != NULL)
		pg_atomic_fetch_add_u64(&slot->dest_generation, 1);
}

/* How many committed changes of this database's destinations there have been. */
uint64
idem_stats_dest_generation(void)
{
	IdemStatsSlot *slot = stats_my_slot();

	return slot == NULL ? 0 : pg_atomic_read_u64(&slot->dest_generation);
}

/* The PID of the cleanup worker registered for dbid, or 0. */
int
idem_stats_worker_pid(Oid dbid)
{
	IdemStatsSlot *slot;
	int			pid = 0;

	if (stats == NULL)
		return 0;
	LWLockAcquire(stats->lock, LW_SHARED);
	slot = stats_find_slot(dbid);
	if (slot != NULL)
		pid = slot->worker_pid;
	LWLockRelease(stats->lock);
	return pid;
}

/* Raise the "not preloaded" error of the statistics functions. */
static void
stats_require(const char *caller)
{
	if (stats == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s requires idempotency to be loaded via shared_preload_libraries", caller),
				 errdetail("The statistics live in shared memory, which only a library loaded at server start can have."),
				 errhint("Add idempotency to shared_preload_libraries in postgresql.conf and restart the server.")));
}

/* An interval of usecs microseconds. */
static Datum
interval_usecs(int64 usecs)
{
	Interval   *itv = palloc0(sizeof(Interval));

	itv->time = usecs;
	return IntervalPGetDatum(itv);
}

PG_FUNCTION_INFO_V1(idem_stats);
PG_FUNCTION_INFO_V1(idem_stats_reset);

#define IDEM_STATS_COLS		(1 + IDEM_STAT_NUM_COUNTERS + 6)

/*
 * idem_stats(): one row per database with a slot.  cleanup_lag bounds the
 * age of the oldest expired row not yet deleted: everything that expired
 * before the last complete pass started was deleted by it, except the rows
 * it had to leave (a claim in flight), the oldest of which it remembers.
 */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStatsCopy *copies;
	int			ncopies = 0;
	TimestampTz now = GetCurrentTimestamp();

	stats_require("idem_stats");
	InitMaterializedSRF(fcinfo, 0);
	if (rsinfo->setDesc->natts != IDEM_STATS_COLS)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("function idem_stats() does not match the idempotency library"),
				 errdetail("It is declared with %d columns; this version of the library returns %d.",
						   rsinfo->setDesc->natts, IDEM_STATS_COLS),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));

	/* Copy under the lock; look the names up after releasing it. */
	copies = palloc(stats->nslots * sizeof(IdemStatsCopy));
	LWLockAcquire(stats->lock, LW_SHARED);
	for (int i = 0; i < stats->nslots; i++)
	{
		IdemStatsSlot *slot = &stats->slots[i];
		IdemStatsCopy *c = &copies[ncopies];

		if (!OidIsValid(slot->dbid))
			continue;
		c->dbid = slot->dbid;
		c->worker_pid = slot->worker_pid;
		for (int k = 0; k < IDEM_STAT_NUM_COUNTERS; k++)
			c->counters[k] = pg_atomic_read_u64(&slot->counters[k]);
		SpinLockAcquire(&slot->mutex);
		c->stats_reset = slot->stats_reset;
		c->has_cleanup = slot->has_cleanup;
		c->last_cleanup = slot->last_cleanup;
		SpinLockRelease(&slot->mutex);
		ncopies++;
	}
	LWLockRelease(stats->lock);

	for (int i = 0; i < ncopies; i++)
	{
		IdemStatsCopy *c = &copies[i];
		char	   *datname = get_database_name(c->dbid);
		Datum		values[IDEM_STATS_COLS];
		bool		nulls[IDEM_STATS_COLS];
		int			col = 0;

		if (datname == NULL)
			continue;			/* dropped since */
		memset(nulls, false, sizeof(nulls));
		values[col++] = DirectFunctionCall1(namein, CStringGetDatum(datname));
		for (int k = 0; k < IDEM_STAT_NUM_COUNTERS; k++)
			values[col++] = Int64GetDatum((int64) c->counters[k]);
		if (c->has_cleanup)
		{
			IdemCleanupReport *r = &c->last_cleanup;
			TimestampTz oldest = r->started_at;

			if (r->oldest_left != 0 && r->oldest_left < oldest)
				oldest = r->oldest_left;
			values[col++] = TimestampTzGetDatum(r->finished_at);
			values[col++] = interval_usecs(r->finished_at - r->started_at);
			values[col++] = interval_usecs(Max(0, now - oldest));
			values[col++] = Int64GetDatum(r->expired_processing);
		}
		else
		{
			for (int k = 0; k < 4; k++)
				nulls[col++] = true;
		}
		values[col] = Int32GetDatum(c->worker_pid);
		nulls[col++] = (c->worker_pid == 0);
		values[col++] = TimestampTzGetDatum(c->stats_reset);
		Assert(col == IDEM_STATS_COLS);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/*
 * idem_stats_reset(): zero every database's counters and free the slots of
 * databases dropped since.  The results of the last cleanup pass and the
 * worker registrations are state rather than counters, and stay.
 */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	TimestampTz now = GetCurrentTimestamp();
	Oid		   *dropped;
	int			ndropped = 0;

	stats_require("idem_stats_reset");

	/*
	 * Which databases are gone, asked before the LWLock is taken: a catalog
	 * lookup may read and lock, and must not do so under an LWLock.
	 */
	dropped = palloc(stats->nslots * sizeof(Oid));
	LWLockAcquire(stats->lock, LW_SHARED);
	for (int i = 0; i < stats->nslots; i++)
		if (OidIsValid(stats->slots[i].dbid))
			dropped[ndropped++] = stats->slots[i].dbid;
	LWLockRelease(stats->lock);
	for (int i = 0; i < ndropped; i++)
		if (SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(dropped[i])))
			dropped[i--] = dropped[--ndropped];

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	for (int i = 0; i < stats->nslots; i++)
	{
		IdemStatsSlot *slot = &stats->slots[i];
		bool		gone = false;

		if (!OidIsValid(slot->dbid))
			continue;
		for (int d = 0; d < ndropped && !gone; d++)
			gone = (dropped[d] == slot->dbid);
		if (gone && slot->worker_pid == 0)
		{
			slot->dbid = InvalidOid;
			continue;
		}
		for (int k = 0; k < IDEM_STAT_NUM_COUNTERS; k++)
			pg_atomic_write_u64(&slot->counters[k], 0);
		SpinLockAcquire(&slot->mutex);
		slot->stats_reset = now;
		SpinLockRelease(&slot->mutex);
	}
	stats->full_logged = false;
	LWLockRelease(stats->lock);
	pfree(dropped);
	PG_RETURN_VOID();
}
