/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  idem_publish: an event written in the caller's transaction.
 *
 * An endpoint's domain write and the event that announces it must commit
 * together, or the event is either lost (commit, then crash before sending)
 * or false (sent, then rolled back).  idem_publish therefore only writes:
 * one row in idempotency.outbox and, in the same transaction, one row in
 * idempotency.deliveries per destination whose topics match (fan-out at
 * publish time: a relay that walked the outbox by seq would miss an event
 * whose transaction commits after a later one's).  The relay (relay.c)
 * delivers what committed; at commit we wake it.
 *
 * Like idem_claim, this runs for any role: it writes with direct heap and
 * index access, so the caller needs no privilege on the private schema.
 *
 * Events with the same key must reach a destination in publish order.  The
 * publisher takes a transaction-level lock on a hash of the key before it
 * draws the event's seq, so same-key events commit in seq order, and the
 * relay attempts a delivery only when no earlier one of its key is
 * undelivered.  It waits for that lock at most idempotency.wait_timeout:
 * any role may publish, and may keep its transaction open.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "claims.h"
#include "compat.h"
#include "lockhash.h"
#include "outbox.h"
#include "records.h"
#include "shards.h"
#include "stats.h"
#include "relay.h"

#define OUTBOX_SCHEMA	"idempotency"

int			outbox_retention = 7 * 86400;
int			relay_batch_size = 1000;
int			relay_max_in_flight = 64;
int			outbox_max_event_bytes = 1024 * 1024;
int			relay_visibility_margin = 30000;
int			relay_workers = 1;
char	   *relay_allowed_networks = NULL;

/* Set by idem_publish (and the operator functions): wake the relay at commit. */
static bool wake_at_commit = false;

/* Set when a destination changes: tell the relay loops at commit. */
static bool dests_changed_at_commit = false;

/*
 * The nesting level of the outermost live (sub)transaction in which
 * idem_publish wrote deliveries, 0 if none: they are not committed, and a
 * relay pass of this transaction must not send them (outbox_published).
 */
static int	published_level = 0;

/* What idem_publish writes (records.h: IdemRelCache). */
static IdemRelCache publish_rels = IDEM_RELCACHE("outbox", "deliveries", "destinations", "outbox_seq");

#define PUBLISH_OUTBOX			publish_rels.oids[0]
#define PUBLISH_DELIVERIES		publish_rels.oids[1]
#define PUBLISH_DESTINATIONS	publish_rels.oids[2]
#define PUBLISH_SEQ				publish_rels.oids[3]

/* At commit, wake the relay if this transaction gave it work. */
static void
outbox_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
			published_level = 0;
			if (dests_changed_at_commit)
			{
				dests_changed_at_commit = false;
				idem_stats_dest_changed();
			}
			if (wake_at_commit)
			{
				wake_at_commit = false;
				WorkerWakeRelay(MyDatabaseId);
			}
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PREPARE:
			wake_at_commit = false;
			dests_changed_at_commit = false;
			published_level = 0;
			break;
		default:
			break;
	}
}

/*
 * At the end of a subtransaction, follow its deliveries: a commit hands
 * them to its parent, an abort takes them away (none published further out
 * are left, or published_level would be lower).
 */
static void
outbox_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();

	if (published_level < level)
		return;
	if (event == SUBXACT_EVENT_COMMIT_SUB)
		published_level = level - 1;
	else if (event == SUBXACT_EVENT_ABORT_SUB)
		published_level = 0;
}

