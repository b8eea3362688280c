/*-------------------------------------------------------------------------
 *
 * phases.c
 *	  Multi-phase operations: leases, fencing tokens, recovery points,
 *	  downstream keys and the resolution of stuck operations.
 *
 * An effect outside the database (a payment gateway, an SMS) cannot share a
 * transaction with the claim.  A multi-phase claim (idem_claim with a lease)
 * therefore commits on its own as a 'processing' record, and the operation
 * proceeds in phases, each a transaction that commits a recovery point.  If
 * the owner stops renewing its lease, the next claim takes the operation
 * over with the next token and resumes from the last recovery point.
 *
 * Every call that carries a token holds the key's advisory lock until its
 * transaction ends and checks the token against the record's: an owner that
 * was taken over (or whose operation an operator resolved) is fenced with
 * SQLSTATE IK001, and its transaction, with whatever it wrote, rolls back:
 * it cannot commit even if the caller catches the error (claims.c,
 * claims_note_fenced).
 * While an owner's phase transaction holds the lock, nobody can take over.
 *
 * A token call by a role that may not use the record (records.c,
 * idem_role_may_use) fails with 42501 before its token is looked at, so a
 * guessed token reveals and changes nothing.  Tokens come from a
 * database-wide sequence, so no token of a key is ever handed out twice,
 * across expiry and cleanup too.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

#include "claims.h"
#include "compat.h"
#include "fingerprint.h"
#include "outbox.h"
#include "records.h"
#include "stats.h"

/* Longest recovery point and operator's note, in bytes. */
#define IDEM_MAX_RECOVERY_POINT_LEN	1024
#define IDEM_MAX_NOTE_LEN			4096

/*
 * The record of (scope, key) as it stands now, expired or not.  The caller
 * holds the key's lock, so no change is in flight and SnapshotSelf shows
 * the latest state.
 */
static bool
phase_lookup_any(Relation rel, text *scope, text *key, IdemRecord *rec)
{
	Relation	pkey = records_open_pkey(rel);
	bool		found = records_lookup(rel, pkey, SnapshotSelf, scope, key, rec);

	index_close(pkey, NoLock);
	return found;
}

/* The live record of (scope, key): a completed one that expired is none. */
static bool
phase_lookup(Relation rel, text *scope, text *key, IdemRecord *rec)
{
	return phase_lookup_any(rel, scope, key, rec) &&
		(!rec->completed || rec->expires_at > GetCurrentTimestamp());
}

/* A text argument of at most max_len bytes (22023 otherwise), or NULL. */
static text *
phase_text_arg(FunctionCallInfo fcinfo, int argno, const char *name, int max_len)
{
	text	   *value;

	if (PG_ARGISNULL(argno))
		return NULL;
	value = PG_GETARG_TEXT_PP(argno);
	if (VARSIZE_ANY_EXHDR(value) > max_len)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is too long", name),
				 errdetail("A %s has at most %d bytes; this one has %d.",
						   name, max_len, (int) VARSIZE_ANY_EXHDR(value))));
	return value;
}

/* The unknown-operation error. */
static void
report_unknown(text *scope, text *key, const char *caller)
{
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("%s: no operation with idempotency key \"%s\" in scope \"%s\"",
					caller, text_to_cstring(key), text_to_cstring(scope)),
			 errhint("Claim it with idem_claim() and a lease first.")));
}

/* A token argument, which must not be NULL. */
static int64
phase_token_arg(FunctionCallInfo fcinfo, int argno)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("token must not be null"),
				 errhint("Pass the token idem_claim() returned.")));
	return PG_GETARG_INT64(argno);
}

/*
 * Open idempotency.records for a token call or an operator's resolution, and
 * hold the key's lock until the end of the transaction.  The table stays
 * locked as long (the caller closes it with NoLock).
 */
static Relation
phase_open(text *scope, text *key, const char *caller)
{
	Relation	rel = records_open(scope, RowExclusiveLock);

	claim_lock_hold(scope, key, caller);
	return rel;
}

/*
 * Lock the key and return its 'processing' record, checking that the current
 * role may use it and that token is still the current one: the fencing check
 * of every token-carrying call.  Returns idempotency.records, open.
 */
