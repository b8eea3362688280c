/*-------------------------------------------------------------------------
 *
 * relay_helpers.c
 *	  Extra relay processes for a backlog: idempotency.relay_workers.
 *
 * One relay process is bound to one core: it claims, sends and records in
 * turn, and while it waits for its database work its HTTP connections are
 * idle, and the other way round.  When a pass of the per-database worker
 * claims a full batch (idempotency.relay_batch_size deliveries), more are
 * likely waiting, so the worker starts relay helpers -- dynamic background
 * workers in the same database -- until idempotency.relay_workers relay
 * processes run in all.  Each helper runs relay passes back to back, sharing
 * the work with the others through the claim's FOR UPDATE SKIP LOCKED.
 * Per-key order holds across relays as it does across concurrent callers of
 * idem_outbox_relay(): no delivery is claimed while an earlier one of its key
 * is undelivered.
 *
 * Helpers live only as long as a backlog: after a pass that does not claim a
 * full batch a helper waits HELPER_LINGER_MS and tries once more, and exits
 * if that pass is not full either, so an idle outbox costs no extra
 * processes or worker slots.  A helper also exits after a pass when the
 * setting no longer counts it (each has a number, 1 to relay_workers - 1) or
 * when the worker that started it is gone (stopped, restarted, or its
 * database no longer listed): a restarted worker starts helpers of its own.
 * The worker starts a helper in a given place at most once every
 * HELPER_RESTART_MS, so that a backlog the helpers cannot take (every
 * delivery held behind an earlier one of its key) does not start a process
 * per pass.
 *
 * A helper never restarts (BGW_NEVER_RESTART): if one fails, the worker
 * starts another at a later full batch.  When no background worker slot is
 * free the worker carries on alone.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "relay.h"
#include "stats.h"

/* What pg_stat_activity shows as a helper's backend_type and application_name. */
#define IDEM_RELAY_HELPER_TYPE	"idempotency relay"

/* How long a helper waits after a pass that was not full before its last try. */
#define HELPER_LINGER_MS	1000

/* The shortest time between two starts of a helper in the same place. */
#define HELPER_RESTART_MS	5000

/* What a helper is told at start, in bgw_extra. */
typedef struct HelperArgs
{
	int32		number;			/* 1 .. RELAY_MAX_WORKERS - 1 */
	int32		worker_pid;		/* the per-database worker that started it */
} HelperArgs;

/* The helpers this worker started, NULL where none runs, and when. */
static BackgroundWorkerHandle *helpers[RELAY_MAX_WORKERS - 1];
static TimestampTz helper_started_at[RELAY_MAX_WORKERS - 1];

/* Whether "no slot free" was logged since a helper last started. */
static bool no_slot_logged = false;

/* Whether the helper started with this handle may still be running. */
static bool
relay_helper_alive(BackgroundWorkerHandle *handle)
{
	pid_t		pid;
	BgwHandleStatus status = GetBackgroundWorkerPid(handle, &pid);

	if (status == BGWH_POSTMASTER_DIED)
		proc_exit(1);
	return status == BGWH_STARTED || status == BGWH_NOT_YET_STARTED;
}

/* See relay.h. */
void
relay_start_helpers(const char *dbname)
{
	TimestampTz now = GetCurrentTimestamp();

	/*
	 * Helpers stay only while this worker is the one registered for the
	 * database; one that could not register (no statistics slot free) would
	 * see its helpers dismissed at once, and start them again and again.
	 */
	if (idem_stats_worker_pid(MyDatabaseId) != MyProcPid)
		return;

	/* Helper i + 1 runs in place i, while relay_workers counts it. */
	for (int i = 0; i < Min(relay_workers, RELAY_MAX_WORKERS) - 1; i++)
	{
		BackgroundWorker worker;
		HelperArgs	args;
		MemoryContext oldcxt;
		bool		started;

		if (helpers[i] != NULL)
		{
			if (relay_helper_alive(helpers[i]))
				continue;
			pfree(helpers[i]);
			helpers[i] = NULL;
		}
		if (helper_started_at[i] != 0 &&
			!TimestampDifferenceExceeds(helper_started_at[i], now, HELPER_RESTART_MS))
			continue;

		memset(&worker, 0, sizeof(worker));
		worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
		worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
		worker.bgw_restart_time = BGW_NEVER_RESTART;
		strlcpy(worker.bgw_library_name, "idempotency", BGW_MAXLEN);
		strlcpy(worker.bgw_function_name, "idem_relay_helper_main", BGW_MAXLEN);
		snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency relay for database %s", dbname);
		strlcpy(worker.bgw_type, IDEM_RELAY_HELPER_TYPE, BGW_MAXLEN);
		worker.bgw_main_arg = ObjectIdGetDatum(MyDatabaseId);
		worker.bgw_notify_pid = 0;
		args.number = i + 1;
		args.worker_pid = MyProcPid;
		memcpy(worker.bgw_extra, &args, sizeof(args));

		oldcxt = MemoryContextSwitchTo(TopMemoryContext);
		started = RegisterDynamicBackgroundWorker(&worker, &helpers[i]);
		MemoryContextSwitchTo(oldcxt);
		if (!started)
		{
			helpers[i] = NULL;
			if (!no_slot_logged)
				ereport(LOG,
						(errmsg("could not start an idempotency relay helper for database \"%s\"", dbname),
						 errdetail("No background worker slot is free; the relay goes on with fewer processes."),
						 errhint("Raise max_worker_processes, or lower idempotency.relay_workers.")));
			no_slot_logged = true;
			return;
		}
		no_slot_logged = false;
		helper_started_at[i] = now;
	}
}

/* Whether this helper should stop: no longer counted, or its worker gone. */
static bool
relay_helper_dismissed(const HelperArgs *args)
{
	if (ConfigReloadPending)
	{
		ConfigReloadPending = false;
		ProcessConfigFile(PGC_SIGHUP);
	}
	return args->number >= relay_workers ||
		idem_stats_worker_pid(MyDatabaseId) != args->worker_pid;
}

/* One relay pass of a helper, for bgworker_run_guarded: *arg gets the deliveries attempted. */
static void
relay_helper_pass(void *arg)
{
	*(int64 *) arg = relay_run(relay_batch_size);
}

/*
 * Main function of a relay helper: relay passes back to back while they
 * claim full batches; after one that does not, wait a moment and try once
 * more, then exit.  Exit early when dismissed.  A pass that fails is logged
 * and counts as one that was not full.
 */
void
idem_relay_helper_main(Datum main_arg)
{
	HelperArgs	args;
	bool		lingered = false;
	char		context[BGW_MAXLEN];

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	BackgroundWorkerInitializeConnectionByOid(DatumGetObjectId(main_arg), InvalidOid, 0);
	pgstat_report_appname(IDEM_RELAY_HELPER_TYPE);
	pgstat_report_activity(STATE_IDLE, NULL);
	/* As the worker: short transactions that never wait. */
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);

	/* "idempotency relay for database <name>" */
	strlcpy(context, MyBgworkerEntry->bgw_name, sizeof(context));
	while (!relay_helper_dismissed(&args))
	{
		int64		attempted = 0;

		CHECK_FOR_INTERRUPTS();
		if (bgworker_run_guarded(context, relay_helper_pass, &attempted) &&
			attempted >= relay_batch_size)
		{
			lingered = false;
			continue;
		}
		if (lingered)
			break;
		lingered = true;
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 HELPER_LINGER_MS, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
	proc_exit(0);
}
