/*-------------------------------------------------------------------------
 *
 * records.c
 *	  Direct heap and index access to idempotency.records.
 *
 * The claim path runs on every request, so it does not go through SPI or the
 * planner: it scans the primary key with a snapshot the caller chooses and
 * inserts with heap_insert plus index_insert, the way core code maintains its
 * catalogs.  Direct access also means callers need no privilege on the table,
 * which no role but the owner can read.
 *
 * The invariant the callers rely on: every writer of a live record (a claim
 * that stores or replaces it, a multi-phase call, an operator's resolution)
 * holds the key's advisory lock until its transaction ends.  With that lock
 * in hand, no change to a live record can be in flight, so a lookup with
 * SnapshotSelf sees its latest committed state.  The cleanup worker deletes
 * only expired rows, which claims treat as absent anyway: it holds the key's
 * lock just around each delete, and a claim that meets a row it is deleting
 * waits for that delete in records_delete_expired.
 *
 * Every function here that opens a relation keeps its lock until the
 * transaction ends (callers close with NoLock), as core does: a VACUUM FULL,
 * CLUSTER or rewriting ALTER TABLE between a lookup and the delete or update
 * of the TID it found would make that TID name another key's row.  Deletes
 * and updates also check that the row at the TID is still the key's.
 *
 * A record remembers the role that claimed it (owner): only that role, its
 * members with its privileges, and superusers may read its response or act
 * on it (idem_role_may_use).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/indexing.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation.h"
#include "commands/sequence.h"
#include "common/int.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "storage/bufmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

#include "compat.h"
#include "records.h"
#include "shards.h"
#include "stats.h"

#define RECORDS_SCHEMA		"idempotency"
#define RECORDS_TABLE		"records"
#define RECORDS_PKEY		"records_pkey"
#define TOKENS_SEQUENCE		"tokens"
#define AUDIT_TABLE			"audit"

/*
 * A Citus node's fencing tokens: the node's group above bit 48, its
 * sequence's value (which starts at 2^32) below; groups up to 32767.
 */
#define RECORDS_TOKEN_GROUP_SHIFT	48
#define RECORDS_TOKEN_MAX_GROUP		32767

/* Column numbers of idempotency.audit. */
#define Anum_audit_at				1
#define Anum_audit_actor			2
#define Anum_audit_action			3
#define Anum_audit_scope			4
#define Anum_audit_key				5
#define Anum_audit_token_before		6
#define Anum_audit_token_after		7
#define Anum_audit_status			8
#define Anum_audit_note				9
#define Anum_audit_session_actor	10
#define Natts_audit					10

/* The registered sets of cached OIDs (idem_relcache_register). */
static IdemRelCache *relcaches = NULL;

/* idempotency.records, its primary key and the sequence of fencing tokens. */
static IdemRelCache records_rels = IDEM_RELCACHE(RECORDS_TABLE, RECORDS_PKEY,
												 TOKENS_SEQUENCE);

/* Mark every set that holds relid (or all, for a cache reset) stale. */
static void
idem_relcache_callback(Datum arg, Oid relid)
{
	for (IdemRelCache *c = relcaches; c != NULL; c = c->next)
		for (int i = 0; i < c->nrels; i++)
			if (relid == InvalidOid || relid == c->oids[i])
				c->stale = true;
}

/* Register a set of cached OIDs; called from _PG_init, once per set. */
void
idem_relcache_register(IdemRelCache *cache)
{
	if (relcaches == NULL)
		CacheRegisterRelcacheCallback(idem_relcache_callback, (Datum) 0);
	cache->next = relcaches;
	relcaches = cache;
}

/*
 * Look the set's relations up again if it is stale.  False, with the set
 * left stale, if one of them does not exist: the caller says why.
 */
bool
idem_relcache_resolve(IdemRelCache *cache)
{
	Oid			nspid;

	if (!cache->stale)
		return true;
	nspid = get_namespace_oid(RECORDS_SCHEMA, true);
	for (int i = 0; i < cache->nrels; i++)
	{
		cache->oids[i] = OidIsValid(nspid) ? get_relname_relid(cache->names[i], nspid) : InvalidOid;
		if (!OidIsValid(cache->oids[i]))
			return false;
	}
	cache->stale = false;
	return true;
}