/* Define the outbox's GUCs and callbacks; called from _PG_init. */
void
OutboxInit(void)
{
	DefineCustomIntVariable("idempotency.outbox_retention",
							"How long delivered events are kept before cleanup removes them.",
							"Dead-lettered events are kept until they are redriven and delivered.",
							&outbox_retention,
							7 * 86400, 0, INT_MAX,
							PGC_SUSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.relay_batch_size",
							"Most deliveries the relay claims in one pass.",
							NULL,
							&relay_batch_size,
							1000, 1, RELAY_MAX_BATCH,
							PGC_SUSET, 0,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.relay_max_in_flight",
							"Most HTTP requests the relay has in flight at once.",
							NULL,
							&relay_max_in_flight,
							64, 1, 10000,
							PGC_SUSET, 0,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.relay_visibility_margin",
							"How long past the time its HTTP requests may take a claimed delivery stays hidden from other relays.",
							"A relay that dies leaves its claims to be taken again after this; too short, and a slow relay's deliveries are sent twice.",
							&relay_visibility_margin,
							30000, 0, INT_MAX,
							PGC_SUSET, GUC_UNIT_MS,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.relay_workers",
							"Most relay processes per database while a backlog lasts.",
							"The worker starts helpers when a pass claims a full batch; they exit once the backlog is gone.",
							&relay_workers,
							1, 1, RELAY_MAX_WORKERS,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);
	DefineCustomStringVariable("idempotency.relay_allowed_networks",
							   "Non-public addresses that http destinations may reach.",
							   "IP addresses and CIDR networks, comma-separated.  The relay refuses to connect to loopback, private, link-local and other special-purpose addresses unless listed here; names are checked by the address they resolve to.",
							   &relay_allowed_networks,
							   "",
							   PGC_SUSET, GUC_LIST_INPUT,
							   http_check_allowed_networks, http_assign_allowed_networks, NULL);
	DefineCustomIntVariable("idempotency.max_event_bytes",
							"Largest event idem_publish accepts, payload and headers together.",
							NULL,
							&outbox_max_event_bytes,
							1024 * 1024, 0, MaxAllocSize,
							PGC_SUSET, GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	idem_relcache_register(&publish_rels);
	RegisterXactCallback(outbox_xact_callback, NULL);
	RegisterSubXactCallback(outbox_subxact_callback, NULL);
}

/* Whether this transaction wrote deliveries that are still live (uncommitted). */
bool
outbox_published(void)
{
	return published_level > 0;
}

/* Ask for the relay to be woken when this transaction commits. */
void
outbox_wake_at_commit(void)
{
	wake_at_commit = true;
}

/*
 * A destination changed in this transaction: at commit, relay loops give
 * back what they claimed for it before (stats.c's destination generation),
 * and the relay is woken.
 */
void
outbox_dests_changed_at_commit(void)
{
	dests_changed_at_commit = true;
	wake_at_commit = true;
}

/* Whether the outbox tables exist in this database (the extension at 1.1). */
bool
outbox_installed(void)
{
	Oid			nspid = get_namespace_oid(OUTBOX_SCHEMA, true);

	return OidIsValid(nspid) &&
		OidIsValid(get_relname_relid("deliveries", nspid)) &&
		OidIsValid(get_relname_relid("destinations", nspid));
}

/* The OID of idempotency.<relname>, with a clear error if the extension is absent. */
Oid
outbox_relid(const char *relname)
{
	Oid			nspid = get_namespace_oid(OUTBOX_SCHEMA, true);
	Oid			relid = OidIsValid(nspid) ? get_relname_relid(relname, nspid) : InvalidOid;

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("extension \"idempotency\" is not installed in this database, or not at version 1.1"),
				 errhint("Run CREATE EXTENSION idempotency, or ALTER EXTENSION idempotency UPDATE.")));
	return relid;
}

/*
 * Run what follows as the owner of the extension's tables, in a
 * security-restricted operation with search_path pg_catalog, pg_temp (the
 * way core runs maintenance code): the caller's identity and settings can
 * change nothing about the queries.  Undone by outbox_restore_user, or by
 * the (sub)transaction's abort.
 */
