/*-------------------------------------------------------------------------
 *
 * shards.c
 *	  Citus: reach the local shard of a distributed table of the extension.
 *
 * On a Citus cluster idempotency.records and idempotency.inbox may be
 * distributed by the scope (the inbox's source), colocated with the tenant
 * tables, so that a record lives on the node that holds the tenant's rows
 * and the claim, the domain write and the stored response commit in one
 * local transaction of that node (see idem_citus_distribute).  The
 * distributed table itself is then an empty shell on every node: Citus
 * keeps the rows in shards, plain tables named <table>_<shardid>, and knows
 * nothing of the library's writes, which go straight to the heap.  So every
 * function that reads or writes those tables asks shard_resolve which
 * relation holds the rows of its scope, and never falls back to the shell.
 *
 * shard_resolve hashes the scope the way Citus hashes the distribution
 * column (the type's standard hash function, under the column's
 * collation), finds the shard whose hash range covers it, and takes the
 * lock that Citus's own writers take on the shard's metadata: an advisory
 * lock of class 8 on (colocation id, shard index) in share mode, which a
 * shard move or split takes in exclusive mode on every node before it
 * switches the placement.  A write that began before the switch therefore
 * commits before the move does, and is carried along by the move's logical
 * replication; one that begins after sees the new placement.  The map from
 * hash ranges to shards comes from Citus's catalogs, is cached per backend,
 * and is dropped on a relcache invalidation of the distributed table (which
 * Citus sends whenever a placement of one of its shards changes); after
 * taking the lock, pending invalidations are read, so the map used is never
 * older than the lock.  A scope whose shard has no placement on this node
 * is refused with 40001: the call did not reach the node that holds it
 * (Citus did not delegate it, or the shard moved meanwhile).  Records are
 * found by the scope's text, so a scope that the tenant's type reads but
 * writes otherwise ('042' for 42) is refused: it would be a second record
 * of the same tenant and key.
 *
 * And an event published on this node, or with
 * idempotency.citus_atomic_local_writes any write on this node, has Citus
 * commit the transaction's writes on other nodes with two-phase commit, so
 * that a record on a worker never outlives a coordinator-side write of its
 * transaction.
 *
 * Without Citus, or while the table is not distributed, shard_resolve
 * returns the table itself, at the cost of one flag test.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <dlfcn.h>

#include "access/htup_details.h"
#include "access/genam.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/primnodes.h"
#include "nodes/value.h"
#include "parser/parse_func.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/typcache.h"

#include "shards.h"

/* Citus's advisory lock class of a colocated shard's metadata (resource_lock.h). */
#define CITUS_COLOCATED_SHARDS_METADATA_LOCK	8

/* One shard of a distributed table: its hash range and, if here, its relation. */
typedef struct ShardEntry
{
	int64		shardid;
	int32		min_hash;
	int32		max_hash;
	bool		local;			/* has a placement in this node's group */
	Oid			relid;			/* the shard here, once looked up */
	Oid			pkey;			/* its primary key */
} ShardEntry;

/* What a backend knows of one table of the extension that Citus may distribute. */
typedef struct ShardMap
{
	Oid			relid;			/* the table (the shell, when distributed) */
	bool		valid;			/* false: read the catalogs again first */
	bool		distributed;
	uint32		colocation_id;
	AttrNumber	dist_attno;		/* the distribution column */
	bool		dist_is_key;	/* it is the table's text key (attribute 1) */
	Oid			dist_collation;
	Oid			typid;			/* for a tenant column: its type */
	Oid			typinput;		/* and that type's input and output functions */
	Oid			typioparam;
	Oid			typoutput;
	int32		typmod;
	FmgrInfo	hash;
	int			nshards;
	ShardEntry *shards;			/* in hash range order, as Citus numbers them */
	MemoryContext cxt;
} ShardMap;

static void shard_xact_callback(XactEvent event, void *arg);

/* idempotency.citus_atomic_local_writes */
static bool shard_atomic_local_writes = false;

/* records and inbox; a slot is taken by the first table that asks. */
#define SHARD_MAX_MAPS 4
static ShardMap shard_maps[SHARD_MAX_MAPS];
static int	shard_nmaps = 0;

/* Mark the map of relid (every map, for a cache reset) to be read again. */
static void
shard_relcache_callback(Datum arg, Oid relid)
{
	for (int i = 0; i < shard_nmaps; i++)
		if (relid == InvalidOid || shard_maps[i].relid == relid)
			shard_maps[i].valid = false;
}

