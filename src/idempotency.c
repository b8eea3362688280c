/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Module entry point: retried operations that take effect once.
 *
 * Each subsystem defines its own GUCs and callbacks in its Init function;
 * _PG_init only calls them in turn.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "utils/guc.h"

#include "claims.h"
#include "inbox.h"
#include "lockhash.h"
#include "outbox.h"
#include "records.h"
#include "relay.h"
#include "shards.h"
#include "stats.h"
#include "worker.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

/*
 * Load-time setup: GUCs, transaction callbacks, cache invalidation, the
 * utility hook that wakes the relay after COMMIT PREPARED and, when
 * preloaded, shared memory and the cleanup launcher.
 */
void
_PG_init(void)
{
	ClaimsInit();
	RecordsInit();
	LockHashInit();
	InboxInit();
	ShardsInit();
	StatsInit();
	WorkerInit();
	OutboxInit();
	RelayWakeupInit();
	RelayInflightInit();
	MarkGUCPrefixReserved("idempotency");
}