void
outbox_become_owner(OutboxOwnerState *state)
{
	HeapTuple	tuple;
	Oid			owner;
	Oid			relid = outbox_relid("destinations");

	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for relation %u", relid);
	owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
	ReleaseSysCache(tuple);

	GetUserIdAndSecContext(&state->save_userid, &state->save_sec_context);
	SetUserIdAndSecContext(owner, state->save_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	state->save_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
}

/* Back to the caller's identity and settings. */
void
outbox_restore_user(OutboxOwnerState *state)
{
	AtEOXact_GUC(true, state->save_nestlevel);
	SetUserIdAndSecContext(state->save_userid, state->save_sec_context);
}

/*
 * Whether topic matches one of the destination's patterns: '*' matches
 * every topic, 'prefix*' every topic that starts with prefix, anything else
 * only itself.
 */
bool
outbox_topic_matches(Datum topics, text *topic)
{
	ArrayType  *arr = DatumGetArrayTypeP(topics);
	Datum	   *elems;
	bool	   *nulls;
	int			n;
	const char *t = VARDATA_ANY(topic);
	int			tlen = VARSIZE_ANY_EXHDR(topic);
	bool		match = false;

	deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &elems, &nulls, &n);
	for (int i = 0; i < n && !match; i++)
	{
		text	   *pat;
		const char *p;
		int			plen;

		if (nulls[i])
			continue;
		pat = DatumGetTextPP(elems[i]);
		p = VARDATA_ANY(pat);
		plen = VARSIZE_ANY_EXHDR(pat);
		if (plen > 0 && p[plen - 1] == '*')
			match = (tlen >= plen - 1 && memcmp(p, t, plen - 1) == 0);
		else
			match = (plen == tlen && memcmp(p, t, tlen) == 0);
	}
	pfree(elems);
	pfree(nulls);
	return match;
}

/* A UUID version 7 (RFC 9562): 48 bits of Unix milliseconds, then 74 random bits. */
static void
outbox_uuid_v7(pg_uuid_t *uuid, TimestampTz now)
{
	uint64		ms = (uint64) (now / 1000) +
		(uint64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY * 1000;

	for (int i = 0; i < 6; i++)
		uuid->data[i] = (unsigned char) (ms >> (8 * (5 - i)));
	if (!pg_strong_random(&uuid->data[6], UUID_LEN - 6))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate random values")));
	uuid->data[6] = (uuid->data[6] & 0x0F) | 0x70;	/* version 7 */
	uuid->data[8] = (uuid->data[8] & 0x3F) | 0x80;	/* RFC 9562 variant */
}

/* A character HTTP allows in a header name (RFC 9110 tchar). */
static inline bool
is_tchar(unsigned char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		(c >= '0' && c <= '9') || strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/*
 * Check a headers object: names are HTTP tokens, values strings without
 * control characters (no header injection), and none of the names the relay
 * sets itself.  what names the argument in messages.
 */
void
outbox_check_headers(Jsonb *headers, const char *what)
{
	static const char *const reserved[] = {
		"content-type", "content-length", "host", "connection",
		"transfer-encoding", "webhook-id", "webhook-timestamp",
		"webhook-signature", NULL
	};
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	char	   *name = NULL;

	if (!JB_ROOT_IS_OBJECT(headers) || JB_ROOT_IS_SCALAR(headers))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a JSON object", what)));

	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		if (tok == WJB_KEY)
		{
			name = pnstrdup(v.val.string.val, v.val.string.len);

			if (v.val.string.len == 0)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("a header name in %s must not be empty", what)));
			for (int i = 0; i < v.val.string.len; i++)
				if (!is_tchar((unsigned char) name[i]))
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("invalid header name \"%s\" in %s", name, what),
							 errdetail("A header name is an HTTP token: letters, digits and !#$%%&'*+-.^_`|~.")));
			for (int i = 0; reserved[i] != NULL; i++)
				if (pg_strcasecmp(name, reserved[i]) == 0)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("%s must not set header \"%s\"", what, name),
							 errdetail("The relay sets Content-Type, Content-Length, Host, Connection, Transfer-Encoding and the webhook-* headers itself.")));
		}
		else if (tok == WJB_VALUE)
		{
			if (v.type != jbvString)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("header \"%s\" in %s must have a string value", name, what)));
			for (int i = 0; i < v.val.string.len; i++)
			{
				unsigned char c = (unsigned char) v.val.string.val[i];

				if ((c < 0x20 && c != '\t') || c == 0x7F)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("header \"%s\" in %s must not contain control characters", name, what)));
			}
		}
	}
}