/* Register the invalidation and commit callbacks; called once from _PG_init. */
void
ShardsInit(void)
{
	DefineCustomBoolVariable("idempotency.citus_atomic_local_writes",
							 "On Citus, whether a transaction that wrote on this node commits its writes on other nodes with two-phase commit.",
							 "On: a coordinator-side write commits with the records that delegated calls stored on a worker, or not at all; a worker that used NOTIFY or temporary objects in it then cannot prepare, and the commit fails. Off: only events published on this node are committed that way.",
							 &shard_atomic_local_writes,
							 false,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	CacheRegisterRelcacheCallback(shard_relcache_callback, (Datum) 0);
	RegisterXactCallback(shard_xact_callback, NULL);
}

/* Run a catalog query with the latest snapshot; the caller is connected to SPI. */
static void
shard_query(const char *sql, Oid relid)
{
	Oid			argtypes[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(relid)};
	SPIPlanPtr	plan = SPI_prepare(sql, 1, argtypes);

	if (plan == NULL)
		elog(ERROR, "SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
	/*
	 * The latest snapshot, not the transaction's: under REPEATABLE READ a
	 * transaction snapshot taken before a shard move would still show the
	 * old placement, and the write would go to a shard about to be dropped.
	 */
	if (SPI_execute_snapshot(plan, values, NULL, GetLatestSnapshot(), InvalidSnapshot,
							 true, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the Citus metadata of relation %u", relid);
}

/*
 * Whether rel's last column is the tenant column that idem_citus_distribute
 * adds after the natts columns the library knows.
 */
bool
shard_has_tenant_column(Relation rel, int natts)
{
	TupleDesc	desc = RelationGetDescr(rel);

	return desc->natts == natts + 1 &&
		strcmp(NameStr(TupleDescAttr(desc, natts)->attname), SHARD_TENANT_COLUMN) == 0;
}

/* Read what the map needs from the distribution column (attribute attno of the shell). */
static void
shard_map_column(ShardMap *map, Relation shell, AttrNumber attno)
{
	TupleDesc	desc = RelationGetDescr(shell);
	Form_pg_attribute att;
	TypeCacheEntry *type;
	bool		typisvarlena;

	/* A node added after idem_citus_distribute has the extension's table only. */
	if (attno < 1 || attno > desc->natts)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.%s on this node lacks the column Citus distributes it by",
						RelationGetRelationName(shell)),
				 errdetail("Citus distributes it by column %d; the table here has %d columns.",
						   attno, desc->natts),
				 errhint("Run SELECT idem_citus_distribute(...) on the coordinator again: it adds the tenant column on the nodes added since.")));
	att = TupleDescAttr(desc, attno - 1);
	map->dist_attno = attno;
	map->dist_is_key = (attno == 1);
	if (!map->dist_is_key &&
		!(attno == desc->natts && strcmp(NameStr(att->attname), SHARD_TENANT_COLUMN) == 0))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency.%s is distributed by column \"%s\"",
						RelationGetRelationName(shell), NameStr(att->attname)),
				 errdetail("The extension's tables can be distributed only by their first column or by the column \"%s\" that idem_citus_distribute adds.",
						   SHARD_TENANT_COLUMN),
				 errhint("Undistribute the table and run idem_citus_distribute().")));
	map->dist_collation = att->attcollation;
	map->typmod = att->atttypmod;
	map->typid = att->atttypid;
	getTypeInputInfo(att->atttypid, &map->typinput, &map->typioparam);
	getTypeOutputInfo(att->atttypid, &map->typoutput, &typisvarlena);
	type = lookup_type_cache(att->atttypid, TYPECACHE_HASH_PROC_FINFO);
	if (!OidIsValid(type->hash_proc))
		elog(ERROR, "type %u of the distribution column has no hash function", att->atttypid);
	fmgr_info_copy(&map->hash, &type->hash_proc_finfo, map->cxt);
}

/*
 * Read the map of relid from Citus's catalogs: whether it is distributed,
 * by which column, and its shards with their hash ranges and whether they
 * are placed here.  Anything but a hash-distributed table is refused.
 */
static void
shard_map_read(ShardMap *map)
{
	Relation	shell;
	HeapTuple	tup;
	bool		isnull;
	char		method;
	Node	   *partkey;

	MemoryContextReset(map->cxt);
	map->distributed = false;
	map->nshards = 0;
	map->shards = NULL;
	if (!OidIsValid(get_extension_oid("citus", true)))
		return;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	shard_query("SELECT p.partmethod, p.colocationid, p.partkey FROM pg_catalog.pg_dist_partition p"
				" WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1", map->relid);
	if (SPI_processed == 0)
	{
		SPI_finish();
		return;
	}
	tup = SPI_tuptable->vals[0];
	method = DatumGetChar(SPI_getbinval(tup, SPI_tuptable->tupdesc, 1, &isnull));
	shell = relation_open(map->relid, AccessShareLock);
	if (method != 'h')
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency.%s is a Citus table that is not hash-distributed",
						RelationGetRelationName(shell)),
				 errdetail("A record must live on the node that holds its tenant's rows: the table must be distributed by hash, colocated with the tenant tables."),
				 errhint("Undistribute the table and run idem_citus_distribute().")));
	map->colocation_id = DatumGetUInt32(SPI_getbinval(tup, SPI_tuptable->tupdesc, 2, &isnull));
	partkey = stringToNode(TextDatumGetCString(SPI_getbinval(tup, SPI_tuptable->tupdesc, 3, &isnull)));
	if (!IsA(partkey, Var))
		elog(ERROR, "unexpected distribution key of relation %u", map->relid);
	shard_map_column(map, shell, ((Var *) partkey)->varattno);
	relation_close(shell, NoLock);

	shard_query("SELECT s.shardid, s.shardminvalue::pg_catalog.int4, s.shardmaxvalue::pg_catalog.int4,"
				"       EXISTS (SELECT FROM pg_catalog.pg_dist_placement pl, pg_catalog.pg_dist_local_group g"
				"                WHERE pl.shardid OPERATOR(pg_catalog.=) s.shardid"
				"                  AND pl.groupid OPERATOR(pg_catalog.=) g.groupid)"
				"  FROM pg_catalog.pg_dist_shard s"
				" WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1"
				" ORDER BY 2", map->relid);
	map->nshards = SPI_processed;
	map->shards = MemoryContextAllocZero(map->cxt, sizeof(ShardEntry) * Max(map->nshards, 1));
	for (int i = 0; i < map->nshards; i++)
	{
		TupleDesc	desc = SPI_tuptable->tupdesc;
		ShardEntry *s = &map->shards[i];

		tup = SPI_tuptable->vals[i];
		s->shardid = DatumGetInt64(SPI_getbinval(tup, desc, 1, &isnull));
		s->min_hash = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));
		s->max_hash = DatumGetInt32(SPI_getbinval(tup, desc, 3, &isnull));
		s->local = DatumGetBool(SPI_getbinval(tup, desc, 4, &isnull));
	}
	SPI_finish();
	map->distributed = true;
}

