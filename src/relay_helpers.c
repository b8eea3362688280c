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
 * the work with the others through the claim's FOR UPDATE SKIP LOCKED, and
 * exits after the first pass that does not claim a full batch: helpers live
 * only as long as a backlog, so an idle outbox costs no extra processes or
 * worker slots.  Per-key order holds across relays as it does across
 * concurrent callers of idem_outbox_relay(): no delivery is claimed while an
 * earlier one of its key is undelivered.
 *
 * A helper never restarts (BGW_NEVER_RESTART): if one fails, the worker
 * starts another at its next full batch.  When no background worker slot is
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
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"

#include "outbox.h"
#include "relay.h"

/* What pg_stat_activity shows as a helper's backend_type and application_name. */
#define IDEM_RELAY_HELPER_TYPE	"idempotency relay"

/* The helpers this worker started, NULL where none runs. */
static BackgroundWorkerHandle *helpers[RELAY_MAX_WORKERS - 1];

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
	int			wanted = Min(relay_workers, RELAY_MAX_WORKERS) - 1;

	for (int i = 0; i < lengthof(helpers); i++)
	{
		BackgroundWorker worker;
		MemoryContext oldcxt;
		bool		started;

		if (helpers[i] != NULL)
		{
			if (relay_helper_alive(helpers[i]))
			{
				wanted--;
				continue;
			}
			pfree(helpers[i]);
			helpers[i] = NULL;
		}
		if (wanted <= 0)
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
		wanted--;
	}
}

/*
 * Main function of a relay helper: relay passes back to back until one does
 * not claim a full batch, then exit.
 */
void
idem_relay_helper_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	BackgroundWorkerInitializeConnectionByOid(DatumGetObjectId(main_arg), InvalidOid, 0);
	pgstat_report_appname(IDEM_RELAY_HELPER_TYPE);
	pgstat_report_activity(STATE_IDLE, NULL);
	/* As the worker: short transactions that never wait. */
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);

	for (;;)
	{
		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}
		if (relay_run(relay_batch_size) < relay_batch_size)
			break;
	}
	proc_exit(0);
}