/* Check a topic, key or name: non-empty and at most OUTBOX_MAX_NAME_LEN bytes. */
void
outbox_check_name(text *value, const char *what)
{
	int			len = VARSIZE_ANY_EXHDR(value);

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", what)));
	if (len > OUTBOX_MAX_NAME_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is too long", what),
				 errdetail("It has %d bytes; at most %d are allowed.",
						   len, OUTBOX_MAX_NAME_LEN)));
}

/*
 * Inserting rows the way the executor does, so that every index of the table
 * (partial ones included) is maintained, without the planner or SPI.
 */
typedef struct OutboxWriter
{
	Relation	rel;
	EState	   *estate;
	ResultRelInfo *rri;
	TupleTableSlot *slot;
} OutboxWriter;

/* Open relid for inserts; the RowExclusiveLock is kept until the transaction ends. */
static void
writer_open(OutboxWriter *w, Oid relid)
{
	w->rel = table_open(relid, RowExclusiveLock);
	w->estate = CreateExecutorState();
	w->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(w->rri, w->rel, 1, NULL, 0);
	ExecOpenIndices(w->rri, false);
	w->slot = MakeSingleTupleTableSlot(RelationGetDescr(w->rel), &TTSOpsVirtual);
}

/* Insert one row and its index entries. */
static void
writer_insert(OutboxWriter *w, Datum *values, bool *nulls)
{
	TupleTableSlot *slot = w->slot;
	int			natts = RelationGetDescr(w->rel)->natts;

	ExecClearTuple(slot);
	memcpy(slot->tts_values, values, natts * sizeof(Datum));
	memcpy(slot->tts_isnull, nulls, natts * sizeof(bool));
	ExecStoreVirtualTuple(slot);
	simple_table_tuple_insert(w->rel, slot);
	if (w->rri->ri_NumIndices > 0)
		list_free(ExecInsertIndexTuples(w->rri, slot, w->estate,
										false, false, NULL, NIL, false));
	ResetPerTupleExprContext(w->estate);
}

/* Done inserting; the table stays locked until the transaction ends. */
static void
writer_close(OutboxWriter *w)
{
	ExecDropSingleTupleTableSlot(w->slot);
	ExecCloseIndices(w->rri);
	FreeExecutorState(w->estate);
	table_close(w->rel, NoLock);
}

/*
 * Take the publishing lock of an event key, held until the transaction ends:
 * same-key publishers thus draw their seq in the order they commit.
 */
static void
outbox_key_lock(text *key)
{
	LOCKTAG		tag;

	idem_lock_tag(&tag, OUTBOX_LOCK_CLASS, key, NULL);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

/*
 * Take the publishing lock of an event key as outbox_key_lock does, waiting
 * at most idempotency.wait_timeout (or the caller's lock_timeout, if
 * shorter) for a transaction that holds it, then failing with 55P03.  Any
 * role may publish: without a bound, one that kept a transaction open
 * after publishing with a key would hold every other publisher of that key
 * for as long as it liked.  A wait_timeout of 0 waits a millisecond.
 */
static void
outbox_key_lock_bounded(text *key)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	int			saved_lock_timeout = LockTimeout;
	int			bound = Max(idem_wait_timeout, 1);
	bool		bounded_by_us = (LockTimeout == 0 || LockTimeout > bound);

	if (bounded_by_us)
		LockTimeout = bound;
	PG_TRY();
	{
		outbox_key_lock(key);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		LockTimeout = saved_lock_timeout;
		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		if (!bounded_by_us || edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
		{
			FreeErrorData(edata);
			PG_RE_THROW();
		}
		FlushErrorState();
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("could not lock event key \"%s\" for publishing", text_to_cstring(key)),
				 errdetail("Another transaction has held it for longer than idempotency.wait_timeout (%d ms).",
						   idem_wait_timeout),
				 errhint("Retry once that transaction has ended.  Publishers of a key wait for one another, so transactions that publish should commit promptly; idle_in_transaction_session_timeout ends those that do not.")));
	}
	PG_END_TRY();
	LockTimeout = saved_lock_timeout;
}

