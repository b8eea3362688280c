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
#include "executor/executor.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"

#include "records.h"

#define RECORDS_SCHEMA		"idempotency"
#define RECORDS_TABLE		"records"
#define RECORDS_PKEY		"records_pkey"
#define AUDIT_TABLE			"audit"

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
#define Natts_audit					9

/* The registered sets of cached OIDs (idem_relcache_register). */
static IdemRelCache *relcaches = NULL;

/* idempotency.records and its primary key. */
static IdemRelCache records_rels = IDEM_RELCACHE(RECORDS_TABLE, RECORDS_PKEY);

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

/* Open idempotency.records with the given lock mode. */
Relation
records_open(LOCKMODE lockmode)
{
	if (!idem_relcache_resolve(&records_rels))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("extension \"idempotency\" is not installed in this database"),
				 errhint("Run CREATE EXTENSION idempotency.")));
	return table_open(records_rels.oids[0], lockmode);
}

/* Open the primary key of idempotency.records (after records_open) for lookups. */
Relation
records_open_pkey(void)
{
	return index_open(records_rels.oids[1], AccessShareLock);
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
	Datum		values[Natts_records];
	bool		nulls[Natts_records];
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
 * Insert into every index of rel, as CatalogIndexInsert does.  Only plain
 * column indexes can be maintained without an executor state, so an index a
 * DBA added with expressions or a predicate is refused rather than corrupted.
 * The inbox (inbox.c) maintains its table's indexes with this too.
 */
void
records_index_insert(Relation rel, HeapTuple tuple)
{
	CatalogIndexState indstate;
	TupleTableSlot *slot;
	Datum		values[INDEX_MAX_KEYS];
	bool		isnull[INDEX_MAX_KEYS];

	/* A HOT update needs no new index entries. */
	if (HeapTupleIsHeapOnly(tuple))
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
	Datum		values[Natts_records];
	bool		nulls[Natts_records];

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
	records_index_insert(rel, tuple);
	heap_freetuple(tuple);

	/* Make the record visible to the rest of this transaction. */
	CommandCounterIncrement();
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

	simple_heap_update(rel, &otid, tuple);
	records_index_insert(rel, tuple);
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

	memset(nulls, false, sizeof(nulls));
	values[Anum_audit_at - 1] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[Anum_audit_actor - 1] = CStringGetTextDatum(GetUserNameFromId(GetSessionUserId(), false));
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
	records_index_insert(rel, tuple);
	heap_freetuple(tuple);
	table_close(rel, RowExclusiveLock);
	CommandCounterIncrement();
}

/*
 * Delete an expired record before its key is claimed again.  The cleanup
 * worker may have deleted it first; that is as good as our own delete.
 */
void
records_delete_expired(Relation rel, ItemPointer tid)
{
	TM_FailureData tmfd;
	TM_Result	result;

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
