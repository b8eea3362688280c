/*-------------------------------------------------------------------------
 *
 * destinations.c
 *	  Managing the outbox's destinations, and redriving dead letters.
 *
 * A destination says where the relay delivers the events whose topic it
 * matches: a NOTIFY channel, a SQL function f(jsonb), or an HTTP endpoint
 * signed with Standard Webhooks secrets.  These functions are not granted to
 * PUBLIC: the extension's owner calls them, or grants them to an operator
 * role.  They write the private tables as the owner of those tables, so a
 * granted role needs no privilege on the schema; no other role can read the
 * secrets, and no role without these functions can make the relay send
 * anything anywhere new.
 *
 * Every value is validated here, with SQLSTATE 22023 and the list of what is
 * allowed, because the tables have no CHECK constraints and the relay trusts
 * what it reads.  Error messages never quote a secret.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "access/htup_details.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "common/base64.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/regproc.h"
#include "utils/syscache.h"

#include "compat.h"
#include "outbox.h"
#include "relay_http.h"

/* Secrets: "whsec_" then the base64 of this many bytes. */
#define SECRET_PREFIX			"whsec_"
#define SECRET_MIN_BYTES		16
#define SECRET_MAX_BYTES		128
#define MAX_SECRETS				10

/* Options as validated; durations in milliseconds. */
typedef struct DestOptions
{
	int32		max_attempts;
	int64		backoff_base_ms;
	int64		backoff_cap_ms;
	int64		timeout_ms;
	int32		max_in_flight;	/* http: requests open to the endpoint at once */
	int64		connect_timeout_ms; /* http: connecting, within timeout_ms */
	int32		failure_threshold;	/* http: consecutive failures that open the circuit */
	int64		disable_after_ms;	/* http: open and failing this long: disabled */
	Datum		secrets;		/* text[], or 0 when none */
} DestOptions;

/* The kind named kind, or an error listing the kinds. */
DestKind
dest_kind_from_name(const char *kind)
{
	if (strcmp(kind, "notify") == 0)
		return DEST_NOTIFY;
	if (strcmp(kind, "function") == 0)
		return DEST_FUNCTION;
	if (strcmp(kind, "http") == 0)
		return DEST_HTTP;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("unknown destination kind \"%s\"", kind),
			 errdetail("The kinds are 'notify', 'function' and 'http'.")));
	pg_unreachable();
}

/* The SQL name of a kind. */
const char *
dest_kind_name(DestKind kind)
{
	switch (kind)
	{
		case DEST_NOTIFY:
			return "notify";
		case DEST_FUNCTION:
			return "function";
		case DEST_HTTP:
			return "http";
	}
	return "?";
}

/* The option keys a kind accepts, for errdetail. */
static const char *
dest_allowed_options(DestKind kind)
{
	switch (kind)
	{
		case DEST_HTTP:
			return "max_attempts, backoff_base, backoff_cap, timeout, connect_timeout, max_in_flight, failure_threshold, disable_after, secret, secrets, headers";
		case DEST_FUNCTION:
			return "max_attempts, backoff_base, backoff_cap, timeout";
		case DEST_NOTIFY:
			return "max_attempts, backoff_base, backoff_cap, reference";
	}
	return "max_attempts, backoff_base, backoff_cap";
}

/* A required argument. */
static Datum
dest_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
	return PG_GETARG_DATUM(argno);
}

/*
 * A destination's name argument: not null (22004), not empty and not over
 * OUTBOX_MAX_NAME_LEN bytes (22023, as create requires), so that a name no
 * destination can have is reported as bad, not as missing.
 */
static text *
dest_name_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	text	   *value = DatumGetTextPP(dest_arg(fcinfo, argno, name));

	outbox_check_name(value, "destination name");
	return value;
}

/*
 * A duration option in milliseconds, between min_ms and max_ms: a JSON number
 * of seconds, or a string in interval syntax ('250ms', '5 minutes').
 */