static Relation
phase_fetch(text *scope, text *key, int64 token, IdemRecord *rec,
			const char *caller)
{
	Relation	rel = phase_open(scope, key, caller);

	/*
	 * A token names an operation that once was: without its record (expired
	 * and removed, or never there) the caller cannot be its owner, and must
	 * no more commit than an owner that was taken over.  An expired record
	 * is still looked at, as if it had not expired.
	 */
	if (!phase_lookup_any(rel, scope, key, rec))
	{
		idem_stats_count(IDEM_STAT_FENCED);
		claims_note_fenced(scope, key);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FENCED),
				 errmsg("%s: idempotency key \"%s\" in scope \"%s\" has no operation that token " INT64_FORMAT " could belong to",
						caller, text_to_cstring(key), text_to_cstring(scope), token),
				 errdetail("Its record has expired and was removed, or it never existed: the operation is over."),
				 errhint("Stop working on it: nothing this transaction wrote will take effect.")));
	}
	if (!idem_role_may_use(rec->owner))
		records_deny(scope, key);
	if (rec->token != token)
	{
		idem_stats_count(IDEM_STAT_FENCED);
		claims_note_fenced(scope, key);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FENCED),
				 errmsg("%s: token " INT64_FORMAT " of idempotency key \"%s\" in scope \"%s\" is no longer current",
						caller, token, text_to_cstring(key), text_to_cstring(scope)),
				 errdetail("The operation was taken over; its current token is " INT64_FORMAT ".",
						   rec->token),
				 errhint("Stop working on it: its new owner carries on, and nothing this transaction wrote will take effect.")));
	}
	if (rec->completed)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s: the operation with idempotency key \"%s\" in scope \"%s\" is already completed",
						caller, text_to_cstring(key), text_to_cstring(scope))));
	return rel;
}

/* Write back a record changed under the key's lock; closes rel (its lock stays). */
static void
phase_store(Relation rel, text *scope, text *key, const IdemRecord *rec)
{
	records_update(rel, scope, key, rec);
	table_close(rel, NoLock);
}

/*
 * Complete a 'processing' record with its response.  Its ttl counts from
 * completion, so an operation that ran long still replays for the full ttl.
 */
static void
phase_complete(IdemRecord *rec, int32 status, Jsonb *body, Jsonb *headers)
{
	TimestampTz now = GetCurrentTimestamp();

	claim_check_response(status, body, headers);
	rec->expires_at = idem_timestamp_add(now, rec->expires_at - rec->created_at,
										 "expiry time");
	rec->completed = true;
	rec->has_status = true;
	rec->status = status;
	rec->body = body;
	rec->headers = headers;
	rec->has_completed_at = true;
	rec->completed_at = now;
}

/* idem_succeed(scope, key, status, body, headers, token): complete a multi-phase operation. */
void
phase_succeed(FunctionCallInfo fcinfo, text *scope, text *key)
{
	IdemRecord	rec;
	Relation	rel;

	rel = phase_fetch(scope, key, phase_token_arg(fcinfo, 5), &rec, "idem_succeed");
	phase_complete(&rec, PG_GETARG_INT32(2),
				   PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3),
				   PG_ARGISNULL(4) ? NULL : PG_GETARG_JSONB_P(4));
	phase_store(rel, scope, key, &rec);
}

PG_FUNCTION_INFO_V1(idem_release_token);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_downstream_key);
PG_FUNCTION_INFO_V1(idem_resolve_complete);
PG_FUNCTION_INFO_V1(idem_resolve_release);

/*
 * idem_release(scope, key, token): give a multi-phase operation up.  The lease
 * ends now, so the next claim takes it over at once and resumes from the last
 * recovery point: phases already committed are not repeated.
 */
Datum
idem_release_token(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	IdemRecord	rec;
	Relation	rel;

	claim_scope_key_args(fcinfo, &scope, &key);
	rel = phase_fetch(scope, key, phase_token_arg(fcinfo, 2), &rec, "idem_release");
	rec.lease_expires_at = GetCurrentTimestamp();
	phase_store(rel, scope, key, &rec);
	idem_stats_count(IDEM_STAT_RELEASES);
	PG_RETURN_VOID();
}

/* idem_checkpoint(scope, key, token, recovery_point): commit a phase's progress with it. */
Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	int64		token;
	text	   *recovery_point;
	IdemRecord	rec;
	Relation	rel;

	claim_scope_key_args(fcinfo, &scope, &key);
	token = phase_token_arg(fcinfo, 2);
	if (PG_ARGISNULL(3))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("recovery_point must not be null")));
	recovery_point = phase_text_arg(fcinfo, 3, "recovery point",
									IDEM_MAX_RECOVERY_POINT_LEN);
	rel = phase_fetch(scope, key, token, &rec, "idem_checkpoint");
	rec.recovery_point = recovery_point;
	phase_store(rel, scope, key, &rec);
	PG_RETURN_VOID();
}