/* Register the cached OIDs of idempotency.records; called once from _PG_init. */
void
RecordsInit(void)
{
	idem_relcache_register(&records_rels);
}

/*
 * The error for a relation of the extension that is missing (relname, in
 * schema idempotency): the extension is not installed, or its SQL objects
 * are older than its library (make install and a restart, but no ALTER
 * EXTENSION UPDATE yet).  The version of the records table tells which.
 */
void
idem_report_missing(const char *relname)
{
	Oid			nspid = get_namespace_oid(RECORDS_SCHEMA, true);

	if (OidIsValid(nspid) && OidIsValid(get_relname_relid(RECORDS_TABLE, nspid)))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idempotency\" in this database is older than its library"),
				 errdetail("Relation idempotency.%s, which this version of the library uses, does not exist.",
						   relname),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_TABLE),
			 errmsg("extension \"idempotency\" is not installed in this database"),
			 errhint("Run CREATE EXTENSION idempotency.")));
}

/*
 * Refuse a table of the extension whose columns are not the ones this
 * library reads and writes: the library was upgraded (make install and a
 * restart) but ALTER EXTENSION UPDATE has not run yet.  The tenant column
 * that idem_citus_distribute may add last (shards.h) is the one exception.
 */
void
records_check_columns(Relation rel, int natts)
{
	if (RelationGetDescr(rel)->natts != natts && !shard_has_tenant_column(rel, natts))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("table idempotency.%s does not match the idempotency library",
						RelationGetRelationName(rel)),
				 errdetail("The table has %d columns; this version of the library expects %d.",
						   RelationGetDescr(rel)->natts, natts),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));
}

/*
 * Open the relation that holds the records of scope with the given lock
 * mode, which the caller keeps until its transaction ends (table_close with
 * NoLock): idempotency.records, or, when Citus distributes it, its local
 * shard for scope (shards.c; 40001 if the shard is not on this node).
 */
Relation
records_open(text *scope, LOCKMODE lockmode)
{
	Relation	rel;
	ShardTarget target;

	if (!idem_relcache_resolve(&records_rels))
		idem_report_missing(TOKENS_SEQUENCE);
	shard_resolve(records_rels.oids[0], records_rels.oids[1], scope, &target);
	rel = table_open(target.relid, lockmode);
	records_check_columns(rel, Natts_records);
	return rel;
}

/*
 * Open the primary key of rel (from records_open) for lookups; the caller
 * closes it with NoLock.
 */
Relation
records_open_pkey(Relation rel)
{
	return index_open(shard_pkey_of(rel, records_rels.oids[1]), AccessShareLock);
}

/*
 * The next fencing token of a key whose current token is after (0 for a key
 * without a record): database-wide and increasing, so a token handed out
 * for a key is never handed out again for it, whatever expired or was
 * deleted in between.  The sequence starts above every per-key counter that
 * version 1.1 handed out.  Each node of a Citus cluster has a sequence of
 * its own, so a node's tokens carry its group (shard_local_group) in their
 * bits from RECORDS_TOKEN_GROUP_SHIFT up: no two nodes hand out the same
 * token, also for a key whose record moved between them and expired.  And
 * a record that a shard move brought here may carry a token above this
 * node's, which the key's next token must still exceed.
 */
int64
records_next_token(int64 after)
{
	int64		token = nextval_internal(records_rels.oids[2], false);
	int32		group = shard_local_group();

	if (group > 0)
	{
		if (group > RECORDS_TOKEN_MAX_GROUP || token >= ((int64) 1 << RECORDS_TOKEN_GROUP_SHIFT))
			ereport(ERROR,
					(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
					 errmsg("fencing tokens of Citus group %d are used up", group)));
		token += (int64) group << RECORDS_TOKEN_GROUP_SHIFT;
	}

	if (token <= after)
	{
		if (after == PG_INT64_MAX)
			ereport(ERROR,
					(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
					 errmsg("the fencing tokens of this key are used up")));
		token = after + 1;
	}
	return token;
}

