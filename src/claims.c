/*-------------------------------------------------------------------------
 *
 * claims.c
 *	  Claiming an idempotency key, storing its response, replaying it.
 *
 * A claim is not a row.  It is an exclusive advisory lock on a hash of
 * (scope, key), held until the claiming transaction ends, plus an entry in
 * this backend's list of pending claims.  idem_succeed then writes the one
 * and only row of the operation, with its response, in the caller's
 * transaction.  So a create writes a single tuple, a replay is a read-only
 * index lookup, and a claim can never be committed without its response: the
 * pre-commit callback refuses to commit while a claim is unfinished.
 *
 * Every claim first tries the key's lock without waiting.  If it is free,
 * one lookup decides: nobody can be changing the record, so the latest
 * committed state is the truth; a replay then gives the lock back at once.
 * If another transaction holds the key, a record visible to the statement's
 * snapshot that answers (a replay, a mismatch, a live lease) answers without
 * waiting; otherwise the claim waits up to idempotency.wait_timeout for the
 * holder's transaction to end and looks again: it replays the winner's
 * response, or claims the key itself if the winner rolled back.  Under
 * REPEATABLE READ and SERIALIZABLE a record the transaction's snapshot
 * cannot see must not decide the outcome, so that case is a serialization
 * failure.  On a hot standby no lock is taken: replays work, claims do not.
 *
 * Time is the clock's (GetCurrentTimestamp), not the statement's start: a
 * claim made late in a long procedure must not create a record that has
 * already expired.  A record's ttl counts from when its response is stored.
 *
 * A record remembers the role that claimed it.  Another role that meets a
 * live record of the key -- to replay it, to be told it mismatches or is in
 * progress, or to take it over -- gets 42501 and learns nothing else.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>
#include <math.h>

#include "access/genam.h"
#include "access/table.h"
#include "access/xlog.h"
#include "access/xact.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/snapmgr.h"

#include "claims.h"
#include "compat.h"
#include "fingerprint.h"
#include "lockhash.h"
#include "stats.h"

int			idem_wait_timeout = 5000;
int			idem_default_ttl = 86400;
int			idem_max_response_bytes = 1024 * 1024;
int			idem_stuck_after = 300;
bool		idem_store_server_errors = false;

typedef enum ClaimState
{
	CLAIM_HELD,					/* claimed, response not stored yet */
	CLAIM_SUCCEEDED,			/* response stored */
	CLAIM_RELEASED				/* given up */
} ClaimState;

/*
 * One change of a claim's state in this transaction.  The list is a log,
 * appended in order; the last entry of a key is its current state.  A
 * subtransaction's entries are always the tail of the log, so rolling one back
 * truncates the log and restores the states it changed.
 */
typedef struct ClaimEntry
{
	text	   *scope;
	text	   *key;
	bytea	   *fingerprint;
	TimestampTz created_at;
	int64		ttl;			/* microseconds, from idem_succeed on */
	Oid			owner;			/* the role that claimed it */
	int64		token;
	ClaimState	state;
	int			nest_level;		/* subtransaction level of the change */
} ClaimEntry;

/* The log lives in TopTransactionContext; these are reset at transaction end. */
static ClaimEntry *claim_log = NULL;
static int	claim_log_len = 0;
static int	claim_log_size = 0;
static int	claims_unfinished = 0;

/*
 * The first key whose token call this transaction was fenced from
 * ("key" in scope "scope"), in TopTransactionContext; NULL if none.
 */
static char *claims_fenced = NULL;

/* Same bytes, for texts and byteas alike. */
static inline bool
varlena_equal(const struct varlena *a, const struct varlena *b)
{
	Size		len = VARSIZE_ANY_EXHDR(a);

	return len == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), len) == 0;
}

/* The current entry of (scope, key) in this transaction, or NULL. */
static ClaimEntry *
claim_log_find(text *scope, text *key)
{
	for (int i = claim_log_len - 1; i >= 0; i--)
	{
		ClaimEntry *e = &claim_log[i];

		if (varlena_equal(e->key, key) && varlena_equal(e->scope, scope))
			return e;
	}
	return NULL;
}

/* Append a state change; the first entry of a key copies its values into TopTransactionContext. */
static void
claim_log_append(const ClaimEntry *entry, ClaimState state)
{
	ClaimEntry	copy = *entry;	/* entry may point into the log we grow */
	MemoryContext oldcontext = MemoryContextSwitchTo(TopTransactionContext);
	ClaimEntry *e;

	if (claim_log_len == claim_log_size)
	{
		claim_log_size = claim_log_size ? claim_log_size * 2 : 8;
		claim_log = claim_log ?
			repalloc(claim_log, claim_log_size * sizeof(ClaimEntry)) :
			palloc(claim_log_size * sizeof(ClaimEntry));
	}
	e = &claim_log[claim_log_len++];
	*e = copy;
	if (state == CLAIM_HELD)
	{
		e->scope = (text *) PG_DETOAST_DATUM_COPY(PointerGetDatum(copy.scope));
		e->key = (text *) PG_DETOAST_DATUM_COPY(PointerGetDatum(copy.key));
		e->fingerprint = (bytea *) PG_DETOAST_DATUM_COPY(PointerGetDatum(copy.fingerprint));
		claims_unfinished++;
	}
	else
		claims_unfinished--;
	e->state = state;
	e->nest_level = GetCurrentTransactionNestLevel();
	MemoryContextSwitchTo(oldcontext);
}

