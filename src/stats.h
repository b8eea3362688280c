/*-------------------------------------------------------------------------
 *
 * stats.h
 *	  Shared-memory statistics: per-database counters behind the idem_stats
 *	  view, and the registry of running cleanup workers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STATS_H
#define IDEM_STATS_H

#include "postgres.h"

#include "utils/timestamp.h"

/* The counters of one database, in the order the idem_stats view shows them. */
typedef enum IdemStatCounter
{
	IDEM_STAT_CLAIMS,			/* idem_claim answered 'claimed' */
	IDEM_STAT_REPLAYS,			/* ... 'replay' */
	IDEM_STAT_MISMATCHES,		/* ... 'mismatch' */
	IDEM_STAT_IN_PROGRESS,		/* ... 'in_progress' */
	IDEM_STAT_TAKEOVERS,		/* multi-phase: a lease taken over */
	IDEM_STAT_FENCED,			/* multi-phase: a call refused by its token */
	IDEM_STAT_DENIED,			/* a role refused another role's key (42501) */
	IDEM_STAT_RELEASES,			/* idem_release */
	IDEM_STAT_INBOX_ACCEPTED,	/* idem_inbox_accept returned true */
	IDEM_STAT_INBOX_DUPLICATES, /* ... false */
	IDEM_STAT_CLEANUP_RUNS,		/* complete cleanup passes */
	IDEM_STAT_ROWS_DELETED,		/* expired records and inbox marks deleted */
	IDEM_STAT_NUM_COUNTERS
} IdemStatCounter;

/* What one complete cleanup pass reports. */
typedef struct IdemCleanupReport
{
	TimestampTz started_at;		/* rows expiring before this were due */
	TimestampTz finished_at;
	TimestampTz oldest_left;	/* oldest expiry of a due row left behind, or 0 */
	int64		expired_processing; /* due 'processing' records left in place */
} IdemCleanupReport;

extern int	idem_max_databases;

extern void StatsInit(void);
extern void idem_stats_count(IdemStatCounter counter);
extern void idem_stats_add(IdemStatCounter counter, uint64 n);
extern void idem_stats_report_cleanup(const IdemCleanupReport *report);

extern int	idem_stats_register_worker(void);
extern void idem_stats_wake_worker(void);
extern void idem_stats_dest_changed(void);
extern uint64 idem_stats_dest_generation(void);
extern int	idem_stats_worker_pid(Oid dbid);

#endif							/* IDEM_STATS_H */