/*
 * Read map again and mark it valid, unless an invalidation arrives while it
 * is read; a map whose reading failed stays invalid.  (A function of its
 * own, so that no local of the caller lives across the longjmp.)
 */
static void
shard_map_refresh(ShardMap *map)
{
	map->valid = true;
	PG_TRY();
	{
		shard_map_read(map);
	}
	PG_CATCH();
	{
		map->valid = false;
		PG_RE_THROW();
	}
	PG_END_TRY();
}

/*
 * The map of relid, read again if an invalidation made it stale.  An
 * invalidation that arrives while it is read (the queries take locks, and
 * locks read invalidations) makes it read again.
 */
static ShardMap *
shard_map_get(Oid relid)
{
	ShardMap   *map = NULL;

	for (int i = 0; i < shard_nmaps; i++)
		if (shard_maps[i].relid == relid)
			map = &shard_maps[i];
	if (map == NULL)
	{
		if (shard_nmaps == SHARD_MAX_MAPS)
			elog(ERROR, "too many shard maps");
		map = &shard_maps[shard_nmaps];
		memset(map, 0, sizeof(*map));
		map->cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency shard map",
										 ALLOCSET_SMALL_SIZES);
		map->relid = relid;
		shard_nmaps++;
	}
	for (int tries = 0; !map->valid; tries++)
	{
		if (tries == 100)
			elog(ERROR, "the Citus metadata of relation %u keeps changing", relid);
		shard_map_refresh(map);
	}
	return map;
}

/* The index of the shard whose hash range holds hash (binary search). */
static int
shard_index_of(ShardMap *map, int32 hash)
{
	int			lo = 0;
	int			hi = map->nshards - 1;

	while (lo <= hi)
	{
		int			mid = lo + (hi - lo) / 2;

		if (hash < map->shards[mid].min_hash)
			hi = mid - 1;
		else if (hash > map->shards[mid].max_hash)
			lo = mid + 1;
		else
			return mid;
	}
	ereport(ERROR,
			(errcode(ERRCODE_DATA_EXCEPTION),
			 errmsg("no shard of relation %u covers hash value %d", map->relid, hash),
			 errdetail("The hash ranges of the table's shards in pg_dist_shard leave a gap.")));
	return -1;					/* keep the compiler quiet */
}

/*
 * What relid's messages call the value a caller passes and the row it
 * finds: an inbox's source and mark, else a record's scope and record.
 */
static void
shard_value_words(Oid relid, const char **value_word, const char **row_word)
{
	char	   *relname = get_rel_name(relid);
	bool		inbox = relname != NULL && strcmp(relname, "inbox") == 0;

	*value_word = inbox ? "source" : "scope";
	*row_word = inbox ? "mark" : "record";
}

/*
 * The value of the distribution column for rows of value (a scope or
 * source) of table relid: the value itself, or read as the
 * tenant column's type typid.  A value that the type refuses ('acme' for a
 * bigint) is a wrong scope, reported as such with 22023 like another
 * spelling of a tenant, not as the 22P02 of text the application sent.
 */
static Datum
shard_dist_datum(Oid typid, Oid typinput, Oid typioparam, int32 typmod, bool is_key,
				 text *value, Oid relid)
{
	MemoryContext oldcontext = CurrentMemoryContext;
	char	   *str;
	volatile Datum d = (Datum) 0;

	if (is_key)
		return PointerGetDatum(value);
	str = text_to_cstring(value);
	PG_TRY();
	{
		d = OidInputFunctionCall(typinput, str, typioparam, typmod);
	}
	PG_CATCH();
	{
		ErrorData  *edata;
		const char *value_word;
		const char *row_word;

		MemoryContextSwitchTo(oldcontext);
		edata = CopyErrorData();
		if (ERRCODE_TO_CATEGORY(edata->sqlerrcode) != ERRCODE_DATA_EXCEPTION)
			PG_RE_THROW();
		FlushErrorState();
		shard_value_words(relid, &value_word, &row_word);
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s \"%s\" is not a tenant of type %s",
						value_word, str, format_type_be(typid)),
				 errdetail("Citus distributes idempotency.%s by a tenant of type %s: %s.",
						   get_rel_name(relid), format_type_be(typid), edata->message),
				 errhint("Pass the tenant's value as the %s, or call the functions of schema idem_citus with a %s.",
						 value_word, format_type_be(typid))));
	}
	PG_END_TRY();
	return d;
}

