/*-------------------------------------------------------------------------
 *
 * relay_harness.c
 *	  A test and benchmark harness for relay_run: a relay pass in a process
 *	  of its own.
 *
 * relay_run is a synchronous pass called outside any transaction, so that
 * it commits its claims before delivering and makes HTTP requests while no
 * transaction is open.  (The per-database worker and its helpers no longer
 * run passes: they run relay_loop_run, see relay_loop.c.)  To test this
 * path on its own, idem_relay_harness() starts a short-lived dynamic
 * background worker in the caller's database that calls relay_run, waits
 * for it and returns the number of deliveries attempted.
 *
 * It is not part of the extension's SQL API: the tests and bench/ declare it
 * themselves, as a superuser, with
 *
 *	CREATE FUNCTION idem_relay_harness(max_events int, max_passes int)
 *	RETURNS bigint AS 'idempotency', 'idem_relay_harness' LANGUAGE C STRICT;
 *	CREATE FUNCTION idem_relay_next_due() RETURNS timestamptz
 *	AS 'idempotency', 'idem_relay_next_due' LANGUAGE C;
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "storage/dsm.h"
#include "storage/ipc.h"
#include "tcop/tcopprot.h"
#include "utils/timestamp.h"

#include "relay.h"

/* What the harness worker is asked to do, passed in bgw_extra. */
typedef struct HarnessArgs
{
	Oid			dbid;
	Oid			userid;
	int32		max_events;
	int32		max_passes;
} HarnessArgs;

/* What it reports back, in a dynamic shared memory segment. */
typedef struct HarnessResult
{
	int64		attempted;
	int32		passes;
	bool		finished;
} HarnessResult;

PGDLLEXPORT void idem_relay_harness_main(Datum main_arg);

PG_FUNCTION_INFO_V1(idem_relay_harness);

/*
 * idem_relay_harness(max_events, max_passes) returns bigint: run up to
 * max_passes relay passes of max_events in a background worker (stopping at
 * the first pass that attempts nothing), and return the deliveries attempted.
 */
Datum
idem_relay_harness(PG_FUNCTION_ARGS)
{
	HarnessArgs args;
	BackgroundWorker worker;
	BackgroundWorkerHandle *handle;
	BgwHandleStatus status;
	dsm_segment *seg;
	HarnessResult *result;
	int64		attempted;

	if (!superuser())
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("only superusers can run the relay harness")));
	args.dbid = MyDatabaseId;
	args.userid = GetUserId();
	args.max_events = PG_GETARG_INT32(0);
	args.max_passes = PG_GETARG_INT32(1);
	if (args.max_events < 1 || args.max_passes < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_events and max_passes must be at least 1")));

	seg = dsm_create(sizeof(HarnessResult), 0);
	result = dsm_segment_address(seg);
	memset(result, 0, sizeof(HarnessResult));

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_relay_harness_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency relay harness");
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency relay harness");
	worker.bgw_main_arg = UInt32GetDatum(dsm_segment_handle(seg));
	memcpy(worker.bgw_extra, &args, sizeof(args));
	worker.bgw_notify_pid = MyProcPid;

	if (!RegisterDynamicBackgroundWorker(&worker, &handle))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_RESOURCES),
				 errmsg("could not start the relay harness worker"),
				 errhint("Raise max_worker_processes.")));
	status = WaitForBackgroundWorkerShutdown(handle);
	if (status != BGWH_STOPPED || !result->finished)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("the relay harness worker did not finish"),
				 errhint("See the server log.")));
	attempted = result->attempted;
	dsm_detach(seg);
	PG_RETURN_INT64(attempted);
}

/* The harness worker: relay passes exactly as the background worker runs them. */
void
idem_relay_harness_main(Datum main_arg)
{
	HarnessArgs args;
	dsm_segment *seg;
	HarnessResult *result;

	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	BackgroundWorkerInitializeConnectionByOid(args.dbid, args.userid, 0);

	seg = dsm_attach(DatumGetUInt32(main_arg));
	if (seg == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("could not map the relay harness's shared memory")));
	result = dsm_segment_address(seg);

	for (int pass = 0; pass < args.max_passes; pass++)
	{
		int64		n = relay_run(args.max_events);

		result->attempted += n;
		result->passes++;
		if (n == 0)
			break;
	}
	result->finished = true;
	dsm_detach(seg);
	proc_exit(0);
}

PG_FUNCTION_INFO_V1(idem_relay_next_due);

/*
 * idem_relay_next_due() returns timestamptz: relay_next_due() from SQL, for
 * tests (NULL when nothing is pending).  Declared like idem_relay_harness.
 */
Datum
idem_relay_next_due(PG_FUNCTION_ARGS)
{
	TimestampTz due = relay_next_due();

	if (due == 0)
		PG_RETURN_NULL();
	PG_RETURN_TIMESTAMPTZ(due);
}
