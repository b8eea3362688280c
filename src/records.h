/*-------------------------------------------------------------------------
 *
 * records.h
 *	  Access to idempotency.records, the table of operations and their
 *	  stored responses.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_RECORDS_H
#define IDEM_RECORDS_H

#include "postgres.h"

#include "access/htup.h"
#include "storage/itemptr.h"
#include "utils/jsonb.h"
#include "utils/rel.h"
#include "utils/snapshot.h"
#include "utils/timestamp.h"

#include "compat.h"

/* Column numbers of idempotency.records, in the order the install script declares them. */
#define Anum_records_scope				1
#define Anum_records_key				2
#define Anum_records_state				3
#define Anum_records_fingerprint		4
#define Anum_records_status				5
#define Anum_records_headers			6
#define Anum_records_body				7
#define Anum_records_token				8
#define Anum_records_recovery_point		9
#define Anum_records_lease_expires_at	10
#define Anum_records_created_at			11
#define Anum_records_completed_at		12
#define Anum_records_expires_at			13
#define Anum_records_claimed_at			14
#define Anum_records_owner				15
#define Natts_records					15

/* Values of records.state. */
#define RECORD_STATE_COMPLETED	"completed"
#define RECORD_STATE_PROCESSING	"processing"

/*
 * One record as read from the table.  Pointers are palloc'd copies in the
 * caller's memory context; absent values are NULL pointers or the has_* flags.
 */
typedef struct IdemRecord
{
	ItemPointerData tid;
	bool		completed;		/* state = 'completed' (else 'processing') */
	bytea	   *fingerprint;
	bool		has_status;
	int32		status;
	Jsonb	   *headers;
	Jsonb	   *body;
	int64		token;
	text	   *recovery_point;
	bool		has_lease;
	TimestampTz lease_expires_at;
	TimestampTz created_at;
	bool		has_completed_at;
	TimestampTz completed_at;
	TimestampTz expires_at;
	TimestampTz claimed_at;		/* when the current token was handed out */
	Oid			owner;			/* the role that claimed it; InvalidOid: written
								 * before version 1.2, open to every role */
} IdemRecord;

/*
 * The OIDs of some of the extension's relations (schema idempotency), as a
 * module caches them.  A relcache invalidation of one of them (DROP/CREATE
 * EXTENSION, but also every ANALYZE or VACUUM) only marks the set stale: the
 * callback runs whenever a lock is acquired, in the middle of an operation
 * that already holds the relations open and still uses their OIDs, so it
 * must not change them.  The next operation looks them up again with
 * idem_relcache_resolve before it opens anything.
 */
#define IDEM_RELCACHE_MAX	4

typedef struct IdemRelCache
{
	int			nrels;
	const char *names[IDEM_RELCACHE_MAX];
	Oid			oids[IDEM_RELCACHE_MAX];
	bool		stale;			/* look them up again before the next use */
	struct IdemRelCache *next;	/* the registered sets */
} IdemRelCache;

/* A set of relations by name, stale until first resolved. */
#define IDEM_RELCACHE(...) \
	{lengthof(((const char *[]) {__VA_ARGS__})), {__VA_ARGS__}, {InvalidOid}, true, NULL}

extern void idem_relcache_register(IdemRelCache *cache);
extern bool idem_relcache_resolve(IdemRelCache *cache);

extern void RecordsInit(void);
pg_noreturn extern void idem_report_missing(const char *relname);
extern void records_check_columns(Relation rel, int natts);
extern Relation records_open(text *scope, LOCKMODE lockmode);
extern Relation records_open_pkey(Relation rel);
extern bool records_lookup(Relation rel, Relation pkey, Snapshot snapshot,
						   text *scope, text *key, IdemRecord *rec);
extern void records_insert(Relation rel, text *scope, text *key,
						   const IdemRecord *rec);
extern void records_update(Relation rel, text *scope, text *key,
						   const IdemRecord *rec);
extern void records_audit(const char *action, text *scope, text *key,
						  int64 token_before, int64 token_after,
						  const IdemRecord *rec, text *note);
extern void records_check_tid(Relation rel, ItemPointer tid, AttrNumber scope_attnum,
							  text *scope, text *key);
extern void records_delete_expired(Relation rel, ItemPointer tid,
								   AttrNumber scope_attnum, text *scope, text *key);
extern void records_index_insert(Relation rel, HeapTuple tuple,
								 bool only_summarizing);
extern int64 records_next_token(int64 after);

extern bool idem_role_may_use(Oid owner);
pg_noreturn extern void records_deny(text *scope, text *key);
extern TimestampTz idem_timestamp_add(TimestampTz t, int64 usecs, const char *what);

#endif							/* IDEM_RECORDS_H */