/* Look up the local shard's relation and primary key by Citus's names for them. */
static void
shard_find_relation(ShardMap *map, ShardEntry *s, Oid pkey)
{
	Oid			nspid = get_rel_namespace(map->relid);
	char	   *relname = psprintf("%s_" INT64_FORMAT, get_rel_name(map->relid), s->shardid);
	char	   *pkeyname = psprintf("%s_" INT64_FORMAT, get_rel_name(pkey), s->shardid);

	s->relid = get_relname_relid(relname, nspid);
	s->pkey = get_relname_relid(pkeyname, nspid);
	if (!OidIsValid(s->relid) || !OidIsValid(s->pkey))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("shard " INT64_FORMAT " of idempotency.%s is placed on this node but its table is missing",
						s->shardid, get_rel_name(map->relid)),
				 errdetail("Relation idempotency.%s or idempotency.%s does not exist.", relname, pkeyname),
				 errhint("The transaction might succeed if retried.")));
}

/*
 * Refuse a scope (an inbox's source) that is not the text the tenant
 * column's type writes for its value ('042' or '+42' for the bigint 42, an
 * uppercase uuid): records are found by the scope's text, so another
 * spelling of a tenant would be another record of the same key, and the
 * operation would execute once per spelling.
 */
static void
shard_check_canonical(ShardMap *map, text *value, Datum d)
{
	char	   *canonical = OidOutputFunctionCall(map->typoutput, d);
	int			len = strlen(canonical);
	const char *value_word;
	const char *row_word;

	if (len != VARSIZE_ANY_EXHDR(value) || memcmp(canonical, VARDATA_ANY(value), len) != 0)
	{
		shard_value_words(map->relid, &value_word, &row_word);
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s \"%s\" is not the canonical text of its tenant",
						value_word, text_to_cstring(value)),
				 errdetail("Citus distributes idempotency.%s by a tenant of type %s, which writes this tenant as \"%s\". A %s is found by the %s's text, so a tenant must always be written the same way.",
						   get_rel_name(map->relid), format_type_be(map->typid), canonical,
						   row_word, value_word),
				 errhint("Pass the %s as \"%s\", or call the functions of schema idem_citus with a %s.",
						 value_word, canonical, format_type_be(map->typid))));
	}
	pfree(canonical);
}

/*
 * Which relation holds the rows of value (a scope, or an inbox's source) of
 * table relid, whose primary key is pkey: the table itself, or -- when Citus
 * distributes it -- the local shard of value's hash, with the shard's
 * metadata lock held in share mode until the transaction ends.  A shard
 * that is not placed on this node is refused with 40001.
 */
void
shard_resolve(Oid relid, Oid pkey, text *value, ShardTarget *target)
{
	ShardMap   *map = shard_map_get(relid);
	ShardEntry *s;
	int			idx = -1;
	LOCKTAG		tag;

	target->relid = relid;
	target->pkey = pkey;
	target->distributed = false;
	if (!map->distributed)
		return;

	for (;;)
	{
		Datum		d = shard_dist_datum(map->typid, map->typinput, map->typioparam, map->typmod,
										 map->dist_is_key, value, map->relid);
		int32		hash = DatumGetInt32(FunctionCall1Coll(&map->hash, map->dist_collation, d));
		int			now_idx;

		if (!map->dist_is_key)
			shard_check_canonical(map, value, d);
		now_idx = shard_index_of(map, hash);

		if (now_idx != idx)
		{
			idx = now_idx;
			SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) idx, map->colocation_id,
								 CITUS_COLOCATED_SHARDS_METADATA_LOCK);
			(void) LockAcquire(&tag, ShareLock, false, false);
		}
		/* A move that committed before we got the lock has sent its invalidations. */
		AcceptInvalidationMessages();
		if (map->valid)
			break;
		map = shard_map_get(relid);
		if (!map->distributed)
			return;
	}

	s = &map->shards[idx];
	if (!s->local)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("the rows of \"%s\" in idempotency.%s are not on this node",
						text_to_cstring(value), get_rel_name(relid)),
				 errdetail("Citus keeps them in shard " INT64_FORMAT ", which has no placement on this node.",
						   s->shardid),
				 errhint("Call the function so that Citus delegates it to the node that holds the shard: a top-level SELECT on the coordinator with a constant first argument, force-delegated inside a transaction block (see idem_citus_distribute). After a shard move, the transaction might succeed if retried.")));
	if (!OidIsValid(s->relid))
		shard_find_relation(map, s, pkey);
	target->relid = s->relid;
	target->pkey = s->pkey;
	target->distributed = true;
}