/* idem_extend(scope, key, token, lease): a heartbeat; returns the new end of the lease. */
Datum
idem_extend(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	int64		token;
	IdemRecord	rec;
	Relation	rel;
	TimestampTz lease_expires_at;

	claim_scope_key_args(fcinfo, &scope, &key);
	token = phase_token_arg(fcinfo, 2);
	if (PG_ARGISNULL(3))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("lease must not be null")));
	/* Validate first; the lease starts once the key is ours, after any wait. */
	(void) claim_interval_end(fcinfo, 3, GetCurrentTimestamp(), "lease");
	rel = phase_fetch(scope, key, token, &rec, "idem_extend");
	lease_expires_at = claim_interval_end(fcinfo, 3, GetCurrentTimestamp(), "lease");
	rec.lease_expires_at = lease_expires_at;
	phase_store(rel, scope, key, &rec);
	PG_RETURN_TIMESTAMPTZ(lease_expires_at);
}

/*
 * idem_downstream_key(scope, key, label): the idempotency key to send to an
 * external provider for one step of an operation.  The same for every owner
 * and every retry, so a takeover that repeats the step reuses the provider's
 * own deduplication.  A UUID (version 8) made of SHA-256 over the three
 * values, so that any provider accepts it.
 */
Datum
idem_downstream_key(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	text	   *label;
	StringInfoData buf;
	uint8		hash[IDEM_SHA256_LEN];
	char		out[37];
	int			pos = 0;

	claim_scope_key_args(fcinfo, &scope, &key);
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("label must not be null")));
	label = PG_GETARG_TEXT_PP(2);
	if (VARSIZE_ANY_EXHDR(label) == 0 || VARSIZE_ANY_EXHDR(label) > IDEM_MAX_KEY_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("label must have 1 to %d bytes", IDEM_MAX_KEY_LEN)));

	/* NUL separators keep ("a", "bc") and ("ab", "c") apart. */
	initStringInfo(&buf);
	appendStringInfoString(&buf, "idempotency downstream key v1");
	appendStringInfoChar(&buf, '\0');
	appendBinaryStringInfo(&buf, VARDATA_ANY(scope), VARSIZE_ANY_EXHDR(scope));
	appendStringInfoChar(&buf, '\0');
	appendBinaryStringInfo(&buf, VARDATA_ANY(key), VARSIZE_ANY_EXHDR(key));
	appendStringInfoChar(&buf, '\0');
	appendBinaryStringInfo(&buf, VARDATA_ANY(label), VARSIZE_ANY_EXHDR(label));
	idem_sha256(buf.data, buf.len, hash);

	hash[6] = (hash[6] & 0x0F) | 0x80;	/* version 8 */
	hash[8] = (hash[8] & 0x3F) | 0x80;	/* RFC 9562 variant */
	for (int i = 0; i < 16; i++)
	{
		if (i == 4 || i == 6 || i == 8 || i == 10)
			out[pos++] = '-';
		pos += snprintf(out + pos, sizeof(out) - pos, "%02x", hash[i]);
	}
	PG_RETURN_TEXT_P(cstring_to_text_with_len(out, pos));
}

/*
 * Lock a stuck operation for an operator: it must be 'processing' with an
 * expired lease.  Returns its record and idempotency.records, open; the
 * caller moves the token on, which fences the old owner.  Operators act on
 * every role's operations: EXECUTE on these functions is their privilege.
 */
static Relation
resolve_fetch(FunctionCallInfo fcinfo, text **scope, text **key,
			  IdemRecord *rec, const char *caller)
{
	Relation	rel;

	claim_scope_key_args(fcinfo, scope, key);
	rel = phase_open(*scope, *key, caller);
	if (!phase_lookup(rel, *scope, *key, rec))
		report_unknown(*scope, *key, caller);
	if (rec->completed)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s: the operation with idempotency key \"%s\" in scope \"%s\" is already completed",
						caller, text_to_cstring(*key), text_to_cstring(*scope))));
	if (rec->has_lease && rec->lease_expires_at > GetCurrentTimestamp())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s: the operation with idempotency key \"%s\" in scope \"%s\" still has a live lease",
						caller, text_to_cstring(*key), text_to_cstring(*scope)),
				 errdetail("Its owner may still be at work."),
				 errhint("Resolve it once its lease has expired (see idem_stuck).")));
	return rel;
}

/*
 * idem_resolve_complete(scope, key, status, body, headers, note): an operator
 * stores the final response found by reconciliation with the provider.
 * Returns the new token.
 */