static int64
dest_duration_ms(const JsonbValue *v, const char *key, int64 min_ms, int64 max_ms)
{
	double		ms;

	if (v->type == jbvNumeric)
		ms = DatumGetFloat8(DirectFunctionCall1(numeric_float8,
												NumericGetDatum(v->val.numeric))) * 1000.0;
	else if (v->type == jbvString)
	{
		char	   *str = pnstrdup(v->val.string.val, v->val.string.len);
		char		workbuf[256];
		char	   *field[MAXDATEFIELDS];
		int			ftype[MAXDATEFIELDS];
		int			nf;
		int			dtype;
		struct pg_itm_in itm_in;
		Interval	span;
		int			dterr;

		dterr = ParseDateTime(str, workbuf, sizeof(workbuf), field, ftype,
							  MAXDATEFIELDS, &nf);
		if (dterr == 0)
			dterr = DecodeInterval(field, ftype, nf, INTERVAL_FULL_RANGE,
								   &dtype, &itm_in);
		if (dterr == DTERR_BAD_FORMAT)
			dterr = DecodeISO8601Interval(str, &dtype, &itm_in);
		if (dterr != 0 || dtype != DTK_DELTA || itmin2interval(&itm_in, &span) != 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("option \"%s\" is not a valid duration: \"%s\"", key, str),
					 errhint("Give a number of seconds, or an interval such as '500ms' or '2 minutes'.")));
		ms = ((double) span.time + (double) span.day * USECS_PER_DAY +
			  (double) span.month * DAYS_PER_MONTH * USECS_PER_DAY) / 1000.0;
	}
	else
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("option \"%s\" must be a number of seconds or an interval string", key)));

	if (isnan(ms) || ms < (double) min_ms || ms > (double) max_ms)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("option \"%s\" is out of range", key),
				 errdetail("It must be between %lld ms and %lld ms.",
						   (long long) min_ms, (long long) max_ms)));
	return (int64) ms;
}

/* An integer option between min and max. */
static int32
dest_int_option(const JsonbValue *v, const char *key, int32 min, int32 max)
{
	double		d;

	if (v->type != jbvNumeric)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("option \"%s\" must be a number", key)));
	d = DatumGetFloat8(DirectFunctionCall1(numeric_float8,
										   NumericGetDatum(v->val.numeric)));
	if (isnan(d) || d != floor(d) || d < min || d > max)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("option \"%s\" must be an integer between %d and %d", key, min, max)));
	return (int32) d;
}

/*
 * Check a Standard Webhooks secret: "whsec_" and the base64 of the key.
 * Never quotes the secret.
 */
static void
dest_check_secret(const char *s, int len)
{
	int			prefix = strlen(SECRET_PREFIX);
	const char *b64;
	int			b64len;
	uint8	   *decoded;
	int			n;

	if (len <= prefix || strncmp(s, SECRET_PREFIX, prefix) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a webhook secret must start with \"%s\"", SECRET_PREFIX),
				 errdetail("Secrets take the Standard Webhooks form whsec_ followed by the base64 of the key.")));
	b64 = s + prefix;
	b64len = len - prefix;
	for (int i = 0; i < b64len; i++)
		if (!(isalnum((unsigned char) b64[i]) || b64[i] == '+' ||
			  b64[i] == '/' || b64[i] == '='))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("a webhook secret is not valid base64 after \"%s\"", SECRET_PREFIX)));
	decoded = (uint8 *) palloc(pg_b64_dec_len(b64len) + 1);
	n = pg_b64_decode(b64, b64len, decoded, pg_b64_dec_len(b64len) + 1);
	pfree(decoded);
	if (n < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a webhook secret is not valid base64 after \"%s\"", SECRET_PREFIX)));
	if (n < SECRET_MIN_BYTES || n > SECRET_MAX_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a webhook secret must encode %d to %d bytes", SECRET_MIN_BYTES, SECRET_MAX_BYTES),
				 errdetail("This one encodes %d bytes.", n)));
}

