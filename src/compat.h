/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Differences between the PostgreSQL major versions idempotency supports
 *	  (15 to 18), in one place.
 *
 * The rest of the code is written against the newest API; for older
 * versions, this header supplies small shims of the same names, so a call
 * reads as it would in current PostgreSQL.  Each shim says which version
 * introduced the API it stands in for.  Include it after the PostgreSQL
 * headers that declare the originals.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMPAT_H
#define IDEM_COMPAT_H

#include "postgres.h"

#include "access/heapam.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_proc.h"
#include "common/base64.h"
#include "executor/executor.h"
#include "nodes/execnodes.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "utils/acl.h"
#include "utils/guc.h"

#if PG_VERSION_NUM < 150000
#error "idempotency needs PostgreSQL 15 or later"
#endif

/*
 * PostgreSQL 18 marks functions that do not return with pg_noreturn, a C11
 * _Noreturn in front of the declaration, instead of pg_attribute_noreturn()
 * after it.
 */
#ifndef pg_noreturn
#define pg_noreturn _Noreturn
#endif

/*
 * PostgreSQL 16 replaced the per-class pg_*_aclcheck functions with
 * object_aclcheck(classid, ...).  The extension checks only functions and
 * schemas.
 */
#if PG_VERSION_NUM < 160000
static inline AclResult
object_aclcheck(Oid classid, Oid objectid, Oid roleid, AclMode mode)
{
	if (classid == NamespaceRelationId)
		return pg_namespace_aclcheck(objectid, roleid, mode);
	if (classid != ProcedureRelationId)
		elog(ERROR, "object_aclcheck shim supports functions and schemas only, not class %u", classid);
	return pg_proc_aclcheck(objectid, roleid, mode);
}
#endif

/*
 * PostgreSQL 16 keeps GUC values and check hooks' "extra" data in a memory
 * context: guc_malloc allocates them and the GUC machinery frees them with
 * pfree.  Before, they were malloc'd and freed with free().
 */
#if PG_VERSION_NUM < 160000
static inline void *
guc_malloc(int elevel, size_t size)
{
	void	   *data = malloc(size);

	if (data == NULL)
		ereport(elevel,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	return data;
}
#define guc_free(ptr) free(ptr)
#endif

/*
 * PostgreSQL 16 lets an update that changes only columns of summarizing
 * (BRIN) indexes be HOT: simple_heap_update reports in *update_indexes
 * whether no index, all indexes or only the summarizing ones need the new
 * tuple, and ExecInsertIndexTuples takes onlySummarizing.  Before 16 such an
 * update is never HOT, so "all indexes" unless the tuple is heap-only.
 */
#if PG_VERSION_NUM < 160000
typedef enum TU_UpdateIndexes
{
	TU_None,
	TU_All,
	TU_Summarizing
} TU_UpdateIndexes;

static inline void
compat_simple_heap_update(Relation relation, ItemPointer otid, HeapTuple tup,
						  TU_UpdateIndexes *update_indexes)
{
	simple_heap_update(relation, otid, tup);
	*update_indexes = HeapTupleIsHeapOnly(tup) ? TU_None : TU_All;
}
#define simple_heap_update(relation, otid, tup, update_indexes) \
	compat_simple_heap_update(relation, otid, tup, update_indexes)

#define ExecInsertIndexTuples(rri, slot, estate, update, noDupErr, specConflict, arbiterIndexes, onlySummarizing) \
	ExecInsertIndexTuples(rri, slot, estate, update, noDupErr, specConflict, arbiterIndexes)

/* Whether an index only summarizes ranges of the table (BRIN): none before 16. */
#define IndexInfoIsSummarizing(info) ((void) (info), false)
#else
#define IndexInfoIsSummarizing(info) ((info)->ii_Summarizing)
#endif

/*
 * PostgreSQL 17 numbers backends with MyProcNumber (a ProcNumber) instead of
 * MyProc->pgprocno.
 */
#if PG_VERSION_NUM < 170000
#define MyProcNumber (MyProc->pgprocno)
#endif

/*
 * PostgreSQL 18 added LockAcquireExtended's logLockFailure, which logs a
 * failed conditional acquisition when log_lock_failures is on.
 */
#if PG_VERSION_NUM < 180000
#define LockAcquireExtended(locktag, lockmode, sessionLock, dontWait, reportMemoryError, locallockp, logLockFailure) \
	LockAcquireExtended(locktag, lockmode, sessionLock, dontWait, reportMemoryError, locallockp)
#endif

/*
 * PostgreSQL 18 declares binary data as uint8 in pg_b64_encode's source and
 * pg_b64_decode's destination (char before).
 */
#if PG_VERSION_NUM < 180000
#define pg_b64_encode(src, len, dst, dstlen) \
	pg_b64_encode((const char *) (src), len, dst, dstlen)
#define pg_b64_decode(src, len, dst, dstlen) \
	pg_b64_decode(src, len, (char *) (dst), dstlen)
#endif

/*
 * PostgreSQL 16 exported get_extension_schema(), the schema an extension's
 * objects are in.  Before, it was private to extension.c; this reads
 * pg_extension the same way.
 */
#if PG_VERSION_NUM < 160000
#include "access/genam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "catalog/indexing.h"
#include "catalog/pg_extension.h"
#include "utils/fmgroids.h"
#include "utils/rel.h"

static inline Oid
get_extension_schema(Oid ext_oid)
{
	Oid			result = InvalidOid;
	Relation	rel = table_open(ExtensionRelationId, AccessShareLock);
	ScanKeyData entry[1];
	SysScanDesc scan;
	HeapTuple	tuple;

	ScanKeyInit(&entry[0], Anum_pg_extension_oid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(ext_oid));
	scan = systable_beginscan(rel, ExtensionOidIndexId, true, NULL, 1, entry);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
		result = ((Form_pg_extension) GETSTRUCT(tuple))->extnamespace;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return result;
}
#endif

#endif							/* IDEM_COMPAT_H */