/* Recount unfinished claims after the log was truncated. */
static void
claim_log_recount(void)
{
	claims_unfinished = 0;
	for (int i = 0; i < claim_log_len; i++)
		claims_unfinished += (claim_log[i].state == CLAIM_HELD) ? 1 : -1;
}

/*
 * Whether this transaction holds a claim that has neither a response nor a
 * release: the relay asks after a destination function returns, since the
 * commit guard would otherwise fail the relay's own transaction.
 */
bool
claims_pending(void)
{
	return claims_unfinished > 0;
}

/* Refuse to commit or prepare while a claim has neither a response nor a release. */
static void
claims_check_finished(void)
{
	for (int i = 0; i < claim_log_len && claims_unfinished > 0; i++)
	{
		ClaimEntry *e = &claim_log[i];

		if (e->state == CLAIM_HELD && claim_log_find(e->scope, e->key) == e)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_TRANSACTION_STATE),
					 errmsg("transaction holds an unfinished idempotency claim"),
					 errdetail("Key \"%s\" in scope \"%s\" was claimed, but neither idem_succeed nor idem_release was called.",
							   text_to_cstring(e->key), text_to_cstring(e->scope)),
					 errhint("Store the response with idem_succeed(), give the claim up with idem_release(), or roll back.")));
	}
}

/*
 * A token call of this transaction was fenced (its operation was taken over):
 * remember it, so that the transaction cannot commit even if the caller
 * catches the error (a savepoint, an EXCEPTION block).  The fenced owner's
 * writes must never take effect beside the new owner's.
 */
void
claims_note_fenced(text *scope, text *key)
{
	if (claims_fenced == NULL)
		claims_fenced = MemoryContextStrdup(TopTransactionContext,
											psprintf("\"%s\" in scope \"%s\"",
													 text_to_cstring(key),
													 text_to_cstring(scope)));
}

/* Whether a token call of this transaction was fenced (claims_note_fenced). */
bool
claims_fenced_noted(void)
{
	return claims_fenced != NULL;
}

/*
 * Forget the fence: only for a caller that rolled back the subtransaction
 * holding every write since it was not fenced (the relay, after a
 * destination function).
 */
void
claims_forget_fenced(void)
{
	claims_fenced = NULL;
}

/* Refuse to commit or prepare a transaction that a token call was fenced in. */
static void
claims_check_fenced(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_FENCED),
			 errmsg("cannot commit a transaction that was fenced from idempotency key %s",
					claims_fenced),
			 errdetail("A call in this transaction carried a token that is no longer current: the operation was taken over or has ended."),
			 errhint("Roll back: nothing this transaction wrote may take effect, and the operation's new owner carries on.")));
}

/* Transaction callback: guard the commit, forget the log at the end. */
static void
claims_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PARALLEL_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			if (claims_fenced != NULL)
				claims_check_fenced();
			if (claims_unfinished > 0)
				claims_check_finished();
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			claim_log = NULL;
			claim_log_len = claim_log_size = claims_unfinished = 0;
			claims_fenced = NULL;
			break;
	}
}

/* Subtransaction callback: a rolled-back savepoint takes its claims with it. */
static void
claims_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();

	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		int			keep = claim_log_len;

		while (keep > 0 && claim_log[keep - 1].nest_level >= level)
			keep--;
		if (keep != claim_log_len)
		{
			claim_log_len = keep;
			claim_log_recount();
		}
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		for (int i = claim_log_len - 1; i >= 0 && claim_log[i].nest_level >= level; i--)
			claim_log[i].nest_level = level - 1;
	}
}

