/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  Background cleanup of expired records and inbox marks: the launcher,
 *	  the per-database workers, and the cleanup pass they share with
 *	  idem_cleanup().
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_H
#define IDEM_WORKER_H

#include "postgres.h"

/* GUCs */
extern int	idem_cleanup_interval;
extern int	idem_cleanup_batch_size;
extern int	idem_cleanup_delay;
extern char *idem_databases;

extern void WorkerInit(void);

/* Background worker entry points, found by name in the library. */
extern PGDLLEXPORT void idem_launcher_main(Datum main_arg);
extern PGDLLEXPORT void idem_worker_main(Datum main_arg);

#endif							/* IDEM_WORKER_H */
