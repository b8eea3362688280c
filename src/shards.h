/*-------------------------------------------------------------------------
 *
 * shards.h
 *	  Citus: the local shard of the extension's tables that Citus
 *	  distributes (idempotency.records and idempotency.inbox).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SHARDS_H
#define IDEM_SHARDS_H

#include "postgres.h"

#include "lib/stringinfo.h"
#include "nodes/pg_list.h"
#include "utils/rel.h"

/*
 * The column that setup adds to a distributed table of the extension when
 * the tenant tables are distributed by a column of another type than the
 * table's text key (see idem_citus_distribute): the scope (or the inbox's
 * source) read as a value of that type.  It is the last column, after the
 * ones the library reads and writes by number.
 */
#define SHARD_TENANT_COLUMN		"tenant"

/* Where the rows of one scope live: the table itself, or its local shard. */
typedef struct ShardTarget
{
	Oid			relid;			/* the relation to read and write */
	Oid			pkey;			/* its primary key */
	bool		distributed;	/* relid is a Citus shard */
} ShardTarget;

extern void ShardsInit(void);
extern void shard_resolve(Oid relid, Oid pkey, text *value, ShardTarget *target);
extern Oid	shard_pkey_of(Relation rel, Oid pkey);
extern List *shard_local_relids(Oid relid);
extern bool shard_has_tenant_column(Relation rel, int natts);
extern Datum shard_tenant_value(Relation rel, int natts, text *value);
extern bool shard_citus_coordinator(void);
extern void shard_check_workers(void);
extern void shard_run_on_workers(const char *command, int nparams,
								 const char *const *values, const char *user);
extern void shard_commit_with_2pc(void);
extern int32 shard_local_group(void);

#endif							/* IDEM_SHARDS_H */
