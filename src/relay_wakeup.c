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
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"

#include "relay.h"
#include "stats.h"

/* Wake the relay of database dbid (the publisher's own database). */
void
WorkerWakeRelay(Oid dbid)
{
	if (dbid == MyDatabaseId)
		idem_stats_wake_worker();
}