/* Define the GUCs and register the transaction callbacks; called from _PG_init. */
void
ClaimsInit(void)
{
	DefineCustomIntVariable("idempotency.wait_timeout",
							"How long a duplicate claim waits for the transaction that holds its key.",
							"After this, the duplicate gets 'in_progress'. 0 answers at once.",
							&idem_wait_timeout,
							5000, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.default_ttl",
							"How long a record is kept when idem_claim is given no ttl.",
							"Choose more than the longest time a client keeps retrying.",
							&idem_default_ttl,
							86400, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.max_response_bytes",
							"Largest response idem_succeed stores, body and headers together.",
							NULL,
							&idem_max_response_bytes,
							1024 * 1024, 0, MaxAllocSize,
							PGC_SUSET, GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.stuck_after",
							"How long after its lease expired an untaken multi-phase operation is listed in idem_stuck.",
							NULL,
							&idem_stuck_after,
							300, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomBoolVariable("idempotency.store_server_errors",
							 "Whether idem_execute stores a handler's 5xx response like any other.",
							 "Off: a 5xx is a transient failure; the handler's writes are rolled back, the claim is released and the next retry executes again.",
							 &idem_store_server_errors,
							 false,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);

	RegisterXactCallback(claims_xact_callback, NULL);
	RegisterSubXactCallback(claims_subxact_callback, NULL);
}

/* A text argument that must not be NULL (22004 otherwise). */
text *
claim_arg_text(FunctionCallInfo fcinfo, int argno, const char *name)
{
	Oid			type = get_fn_expr_argtype(fcinfo->flinfo, argno);

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
	/* Called without an expression (from C): the declared type. */
	if (!OidIsValid(type) && fcinfo->flinfo != NULL && OidIsValid(fcinfo->flinfo->fn_oid))
	{
		Oid		   *argtypes;
		int			nargs;

		(void) get_func_signature(fcinfo->flinfo->fn_oid, &argtypes, &nargs);
		if (argno < nargs)
			type = argtypes[argno];
	}
	/*
	 * A scope or source given as a tenant id (bigint, uuid: the overloads
	 * that Citus delegates, see idem_citus_distribute) is its text form.
	 */
	if (OidIsValid(type) && type != TEXTOID)
	{
		Oid			output;
		bool		varlena;

		getTypeOutputInfo(type, &output, &varlena);
		return cstring_to_text(OidOutputFunctionCall(output, PG_GETARG_DATUM(argno)));
	}
	return PG_GETARG_TEXT_PP(argno);
}

/*
 * Validate scope and key: non-empty, bounded, the key printable ASCII, the
 * scope without control characters (error messages and the server log quote
 * it: a newline or an escape sequence in it could forge log lines).
 */
static void
claim_check_scope_key(text *scope, text *key)
{
	int			scope_len = VARSIZE_ANY_EXHDR(scope);
	int			key_len = VARSIZE_ANY_EXHDR(key);
	const unsigned char *k = (const unsigned char *) VARDATA_ANY(key);
	const unsigned char *sc = (const unsigned char *) VARDATA_ANY(scope);

	if (scope_len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope must not be empty")));
	if (scope_len > IDEM_MAX_SCOPE_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope is too long"),
				 errdetail("A scope has at most %d bytes; this one has %d.",
						   IDEM_MAX_SCOPE_LEN, scope_len)));
	for (int i = 0; i < scope_len; i++)
		if (sc[i] < 0x20 || sc[i] == 0x7F)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("scope must not contain control characters"),
					 errdetail("Byte %d of the scope is 0x%02x.", i + 1, sc[i])));
	if (key_len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency key must not be empty")));
	if (key_len > IDEM_MAX_KEY_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency key is too long"),
				 errdetail("A key has at most %d characters; this one has %d.",
						   IDEM_MAX_KEY_LEN, key_len)));
	for (int i = 0; i < key_len; i++)
		if (k[i] < 0x20 || k[i] > 0x7E)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("idempotency key must be printable ASCII"),
					 errdetail("Byte %d of the key is 0x%02x; only 0x20 to 0x7E are allowed.",
							   i + 1, k[i])));
}

/* Arguments 0 and 1 of every SQL function here: scope and key, validated. */
void
claim_scope_key_args(FunctionCallInfo fcinfo, text **scope, text **key)
{
	*scope = claim_arg_text(fcinfo, 0, "scope");
	*key = claim_arg_text(fcinfo, 1, "key");
	claim_check_scope_key(*scope, *key);
}

/* Argument 2, the request, must not be NULL. */
void
claim_check_request(FunctionCallInfo fcinfo)
{
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("request must not be null"),
				 errhint("Pass '{}' for a request without a body.")));
}

/*
 * now + the interval argument argno, which must be positive.  Returns 0 when
 * the argument is NULL or absent (an older SQL declaration without it).
 */
TimestampTz
claim_interval_end(FunctionCallInfo fcinfo, int argno, TimestampTz now,
				   const char *name)
{
	Interval   *span;
	TimestampTz end = 0;

	if (PG_NARGS() <= argno || PG_ARGISNULL(argno))
		return 0;

	/*
	 * An interval that is not positive even counted roughly (a month as 30
	 * days) is refused before it is added: one far enough back (-7000
	 * years) would fail the addition with 22008 instead.
	 */
	span = PG_GETARG_INTERVAL_P(argno);
	if ((double) span->month * DAYS_PER_MONTH * USECS_PER_DAY +
		(double) span->day * USECS_PER_DAY + (double) span->time > 0)
		end = DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
													  TimestampTzGetDatum(now),
													  IntervalPGetDatum(span)));
	if (end <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name),
				 errdetail("The %s given was %s.", name,
						   DatumGetCString(DirectFunctionCall1(interval_out,
															   PG_GETARG_DATUM(argno))))));
	return end;
}

/*
 * The ttl argument argno in microseconds (as long as it lasts from now), or
 * idempotency.default_ttl when it is NULL.
 */
int64
claim_ttl(FunctionCallInfo fcinfo, int argno, TimestampTz now)
{
	TimestampTz expires_at = claim_interval_end(fcinfo, argno, now, "ttl");

	return expires_at != 0 ? expires_at - now :
		(int64) idem_default_ttl * USECS_PER_SEC;
}