/*
 * The primary key of rel, a relation shard_resolve returned for a table
 * whose own primary key is pkey.
 */
Oid
shard_pkey_of(Relation rel, Oid pkey)
{
	Oid			relid = RelationGetRelid(rel);

	for (int i = 0; i < shard_nmaps; i++)
		for (int j = 0; j < shard_maps[i].nshards; j++)
			if (shard_maps[i].shards[j].relid == relid)
				return shard_maps[i].shards[j].pkey;
	return pkey;
}

/*
 * The relations that hold relid's rows on this node: relid itself, or,
 * when Citus distributes it, its local shards (for cleanup).
 */
List *
shard_local_relids(Oid relid)
{
	ShardMap   *map = shard_map_get(relid);
	List	   *relids = NIL;
	Oid			nspid;

	if (!map->distributed)
		return list_make1_oid(relid);
	nspid = get_rel_namespace(relid);
	for (int i = 0; i < map->nshards; i++)
		if (map->shards[i].local)
		{
			char	   *relname = psprintf("%s_" INT64_FORMAT, get_rel_name(relid),
										   map->shards[i].shardid);
			Oid			shard = get_relname_relid(relname, nspid);

			/* Not created yet, or dropped after a move: nothing to clean. */
			if (OidIsValid(shard))
				relids = lappend_oid(relids, shard);
			pfree(relname);
		}
	return relids;
}

/*
 * The tenant column's value (the column after the natts the library knows)
 * for rows of value in rel: value read as the column's type, as Citus reads
 * the first argument of a function it delegates.  A value that is not one
 * (a scope 'abc' for a bigint tenant) fails with 22023.
 */
Datum
shard_tenant_value(Relation rel, int natts, text *value)
{
	Form_pg_attribute att = TupleDescAttr(RelationGetDescr(rel), natts);
	Oid			typinput;
	Oid			typioparam;

	getTypeInputInfo(att->atttypid, &typinput, &typioparam);
	return shard_dist_datum(att->atttypid, typinput, typioparam, att->atttypmod, false, value,
							RelationGetRelid(rel));
}

/*
 * Whether this node is the coordinator of a Citus cluster with workers: the
 * node from which the extension's settings (its outbox destinations) reach
 * every node.
 */
bool
shard_citus_coordinator(void)
{
	bool		coordinator;
	bool		isnull;

	if (!OidIsValid(get_extension_oid("citus", true)))
		return false;
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT g.groupid OPERATOR(pg_catalog.=) 0 AND EXISTS ("
					"        SELECT FROM pg_catalog.pg_dist_node n"
					"         WHERE n.groupid OPERATOR(pg_catalog.<>) 0 AND n.isactive"
					"           AND n.noderole OPERATOR(pg_catalog.=) 'primary')"
					"  FROM pg_catalog.pg_dist_local_group g", true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the Citus node metadata");
	coordinator = SPI_processed == 1 &&
		DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull)) &&
		!isnull;
	SPI_finish();
	return coordinator;
}

/*
 * The functions of citus.so that the extension calls, as Citus 13 declares
 * them.  Two are internal: Citus built for PostgreSQL 15 exports them, but
 * from PostgreSQL 16 on extensions are built with hidden symbols, and only
 * Citus's SQL-callable functions are found.  For those builds one such
 * function, execute_command_on_remote_nodes_as_user (which Citus 13 builds
 * but declares in no SQL script), does what the two do: it sends a command
 * to every other node inside the coordinated transaction, which it
 * switches to two-phase commit.  get_current_transaction_id, declared in
 * SQL since Citus 8, tells that citus.so is loaded.
 */
typedef void (*CitusSendParams) (const char *command, const char *user,
								 int parameterCount, const Oid *parameterTypes,
								 const char *const *parameterValues);

typedef struct CitusEntryPoints
{
	bool		looked_up;
	bool		loaded;			/* citus.so is loaded into this backend */
	/* Use2PCForCoordinatedTransaction (transaction_management.c), if exported */
	void		(*use_2pc) (void);
	/* SendCommandToRemoteMetadataNodesParams (worker_transaction.c), if exported */
	CitusSendParams send_params;
	/* execute_command_on_remote_nodes_as_user(query text, username text) */
	PGFunction	send_text;
} CitusEntryPoints;

static CitusEntryPoints citus_entry;

/* Whether this transaction must commit its writes on other nodes with 2PC. */
static bool shard_2pc_wanted = false;

/* Whether shard_citus_send_text sent something in this transaction (so: 2PC). */
static bool shard_sent_text = false;

/*
 * Look up citus.so's functions once per backend.  PostgreSQL loads
 * libraries with RTLD_GLOBAL, and Citus is preloaded wherever it runs, so
 * what citus.so exports is found by name; none of it is found without
 * Citus.
 */