/* Validate options for a destination of kind; fill o with the values and defaults. */
static void
dest_parse_options(DestKind kind, Jsonb *options, DestOptions *o)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	char	   *key = NULL;
	bool		has_secret = false;
	bool		has_secrets = false;
	ArrayBuildState *secrets = NULL;

	o->max_attempts = DEST_DEFAULT_MAX_ATTEMPTS;
	o->backoff_base_ms = DEST_DEFAULT_BACKOFF_BASE;
	o->backoff_cap_ms = DEST_DEFAULT_BACKOFF_CAP;
	o->timeout_ms = DEST_DEFAULT_TIMEOUT;
	o->max_in_flight = DEST_DEFAULT_MAX_IN_FLIGHT;
	o->connect_timeout_ms = DEST_DEFAULT_CONNECT_TIMEOUT;
	o->failure_threshold = DEST_DEFAULT_FAILURE_THRESHOLD;
	o->disable_after_ms = DEST_DEFAULT_DISABLE_AFTER;
	o->secrets = (Datum) 0;

	if (!JB_ROOT_IS_OBJECT(options) || JB_ROOT_IS_SCALAR(options))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("options must be a JSON object")));

	it = JsonbIteratorInit(&options->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		if (tok == WJB_KEY)
		{
			key = pnstrdup(v.val.string.val, v.val.string.len);
			continue;
		}
		if (tok != WJB_VALUE)
			continue;

		if (strcmp(key, "max_attempts") == 0)
			o->max_attempts = dest_int_option(&v, key, 1, 1000);
		else if (strcmp(key, "backoff_base") == 0)
			o->backoff_base_ms = dest_duration_ms(&v, key, 1, 86400 * 1000L);
		else if (strcmp(key, "backoff_cap") == 0)
			o->backoff_cap_ms = dest_duration_ms(&v, key, 1, 30 * 86400 * 1000L);
		else if (kind == DEST_NOTIFY && strcmp(key, "reference") == 0)
		{
			/* The relay reads it from the options column. */
			if (v.type != jbvBool)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("option \"reference\" must be true or false")));
		}
		else if ((kind == DEST_HTTP || kind == DEST_FUNCTION) && strcmp(key, "timeout") == 0)
			o->timeout_ms = dest_duration_ms(&v, key, 1, 3600 * 1000L);
		else if (kind == DEST_HTTP && strcmp(key, "connect_timeout") == 0)
			o->connect_timeout_ms = dest_duration_ms(&v, key, 1, 3600 * 1000L);
		else if (kind == DEST_HTTP && strcmp(key, "max_in_flight") == 0)
			o->max_in_flight = dest_int_option(&v, key, 1, 1000);
		else if (kind == DEST_HTTP && strcmp(key, "failure_threshold") == 0)
			o->failure_threshold = dest_int_option(&v, key, 1, 1000000);
		else if (kind == DEST_HTTP && strcmp(key, "disable_after") == 0)
			o->disable_after_ms = dest_duration_ms(&v, key, 1, 365 * 86400 * 1000L);
		else if (kind == DEST_HTTP && strcmp(key, "secret") == 0)
		{
			if (v.type != jbvString)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("option \"secret\" must be a string")));
			dest_check_secret(v.val.string.val, v.val.string.len);
			secrets = accumArrayResult(secrets,
									   PointerGetDatum(cstring_to_text_with_len(v.val.string.val,
																				v.val.string.len)),
									   false, TEXTOID, CurrentMemoryContext);
			has_secret = true;
		}
		else if (kind == DEST_HTTP && strcmp(key, "secrets") == 0)
		{
			JsonbIterator *ait;
			JsonbValue	e;
			JsonbIteratorToken atok;
			int			n = 0;

			if (v.type != jbvBinary || !JsonContainerIsArray(v.val.binary.data))
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("option \"secrets\" must be an array of strings")));
			ait = JsonbIteratorInit(v.val.binary.data);
			while ((atok = JsonbIteratorNext(&ait, &e, true)) != WJB_DONE)
			{
				if (atok != WJB_ELEM)
					continue;
				if (e.type != jbvString)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("option \"secrets\" must be an array of strings")));
				dest_check_secret(e.val.string.val, e.val.string.len);
				secrets = accumArrayResult(secrets,
										   PointerGetDatum(cstring_to_text_with_len(e.val.string.val,
																					e.val.string.len)),
										   false, TEXTOID, CurrentMemoryContext);
				n++;
			}
			if (n == 0 || n > MAX_SECRETS)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("option \"secrets\" must hold 1 to %d secrets", MAX_SECRETS)));
			has_secrets = true;
		}
		else if (kind == DEST_HTTP && strcmp(key, "headers") == 0)
		{
			Jsonb	   *headers;

			if (v.type != jbvBinary || !JsonContainerIsObject(v.val.binary.data))
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("option \"headers\" must be a JSON object")));
			headers = JsonbValueToJsonb(&v);
			outbox_check_headers(headers, "option \"headers\"");
		}
		else
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("unknown option \"%s\" for a destination of kind '%s'",
							key, dest_kind_name(kind)),
					 errdetail("The options of a '%s' destination are: %s.",
							   dest_kind_name(kind), dest_allowed_options(kind))));
	}

	if (o->backoff_cap_ms < o->backoff_base_ms)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("option \"backoff_cap\" must not be less than \"backoff_base\""),
				 errdetail("backoff_base is %lld ms (default %d ms); backoff_cap is %lld ms (default %d ms).",
						   (long long) o->backoff_base_ms, DEST_DEFAULT_BACKOFF_BASE,
						   (long long) o->backoff_cap_ms, DEST_DEFAULT_BACKOFF_CAP)));
	if (has_secret && has_secrets)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("options \"secret\" and \"secrets\" cannot be used together"),
				 errhint("During a rotation, list the old and the new secret in \"secrets\".")));
	if (kind == DEST_HTTP && secrets == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("an 'http' destination needs a signing secret"),
				 errhint("Give options {\"secret\": \"whsec_...\"}: whsec_ and the base64 of a random key (24 to 64 bytes are recommended).")));
	if (secrets != NULL)
		o->secrets = makeArrayResult(secrets, CurrentMemoryContext);
}