/* Expiry time from the ttl argument, or from idempotency.default_ttl when it is NULL. */
TimestampTz
claim_expiry(FunctionCallInfo fcinfo, int argno, TimestampTz now)
{
	return idem_timestamp_add(now, claim_ttl(fcinfo, argno, now), "expiry time");
}

/* Refuse response headers that are not a JSON object (NULL: none). */
void
claim_check_headers(Jsonb *headers)
{
	if (headers != NULL && !(JB_ROOT_IS_OBJECT(headers) && !JB_ROOT_IS_SCALAR(headers)))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers must be a JSON object")));
}

/* Validate a response before it is stored: status range, headers an object, size cap. */
void
claim_check_response(int32 status, Jsonb *body, Jsonb *headers)
{
	Size		size = 0;

	if (status < 100 || status > 599)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status must be between 100 and 599"),
				 errdetail("The status given was %d.", status)));
	claim_check_headers(headers);
	if (body != NULL)
		size += VARSIZE(body);
	if (headers != NULL)
		size += VARSIZE(headers);
	if (size > (Size) idem_max_response_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response is too large to store"),
				 errdetail("Body and headers take %zu bytes; idempotency.max_response_bytes is %d.",
						   size, idem_max_response_bytes)));
}

/*
 * The advisory lock tag of (scope, key) in this database (lockhash.c), to be
 * computed once idempotency.records is open.  The cleanup worker takes the
 * same lock, without waiting, before it deletes an expired record, so it
 * never deletes a record under a claim in flight.
 */
void
claim_locktag(LOCKTAG *tag, text *scope, text *key)
{
	idem_lock_tag(tag, IDEM_LOCK_CLASS, scope, key);
}

/*
 * Wait for the key's lock, at most idempotency.wait_timeout.  The lock
 * manager's own lock_timeout does the timing, so the waiter wakes the moment
 * the holder's transaction ends; its timeout error is caught in an internal
 * subtransaction, as PL/pgSQL catches exceptions.  Any other error (deadlock,
 * cancel) propagates.
 */
static bool
claim_lock_wait(const LOCKTAG *tag)
{
	MemoryContext oldcontext = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	int			saved_lock_timeout = LockTimeout;
	volatile bool acquired = false;

	if (idem_wait_timeout == 0)
		return false;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcontext);

	PG_TRY();
	{
		if (LockTimeout == 0 || LockTimeout > idem_wait_timeout)
			LockTimeout = idem_wait_timeout;
		(void) LockAcquire(tag, ExclusiveLock, false, false);
		LockTimeout = saved_lock_timeout;
		/* Committing the subtransaction hands the lock to our transaction. */
		ReleaseCurrentSubTransaction();
		acquired = true;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		LockTimeout = saved_lock_timeout;
		MemoryContextSwitchTo(oldcontext);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		if (edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			ReThrowError(edata);
		FreeErrorData(edata);
	}
	PG_END_TRY();

	MemoryContextSwitchTo(oldcontext);
	CurrentResourceOwner = oldowner;
	return acquired;
}

/*
 * Take the key's lock if it is free.  *already_held tells whether this
 * transaction held it before, *owner which resource owner holds it now.
 */
static bool
claim_lock_try(const LOCKTAG *tag, bool *already_held, ResourceOwner *owner)
{
	LockAcquireResult res;

	res = LockAcquireExtended(tag, ExclusiveLock, false, true, true, NULL, false);
	*already_held = (res == LOCKACQUIRE_ALREADY_HELD ||
					 res == LOCKACQUIRE_ALREADY_CLEAR);
	*owner = CurrentResourceOwner;
	return res != LOCKACQUIRE_NOT_AVAIL;
}

/*
 * Hold the key's lock until the end of the transaction, as every writer of a
 * record does; waits up to idempotency.wait_timeout, then fails with 55P03.
 * The caller has opened idempotency.records.
 */
void
claim_lock_hold(text *scope, text *key, const char *caller)
{
	LOCKTAG		tag;
	bool		already_held;
	ResourceOwner owner;

	PreventCommandIfReadOnly(psprintf("%s()", caller));
	claim_locktag(&tag, scope, key);
	if (!claim_lock_try(&tag, &already_held, &owner) && !claim_lock_wait(&tag))
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("%s: idempotency key \"%s\" in scope \"%s\" is busy",
						caller, text_to_cstring(key), text_to_cstring(scope)),
				 errdetail("Another transaction held the key for longer than idempotency.wait_timeout."),
				 errhint("Retry later.")));
}

/* Release a lock this claim took, under the resource owner that holds it. */
static void
claim_lock_release(const LOCKTAG *tag, ResourceOwner owner)
{
	ResourceOwner saved_owner = CurrentResourceOwner;

	CurrentResourceOwner = owner;
	LockRelease(tag, ExclusiveLock, false);
	CurrentResourceOwner = saved_owner;
}

/* What an existing record means for a new claim of its key. */
typedef enum RecordStanding
{
	RECORD_GONE,				/* expired: the key behaves as new */
	RECORD_ANSWERS,				/* replay, mismatch or in progress */
	RECORD_TAKEOVER				/* processing, lease expired: claim it over */
} RecordStanding;

