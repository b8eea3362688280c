/*-------------------------------------------------------------------------
 *
 * execute.c
 *	  idem_execute: claim, run a handler, store and answer, in one call.
 *
 * Every outcome comes back HTTP-ready: the handler's response when it ran,
 * the stored response with "Idempotent-Replayed: true" on a replay, 422 for a
 * key reused with another request and 409 with Retry-After for a duplicate
 * still in flight, both with an application/problem+json body (RFC 9457).
 *
 * The handler runs in the caller's transaction with the caller's privileges:
 * this function is not SECURITY DEFINER, and it checks the caller's EXECUTE
 * privilege on the handler before it claims anything.
 *
 * A 5xx from the handler is a transient failure: the handler runs in a
 * subtransaction of its own, which is rolled back, the claim is released and
 * the 5xx is answered without being stored, so the next retry executes again
 * (unless idempotency.store_server_errors says to store it like any other).
 * Not stored, it is not held to idempotency.max_response_bytes either.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "executor/executor.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/resowner.h"
#include "utils/syscache.h"

#include "claims.h"
#include "compat.h"
#include "fingerprint.h"

/* Per-call-site state kept in fn_extra: the checked handler and our result type. */
typedef struct ExecuteCache
{
	Oid			handler;
	FmgrInfo	handler_finfo;
	TupleDesc	result_desc;
} ExecuteCache;

/*
 * The OID of idem_response, which lives in the same schema as the type
 * idem_execute returns (idem_execute_result): the extension's schema, also
 * for the idem_execute of schema idem_citus.
 */
static Oid
response_type_oid(Oid funcoid)
{
	HeapTuple	typtup = SearchSysCache1(TYPEOID, ObjectIdGetDatum(get_func_rettype(funcoid)));
	Oid			nspid;

	if (!HeapTupleIsValid(typtup))
		elog(ERROR, "cache lookup failed for the result type of function %u", funcoid);
	nspid = ((Form_pg_type) GETSTRUCT(typtup))->typnamespace;
	ReleaseSysCache(typtup);
	return GetSysCacheOid2(TYPENAMENSP, Anum_pg_type_oid,
						   CStringGetDatum("idem_response"),
						   ObjectIdGetDatum(nspid));
}

/* Check that handler is a plain function f(jsonb) returning idem_response. */
static void
check_handler_signature(Oid handler, Oid response_type)
{
	HeapTuple	proctup = SearchSysCache1(PROCOID, ObjectIdGetDatum(handler));
	Form_pg_proc proc;
	bool		ok;

	if (!HeapTupleIsValid(proctup))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("handler function with OID %u does not exist", handler)));
	proc = (Form_pg_proc) GETSTRUCT(proctup);
	ok = proc->prokind == PROKIND_FUNCTION && !proc->proretset &&
		proc->pronargs == 1 && proc->proargtypes.values[0] == JSONBOID &&
		proc->prorettype == response_type;
	ReleaseSysCache(proctup);

	if (!ok)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("handler %s has the wrong signature",
						format_procedure(handler)),
				 errdetail("A handler is a function taking one jsonb argument and returning idem_response.")));
}

/* The cache for this call site, with handler checked and looked up. */
static ExecuteCache *
execute_cache(FunctionCallInfo fcinfo, Oid handler)
{
	ExecuteCache *cache = (ExecuteCache *) fcinfo->flinfo->fn_extra;
	MemoryContext oldcontext;

	if (cache != NULL && cache->handler == handler)
		return cache;

	oldcontext = MemoryContextSwitchTo(fcinfo->flinfo->fn_mcxt);
	if (cache == NULL)
	{
		TupleDesc	tupdesc;

		cache = palloc0(sizeof(ExecuteCache));
		if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
			elog(ERROR, "return type of idem_execute must be a row type");
		cache->result_desc = BlessTupleDesc(CreateTupleDescCopy(tupdesc));
		fcinfo->flinfo->fn_extra = cache;
	}
	check_handler_signature(handler, response_type_oid(fcinfo->flinfo->fn_oid));
	fmgr_info_cxt(handler, &cache->handler_finfo, fcinfo->flinfo->fn_mcxt);
	cache->handler = handler;
	MemoryContextSwitchTo(oldcontext);
	return cache;
}

/* Parse a JSON text built here into jsonb. */
static Jsonb *
jsonb_from_text(const char *json)
{
	return DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum(json)));
}

/* An application/problem+json answer: its body, and headers with an optional Retry-After. */
static void
problem_response(int32 status, const char *title, const char *detail,
				 int32 retry_after, Jsonb **headers, Jsonb **body)
{
	StringInfoData buf;

	initStringInfo(&buf);
	appendStringInfoString(&buf, "{\"Content-Type\": \"application/problem+json\"");
	if (retry_after > 0)
		appendStringInfo(&buf, ", \"Retry-After\": \"%d\"", retry_after);
	appendStringInfoChar(&buf, '}');
	*headers = jsonb_from_text(buf.data);

	resetStringInfo(&buf);
	appendStringInfoString(&buf, "{\"type\": \"about:blank\", \"title\": ");
	escape_json(&buf, title);
	appendStringInfo(&buf, ", \"status\": %d, \"detail\": ", status);
	escape_json(&buf, detail);
	appendStringInfoChar(&buf, '}');
	*body = jsonb_from_text(buf.data);
	pfree(buf.data);
}