/*
 * Whether the current role may read or act on a record (or inbox mark)
 * owned by owner: the owner itself, a role with its privileges (a member
 * that inherits them), or a superuser.  Rows written before version 1.2 have
 * no owner and stay open to every role.  has_privs_of_role caches the
 * current role's memberships for the backend, so the usual case (the same
 * role) costs a comparison, and the rest a cached list lookup.
 */
bool
idem_role_may_use(Oid owner)
{
	Oid			current = GetUserId();

	return !OidIsValid(owner) || owner == current || has_privs_of_role(current, owner);
}

/*
 * The error for a role that may not use a record.  It reveals neither the
 * response, nor whether the request matched, nor the owner.
 */
void
records_deny(text *scope, text *key)
{
	idem_stats_count(IDEM_STAT_DENIED);
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("permission denied for idempotency key \"%s\" in scope \"%s\"",
					text_to_cstring(key), text_to_cstring(scope)),
			 errdetail("The key's record belongs to a role whose privileges the current role does not have."),
			 errhint("Put the principal (tenant or user) into the scope, so that different roles never share a key.")));
}

/*
 * t + usecs, which must be a valid timestamp: the records are dumped and
 * restored as text, and a value beyond the end of the timestamptz range
 * would be written out but refused on the way back in.
 */
TimestampTz
idem_timestamp_add(TimestampTz t, int64 usecs, const char *what)
{
	TimestampTz result;

	if (pg_add_s64_overflow(t, usecs, &result) || !IS_VALID_TIMESTAMP(result))
		ereport(ERROR,
				(errcode(ERRCODE_DATETIME_VALUE_OUT_OF_RANGE),
				 errmsg("%s is out of range", what),
				 errdetail("It would end after the last timestamp PostgreSQL can store.")));
	return result;
}

/* Text column as a palloc'd copy, or NULL. */
static inline text *
copy_text(Datum value, bool isnull)
{
	return isnull ? NULL : DatumGetTextPCopy(value);
}

/* Fill rec from a heap tuple, copying every value out of the buffer. */
static void
record_from_tuple(Relation rel, HeapTuple tuple, IdemRecord *rec)
{
	Datum		values[Natts_records + 1];
	bool		nulls[Natts_records + 1];
	text	   *state;

	heap_deform_tuple(tuple, RelationGetDescr(rel), values, nulls);

	rec->tid = tuple->t_self;
	state = DatumGetTextPP(values[Anum_records_state - 1]);
	rec->completed = (VARSIZE_ANY_EXHDR(state) == strlen(RECORD_STATE_COMPLETED) &&
					  memcmp(VARDATA_ANY(state), RECORD_STATE_COMPLETED,
							 strlen(RECORD_STATE_COMPLETED)) == 0);
	rec->fingerprint = DatumGetByteaPCopy(values[Anum_records_fingerprint - 1]);
	rec->has_status = !nulls[Anum_records_status - 1];
	rec->status = rec->has_status ? DatumGetInt32(values[Anum_records_status - 1]) : 0;
	rec->headers = nulls[Anum_records_headers - 1] ? NULL :
		DatumGetJsonbPCopy(values[Anum_records_headers - 1]);
	rec->body = nulls[Anum_records_body - 1] ? NULL :
		DatumGetJsonbPCopy(values[Anum_records_body - 1]);
	rec->token = DatumGetInt64(values[Anum_records_token - 1]);
	rec->recovery_point = copy_text(values[Anum_records_recovery_point - 1],
									nulls[Anum_records_recovery_point - 1]);
	rec->has_lease = !nulls[Anum_records_lease_expires_at - 1];
	rec->lease_expires_at = rec->has_lease ?
		DatumGetTimestampTz(values[Anum_records_lease_expires_at - 1]) : 0;
	rec->created_at = DatumGetTimestampTz(values[Anum_records_created_at - 1]);
	rec->has_completed_at = !nulls[Anum_records_completed_at - 1];
	rec->completed_at = rec->has_completed_at ?
		DatumGetTimestampTz(values[Anum_records_completed_at - 1]) : 0;
	rec->expires_at = DatumGetTimestampTz(values[Anum_records_expires_at - 1]);
	/* NULL only in rows written by version 1.0, which had no takeovers. */
	rec->claimed_at = nulls[Anum_records_claimed_at - 1] ? rec->created_at :
		DatumGetTimestampTz(values[Anum_records_claimed_at - 1]);
	rec->owner = nulls[Anum_records_owner - 1] ? InvalidOid :
		DatumGetObjectId(values[Anum_records_owner - 1]);
}

