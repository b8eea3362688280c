/*-------------------------------------------------------------------------
 *
 * idem_test.c
 *	  A test-only module for idempotency: the relay harness, a relay pass
 *	  in a process of its own.
 *
 * It is never part of the extension's build or of its package: the
 * top-level Makefile builds only the sources in src/.  test/run.sh builds
 * and installs it (scripts/deps.sh, idem_test_module_install) for the
 * PostgreSQL under test before the TAP tests, whether the extension was
 * built from source or is installed from the Debian package.
 *
 * A relay pass (relay_pass in idempotency.so) called outside any
 * transaction commits its claims before delivering and makes HTTP requests
 * while no transaction is open.  (The per-database worker and its helpers no longer run passes:
 * they run relay_loop_run, see relay_loop.c.)  To test this path on its
 * own, idem_relay_harness() starts a short-lived dynamic background worker
 * of this module in the caller's database that calls relay_pass, waits for
 * it and returns the number of deliveries attempted.
 *
 * This module does not link against idempotency.so.  It looks up the two
 * functions it needs, relay_pass and relay_next_due_except (declared
 * PGDLLEXPORT in src/relay.h for it), with load_external_function() at
 * first use, in each process: that finds idempotency.so already loaded
 * (shared_preload_libraries, as in the tests) or loads it then, so no load
 * order is relied on, and a missing function is an error, not a crash.
 *
 * It has no SQL script: the tests declare its functions themselves, as a
 * superuser, with
 *
 *	CREATE FUNCTION idem_relay_harness(max_events int, max_passes int)
 *	RETURNS bigint AS 'idem_test', 'idem_relay_harness' LANGUAGE C STRICT;
 *	CREATE FUNCTION idem_relay_next_due() RETURNS timestamptz
 *	AS 'idem_test', 'idem_relay_next_due' LANGUAGE C;
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

PG_MODULE_MAGIC;

/* The library whose functions the harness runs. */
#define IDEM_LIBRARY	"idempotency"

/* Signatures of the functions of idempotency.so, as src/relay.h declares them. */
typedef int64 (*relay_pass_fn) (int max_events);
typedef TimestampTz (*relay_next_due_except_fn) (int32 *full, int nfull);

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

/*
 * relay_pass of idempotency.so, looked up once per process: an error if the
 * library or the function cannot be found.
 */
static relay_pass_fn
harness_relay_pass(void)
{
	static relay_pass_fn fn = NULL;

	if (fn == NULL)
		fn = (relay_pass_fn) load_external_function(IDEM_LIBRARY, "relay_pass", true, NULL);
	return fn;
}

/* relay_next_due_except of idempotency.so, looked up once per process like relay_pass. */
static relay_next_due_except_fn
harness_relay_next_due_except(void)
{
	static relay_next_due_except_fn fn = NULL;

	if (fn == NULL)
		fn = (relay_next_due_except_fn) load_external_function(IDEM_LIBRARY, "relay_next_due_except",
															   true, NULL);
	return fn;
}

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
	/* A missing relay_pass fails here, in the caller, rather than in the worker. */
	(void) harness_relay_pass();

	seg = dsm_create(sizeof(HarnessResult), 0);
	result = dsm_segment_address(seg);
	memset(result, 0, sizeof(HarnessResult));

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	/* The worker's entry point is this module's: idempotency.so has none for it. */
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idem_test");
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

/*
 * The harness worker: relay passes outside any transaction, each managing
 * its own, as the background worker once ran them.
 */
void
idem_relay_harness_main(Datum main_arg)
{
	HarnessArgs args;
	dsm_segment *seg;
	HarnessResult *result;
	relay_pass_fn relay_pass;

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
	relay_pass = harness_relay_pass();

	for (int pass = 0; pass < args.max_passes; pass++)
	{
		int64		n = relay_pass(args.max_events);

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
 * idem_relay_next_due() returns timestamptz: when the relay next has work
 * (relay_next_due_except with no destination left out) from SQL, for tests;
 * NULL when nothing is pending.  Declared like idem_relay_harness.
 */
Datum
idem_relay_next_due(PG_FUNCTION_ARGS)
{
	TimestampTz due = harness_relay_next_due_except() (NULL, 0);

	if (due == 0)
		PG_RETURN_NULL();
	PG_RETURN_TIMESTAMPTZ(due);
}
