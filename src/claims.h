/*-------------------------------------------------------------------------
 *
 * claims.h
 *	  Claiming an idempotency key, storing its response, replaying it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_H
#define IDEM_CLAIMS_H

#include "postgres.h"

#include "fmgr.h"
#include "storage/lock.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "records.h"

/* Longest scope and key, in bytes. */
#define IDEM_MAX_SCOPE_LEN	255
#define IDEM_MAX_KEY_LEN	255

/*
 * pg_locks shows a claim's lock as locktype 'advisory' with this objsubid,
 * which no SQL-level advisory lock uses (those use 1 and 2).
 */
#define IDEM_LOCK_CLASS		0x1DE0

/* A token-carrying call whose token is no longer current (class IK: idempotency key). */
#define ERRCODE_IDEM_FENCED	MAKE_SQLSTATE('I','K','0','0','1')

/* GUCs */
extern int	idem_wait_timeout;
extern int	idem_default_ttl;
extern int	idem_max_response_bytes;
extern int	idem_stuck_after;
extern bool idem_store_server_errors;

typedef enum ClaimOutcome
{
	CLAIM_CLAIMED,
	CLAIM_REPLAY,
	CLAIM_IN_PROGRESS,
	CLAIM_MISMATCH
} ClaimOutcome;

/* What a claim found: the outcome and, for a replay, the stored record. */
typedef struct ClaimAnswer
{
	ClaimOutcome outcome;
	IdemRecord	record;			/* valid for CLAIM_REPLAY */
	int32		retry_after;	/* seconds, for CLAIM_IN_PROGRESS */
	int64		token;			/* for CLAIM_CLAIMED: 1 without a lease, else
								 * from the database's token sequence */
	text	   *recovery_point; /* for CLAIM_CLAIMED */
} ClaimAnswer;

extern void ClaimsInit(void);
extern bool claims_pending(void);
extern void claims_note_fenced(text *scope, text *key);
extern bool claims_fenced_noted(void);
extern void claims_forget_fenced(void);

extern text *claim_arg_text(FunctionCallInfo fcinfo, int argno, const char *name);
extern void claim_scope_key_args(FunctionCallInfo fcinfo, text **scope, text **key);
extern void claim_check_request(FunctionCallInfo fcinfo);
extern TimestampTz claim_interval_end(FunctionCallInfo fcinfo, int argno,
									  TimestampTz now, const char *name);
extern int64 claim_ttl(FunctionCallInfo fcinfo, int argno, TimestampTz now);
extern TimestampTz claim_expiry(FunctionCallInfo fcinfo, int argno, TimestampTz now);
extern void claim_check_headers(Jsonb *headers);
extern void claim_check_response(int32 status, Jsonb *body, Jsonb *headers);

extern void claim_locktag(LOCKTAG *tag, text *scope, text *key);
extern void claim_key(text *scope, text *key, bytea *fingerprint, int64 ttl,
					  int64 lease, ClaimAnswer *answer);
extern void claim_lock_hold(text *scope, text *key, const char *caller);

/* phases.c */
extern void phase_succeed(FunctionCallInfo fcinfo, text *scope, text *key);
extern void claim_succeed(text *scope, text *key, int32 status,
						  Jsonb *body, Jsonb *headers);

/* SQL-callable functions of claims.c that others call directly */
extern PGDLLEXPORT Datum idem_release(PG_FUNCTION_ARGS);

#endif							/* IDEM_CLAIMS_H */
