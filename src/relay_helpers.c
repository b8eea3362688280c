/*-------------------------------------------------------------------------
 *
 * relay_helpers.c
 *	  Extra relay processes for a backlog: idempotency.relay_workers.
 *
 * One relay process is bound to one core: it claims, sends and records in
 * turn, and while it waits for its database work its HTTP connections are
 * idle, and the other way round.  When an iteration of the per-database
 * worker's loop leaves deliveries due that it could not take (a destination
 * had more due than its room, or the claim reached
 * idempotency.relay_max_in_flight or idempotency.relay_batch_size), the
 * worker starts relay helpers -- dynamic background workers in the same
 * database -- until idempotency.relay_workers relay processes run in all.  Each helper runs the worker's relay loop
 * (relay_loop.c: webhooks in flight across iterations, so a slow endpoint
 * holds up only its own deliveries), sharing the work with the others
 * through the claim's FOR UPDATE SKIP LOCKED.
 * Per-key order holds across relays as it does across concurrent callers of
 * idem_outbox_relay(): no delivery is claimed while an earlier one of its key
 * is undelivered.
 *
 * The relay loops share each destination's max_in_flight
 * (relay_inflight.c): a helper adds CPU, not requests, to an endpoint.
 *
 * Helpers live only as long as a backlog: a helper whose loop has neither
 * claimed a full batch nor had a webhook in flight for HELPER_LINGER_MS
 * exits, so an idle outbox costs no extra processes or worker slots.  A
 * helper also exits, once the outcomes of its requests in flight are
 * recorded, when the setting no longer counts it (each has a number, 1 to relay_workers - 1) or
 * when the worker that started it is gone (stopped, restarted, or its
 * database no longer listed): a restarted worker starts helpers of its own.
 * The worker starts a helper in a given place at most once every
 * HELPER_RESTART_MS, so that a backlog the helpers cannot take (every
 * delivery held behind an earlier one of its key) does not start a process
 * per pass.
 *
 * A helper never restarts (BGW_NEVER_RESTART): if one fails, the worker
 * starts another at a later backlog.  When no background worker slot is
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

/* How long a helper stays with no full claim and nothing in flight. */
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

/* What one iteration of a helper's loop found out. */
typedef struct HelperIteration
{
	int			max_events;		/* 0: claim nothing, only collect and record */
	TimestampTz wake_at;		/* come back then at the latest (0: when woken) */
	bool		full;			/* the claim took max_events */
	bool		backlog;		/* deliveries were left due */
} HelperIteration;

/* One iteration of the relay loop in a helper, for bgworker_run_guarded. */
static void
relay_helper_iteration(void *arg)
{
	HelperIteration *iter = arg;

	iter->full = false;
	iter->wake_at = 0;
	/* No commit wakes a helper: it looks for work at every iteration. */
	relay_loop_look_again();
	(void) relay_loop_run(iter->max_events, &iter->wake_at, &iter->full, &iter->backlog);
}

/*
 * Sleep until the loop's requests have news, its next due time or a timer
 * of libcurl comes, or at most max_ms.
 */
static void
relay_helper_wait(TimestampTz wake_at, long max_ms)
{
	long		timeout = max_ms;

	if (wake_at != 0)
		timeout = Min(timeout, TimestampDifferenceMilliseconds(GetCurrentTimestamp(), wake_at));
	relay_loop_wait(timeout, PG_WAIT_EXTENSION);
}

/*
 * Main function of a relay helper: the worker's relay loop (relay_loop_run),
 * so that a slow endpoint holds up only its own deliveries here as well.
 * The helper stays while the loop claims full batches or holds claims it
 * has not settled (webhooks in flight, function and notify deliveries not
 * made yet, outcomes not recorded yet); once it has neither for
 * HELPER_LINGER_MS, it exits.  When dismissed it claims nothing more,
 * settles what it holds (each request within its destination's timeout),
 * then exits.  An iteration that fails is logged; its requests are
 * abandoned (their claims expire and are taken again), and the helper goes
 * on as after an iteration that was not full.
 */
void
idem_relay_helper_main(Datum main_arg)
{
	HelperArgs	args;
	TimestampTz idle_since = 0;
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
	for (;;)
	{
		HelperIteration iter = {relay_batch_size, 0, false, false};
		bool		dismissed = relay_helper_dismissed(&args);
		TimestampTz now;

		CHECK_FOR_INTERRUPTS();
		if (dismissed)
		{
			/* Only what it holds (in flight, to make, to record), then go. */
			if (!relay_loop_holds_claims())
				break;
			iter.max_events = 0;
		}
		if (!bgworker_run_guarded(context, relay_helper_iteration, &iter))
			iter.full = false;
		if (iter.full)
		{
			idle_since = 0;
			continue;
		}
		now = GetCurrentTimestamp();
		/* Never gone with claims unsettled: they would count as interrupted. */
		if (relay_loop_holds_claims())
		{
			idle_since = 0;
			relay_helper_wait(iter.wake_at, HELPER_LINGER_MS);
			continue;
		}
		if (dismissed)
			break;
		if (idle_since == 0)
			idle_since = now;
		else if (TimestampDifferenceExceeds(idle_since, now, HELPER_LINGER_MS))
			break;
		relay_helper_wait(iter.wake_at, HELPER_LINGER_MS);
	}
	proc_exit(0);
}