static CitusEntryPoints *
shard_citus_entry_points(void)
{
	if (!citus_entry.looked_up)
	{
		citus_entry.use_2pc = (void (*) (void)) dlsym(RTLD_DEFAULT, "Use2PCForCoordinatedTransaction");
		citus_entry.send_params = (CitusSendParams) dlsym(RTLD_DEFAULT, "SendCommandToRemoteMetadataNodesParams");
		citus_entry.send_text = (PGFunction) dlsym(RTLD_DEFAULT, "execute_command_on_remote_nodes_as_user");
		citus_entry.loaded = dlsym(RTLD_DEFAULT, "get_current_transaction_id") != NULL;
		citus_entry.looked_up = true;
	}
	return &citus_entry;
}

/*
 * Check that the extension citus of this database is of a version whose
 * functions the extension knows how to call (13.x), or fail with what
 * (a verb phrase: "cannot be sent to the workers") cannot be done.
 */
static void
shard_check_citus_version(const char *what)
{
	static bool checked = false;
	char	   *version;
	bool		pushed = false;

	if (checked)
		return;
	/* At pre-commit the statement's snapshot is gone. */
	if (!ActiveSnapshotSet())
	{
		PushActiveSnapshot(GetTransactionSnapshot());
		pushed = true;
	}
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT extversion FROM pg_catalog.pg_extension"
					" WHERE extname OPERATOR(pg_catalog.=) 'citus'", true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the version of extension citus");
	version = SPI_processed == 1 ?
		pstrdup(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1)) : pstrdup("none");
	SPI_finish();
	if (pushed)
		PopActiveSnapshot();
	if (strncmp(version, "13.", 3) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("%s with Citus %s", what, version),
				 errdetail("The extension works with the distributed transactions of Citus 13.")));
	checked = true;
}

/* While shard_citus_send_text runs: the first error a node reported. */
static ErrorData *shard_node_error = NULL;
static emit_log_hook_type shard_prev_emit_log_hook = NULL;

/*
 * Keep the first warning that reports a node's error (Citus reports an
 * error of a statement after the first of several as a warning, and fails
 * the transaction only at its commit), instead of reporting it: it becomes
 * an error.
 */
static void
shard_catch_node_error(ErrorData *edata)
{
	if (edata->elevel == WARNING && edata->context != NULL &&
		strstr(edata->context, "while executing command on") != NULL)
	{
		if (shard_node_error == NULL)
		{
			MemoryContext oldcontext = MemoryContextSwitchTo(TopTransactionContext);

			shard_node_error = palloc0(sizeof(ErrorData));
			shard_node_error->sqlerrcode = edata->sqlerrcode;
			shard_node_error->message = edata->message ? pstrdup(edata->message) : NULL;
			shard_node_error->detail = edata->detail ? pstrdup(edata->detail) : NULL;
			shard_node_error->hint = edata->hint ? pstrdup(edata->hint) : NULL;
			shard_node_error->context = pstrdup(edata->context);
			MemoryContextSwitchTo(oldcontext);
		}
		edata->output_to_client = false;
		edata->output_to_server = false;
	}
	if (shard_prev_emit_log_hook)
		shard_prev_emit_log_hook(edata);
}

/* Report the node's error that shard_catch_node_error kept, if any, at elevel. */
static void
shard_report_node_error(int elevel)
{
	ErrorData  *node_error = shard_node_error;

	shard_node_error = NULL;
	if (node_error != NULL)
		ereport(elevel,
				(errcode(node_error->sqlerrcode),
				 errmsg_internal("%s", node_error->message),
				 node_error->detail ? errdetail_internal("%s", node_error->detail) : 0,
				 node_error->hint ? errhint("%s", node_error->hint) : 0,
				 errcontext("%s", node_error->context)));
}

/*
 * Call Citus's execute_command_on_remote_nodes_as_user: command, as role
 * user, on every other active primary node, inside the coordinated
 * transaction, which it switches to two-phase commit.  It requires a
 * superuser, for it can run anything as anyone: the extension calls it
 * with its own commands only, as the bootstrap superuser for the time of
 * the call, and the command runs on the nodes as user.  Citus sends the
 * command between two others and reports a node's error of it as a
 * warning: that becomes this call's error, with the node's SQLSTATE.  For
 * the time of the call, warnings are reported (so that the hook sees
 * them) and Citus does not echo the command to the client
 * (citus.log_remote_commands, which any role may set): it may hold
 * secrets that the caller is not allowed to read.
 */