/*
 * Classify a record.  A completed record lives until expires_at; a
 * 'processing' one (multi-phase) does not expire while unfinished: its lease
 * alone says whether its owner is still at work.
 */
static RecordStanding
record_standing(const IdemRecord *rec, bytea *fingerprint, TimestampTz now)
{
	if (rec->completed)
		return rec->expires_at > now ? RECORD_ANSWERS : RECORD_GONE;
	if (!varlena_equal(rec->fingerprint, fingerprint))
		return RECORD_ANSWERS;
	if (rec->has_lease && rec->lease_expires_at > now)
		return RECORD_ANSWERS;
	return RECORD_TAKEOVER;
}

/* Answer a claim from a record that answers it: replay, mismatch, or in progress. */
static void
answer_from_record(IdemRecord *rec, bytea *fingerprint, TimestampTz now,
				   ClaimAnswer *answer)
{
	if (!varlena_equal(rec->fingerprint, fingerprint))
		answer->outcome = CLAIM_MISMATCH;
	else if (rec->completed)
	{
		answer->outcome = CLAIM_REPLAY;
		answer->record = *rec;
	}
	else
	{
		/* Seconds, at least 1; a lease of decades must not overflow. */
		double		seconds = ceil((rec->lease_expires_at - now) / (double) USECS_PER_SEC);

		answer->outcome = CLAIM_IN_PROGRESS;
		answer->retry_after = (int32) Max(1.0, Min(seconds, (double) PG_INT32_MAX));
	}
}

/* Count a claim's outcome in the shared statistics (a no-op unless preloaded). */
static void
count_outcome(const ClaimAnswer *answer)
{
	static const IdemStatCounter counters[] = {
		[CLAIM_CLAIMED] = IDEM_STAT_CLAIMS,
		[CLAIM_REPLAY] = IDEM_STAT_REPLAYS,
		[CLAIM_IN_PROGRESS] = IDEM_STAT_IN_PROGRESS,
		[CLAIM_MISMATCH] = IDEM_STAT_MISMATCHES,
	};

	idem_stats_count(counters[answer->outcome]);
}

/*
 * Take over a multi-phase operation whose lease expired: the next token, a
 * new lease.  rel is idempotency.records, open.
 */
static void
claim_takeover(Relation rel, text *scope, text *key, IdemRecord *rec,
			   TimestampTz now, TimestampTz lease_expires_at, ClaimAnswer *answer)
{
	if (lease_expires_at == 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency key \"%s\" in scope \"%s\" belongs to a multi-phase operation",
						text_to_cstring(key), text_to_cstring(scope)),
				 errdetail("Its owner's lease expired; only a claim with a lease can take it over."),
				 errhint("Pass a lease to idem_claim().")));

	rec->token = records_next_token(rec->token);
	rec->has_lease = true;
	rec->lease_expires_at = lease_expires_at;
	rec->claimed_at = now;
	records_update(rel, scope, key, rec);

	answer->outcome = CLAIM_CLAIMED;
	answer->token = rec->token;
	answer->recovery_point = rec->recovery_point;
	idem_stats_count(IDEM_STAT_TAKEOVERS);
}

/*
 * Start a multi-phase operation: its 'processing' record commits with this
 * transaction, with a token no earlier claim of the key ever had (greater
 * than token_after, the token of the expired record it replaces, if any).
 */
static void
claim_multi_phase(Relation rel, text *scope, text *key, bytea *fingerprint,
				  TimestampTz now, int64 ttl, TimestampTz lease_expires_at,
				  int64 token_after, ClaimAnswer *answer)
{
	IdemRecord	rec;

	memset(&rec, 0, sizeof(rec));
	rec.completed = false;
	rec.fingerprint = fingerprint;
	rec.token = records_next_token(token_after);
	rec.has_lease = true;
	rec.lease_expires_at = lease_expires_at;
	rec.created_at = now;
	rec.claimed_at = now;
	rec.expires_at = idem_timestamp_add(now, ttl, "expiry time");
	rec.owner = GetUserId();
	records_insert(rel, scope, key, &rec);

	answer->outcome = CLAIM_CLAIMED;
	answer->token = rec.token;
}

/*
 * Claim (scope, key), or say why not.  See the file header for the
 * protocol.  ttl is how long the record lives after its response is stored,
 * in microseconds.  lease is 0 for a claim that completes in this
 * transaction, else the length of a multi-phase claim's lease in
 * microseconds: it starts when the claim is granted, after any wait for the
 * key.
 *
 * The table and its index stay locked until the transaction ends (closed
 * with NoLock): a rewrite must not move the row whose TID this found.
 */