/*
 * Validate topic patterns: a non-empty one-dimensional array of non-empty
 * names, each ending in at most one '*' (a prefix pattern).
 */
void
dest_check_topics(ArrayType *topics)
{
	Datum	   *elems;
	bool	   *nulls;
	int			n;

	if (ARR_NDIM(topics) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("topics must be a one-dimensional array")));
	deconstruct_array(topics, TEXTOID, -1, false, TYPALIGN_INT, &elems, &nulls, &n);
	if (n == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("topics must not be empty"),
				 errhint("Use '{*}' for every topic.")));
	for (int i = 0; i < n; i++)
	{
		text	   *t;
		char	   *s;
		char	   *star;

		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("topics must not contain nulls")));
		t = DatumGetTextPP(elems[i]);
		outbox_check_name(t, "topic pattern");
		s = text_to_cstring(t);
		star = strchr(s, '*');
		if (star != NULL && star[1] != '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("topic pattern \"%s\" is invalid", s),
					 errdetail("A pattern is a topic, a prefix followed by '*', or '*' alone.")));
	}
}

/*
 * Validate the target of a destination of kind.  Returns the target to
 * store (a function's qualified signature) and, for kind 'function', its
 * OID in *func.
 */
static char *
dest_check_target(DestKind kind, const char *target, Oid *func)
{
	*func = InvalidOid;
	switch (kind)
	{
		case DEST_NOTIFY:
			if (target[0] == '\0' || strlen(target) >= NAMEDATALEN)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("a 'notify' target must be a channel name of 1 to %d bytes",
								NAMEDATALEN - 1)));
			return pstrdup(target);

		case DEST_FUNCTION:
			{
				Oid			oid = DatumGetObjectId(DirectFunctionCall1(regprocedurein,
																	   CStringGetDatum(target)));
				HeapTuple	proctup = SearchSysCache1(PROCOID, ObjectIdGetDatum(oid));
				Form_pg_proc proc;
				bool		ok;

				if (!HeapTupleIsValid(proctup))
					elog(ERROR, "cache lookup failed for function %u", oid);
				proc = (Form_pg_proc) GETSTRUCT(proctup);
				ok = proc->prokind == PROKIND_FUNCTION && !proc->proretset &&
					proc->pronargs == 1 && proc->proargtypes.values[0] == JSONBOID;
				ReleaseSysCache(proctup);
				if (!ok)
					ereport(ERROR,
							(errcode(ERRCODE_WRONG_OBJECT_TYPE),
							 errmsg("function %s cannot be a destination", format_procedure(oid)),
							 errdetail("A destination function takes one jsonb argument (the event) and returns a single value, which is ignored.")));
				if (object_aclcheck(ProcedureRelationId, oid, GetUserId(), ACL_EXECUTE) != ACLCHECK_OK)
					ereport(ERROR,
							(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
							 errmsg("permission denied for function %s", format_procedure(oid)),
							 errdetail("The relay calls the function as the role that creates the destination.")));
				*func = oid;
				return format_procedure_qualified(oid);
			}

		case DEST_HTTP:
			{
				const char *why = http_check_url(target);

				if (why != NULL)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("invalid 'http' target URL"),
							 errdetail("%s", why)));
				why = http_check_url_host(target);
				if (why != NULL)
					ereport(ERROR,
							(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
							 errmsg("'http' target URL leads to a non-public address"),
							 errdetail("%s", why),
							 errhint("The relay connects only to public addresses; a superuser can allow others in idempotency.relay_allowed_networks.")));
				return pstrdup(target);
			}
	}
	return NULL;
}

