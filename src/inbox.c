/*-------------------------------------------------------------------------
 *
 * inbox.c
 *	  idem_inbox_accept: take each incoming message into effect once.
 *
 * A consumer calls idem_inbox_accept(source, message_id) in the transaction
 * that applies the message.  The first call inserts a mark into
 * idempotency.inbox and returns true; the mark commits or rolls back with the
 * consumer's own writes, so "applied" and "marked" cannot disagree.  A
 * redelivery finds the committed mark and gets false.
 *
 * Concurrent deliveries resolve like claims (claims.c): a live mark visible
 * to the statement answers false at once, without a lock or a write;
 * otherwise the caller takes an exclusive advisory lock on a hash of (source,
 * message_id), held until its transaction ends, and looks again with a fresh
 * snapshot.  So a second delivery waits for the first consumer's transaction
 * and gets false if it committed, true if it rolled back.  Under REPEATABLE
 * READ and SERIALIZABLE a mark committed after the snapshot was taken is a
 * serialization failure, since the consumer's snapshot does not show the
 * first delivery's effects.  An expired mark behaves as if it were gone.
 *
 * Like the claim path, this uses direct heap and index access, so a caller
 * needs no privilege on the table.  A mark remembers the role that accepted
 * it: another role that meets a live mark gets 42501, so that it can neither
 * learn which messages a consumer took nor make the consumer skip one by
 * accepting it first.  The table lock is kept until the transaction ends,
 * so that a rewrite cannot move the expired mark this deletes by TID.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

#include "claims.h"
#include "inbox.h"
#include "lockhash.h"
#include "records.h"
#include "shards.h"
#include "stats.h"

#define INBOX_TABLE		"inbox"
#define INBOX_PKEY		"inbox_pkey"

/* idempotency.inbox and its primary key (records.h: IdemRelCache). */
static IdemRelCache inbox_rels = IDEM_RELCACHE(INBOX_TABLE, INBOX_PKEY);

/* Register the cached OIDs of idempotency.inbox; called once from _PG_init. */
void
InboxInit(void)
{
	idem_relcache_register(&inbox_rels);
}

/*
 * Open the relation that holds the marks of source: idempotency.inbox, or,
 * when Citus distributes it, its local shard for source (shards.c).  A clear
 * error if the installed version lacks it or has other columns.  The caller
 * keeps the lock (closes with NoLock).
 */
static Relation
inbox_open(text *source, LOCKMODE lockmode)
{
	Relation	rel;
	ShardTarget target;

	if (!idem_relcache_resolve(&inbox_rels))
		idem_report_missing(INBOX_TABLE);
	shard_resolve(inbox_rels.oids[0], inbox_rels.oids[1], source, &target);
	rel = table_open(target.relid, lockmode);
	records_check_columns(rel, Natts_inbox);
	return rel;
}

/*
 * The advisory lock tag of (source, message_id) in this database (lockhash.c),
 * to be computed once idempotency.inbox is open.
 */
void
inbox_locktag(LOCKTAG *tag, text *source, text *message_id)
{
	idem_lock_tag(tag, IDEM_INBOX_LOCK_CLASS, source, message_id);
}

/* What a lookup found: where the mark is, when it expires, whose it is. */
typedef struct InboxMark
{
	ItemPointerData tid;
	TimestampTz expires_at;
	Oid			owner;			/* the role that accepted it, or InvalidOid */
	bool		mine;			/* inserted by this transaction */
} InboxMark;

/* Find the mark of (source, message_id) visible to snapshot; false if there is none. */
static bool
inbox_lookup(Relation rel, Snapshot snapshot, text *source, text *message_id,
			 InboxMark *mark)
{
	ScanKeyData skey[2];
	SysScanDesc scan;
	HeapTuple	tuple;
	bool		found = false;

	/* The key columns are COLLATE "C", as are ScanKeyInit's scan keys. */
	ScanKeyInit(&skey[0], Anum_inbox_source, BTEqualStrategyNumber,
				F_TEXTEQ, PointerGetDatum(source));
	ScanKeyInit(&skey[1], Anum_inbox_message_id, BTEqualStrategyNumber,
				F_TEXTEQ, PointerGetDatum(message_id));

	scan = systable_beginscan(rel, shard_pkey_of(rel, inbox_rels.oids[1]), true, snapshot, 2, skey);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		bool		isnull;

		mark->tid = tuple->t_self;
		mark->expires_at = DatumGetTimestampTz(heap_getattr(tuple, Anum_inbox_expires_at,
															RelationGetDescr(rel), &isnull));
		mark->owner = DatumGetObjectId(heap_getattr(tuple, Anum_inbox_owner,
													RelationGetDescr(rel), &isnull));
		if (isnull)
			mark->owner = InvalidOid;
		mark->mine = TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(tuple->t_data));
		found = true;
	}
	systable_endscan(scan);
	return found;
}

/* Insert a mark; the caller holds its advisory lock, the primary key stays the last line of defence. */
static void
inbox_insert(Relation rel, text *source, text *message_id,
			 TimestampTz accepted_at, TimestampTz expires_at)
{
	Datum		values[Natts_inbox + 1];
	bool		nulls[Natts_inbox + 1];
	HeapTuple	tuple;

	memset(nulls, false, sizeof(nulls));
	values[Anum_inbox_source - 1] = PointerGetDatum(source);
	values[Anum_inbox_message_id - 1] = PointerGetDatum(message_id);
	values[Anum_inbox_accepted_at - 1] = TimestampTzGetDatum(accepted_at);
	values[Anum_inbox_expires_at - 1] = TimestampTzGetDatum(expires_at);
	values[Anum_inbox_owner - 1] = ObjectIdGetDatum(GetUserId());
	/* A shard of a table distributed by tenant: the source as a tenant value. */
	if (RelationGetDescr(rel)->natts > Natts_inbox)
		values[Natts_inbox] = shard_tenant_value(rel, Natts_inbox, source);

	tuple = heap_form_tuple(RelationGetDescr(rel), values, nulls);
	simple_heap_insert(rel, tuple);
	records_index_insert(rel, tuple, false);
	heap_freetuple(tuple);

	/* Make the mark visible to the rest of this transaction. */
	CommandCounterIncrement();
}