static void
claim_decide(text *scope, text *key, bytea *fingerprint, int64 ttl,
			 int64 lease, ClaimAnswer *answer)
{
	TimestampTz now = GetCurrentTimestamp();
	Relation	rel;
	Relation	pkey;
	IdemRecord	rec;
	LOCKTAG		tag;
	bool		already_held = false;
	ResourceOwner lock_owner = CurrentResourceOwner;
	bool		locked;
	bool		found;
	ItemPointerData seen_tid;
	RecordStanding standing;
	ClaimEntry *mine;
	ClaimEntry	entry;
	TimestampTz lease_expires_at;

	memset(answer, 0, sizeof(*answer));
	rel = records_open(scope, AccessShareLock);
	pkey = records_open_pkey(rel);
	claim_locktag(&tag, scope, key);
	ItemPointerSetInvalid(&seen_tid);

	/*
	 * Take the key's lock if nobody holds it: then a single lookup settles
	 * the claim.  Every writer of a record holds its key's lock, so with the
	 * lock in hand no change is in flight and SnapshotSelf (committed rows,
	 * and ours) shows the latest state without the cost of an MVCC snapshot.
	 */
	locked = !RecoveryInProgress() &&
		claim_lock_try(&tag, &already_held, &lock_owner);
	if (!locked)
	{
		/*
		 * Someone holds the key (or this is a hot standby).  A record
		 * visible to this statement that answers needs no wait and no write.
		 */
		if (records_lookup(rel, pkey, GetActiveSnapshot(), scope, key, &rec))
		{
			if (record_standing(&rec, fingerprint, now) == RECORD_ANSWERS)
			{
				if (!idem_role_may_use(rec.owner))
					records_deny(scope, key);
				answer_from_record(&rec, fingerprint, now, answer);
				index_close(pkey, NoLock);
				table_close(rel, NoLock);
				return;
			}
			seen_tid = rec.tid;
		}
		PreventCommandIfReadOnly("idem_claim()");
		if (!claim_lock_wait(&tag))
		{
			answer->outcome = CLAIM_IN_PROGRESS;
			answer->retry_after = 1;
			index_close(pkey, NoLock);
			table_close(rel, NoLock);
			return;
		}
		/* The wait's subtransaction handed the lock to our transaction. */
		lock_owner = CurTransactionResourceOwner;
		/* After a wait, leases and expiry are judged at the present time. */
		now = GetCurrentTimestamp();
	}

	found = records_lookup(rel, pkey, SnapshotSelf, scope, key, &rec);
	standing = found ? record_standing(&rec, fingerprint, now) : RECORD_GONE;
	mine = claim_log_find(scope, key);

	/* Another role's live record: nothing about it is revealed. */
	if (standing != RECORD_GONE && !idem_role_may_use(rec.owner))
		records_deny(scope, key);

	/*
	 * A version this transaction's snapshot cannot see must not decide the
	 * outcome under REPEATABLE READ or SERIALIZABLE.  Our own record (completed
	 * earlier in this statement) is no conflict.
	 */
	if (standing != RECORD_GONE && IsolationUsesXactSnapshot() && mine == NULL)
	{
		IdemRecord	seen;

		if (locked &&
			records_lookup(rel, pkey, GetActiveSnapshot(), scope, key, &seen))
			seen_tid = seen.tid;
		if (!ItemPointerEquals(&seen_tid, &rec.tid))
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to a concurrent claim of idempotency key \"%s\" in scope \"%s\"",
							text_to_cstring(key), text_to_cstring(scope)),
					 errdetail("Another transaction changed the key's record after this transaction's snapshot was taken."),
					 errhint("The transaction might succeed if retried.")));
	}
	index_close(pkey, NoLock);
	table_close(rel, NoLock);

	if (standing != RECORD_ANSWERS)
	{
		if (mine != NULL && mine->state == CLAIM_HELD)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idempotency key \"%s\" in scope \"%s\" is already claimed by this transaction",
							text_to_cstring(key), text_to_cstring(scope)),
					 errhint("Call idem_succeed() or idem_release() before claiming it again.")));
		PreventCommandIfReadOnly("idem_claim()");
	}
	lease_expires_at = lease != 0 ? idem_timestamp_add(now, lease, "lease") : 0;

	if (standing == RECORD_ANSWERS)
	{
		answer_from_record(&rec, fingerprint, now, answer);
		/* Answering needs no lock: let the next duplicate in at once. */
		if (!already_held)
			claim_lock_release(&tag, lock_owner);
		return;
	}

	/* A claim that writes now: a takeover, an expired record, a lease. */
	if (standing == RECORD_TAKEOVER || found || lease_expires_at != 0)
	{
		rel = records_open(scope, RowExclusiveLock);
		if (standing == RECORD_TAKEOVER)
			claim_takeover(rel, scope, key, &rec, now, lease_expires_at, answer);
		else
		{
			/* An expired record behaves as if it were gone: remove it for ours. */
			if (found)
				records_delete_expired(rel, &rec.tid, Anum_records_scope, scope, key);
			if (lease_expires_at != 0)
				claim_multi_phase(rel, scope, key, fingerprint, now, ttl,
								  lease_expires_at, found ? rec.token : 0, answer);
		}
		table_close(rel, NoLock);
		if (standing == RECORD_TAKEOVER || lease_expires_at != 0)
			return;
	}

	/* A claim that completes in this transaction writes at idem_succeed. */
	entry.scope = scope;
	entry.key = key;
	entry.fingerprint = fingerprint;
	entry.created_at = now;
	entry.ttl = ttl;
	entry.owner = GetUserId();
	entry.token = 1;
	claim_log_append(&entry, CLAIM_HELD);

	answer->outcome = CLAIM_CLAIMED;
	answer->token = 1;
}