/* The "destination does not exist" error. */
static void
dest_report_missing(text *name)
{
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("destination \"%s\" does not exist", text_to_cstring(name))));
}

/* Run one statement with arguments as the tables' owner; returns SPI_processed. */
static uint64
dest_execute(const char *sql, int nargs, Oid *argtypes, Datum *values,
			 const char *nulls, int expected)
{
	OutboxOwnerState owner;
	uint64		processed;
	int			rc;

	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	rc = SPI_execute_with_args(sql, nargs, argtypes, values, nulls, false, 0);
	if (rc != expected)
		elog(ERROR, "SPI_execute_with_args failed: %s", SPI_result_code_string(rc));
	processed = SPI_processed;
	SPI_finish();
	outbox_restore_user(&owner);
	return processed;
}

PG_FUNCTION_INFO_V1(idem_destination_create);
PG_FUNCTION_INFO_V1(idem_destination_alter);
PG_FUNCTION_INFO_V1(idem_destination_drop);
PG_FUNCTION_INFO_V1(idem_destination_pause);
PG_FUNCTION_INFO_V1(idem_destination_resume);
PG_FUNCTION_INFO_V1(idem_outbox_redrive);
PG_FUNCTION_INFO_V1(idem_outbox_redrive_dead);

/* idem_destination_create(name, kind, target, topics, options): add a destination. */
Datum
idem_destination_create(PG_FUNCTION_ARGS)
{
	text	   *name = dest_name_arg(fcinfo, 0, "name");
	char	   *kind_name = TextDatumGetCString(dest_arg(fcinfo, 1, "kind"));
	char	   *target = TextDatumGetCString(dest_arg(fcinfo, 2, "target"));
	ArrayType  *topics = DatumGetArrayTypeP(dest_arg(fcinfo, 3, "topics"));
	Jsonb	   *options = DatumGetJsonbP(dest_arg(fcinfo, 4, "options"));
	DestKind	kind;
	DestOptions o;
	Oid			func;
	char	   *stored_target;
	Oid			argtypes[17] = {TEXTOID, TEXTOID, TEXTOID, TEXTARRAYOID, OIDOID,
		OIDOID, TEXTOID, JSONBOID, TEXTARRAYOID, INT4OID, INT8OID, INT8OID, INT8OID,
	INT4OID, INT8OID, INT4OID, INT8OID};
	Datum		values[17];
	char		nulls[17];

	kind = dest_kind_from_name(kind_name);
	stored_target = dest_check_target(kind, target, &func);
	dest_check_topics(topics);
	dest_parse_options(kind, options, &o);

	memset(nulls, ' ', sizeof(nulls));
	values[0] = PointerGetDatum(name);
	values[1] = CStringGetTextDatum(dest_kind_name(kind));
	values[2] = CStringGetTextDatum(stored_target);
	values[3] = PointerGetDatum(topics);
	values[4] = ObjectIdGetDatum(func);
	nulls[4] = OidIsValid(func) ? ' ' : 'n';
	values[5] = ObjectIdGetDatum(GetUserId());
	values[6] = CStringGetTextDatum(GetConfigOption("search_path", false, false));
	values[7] = JsonbPGetDatum(options);
	values[8] = o.secrets;
	nulls[8] = o.secrets != (Datum) 0 ? ' ' : 'n';
	values[9] = Int32GetDatum(o.max_attempts);
	values[10] = Int64GetDatum(o.backoff_base_ms);
	values[11] = Int64GetDatum(o.backoff_cap_ms);
	values[12] = Int64GetDatum(o.timeout_ms);
	values[13] = Int32GetDatum(o.max_in_flight);
	values[14] = Int64GetDatum(o.connect_timeout_ms);
	values[15] = Int32GetDatum(o.failure_threshold);
	values[16] = Int64GetDatum(o.disable_after_ms);

	if (dest_execute("INSERT INTO idempotency.destinations"
					 "  (name, kind, target, topics, func, run_as, search_path, options,"
					 "   secrets, headers, max_attempts, backoff_base_ms, backoff_cap_ms, timeout_ms,"
					 "   max_in_flight, connect_timeout_ms, failure_threshold, disable_after_ms)"
					 " VALUES ($1, $2, $3, $4, $5::regprocedure, $6::regrole, $7,"
					 "  $8 - '{secret,secrets,headers}'::text[], $9, $8 -> 'headers', $10, $11, $12, $13,"
					 "  $14, $15, $16, $17)"
					 " ON CONFLICT (name) DO NOTHING",
					 17, argtypes, values, nulls, SPI_OK_INSERT) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_DUPLICATE_OBJECT),
				 errmsg("destination \"%s\" already exists", text_to_cstring(name))));
	dest_sync_note(name, true, false);
	PG_RETURN_VOID();
}

