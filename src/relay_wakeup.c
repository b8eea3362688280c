/*-------------------------------------------------------------------------
 *
 * relay_wakeup.c
 *	  The seam between the outbox and the per-database background worker.
 *
 * PLACEHOLDER.  The background worker (launcher plus one worker per database
 * in idempotency.databases, each waiting on its latch) is being written on
 * another branch.  When it is merged, this definition is replaced by one
 * that sets the latch of the worker serving dbid, so that a relay idle on its
 * latch wakes at the commit of a publishing transaction: no polling delay,
 * and no NOTIFY (whose global lock would serialise publishers).
 *
 * Until then it does nothing: the relay runs only when idem_outbox_relay()
 * is called.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "relay.h"

/* Placeholder: wake database dbid's relay.  Does nothing until the worker exists. */
void
WorkerWakeRelay(Oid dbid)
{
}