/*
 * Claim (scope, key), or say why not, and count the outcome.  ttl and lease
 * are in microseconds (lease 0: no lease).
 */
void
claim_key(text *scope, text *key, bytea *fingerprint, int64 ttl, int64 lease,
		  ClaimAnswer *answer)
{
	claim_decide(scope, key, fingerprint, ttl, lease, answer);
	count_outcome(answer);
}

/* The claim of (scope, key) this transaction holds; an error if it holds none. */
static ClaimEntry *
claim_held(text *scope, text *key, const char *caller)
{
	ClaimEntry *e = claim_log_find(scope, key);

	/*
	 * The claim is the role's that made it, also when a SECURITY DEFINER
	 * function made it in the caller's transaction: the caller may not store
	 * a response of its own under it, nor give it up.
	 */
	if (e != NULL && !idem_role_may_use(e->owner))
		records_deny(scope, key);
	if (e == NULL || e->state != CLAIM_HELD)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s: this transaction holds no claim on idempotency key \"%s\" in scope \"%s\"",
						caller, text_to_cstring(key), text_to_cstring(scope)),
				 e == NULL ? 0 :
				 errdetail("The claim was already %s in this transaction.",
						   e->state == CLAIM_SUCCEEDED ? "completed" : "released"),
				 errhint("Call idem_claim() in the same transaction first.")));
	return e;
}

/* Store the response of a claim held by this transaction: the operation's single write. */
void
claim_succeed(text *scope, text *key, int32 status, Jsonb *body, Jsonb *headers)
{
	ClaimEntry *e = claim_held(scope, key, "idem_succeed");
	IdemRecord	rec;
	Relation	rel;

	claim_check_response(status, body, headers);

	memset(&rec, 0, sizeof(rec));
	rec.completed = true;
	rec.fingerprint = e->fingerprint;
	rec.has_status = true;
	rec.status = status;
	rec.headers = headers;
	rec.body = body;
	rec.token = e->token;
	rec.created_at = e->created_at;
	rec.has_completed_at = true;
	rec.completed_at = GetCurrentTimestamp();
	rec.expires_at = idem_timestamp_add(rec.completed_at, e->ttl, "expiry time");
	rec.claimed_at = e->created_at;
	rec.owner = e->owner;

	rel = records_open(scope, RowExclusiveLock);
	records_insert(rel, scope, key, &rec);
	table_close(rel, NoLock);

	claim_log_append(e, CLAIM_SUCCEEDED);
}

/* Build an idem_claim_result tuple; the blessed descriptor is cached in fn_extra. */
static Datum
claim_result_datum(FunctionCallInfo fcinfo, const ClaimAnswer *answer)
{
	static const char *const outcome_names[] = {
		[CLAIM_CLAIMED] = "claimed",
		[CLAIM_REPLAY] = "replay",
		[CLAIM_IN_PROGRESS] = "in_progress",
		[CLAIM_MISMATCH] = "mismatch",
	};
	TupleDesc	tupdesc = (TupleDesc) fcinfo->flinfo->fn_extra;
	Datum		values[7];
	bool		nulls[7];

	if (tupdesc == NULL)
	{
		MemoryContext oldcontext = MemoryContextSwitchTo(fcinfo->flinfo->fn_mcxt);

		if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
			elog(ERROR, "return type of idem_claim must be a row type");
		tupdesc = BlessTupleDesc(CreateTupleDescCopy(tupdesc));
		fcinfo->flinfo->fn_extra = tupdesc;
		MemoryContextSwitchTo(oldcontext);
	}

	memset(nulls, true, sizeof(nulls));
	values[0] = CStringGetTextDatum(outcome_names[answer->outcome]);
	nulls[0] = false;
	switch (answer->outcome)
	{
		case CLAIM_REPLAY:
			values[1] = Int32GetDatum(answer->record.status);
			nulls[1] = !answer->record.has_status;
			values[2] = PointerGetDatum(answer->record.headers);
			nulls[2] = (answer->record.headers == NULL);
			values[3] = PointerGetDatum(answer->record.body);
			nulls[3] = (answer->record.body == NULL);
			break;
		case CLAIM_IN_PROGRESS:
			values[4] = Int32GetDatum(answer->retry_after);
			nulls[4] = false;
			break;
		case CLAIM_CLAIMED:
			values[5] = Int64GetDatum(answer->token);
			nulls[5] = false;
			values[6] = PointerGetDatum(answer->recovery_point);
			nulls[6] = (answer->recovery_point == NULL);
			break;
		case CLAIM_MISMATCH:
			break;
	}
	return HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls));
}

PG_FUNCTION_INFO_V1(idem_claim_jsonb);
PG_FUNCTION_INFO_V1(idem_claim_text);
PG_FUNCTION_INFO_V1(idem_claim_bytea);
PG_FUNCTION_INFO_V1(idem_succeed);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_replay);