Datum
idem_resolve_complete(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	IdemRecord	rec;
	int64		token_before;
	text	   *note;
	Relation	rel;

	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status must not be null")));
	note = phase_text_arg(fcinfo, 5, "note", IDEM_MAX_NOTE_LEN);
	rel = resolve_fetch(fcinfo, &scope, &key, &rec, "idem_resolve_complete");
	token_before = rec.token;
	rec.token = records_next_token(rec.token);
	phase_complete(&rec, PG_GETARG_INT32(2),
				   PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3),
				   PG_ARGISNULL(4) ? NULL : PG_GETARG_JSONB_P(4));
	phase_store(rel, scope, key, &rec);
	records_audit("complete", scope, key, token_before, rec.token, &rec, note);
	PG_RETURN_INT64(rec.token);
}

/*
 * idem_resolve_release(scope, key, note): an operator releases a stuck
 * operation so that the next retry takes it over from its recovery point.
 * Returns the new token.
 */
Datum
idem_resolve_release(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	IdemRecord	rec;
	int64		token_before;
	text	   *note;
	Relation	rel;

	note = phase_text_arg(fcinfo, 2, "note", IDEM_MAX_NOTE_LEN);
	rel = resolve_fetch(fcinfo, &scope, &key, &rec, "idem_resolve_release");
	token_before = rec.token;
	rec.token = records_next_token(rec.token);
	rec.has_lease = true;
	rec.lease_expires_at = GetCurrentTimestamp();
	phase_store(rel, scope, key, &rec);
	records_audit("release", scope, key, token_before, rec.token, &rec, note);
	PG_RETURN_INT64(rec.token);
}

PG_FUNCTION_INFO_V1(idem_stuck_records);

/*
 * idempotency.stuck_records(): the rows of the idem_stuck view, for a role
 * that may read the view, read as the extension's owner.  On a Citus
 * coordinator the records are shards on the workers, which Citus reads over
 * connections of the current role: a monitoring role granted only the view
 * has no access to the extension's schema there.  The role checked is the
 * one the query runs as, so a view of the DBA's over idem_stuck answers
 * only roles that may read idem_stuck themselves; a role granted some of
 * the view's columns gets the others null, should it call the function
 * itself.
 */
Datum
idem_stuck_records(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			view = get_relname_relid("idem_stuck",
										 get_extension_schema(get_extension_oid("idempotency", false)));
	OutboxOwnerState owner;
	bool		all_columns;
	bool	   *granted;
	Datum	   *values;
	bool	   *nulls;
	int			natts;

	/* SELECT on the view, or on some of its columns, as for reading the view. */
	all_columns = OidIsValid(view) &&
		pg_class_aclcheck(view, GetUserId(), ACL_SELECT) == ACLCHECK_OK;
	if (!OidIsValid(view) ||
		(!all_columns &&
		 pg_attribute_aclcheck_all(view, GetUserId(), ACL_SELECT, ACLMASK_ANY) != ACLCHECK_OK))
		aclcheck_error(ACLCHECK_NO_PRIV, OBJECT_VIEW, "idem_stuck");
	InitMaterializedSRF(fcinfo, 0);

	/* The view's columns are the function's, in the same order. */
	natts = rsinfo->setDesc->natts;
	granted = palloc(natts * sizeof(bool));
	values = palloc(natts * sizeof(Datum));
	nulls = palloc(natts * sizeof(bool));
	for (int i = 0; i < natts; i++)
		granted[i] = all_columns ||
			pg_attribute_aclcheck(view, i + 1, GetUserId(), ACL_SELECT) == ACLCHECK_OK;

	/*
	 * The horizon is computed once, in a subquery: on a Citus coordinator it
	 * runs there, with the session's idempotency.stuck_after (the setting
	 * does not travel to the workers), and the shards are filtered by its
	 * result.
	 */
	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT scope, key, token, recovery_point,"
					"       now() - coalesce(claimed_at, created_at), now() - lease_expires_at,"
					"       lease_expires_at, created_at, owner"
					"  FROM idempotency.records"
					" WHERE state = 'processing'"
					"   AND lease_expires_at < (SELECT now() - coalesce(current_setting("
					"           'idempotency.stuck_after', true), '5min')::interval)",
					true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the stuck operations");
	if (SPI_tuptable->tupdesc->natts != natts)
		elog(ERROR, "stuck_records has %d columns, not %d", natts, SPI_tuptable->tupdesc->natts);
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		heap_deform_tuple(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, values, nulls);
		for (int j = 0; j < natts; j++)
			nulls[j] |= !granted[j];
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	SPI_finish();
	outbox_restore_user(&owner);
	return (Datum) 0;
}