/*
 * Validate source and message id: both non-empty, at most 255 bytes and
 * without control characters (error messages and the server log quote them);
 * the message id is often a UUID or a number, but any other printable text,
 * non-ASCII included, is accepted.
 */
static void
inbox_check_args(text *source, text *message_id)
{
	int			source_len = VARSIZE_ANY_EXHDR(source);
	int			id_len = VARSIZE_ANY_EXHDR(message_id);
	const unsigned char *id = (const unsigned char *) VARDATA_ANY(message_id);
	const unsigned char *src = (const unsigned char *) VARDATA_ANY(source);

	if (source_len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("source must not be empty")));
	if (source_len > IDEM_MAX_SOURCE_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("source is too long"),
				 errdetail("A source has at most %d bytes; this one has %d.",
						   IDEM_MAX_SOURCE_LEN, source_len)));
	for (int i = 0; i < source_len; i++)
		if (src[i] < 0x20 || src[i] == 0x7F)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("source must not contain control characters"),
					 errdetail("Byte %d of the source is 0x%02x.", i + 1, src[i])));
	if (id_len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("message id must not be empty")));
	if (id_len > IDEM_MAX_MESSAGE_ID_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("message id is too long"),
				 errdetail("A message id has at most %d bytes; this one has %d.",
						   IDEM_MAX_MESSAGE_ID_LEN, id_len)));
	for (int i = 0; i < id_len; i++)
		if (id[i] < 0x20 || id[i] == 0x7F)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("message id must not contain control characters"),
					 errdetail("Byte %d of the message id is 0x%02x.", i + 1, id[i])));
}

/*
 * The error for a role that meets another role's live mark.  It does not say
 * whether the message was taken, only that it is not this role's to ask.
 */
static void
inbox_deny(text *source, text *message_id)
{
	idem_stats_count(IDEM_STAT_DENIED);
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("permission denied for message \"%s\" from source \"%s\"",
					text_to_cstring(message_id), text_to_cstring(source)),
			 errdetail("The message's inbox mark belongs to a role whose privileges the current role does not have."),
			 errhint("Give each consuming role sources of its own, or let the consumers use one common role.")));
}

PG_FUNCTION_INFO_V1(idem_inbox_accept);

/*
 * idem_inbox_accept(source, message_id, ttl): true the first time the message
 * is seen, false for a duplicate.  See the file header for the protocol.
 */
Datum
idem_inbox_accept(PG_FUNCTION_ARGS)
{
	text	   *source = claim_arg_text(fcinfo, 0, "source");
	text	   *message_id = claim_arg_text(fcinfo, 1, "message_id");
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz expires_at;
	Relation	rel;
	InboxMark	mark;
	LOCKTAG		tag;
	LockAcquireResult res;
	Snapshot	snapshot;
	bool		found;

	inbox_check_args(source, message_id);
	expires_at = claim_expiry(fcinfo, 2, now);

	rel = inbox_open(source, AccessShareLock);

	/* A live mark visible to this statement: a duplicate, no lock, no write. */
	if (inbox_lookup(rel, GetActiveSnapshot(), source, message_id, &mark) &&
		mark.expires_at > now)
	{
		if (!idem_role_may_use(mark.owner))
			inbox_deny(source, message_id);
		table_close(rel, NoLock);
		idem_stats_count(IDEM_STAT_INBOX_DUPLICATES);
		PG_RETURN_BOOL(false);
	}

	PreventCommandIfReadOnly("idem_inbox_accept()");

	/* Wait for a concurrent delivery's transaction, then look again. */
	inbox_locktag(&tag, source, message_id);
	res = LockAcquire(&tag, ExclusiveLock, false, false);

	snapshot = RegisterSnapshot(GetLatestSnapshot());
	found = inbox_lookup(rel, snapshot, source, message_id, &mark);
	UnregisterSnapshot(snapshot);
	table_close(rel, NoLock);

	if (found && mark.expires_at > now)
	{
		if (!idem_role_may_use(mark.owner))
			inbox_deny(source, message_id);
		/* Our own mark (from earlier in this statement) is no conflict. */
		if (IsolationUsesXactSnapshot() && !mark.mine)
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to a concurrent delivery of message \"%s\" from source \"%s\"",
							text_to_cstring(message_id), text_to_cstring(source)),
					 errdetail("Another transaction accepted the message after this transaction's snapshot was taken."),
					 errhint("The transaction might succeed if retried.")));
		/* A duplicate needs no lock: let the next delivery in at once. */
		if (res == LOCKACQUIRE_OK)
			LockRelease(&tag, ExclusiveLock, false);
		idem_stats_count(IDEM_STAT_INBOX_DUPLICATES);
		PG_RETURN_BOOL(false);
	}

	rel = inbox_open(source, RowExclusiveLock);
	if (found)
	{
		/* An expired mark behaves as if it were gone: remove it for ours. */
		records_delete_expired(rel, &mark.tid, Anum_inbox_source, source, message_id);
	}
	inbox_insert(rel, source, message_id, now, expires_at);
	table_close(rel, NoLock);

	idem_stats_count(IDEM_STAT_INBOX_ACCEPTED);
	PG_RETURN_BOOL(true);
}