/*
 * idem_destination_alter(name, options): replace a destination's options,
 * e.g. to rotate its secrets or change its retry policy.  Deliveries under
 * way keep their schedule; later attempts use the new options.
 */
Datum
idem_destination_alter(PG_FUNCTION_ARGS)
{
	text	   *name = dest_name_arg(fcinfo, 0, "name");
	Jsonb	   *options = DatumGetJsonbP(dest_arg(fcinfo, 1, "options"));
	OutboxOwnerState owner;
	Oid			argtypes[11] = {TEXTOID, JSONBOID, TEXTARRAYOID, INT4OID, INT8OID, INT8OID, INT8OID,
	INT4OID, INT8OID, INT4OID, INT8OID};
	Datum		values[11];
	char		nulls[11];
	DestKind	kind;
	DestOptions o;
	Datum		arg = PointerGetDatum(name);
	int			rc;

	/* The kind decides which options are valid. */
	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	rc = SPI_execute_with_args("SELECT kind FROM idempotency.destinations WHERE name = $1 FOR UPDATE",
							   1, argtypes, &arg, NULL, false, 0);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "SPI_execute_with_args failed: %s", SPI_result_code_string(rc));
	if (SPI_processed == 0)
		dest_report_missing(name);
	kind = dest_kind_from_name(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1));
	SPI_finish();
	outbox_restore_user(&owner);

	dest_parse_options(kind, options, &o);

	memset(nulls, ' ', sizeof(nulls));
	values[0] = PointerGetDatum(name);
	values[1] = JsonbPGetDatum(options);
	values[2] = o.secrets;
	nulls[2] = o.secrets != (Datum) 0 ? ' ' : 'n';
	values[3] = Int32GetDatum(o.max_attempts);
	values[4] = Int64GetDatum(o.backoff_base_ms);
	values[5] = Int64GetDatum(o.backoff_cap_ms);
	values[6] = Int64GetDatum(o.timeout_ms);
	values[7] = Int32GetDatum(o.max_in_flight);
	values[8] = Int64GetDatum(o.connect_timeout_ms);
	values[9] = Int32GetDatum(o.failure_threshold);
	values[10] = Int64GetDatum(o.disable_after_ms);
	(void) dest_execute("UPDATE idempotency.destinations"
						"   SET options = $2 - '{secret,secrets,headers}'::text[], secrets = $3,"
						"       headers = $2 -> 'headers', max_attempts = $4,"
						"       backoff_base_ms = $5, backoff_cap_ms = $6, timeout_ms = $7,"
						"       max_in_flight = $8, connect_timeout_ms = $9,"
						"       failure_threshold = $10, disable_after_ms = $11"
						" WHERE name = $1",
						11, argtypes, values, nulls, SPI_OK_UPDATE);
	outbox_dests_changed_at_commit();
	dest_sync_note(name, false, false);
	PG_RETURN_VOID();
}