/*
 * Find the record of (scope, key) visible to snapshot through the primary
 * key pkey (from records_open_pkey, so that a caller looking twice opens it
 * once).  Returns false if there is none.
 */
bool
records_lookup(Relation rel, Relation pkey, Snapshot snapshot, text *scope,
			   text *key, IdemRecord *rec)
{
	ScanKeyData skey[2];
	SysScanDesc scan;
	HeapTuple	tuple;
	bool		found = false;

	/* The key columns are COLLATE "C", as are ScanKeyInit's scan keys. */
	ScanKeyInit(&skey[0], Anum_records_scope, BTEqualStrategyNumber,
				F_TEXTEQ, PointerGetDatum(scope));
	ScanKeyInit(&skey[1], Anum_records_key, BTEqualStrategyNumber,
				F_TEXTEQ, PointerGetDatum(key));

	scan = systable_beginscan_ordered(rel, pkey, snapshot, 2, skey);
	tuple = systable_getnext_ordered(scan, ForwardScanDirection);
	if (HeapTupleIsValid(tuple))
	{
		record_from_tuple(rel, tuple, rec);
		found = true;
	}
	systable_endscan_ordered(scan);

	return found;
}

/*
 * Insert into every index of rel (with only_summarizing, into its BRIN
 * indexes only: after a HOT update), as CatalogIndexInsert does.  Only plain
 * column indexes can be maintained without an executor state, so an index a
 * DBA added with expressions or a predicate is refused rather than corrupted.
 * The inbox (inbox.c) maintains its table's indexes with this too.
 */
void
records_index_insert(Relation rel, HeapTuple tuple, bool only_summarizing)
{
	CatalogIndexState indstate;
	TupleTableSlot *slot;
	Datum		values[INDEX_MAX_KEYS];
	bool		isnull[INDEX_MAX_KEYS];

	/*
	 * A HOT update needs no new index entries, except in summarizing (BRIN)
	 * indexes when it changed one of their columns (PostgreSQL 16+).
	 */
	if (HeapTupleIsHeapOnly(tuple) && !only_summarizing)
		return;

	indstate = CatalogOpenIndexes(rel);
	slot = MakeSingleTupleTableSlot(RelationGetDescr(rel), &TTSOpsHeapTuple);
	ExecStoreHeapTuple(tuple, slot, false);

	for (int i = 0; i < indstate->ri_NumIndices; i++)
	{
		Relation	index = indstate->ri_IndexRelationDescs[i];
		IndexInfo  *info = indstate->ri_IndexRelationInfo[i];

		if (!info->ii_ReadyForInserts)
			continue;
		if (only_summarizing && !IndexInfoIsSummarizing(info))
			continue;
		if (info->ii_Expressions != NIL || info->ii_Predicate != NIL ||
			info->ii_ExclusionOps != NULL || !index->rd_index->indimmediate)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("index \"%s\" on idempotency.%s is not supported",
							RelationGetRelationName(index), RelationGetRelationName(rel)),
					 errdetail("Only immediate indexes on plain columns can be maintained by the extension."),
					 errhint("Drop the index.")));

		FormIndexDatum(info, slot, NULL, values, isnull);
		index_insert(index, values, isnull, &tuple->t_self, rel,
					 index->rd_index->indisunique ? UNIQUE_CHECK_YES : UNIQUE_CHECK_NO,
					 false, info);
	}

	ExecDropSingleTupleTableSlot(slot);
	CatalogCloseIndexes(indstate);
}