static void
shard_citus_send_text(const char *command, const char *user)
{
	PGFunction	send_text = shard_citus_entry_points()->send_text;
	Oid			saved_userid;
	int			saved_sec;
	int			gucs;

	if (send_text == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("citus.so does not export execute_command_on_remote_nodes_as_user"),
				 errdetail("The extension reaches the other nodes of a Citus cluster through that function of Citus 13.")));
	gucs = NewGUCNestLevel();
	(void) set_config_option("citus.log_remote_commands", "off", PGC_SUSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("client_min_messages", "warning", PGC_SUSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("log_min_messages", "warning", PGC_SUSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	GetUserIdAndSecContext(&saved_userid, &saved_sec);
	SetUserIdAndSecContext(BOOTSTRAP_SUPERUSERID, saved_sec | SECURITY_LOCAL_USERID_CHANGE);
	shard_node_error = NULL;
	shard_prev_emit_log_hook = emit_log_hook;
	emit_log_hook = shard_catch_node_error;
	PG_TRY();
	{
		DirectFunctionCall2(send_text, CStringGetTextDatum(command), CStringGetTextDatum(user));
	}
	PG_CATCH();
	{
		emit_log_hook = shard_prev_emit_log_hook;
		SetUserIdAndSecContext(saved_userid, saved_sec);
		AtEOXact_GUC(true, gucs);
		/* A node's error caught before another node failed the call. */
		shard_report_node_error(WARNING);
		PG_RE_THROW();
	}
	PG_END_TRY();
	emit_log_hook = shard_prev_emit_log_hook;
	SetUserIdAndSecContext(saved_userid, saved_sec);
	AtEOXact_GUC(true, gucs);
	shard_sent_text = true;
	shard_report_node_error(ERROR);
}

/*
 * Check that command can be sent to every worker by shard_run_on_workers:
 * Citus 13, and every active worker with Citus's metadata, which Citus
 * sends commands of the distributed transaction to (a worker without it,
 * after stop_metadata_sync_to_node, would be left out).  Errors here are
 * this node's, not a worker's.
 */
void
shard_check_workers(void)
{
	CitusEntryPoints *citus;
	int64		without;
	bool		isnull;

	shard_check_citus_version("outbox destinations cannot be sent to the workers");
	citus = shard_citus_entry_points();
	if (citus->send_params == NULL && citus->send_text == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("outbox destinations cannot be sent to the workers"),
				 errdetail("citus.so exports neither SendCommandToRemoteMetadataNodesParams nor execute_command_on_remote_nodes_as_user.")));
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT count(*) FROM pg_catalog.pg_dist_node n"
					" WHERE n.isactive AND n.noderole OPERATOR(pg_catalog.=) 'primary'"
					"   AND NOT n.hasmetadata"
					"   AND n.groupid OPERATOR(pg_catalog.<>) (SELECT groupid FROM pg_catalog.pg_dist_local_group)",
					true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the Citus node metadata");
	without = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	if (without > 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg_plural("%lld active Citus worker has no metadata",
							   "%lld active Citus workers have no metadata",
							   without, (long long) without),
				 errdetail("Outbox destinations reach the workers inside Citus's distributed transaction, which only workers with metadata take part in."),
				 errhint("Run start_metadata_sync_to_node() for them, then the command again.")));
}

/*
 * command with its parameters ($1, $2, ...) replaced by the values as
 * quoted literals, for a Citus that takes no parameters.  Only a $ outside
 * quotes ('...', "...") that follows no identifier character is a
 * parameter; the command is the extension's own, with no dollar quotes.
 */
static char *
shard_inline_params(const char *command, int nparams, const char *const *values)
{
	StringInfoData buf;
	const char *p = command;

	initStringInfo(&buf);
	while (*p)
	{
		if (*p == '\'' || *p == '"')
		{
			/* Copy the quoted text whole; a doubled quote stays inside. */
			char		quote = *p;

			appendStringInfoChar(&buf, *p++);
			while (*p && (*p != quote || p[1] == quote))
			{
				if (*p == quote)
					appendStringInfoChar(&buf, *p++);
				appendStringInfoChar(&buf, *p++);
			}
			if (*p)
				appendStringInfoChar(&buf, *p++);
		}
		else if (*p == '$' && isdigit((unsigned char) p[1]) &&
			(p == command || !(isalnum((unsigned char) p[-1]) || p[-1] == '_' || p[-1] == '$')))
		{
			char	   *end;
			long		n = strtol(p + 1, &end, 10);

			if (n < 1 || n > nparams)
				elog(ERROR, "parameter $%ld of a command for the workers has no value", n);
			appendStringInfoString(&buf, quote_literal_cstr(values[n - 1]));
			p = end;
		}
		else
			appendStringInfoChar(&buf, *p++);
	}
	return buf.data;
}

/*
 * Run command, whose nparams parameters ($1, $2, ...) are the texts values,
 * on every other active node of the Citus cluster as role user, inside this
 * transaction: Citus commits it there with two-phase commit when this
 * transaction commits, and never when it aborts (its recovery resolves the
 * prepared transactions of a crash), so every node applies it or none
 * does.  Where citus.so exports the function for it (Citus built for
 * PostgreSQL 15), the values travel as parameters, and the workers' logs
 * and pg_stat_activity show only the command; elsewhere they are part of
 * the command's text.  A worker that is down, or that fails the command,
 * fails it here with the worker's error.
 */
void
shard_run_on_workers(const char *command, int nparams, const char *const *values,
					 const char *user)
{
	CitusEntryPoints *citus = shard_citus_entry_points();

	if (citus->send_params != NULL)
	{
		Oid		   *types = palloc(sizeof(Oid) * Max(nparams, 1));

		for (int i = 0; i < nparams; i++)
			types[i] = TEXTOID;
		citus->send_params(command, user, nparams, types, values);
		pfree(types);
	}
	else
		shard_citus_send_text(shard_inline_params(command, nparams, values), user);
}