/*
 * idem_destination_drop(name): remove a destination and all its deliveries,
 * pending, dead or delivered.  A transaction publishing at this moment may
 * still add a delivery for it; the relay never claims one whose destination
 * is gone, and cleanup removes it.
 */
Datum
idem_destination_drop(PG_FUNCTION_ARGS)
{
	text	   *name = dest_name_arg(fcinfo, 0, "name");
	Oid			argtypes[1] = {TEXTOID};
	Datum		values[1] = {PointerGetDatum(name)};

	dest_sync_note_drop(name);
	if (dest_execute("WITH d AS (DELETE FROM idempotency.destinations WHERE name = $1 RETURNING id),"
					 " x AS (DELETE FROM idempotency.deliveries WHERE destination_id IN (SELECT id FROM d)),"
					 " s AS (DELETE FROM idempotency.destination_stats WHERE destination_id IN (SELECT id FROM d))"
					 " SELECT id FROM d",
					 1, argtypes, values, NULL, SPI_OK_SELECT) == 0)
		dest_report_missing(name);
	outbox_dests_changed_at_commit();
	dest_sync_note(name, false, false);
	PG_RETURN_VOID();
}

/* idem_destination_pause(name): stop delivering; events still accumulate. */
Datum
idem_destination_pause(PG_FUNCTION_ARGS)
{
	text	   *name = dest_name_arg(fcinfo, 0, "name");
	Oid			argtypes[1] = {TEXTOID};
	Datum		values[1] = {PointerGetDatum(name)};

	if (dest_execute("UPDATE idempotency.destinations SET paused = true WHERE name = $1",
					 1, argtypes, values, NULL, SPI_OK_UPDATE) == 0)
		dest_report_missing(name);
	outbox_dests_changed_at_commit();
	dest_sync_note(name, false, false);
	PG_RETURN_VOID();
}

/*
 * idem_destination_resume(name): deliver again, after a pause, after the
 * endpoint disabled itself with 410 Gone, or after the relay disabled it for
 * failing longer than its disable_after.  The endpoint starts afresh: circuit
 * closed, no failures counted, no pacing.
 */