/*
 * Insert one pending delivery per destination whose topics match, in this
 * transaction.  The destinations are read with the latest snapshot, not the
 * statement's: a destination created a moment ago gets the event.  A
 * destination dropped while this transaction is open may still get a
 * delivery row; the relay never claims it (its destination is gone) and
 * cleanup removes it.  Returns the number of deliveries.
 */
static int
outbox_fan_out(pg_uuid_t *event_id, int64 seq, text *topic, text *key,
			   TimestampTz now)
{
	OutboxWriter w;
	Relation	dests;
	Snapshot	snapshot;
	TableScanDesc scan;
	HeapTuple	tuple;
	Datum		values[Natts_deliveries];
	bool		nulls[Natts_deliveries];
	int			n = 0;

	writer_open(&w, PUBLISH_DELIVERIES);

	memset(nulls, true, sizeof(nulls));
	values[Anum_deliveries_event_id - 1] = UUIDPGetDatum(event_id);
	nulls[Anum_deliveries_event_id - 1] = false;
	values[Anum_deliveries_seq - 1] = Int64GetDatum(seq);
	nulls[Anum_deliveries_seq - 1] = false;
	values[Anum_deliveries_key - 1] = PointerGetDatum(key);
	nulls[Anum_deliveries_key - 1] = (key == NULL);
	values[Anum_deliveries_state - 1] = CStringGetTextDatum("pending");
	nulls[Anum_deliveries_state - 1] = false;
	values[Anum_deliveries_attempts - 1] = Int32GetDatum(0);
	nulls[Anum_deliveries_attempts - 1] = false;
	values[Anum_deliveries_next_attempt_at - 1] = TimestampTzGetDatum(now);
	nulls[Anum_deliveries_next_attempt_at - 1] = false;
	/* Not in a table of version 1.1, whose 13 columns are all writer_insert copies. */
	values[Anum_deliveries_claims - 1] = Int64GetDatum(0);
	nulls[Anum_deliveries_claims - 1] = false;
	nulls[Anum_deliveries_destination_id - 1] = false;

	dests = table_open(PUBLISH_DESTINATIONS, AccessShareLock);
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	scan = table_beginscan(dests, snapshot, 0, NULL);
	while ((tuple = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Datum		id = heap_getattr(tuple, Anum_destinations_id,
									  RelationGetDescr(dests), &isnull);
		Datum		topics = heap_getattr(tuple, Anum_destinations_topics,
										  RelationGetDescr(dests), &isnull);

		if (isnull || !outbox_topic_matches(topics, topic))
			continue;
		values[Anum_deliveries_destination_id - 1] = id;
		writer_insert(&w, values, nulls);
		n++;
	}
	table_endscan(scan);
	UnregisterSnapshot(snapshot);
	table_close(dests, AccessShareLock);
	writer_close(&w);
	return n;
}

PG_FUNCTION_INFO_V1(idem_publish);
PG_FUNCTION_INFO_V1(idem_outbox_event);

/*
 * idem_publish(topic, payload, key, headers) returns uuid: write an event in
 * the caller's transaction and return its id.
 */
Datum
idem_publish(PG_FUNCTION_ARGS)
{
	text	   *topic;
	Jsonb	   *payload;
	text	   *key = NULL;
	Jsonb	   *headers = NULL;
	Size		size;
	pg_uuid_t  *event_id;
	int64		seq;
	TimestampTz now;
	OutboxWriter w;
	Datum		values[Natts_outbox];
	bool		nulls[Natts_outbox];

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("topic must not be null")));
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("payload must not be null"),
				 errhint("Pass 'null'::jsonb or '{}' for an event without a payload.")));
	topic = PG_GETARG_TEXT_PP(0);
	outbox_check_name(topic, "topic");
	payload = PG_GETARG_JSONB_P(1);
	if (!PG_ARGISNULL(2))
	{
		key = PG_GETARG_TEXT_PP(2);
		outbox_check_name(key, "event key");
	}
	if (!PG_ARGISNULL(3))
	{
		headers = PG_GETARG_JSONB_P(3);
		outbox_check_headers(headers, "event headers");
	}
	/* On Citus: the event commits with what this transaction wrote on workers. */
	shard_commit_with_2pc();
	size = VARSIZE(payload) + (headers != NULL ? VARSIZE(headers) : 0);
	if (size > (Size) outbox_max_event_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("event is too large to publish"),
				 errdetail("Payload and headers take %zu bytes; idempotency.max_event_bytes is %d.",
						   size, outbox_max_event_bytes)));

	PreventCommandIfReadOnly("idem_publish()");
	if (!idem_relcache_resolve(&publish_rels))
		(void) outbox_relid("outbox_seq");	/* says which, and why */

	/* The key's lock first, then the seq: same-key events commit in seq order. */
	if (key != NULL)
		outbox_key_lock_bounded(key);
	seq = nextval_internal(PUBLISH_SEQ, false);
	now = GetCurrentTimestamp();
	event_id = palloc(sizeof(pg_uuid_t));
	outbox_uuid_v7(event_id, now);

	memset(nulls, false, sizeof(nulls));
	values[Anum_outbox_event_id - 1] = UUIDPGetDatum(event_id);
	values[Anum_outbox_seq - 1] = Int64GetDatum(seq);
	values[Anum_outbox_topic - 1] = PointerGetDatum(topic);
	values[Anum_outbox_key - 1] = PointerGetDatum(key);
	nulls[Anum_outbox_key - 1] = (key == NULL);
	values[Anum_outbox_payload - 1] = JsonbPGetDatum(payload);
	values[Anum_outbox_headers - 1] = JsonbPGetDatum(headers);
	nulls[Anum_outbox_headers - 1] = (headers == NULL);
	values[Anum_outbox_published_at - 1] = TimestampTzGetDatum(now);

	writer_open(&w, PUBLISH_OUTBOX);
	writer_insert(&w, values, nulls);
	writer_close(&w);

	if (outbox_fan_out(event_id, seq, topic, key, now) > 0)
	{
		int			level = GetCurrentTransactionNestLevel();

		if (published_level == 0 || level < published_level)
			published_level = level;
		outbox_wake_at_commit();
	}

	/* Later statements of this transaction see the event. */
	CommandCounterIncrement();

	PG_RETURN_UUID_P(event_id);
}