/* Run the handler on the request and return its response's fields. */
static void
run_handler(ExecuteCache *cache, Jsonb *request, int32 *status,
			Jsonb **headers, Jsonb **body)
{
	LOCAL_FCINFO(hfcinfo, 1);
	Datum		result;
	HeapTupleHeader response;
	Datum		value;
	bool		isnull;

	InitFunctionCallInfoData(*hfcinfo, &cache->handler_finfo, 1, InvalidOid,
							 NULL, NULL);
	hfcinfo->args[0].value = JsonbPGetDatum(request);
	hfcinfo->args[0].isnull = false;
	result = FunctionCallInvoke(hfcinfo);
	if (hfcinfo->isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("handler %s returned null",
						format_procedure(cache->handler)),
				 errhint("A handler returns an idem_response with a status.")));

	response = DatumGetHeapTupleHeader(result);
	value = GetAttributeByNum(response, 1, &isnull);
	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("handler %s returned a null status",
						format_procedure(cache->handler))));
	*status = DatumGetInt32(value);
	value = GetAttributeByNum(response, 2, &isnull);
	*headers = isnull ? NULL : DatumGetJsonbP(value);
	value = GetAttributeByNum(response, 3, &isnull);
	*body = isnull ? NULL : DatumGetJsonbP(value);
}

/*
 * Run the handler in a subtransaction of its own and keep its writes, unless
 * it answered a server error (5xx): then roll them back and tell the caller.
 * An error of the handler rolls the subtransaction back and propagates, so
 * that a caller's savepoints and exception blocks stay in step.
 */
static bool
run_handler_transient(ExecuteCache *cache, Jsonb *request, int32 *status,
					  Jsonb **headers, Jsonb **body)
{
	MemoryContext callcontext = CurrentMemoryContext;
	ResourceOwner callowner = CurrentResourceOwner;
	bool		server_error;

	BeginInternalSubTransaction(NULL);
	/* The results must outlive the subtransaction: allocate them in ours. */
	MemoryContextSwitchTo(callcontext);
	PG_TRY();
	{
		run_handler(cache, request, status, headers, body);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(callcontext);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(callcontext);
		CurrentResourceOwner = callowner;
		ReThrowError(edata);
	}
	PG_END_TRY();

	server_error = *status >= 500 && *status <= 599;
	if (server_error)
		RollbackAndReleaseCurrentSubTransaction();
	else
		ReleaseCurrentSubTransaction();
	MemoryContextSwitchTo(callcontext);
	CurrentResourceOwner = callowner;
	return server_error;
}

PG_FUNCTION_INFO_V1(idem_execute);

/* idem_execute(scope, key, request, handler, ttl): the whole flow in one call. */
Datum
idem_execute(PG_FUNCTION_ARGS)
{
	text	   *scope;
	text	   *key;
	TimestampTz now = GetCurrentTimestamp();
	int64		ttl;
	Jsonb	   *request;
	Oid			handler;
	Oid			handler_schema;
	ExecuteCache *cache;
	AclResult	aclresult;
	ClaimAnswer answer;
	int32		status = 0;
	Jsonb	   *headers = NULL;
	Jsonb	   *body = NULL;
	bool		replayed = false;
	Datum		values[4];
	bool		nulls[4];

	claim_scope_key_args(fcinfo, &scope, &key);
	claim_check_request(fcinfo);
	if (PG_ARGISNULL(3))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("handler must not be null")));
	request = PG_GETARG_JSONB_P(2);
	handler = PG_GETARG_OID(3);
	ttl = claim_ttl(fcinfo, 4, now);

	cache = execute_cache(fcinfo, handler);
	aclresult = object_aclcheck(ProcedureRelationId, handler, GetUserId(), ACL_EXECUTE);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_FUNCTION, get_func_name(handler));
	/* As calling it by name would: a handler's OID is no way around its schema. */
	handler_schema = get_func_namespace(handler);
	aclresult = object_aclcheck(NamespaceRelationId, handler_schema, GetUserId(), ACL_USAGE);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_SCHEMA, get_namespace_name(handler_schema));

	claim_key(scope, key, idem_fingerprint_jsonb(request), ttl, 0, &answer);
	switch (answer.outcome)
	{
		case CLAIM_CLAIMED:
			if (idem_store_server_errors)
			{
				run_handler(cache, request, &status, &headers, &body);
				claim_succeed(scope, key, status, body, headers);
			}
			else if (run_handler_transient(cache, request, &status, &headers, &body))
			{
				/*
				 * Not stored, so not held to idempotency.max_response_bytes;
				 * its headers must still be an object (a bug either way).
				 */
				claim_check_headers(headers);
				DirectFunctionCall2(idem_release, PointerGetDatum(scope),
									PointerGetDatum(key));
			}
			else
				claim_succeed(scope, key, status, body, headers);
			break;
		case CLAIM_REPLAY:
			status = answer.record.status;
			headers = answer.record.headers ? answer.record.headers :
				jsonb_from_text("{}");
			headers = DatumGetJsonbP(DirectFunctionCall2(jsonb_concat,
														 JsonbPGetDatum(headers),
														 JsonbPGetDatum(jsonb_from_text("{\"Idempotent-Replayed\": \"true\"}"))));
			body = answer.record.body;
			replayed = true;
			break;
		case CLAIM_MISMATCH:
			status = 422;
			problem_response(status, "Idempotency key reused with a different request",
							 "This idempotency key was already used with a request that has a different fingerprint.",
							 0, &headers, &body);
			break;
		case CLAIM_IN_PROGRESS:
			status = 409;
			problem_response(status, "Request in progress",
							 "A request with this idempotency key is still being processed. Retry later.",
							 answer.retry_after, &headers, &body);
			break;
	}

	memset(nulls, false, sizeof(nulls));
	values[0] = Int32GetDatum(status);
	values[1] = PointerGetDatum(headers);
	nulls[1] = (headers == NULL);
	values[2] = PointerGetDatum(body);
	nulls[2] = (body == NULL);
	values[3] = BoolGetDatum(replayed);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(cache->result_desc, values, nulls)));
}