Datum
idem_destination_resume(PG_FUNCTION_ARGS)
{
	text	   *name = dest_name_arg(fcinfo, 0, "name");
	Oid			argtypes[1] = {TEXTOID};
	Datum		values[1] = {PointerGetDatum(name)};

	if (dest_execute("UPDATE idempotency.destinations"
					 "   SET paused = false, disabled_at = NULL, disabled_reason = NULL,"
					 "       circuit = 'closed', consecutive_failures = 0, failing_since = NULL,"
					 "       next_probe_at = NULL, paced_until = NULL"
					 " WHERE name = $1",
					 1, argtypes, values, NULL, SPI_OK_UPDATE) == 0)
		dest_report_missing(name);
	outbox_dests_changed_at_commit();
	dest_sync_note(name, false, true);
	PG_RETURN_VOID();
}

/*
 * idem_outbox_redrive(event_id, destination): send a dead-lettered event
 * again, under the same event id, to one destination or (NULL) to every
 * destination where it is dead.  Returns the number of deliveries redriven.
 */
Datum
idem_outbox_redrive(PG_FUNCTION_ARGS)
{
	Oid			argtypes[2] = {UUIDOID, TEXTOID};
	Datum		values[2];
	char		nulls[2] = {' ', ' '};
	uint64		n;

	values[0] = dest_arg(fcinfo, 0, "event_id");
	values[1] = PG_ARGISNULL(1) ? (Datum) 0 :
		PointerGetDatum(dest_name_arg(fcinfo, 1, "destination"));
	nulls[1] = PG_ARGISNULL(1) ? 'n' : ' ';
	if (!PG_ARGISNULL(1) &&
		dest_execute("SELECT FROM idempotency.destinations WHERE name = $1",
					 1, &argtypes[1], &values[1], NULL, SPI_OK_SELECT) == 0)
		dest_report_missing(PG_GETARG_TEXT_PP(1));

	n = dest_execute("UPDATE idempotency.deliveries x"
					 "   SET state = 'pending', attempts = 0, next_attempt_at = clock_timestamp(),"
					 "       visible_until = NULL"
					 "  FROM idempotency.destinations d"
					 " WHERE d.id = x.destination_id AND x.event_id = $1 AND x.state = 'dead'"
					 "   AND ($2 IS NULL OR d.name = $2)",
					 2, argtypes, values, nulls, SPI_OK_UPDATE);
	if (n > 0)
		outbox_wake_at_commit();
	PG_RETURN_INT64((int64) n);
}

/*
 * idem_outbox_redrive_dead(destination, since): redrive every dead letter of
 * a destination, or those dead-lettered at or after since.  A dead
 * delivery's next_attempt_at is when it was dead-lettered (the relay
 * records its outcome there; retention of orphans reads it the same way);
 * its last_attempt_at, when its last attempt was claimed, may be a
 * request's whole timeout earlier.
 */
Datum
idem_outbox_redrive_dead(PG_FUNCTION_ARGS)
{
	Oid			argtypes[2] = {TEXTOID, TIMESTAMPTZOID};
	Datum		values[2];
	char		nulls[2] = {' ', ' '};
	uint64		n;

	values[0] = PointerGetDatum(dest_name_arg(fcinfo, 0, "destination"));
	values[1] = PG_ARGISNULL(1) ? (Datum) 0 : PG_GETARG_DATUM(1);
	nulls[1] = PG_ARGISNULL(1) ? 'n' : ' ';
	if (dest_execute("SELECT FROM idempotency.destinations WHERE name = $1",
					 1, argtypes, values, NULL, SPI_OK_SELECT) == 0)
		dest_report_missing(PG_GETARG_TEXT_PP(0));

	n = dest_execute("UPDATE idempotency.deliveries x"
					 "   SET state = 'pending', attempts = 0, next_attempt_at = clock_timestamp(),"
					 "       visible_until = NULL"
					 "  FROM idempotency.destinations d"
					 " WHERE d.id = x.destination_id AND d.name = $1 AND x.state = 'dead'"
					 "   AND ($2 IS NULL OR x.next_attempt_at >= $2)",
					 2, argtypes, values, nulls, SPI_OK_UPDATE);
	if (n > 0)
		outbox_wake_at_commit();
	PG_RETURN_INT64((int64) n);
}