/* Form the heap tuple of a record. */
static HeapTuple
record_form_tuple(Relation rel, text *scope, text *key, const IdemRecord *rec)
{
	Datum		values[Natts_records + 1];
	bool		nulls[Natts_records + 1];

	memset(nulls, false, sizeof(nulls));
	values[Anum_records_scope - 1] = PointerGetDatum(scope);
	values[Anum_records_key - 1] = PointerGetDatum(key);
	values[Anum_records_state - 1] = CStringGetTextDatum(rec->completed ?
														 RECORD_STATE_COMPLETED :
														 RECORD_STATE_PROCESSING);
	values[Anum_records_fingerprint - 1] = PointerGetDatum(rec->fingerprint);
	values[Anum_records_status - 1] = Int32GetDatum(rec->status);
	nulls[Anum_records_status - 1] = !rec->has_status;
	values[Anum_records_headers - 1] = PointerGetDatum(rec->headers);
	nulls[Anum_records_headers - 1] = (rec->headers == NULL);
	values[Anum_records_body - 1] = PointerGetDatum(rec->body);
	nulls[Anum_records_body - 1] = (rec->body == NULL);
	values[Anum_records_token - 1] = Int64GetDatum(rec->token);
	values[Anum_records_recovery_point - 1] = PointerGetDatum(rec->recovery_point);
	nulls[Anum_records_recovery_point - 1] = (rec->recovery_point == NULL);
	values[Anum_records_lease_expires_at - 1] = TimestampTzGetDatum(rec->lease_expires_at);
	nulls[Anum_records_lease_expires_at - 1] = !rec->has_lease;
	values[Anum_records_created_at - 1] = TimestampTzGetDatum(rec->created_at);
	values[Anum_records_completed_at - 1] = TimestampTzGetDatum(rec->completed_at);
	nulls[Anum_records_completed_at - 1] = !rec->has_completed_at;
	values[Anum_records_expires_at - 1] = TimestampTzGetDatum(rec->expires_at);
	values[Anum_records_claimed_at - 1] = TimestampTzGetDatum(rec->claimed_at);
	values[Anum_records_owner - 1] = ObjectIdGetDatum(rec->owner);
	nulls[Anum_records_owner - 1] = !OidIsValid(rec->owner);
	/* A shard of a table distributed by tenant: the scope as a tenant value. */
	if (RelationGetDescr(rel)->natts > Natts_records)
		values[Natts_records] = shard_tenant_value(rel, Natts_records, scope);

	return heap_form_tuple(RelationGetDescr(rel), values, nulls);
}

/*
 * Insert a record.  rel must be open with RowExclusiveLock; the caller holds
 * the key's advisory lock, so the unique index sees no live rival, and it
 * stays as the last line of defence.
 */
void
records_insert(Relation rel, text *scope, text *key, const IdemRecord *rec)
{
	HeapTuple	tuple = record_form_tuple(rel, scope, key, rec);

	simple_heap_insert(rel, tuple);
	records_index_insert(rel, tuple, false);
	heap_freetuple(tuple);

	/* Make the record visible to the rest of this transaction. */
	CommandCounterIncrement();
}

/*
 * Check that the row at tid is the one of (scope, key), whose columns start
 * at scope_attnum, before it is deleted or updated.  The caller has kept the
 * table's lock since it found the TID, so nothing can have moved it: this is
 * the last line of defence against acting on another key's row.
 */
void
records_check_tid(Relation rel, ItemPointer tid, AttrNumber scope_attnum,
				  text *scope, text *key)
{
	HeapTupleData tuple;
	Buffer		buffer;
	bool		same = false;

	tuple.t_self = *tid;
	if (ItemPointerGetBlockNumber(tid) < RelationGetNumberOfBlocks(rel) &&
		heap_fetch(rel, SnapshotAny, &tuple, &buffer, false))
	{
		bool		isnull_a;
		bool		isnull_b;
		Datum		a = heap_getattr(&tuple, scope_attnum, RelationGetDescr(rel), &isnull_a);
		Datum		b = heap_getattr(&tuple, scope_attnum + 1, RelationGetDescr(rel), &isnull_b);

		same = !isnull_a && !isnull_b &&
			DatumGetBool(DirectFunctionCall2Coll(texteq, C_COLLATION_OID, a, PointerGetDatum(scope))) &&
			DatumGetBool(DirectFunctionCall2Coll(texteq, C_COLLATION_OID, b, PointerGetDatum(key)));
		ReleaseBuffer(buffer);
	}
	if (!same)
		elog(ERROR, "row (%u,%u) of idempotency.%s is not the one of \"%s\" in \"%s\" any more",
			 ItemPointerGetBlockNumber(tid), ItemPointerGetOffsetNumber(tid),
			 RelationGetRelationName(rel), text_to_cstring(key), text_to_cstring(scope));
}