/* Validated (scope, key), ttl and lease, then the claim and its result row. */
static Datum
claim_with_fingerprint(FunctionCallInfo fcinfo, text *scope, text *key,
					   bytea *fingerprint)
{
	TimestampTz now = GetCurrentTimestamp();
	int64		ttl = claim_ttl(fcinfo, 3, now);
	TimestampTz lease_end = claim_interval_end(fcinfo, 4, now, "lease");
	ClaimAnswer answer;

	claim_key(scope, key, fingerprint, ttl, lease_end != 0 ? lease_end - now : 0,
			  &answer);
	return claim_result_datum(fcinfo, &answer);
}

/* idem_claim(scope, key, request jsonb, ttl): claim with the request's SHA-256 fingerprint. */
Datum
idem_claim_jsonb(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;

	claim_scope_key_args(fcinfo, &scope, &key);
	claim_check_request(fcinfo);
	PG_RETURN_DATUM(claim_with_fingerprint(fcinfo, scope, key,
										   idem_fingerprint_jsonb(PG_GETARG_JSONB_P(2))));
}

/*
 * idem_claim(scope, key, request text, ttl): the request as JSON text.  Also
 * what an untyped literal resolves to, which the jsonb and bytea overloads
 * alone would leave ambiguous.
 */
Datum
idem_claim_text(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	Jsonb	   *request;

	claim_scope_key_args(fcinfo, &scope, &key);
	claim_check_request(fcinfo);
	request = DatumGetJsonbP(DirectFunctionCall1(jsonb_in,
												 CStringGetDatum(text_to_cstring(PG_GETARG_TEXT_PP(2)))));
	PG_RETURN_DATUM(claim_with_fingerprint(fcinfo, scope, key,
										   idem_fingerprint_jsonb(request)));
}

/* idem_claim(scope, key, fingerprint bytea, ttl): claim with the caller's own request hash. */
Datum
idem_claim_bytea(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	bytea	   *fingerprint;

	claim_scope_key_args(fcinfo, &scope, &key);
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("fingerprint must not be null")));
	fingerprint = PG_GETARG_BYTEA_PP(2);
	if (VARSIZE_ANY_EXHDR(fingerprint) == 0 || VARSIZE_ANY_EXHDR(fingerprint) > 64)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("fingerprint must have 1 to 64 bytes"),
				 errdetail("The fingerprint given has %d bytes.",
						   (int) VARSIZE_ANY_EXHDR(fingerprint))));
	PG_RETURN_DATUM(claim_with_fingerprint(fcinfo, scope, key, fingerprint));
}

/*
 * idem_succeed(scope, key, status, body, headers, token): store the response
 * of our claim, or with a token, complete a multi-phase operation.
 */
Datum
idem_succeed(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;

	claim_scope_key_args(fcinfo, &scope, &key);
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status must not be null")));
	if (PG_NARGS() > 5 && !PG_ARGISNULL(5))
		phase_succeed(fcinfo, scope, key);
	else
		claim_succeed(scope, key, PG_GETARG_INT32(2),
					  PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3),
					  PG_ARGISNULL(4) ? NULL : PG_GETARG_JSONB_P(4));
	PG_RETURN_VOID();
}

/*
 * idem_release(scope, key): give our claim up without a response, so a retry
 * executes again.  The key's lock stays until the transaction ends; a waiting
 * duplicate then finds no record and claims the key.
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;

	claim_scope_key_args(fcinfo, &scope, &key);
	claim_log_append(claim_held(scope, key, "idem_release"), CLAIM_RELEASED);
	idem_stats_count(IDEM_STAT_RELEASES);
	PG_RETURN_VOID();
}

/* idem_replay(scope, key): the stored outcome of a key, read-only; no row if unknown or expired. */
Datum
idem_replay(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *scope;
	text	   *key;
	Relation	rel;
	Relation	pkey;
	IdemRecord	rec;
	bool		found;

	claim_scope_key_args(fcinfo, &scope, &key);
	InitMaterializedSRF(fcinfo, 0);

	rel = records_open(scope, AccessShareLock);
	pkey = records_open_pkey(rel);
	found = records_lookup(rel, pkey, GetActiveSnapshot(), scope, key, &rec);
	index_close(pkey, NoLock);
	table_close(rel, NoLock);

	if (found && (!rec.completed || rec.expires_at > GetCurrentTimestamp()))
	{
		Datum		values[7];
		bool		nulls[7];

		if (!idem_role_may_use(rec.owner))
			records_deny(scope, key);

		memset(nulls, false, sizeof(nulls));
		values[0] = CStringGetTextDatum(rec.completed ? RECORD_STATE_COMPLETED :
										RECORD_STATE_PROCESSING);
		values[1] = Int32GetDatum(rec.status);
		nulls[1] = !rec.has_status;
		values[2] = PointerGetDatum(rec.headers);
		nulls[2] = (rec.headers == NULL);
		values[3] = PointerGetDatum(rec.body);
		nulls[3] = (rec.body == NULL);
		values[4] = TimestampTzGetDatum(rec.created_at);
		values[5] = TimestampTzGetDatum(rec.completed_at);
		nulls[5] = !rec.has_completed_at;
		values[6] = TimestampTzGetDatum(rec.expires_at);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