/*
 * Note that this transaction's writes on other nodes must commit with
 * two-phase commit (see shard_force_2pc), and where Citus exports the way
 * to say so, say so now.
 */
void
shard_commit_with_2pc(void)
{
	CitusEntryPoints *citus = shard_citus_entry_points();

	if (!citus->loaded)
		return;
	shard_2pc_wanted = true;
	if (citus->use_2pc != NULL)
		citus->use_2pc();
}

/*
 * Whether this node is the coordinator and began a Citus coordinated
 * transaction that is in progress: the distributed transaction id that
 * Citus assigns when it does (get_current_transaction_id) names the
 * coordinator as its initiator.  (On a worker, Citus also begins one for
 * a delegated call that touches its local shards only; there is no way to
 * tell one that reached other nodes.)
 */
static bool
shard_coordinating_here(void)
{
	Oid			fn;
	HeapTupleHeader id;
	bool		isnull;
	int32		initiator;
	int64		number;

	/* A worker's group, once it has one, stays: read it once. */
	static int32 group = 0;

	if (group == 0)
		group = shard_local_group();
	if (group != 0)
		return false;

	fn = LookupFuncName(list_make2(makeString("pg_catalog"), makeString("get_current_transaction_id")),
						0, NULL, true);
	if (!OidIsValid(fn))
		return false;
	id = DatumGetHeapTupleHeader(OidFunctionCall0(fn));
	initiator = DatumGetInt32(GetAttributeByNum(id, 3, &isnull));
	number = DatumGetInt64(GetAttributeByNum(id, 4, &isnull));
	return number != 0 && initiator == 0;
}

/*
 * Make Citus commit this transaction's writes on other nodes with two-phase
 * commit.  Citus commits a transaction that changed a single other node
 * with a one-phase COMMIT of that node, first, in its pre-commit step: it
 * does not see what this node wrote to plain tables or straight to the heap
 * (the extension's events).  A crash of this node, or an error of its own
 * commit after that step (a serialization failure of SERIALIZABLE, say),
 * would then keep the other node's writes without this node's: an order
 * and its record on a worker without the event published here.  With
 * two-phase commit the other node only prepares, and Citus's recovery
 * resolves its prepared transaction as this node's commit went.  (The
 * other node cannot prepare a transaction that used NOTIFY or temporary
 * objects: the commit then fails.)
 *
 * Where citus.so exports Use2PCForCoordinatedTransaction, it was called
 * already.  Elsewhere, if this node coordinates a distributed transaction,
 * an empty statement goes to every other node inside it, which switches it
 * to two-phase commit: every worker then prepares, also one the
 * transaction did not write on, and all must be up.
 */
static void
shard_force_2pc(void)
{
	CitusEntryPoints *citus = shard_citus_entry_points();

	if (!citus->loaded || citus->use_2pc != NULL || shard_sent_text || !shard_coordinating_here())
		return;
	shard_check_citus_version("this transaction cannot commit on the other nodes with two-phase commit");
	if (citus->send_text == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("this transaction cannot commit on the other nodes with two-phase commit"),
				 errdetail("citus.so exports neither Use2PCForCoordinatedTransaction nor execute_command_on_remote_nodes_as_user."),
				 errhint("Publish the event inside the delegated call, on the worker.")));
	shard_citus_send_text("SELECT", GetUserNameFromId(GetUserId(), false));
}

/*
 * At pre-commit, before Citus's own pre-commit step (Citus is loaded first,
 * and a callback registered later runs earlier): a transaction that
 * published an event on this node, or with
 * idempotency.citus_atomic_local_writes wrote on it (a plain table of the
 * coordinator next to delegated claims, say), commits its writes on other
 * nodes with two-phase commit.  The latter not by default: it would also
 * make every such transaction of the database that used NOTIFY or temporary
 * objects on a worker fail at commit.
 */
static void
shard_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
			/* (a parallel worker's commit is its leader's business) */
			if (shard_atomic_local_writes && TransactionIdIsValid(GetTopTransactionIdIfAny()))
				shard_commit_with_2pc();
			if (shard_2pc_wanted)
				shard_force_2pc();
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			shard_2pc_wanted = false;
			shard_sent_text = false;
			break;
		default:
			break;
	}
}

/*
 * This node's group in a Citus cluster (pg_dist_local_group), 0 without
 * Citus and on the coordinator.  Read from the table each time: a worker
 * learns its group when the coordinator adds it, and callers are not on a
 * hot path.
 */
int32
shard_local_group(void)
{
	Oid			relid;
	Relation	rel;
	SysScanDesc scan;
	HeapTuple	tuple;
	int32		group = 0;

	if (!OidIsValid(get_extension_oid("citus", true)))
		return 0;
	relid = get_relname_relid("pg_dist_local_group", PG_CATALOG_NAMESPACE);
	if (!OidIsValid(relid))
		return 0;
	rel = table_open(relid, AccessShareLock);
	scan = systable_beginscan(rel, InvalidOid, false, NULL, 0, NULL);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		bool		isnull;
		Datum		d = heap_getattr(tuple, 1, RelationGetDescr(rel), &isnull);

		if (!isnull)
			group = DatumGetInt32(d);
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return group;
}

