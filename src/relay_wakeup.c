/*-------------------------------------------------------------------------
 *
 * relay_wakeup.c
 *	  The seam between the outbox and the per-database background worker.
 *
 * A relay idle on its latch wakes at the commit of a publishing transaction:
 * no polling delay, and no NOTIFY, whose global lock would serialise
 * publishers.  The worker serving a database registers its PGPROC in the
 * database's statistics slot (stats.c); without preloading there is no
 * worker and nothing to wake.
 *
 * A transaction that publishes and is then prepared cannot wake the relay at
 * its commit: COMMIT PREPARED runs later, in any session, without the
 * transaction callbacks of the one that published.  So every COMMIT PREPARED
 * wakes the relay of its database (the one it must run in): a wasted pass
 * now and then costs less than events that wait for the next scheduled one.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "tcop/utility.h"

#include "relay.h"
#include "stats.h"

static ProcessUtility_hook_type prev_ProcessUtility = NULL;

/* Wake the relay of database dbid (the publisher's own database). */
void
WorkerWakeRelay(Oid dbid)
{
	if (dbid == MyDatabaseId)
		idem_stats_wake_worker();
}

/* Run a utility statement; after a COMMIT PREPARED, wake the relay. */
static void
relay_process_utility(PlannedStmt *pstmt, const char *queryString,
					  bool readOnlyTree, ProcessUtilityContext context,
					  ParamListInfo params, QueryEnvironment *queryEnv,
					  DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *parsetree = pstmt->utilityStmt;
	bool		commit_prepared = IsA(parsetree, TransactionStmt) &&
		((TransactionStmt *) parsetree)->kind == TRANS_STMT_COMMIT_PREPARED;

	if (prev_ProcessUtility)
		prev_ProcessUtility(pstmt, queryString, readOnlyTree, context,
							params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);

	/* The prepared transaction is committed and visible by now. */
	if (commit_prepared)
	{
		idem_stats_dest_changed();	/* it may have changed a destination */
		WorkerWakeRelay(MyDatabaseId);
	}
}

/* Install the utility hook; called once from _PG_init. */
void
RelayWakeupInit(void)
{
	prev_ProcessUtility = ProcessUtility_hook;
	ProcessUtility_hook = relay_process_utility;
}