/*
 * idem_outbox_event(event_id) returns jsonb: the envelope of an event, as
 * function destinations receive it; NULL if there is no such event (or it
 * was removed after its retention).  How a NOTIFY consumer reads back an
 * event that was too large to send.
 */
Datum
idem_outbox_event(PG_FUNCTION_ARGS)
{
	static SPIPlanPtr plan = NULL;
	OutboxOwnerState owner;
	Datum		arg;
	Datum		result = (Datum) 0;
	bool		isnull = true;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("event_id must not be null")));
	arg = PG_GETARG_DATUM(0);

	outbox_become_owner(&owner);
	SPI_connect();
	if (plan == NULL)
	{
		Oid			argtypes[1] = {UUIDOID};

		plan = SPI_prepare("SELECT jsonb_build_object('id', event_id, 'topic', topic, 'key', key,"
						   " 'payload', payload, 'headers', headers, 'published_at', published_at)"
						   "  FROM idempotency.outbox WHERE event_id = $1",
						   1, argtypes);
		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
	}
	if (SPI_execute_plan(plan, &arg, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "SPI_execute_plan failed");
	if (SPI_processed == 1)
	{
		result = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
		if (!isnull)
			result = SPI_datumTransfer(result, false, -1);
	}
	SPI_finish();
	outbox_restore_user(&owner);

	if (isnull)
		PG_RETURN_NULL();
	PG_RETURN_DATUM(result);
}