/*
 * Replace the record at rec->tid with rec's values.  Only holders of the
 * key's advisory lock update records, and the cleanup worker never deletes a
 * 'processing' one, so no concurrent update can interfere.
 */
void
records_update(Relation rel, text *scope, text *key, const IdemRecord *rec)
{
	HeapTuple	tuple = record_form_tuple(rel, scope, key, rec);
	ItemPointerData otid = rec->tid;
	TU_UpdateIndexes update_indexes;

	records_check_tid(rel, &otid, Anum_records_scope, scope, key);
	simple_heap_update(rel, &otid, tuple, &update_indexes);
	if (update_indexes != TU_None)
		records_index_insert(rel, tuple, update_indexes == TU_Summarizing);
	heap_freetuple(tuple);
	CommandCounterIncrement();
}

/* Append a row to idempotency.audit: who resolved which operation, how and when. */
void
records_audit(const char *action, text *scope, text *key, int64 token_before,
			  int64 token_after, const IdemRecord *rec, text *note)
{
	Oid			nspid = get_namespace_oid(RECORDS_SCHEMA, false);
	Oid			relid = get_relname_relid(AUDIT_TABLE, nspid);
	Relation	rel;
	Datum		values[Natts_audit];
	bool		nulls[Natts_audit];
	HeapTuple	tuple;

	if (!OidIsValid(relid))
		elog(ERROR, "table idempotency.%s does not exist", AUDIT_TABLE);
	rel = table_open(relid, RowExclusiveLock);
	records_check_columns(rel, Natts_audit);

	memset(nulls, false, sizeof(nulls));
	values[Anum_audit_at - 1] = TimestampTzGetDatum(GetCurrentTimestamp());
	/* The role the call ran as, and who logged in (they differ after SET ROLE). */
	values[Anum_audit_actor - 1] = CStringGetTextDatum(GetUserNameFromId(GetUserId(), false));
	values[Anum_audit_session_actor - 1] =
		CStringGetTextDatum(GetUserNameFromId(GetSessionUserId(), false));
	values[Anum_audit_action - 1] = CStringGetTextDatum(action);
	values[Anum_audit_scope - 1] = PointerGetDatum(scope);
	values[Anum_audit_key - 1] = PointerGetDatum(key);
	values[Anum_audit_token_before - 1] = Int64GetDatum(token_before);
	values[Anum_audit_token_after - 1] = Int64GetDatum(token_after);
	values[Anum_audit_status - 1] = Int32GetDatum(rec->status);
	nulls[Anum_audit_status - 1] = !rec->has_status;
	values[Anum_audit_note - 1] = PointerGetDatum(note);
	nulls[Anum_audit_note - 1] = (note == NULL);

	tuple = heap_form_tuple(RelationGetDescr(rel), values, nulls);
	simple_heap_insert(rel, tuple);
	records_index_insert(rel, tuple, false);
	heap_freetuple(tuple);
	table_close(rel, NoLock);
	CommandCounterIncrement();
}

/*
 * Delete an expired record (or inbox mark: scope_attnum says where the key
 * columns are) before its key is claimed again.  The cleanup worker may have
 * deleted it first; that is as good as our own delete.
 */
void
records_delete_expired(Relation rel, ItemPointer tid, AttrNumber scope_attnum,
					   text *scope, text *key)
{
	TM_FailureData tmfd;
	TM_Result	result;

	records_check_tid(rel, tid, scope_attnum, scope, key);
	result = table_tuple_delete(rel, tid, GetCurrentCommandId(true),
								InvalidSnapshot, InvalidSnapshot,
								true, &tmfd, false);
	switch (result)
	{
		case TM_Ok:
		case TM_Deleted:
		case TM_SelfModified:
			break;
		case TM_Updated:
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to concurrent update of an idempotency record"),
					 errhint("The transaction might succeed if retried.")));
			break;
		default:
			elog(ERROR, "unexpected table_tuple_delete status: %u", result);
			break;
	}
	CommandCounterIncrement();
}
