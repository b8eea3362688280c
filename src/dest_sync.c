/*-------------------------------------------------------------------------
 *
 * dest_sync.c
 *	  Citus: outbox destinations managed on the coordinator reach every node.
 *
 * Each node of a Citus cluster keeps its own outbox: an event is published
 * into the outbox of the node whose transaction publishes it (a delegated
 * call runs on the tenant's worker), and that node's worker relays it.  So
 * every node needs the destinations.  A destination command run on the
 * coordinator (create, alter, drop, pause, resume) notes the destination's
 * name; just before the transaction commits, the destination as it now
 * stands on the coordinator -- its whole definition -- is sent to every
 * worker, where idem_destination_sync makes the worker's copy the same; a
 * destination dropped in the transaction goes first, as it was at its
 * first drop there, and the workers drop their copies of it.  A copy is
 * a destination of the same name, kind and target made by the same role
 * and, for a function destination, calling a function of the same schema,
 * name and owner; any other destination of that name is the worker's own
 * (made there): a worker refuses to change it, and a drop leaves it alone.
 * They are sent inside Citus's distributed transaction, and the workers
 * commit them with two-phase commit as the coordinator commits: every node
 * has a transaction's destination changes or none has, also through a
 * crash of the coordinator, and a worker that fails (down, or refusing the
 * definition) fails the coordinator's commit, with its error.  The
 * definitions travel as parameters of the statement where Citus takes
 * them, quoted into its text elsewhere (see shard_run_on_workers).  The
 * workers apply it as the extension's owner: the command's privileges are
 * checked on the coordinator, and each node makes the destination as the
 * role that made it on the coordinator, which a function destination's
 * calls run as.
 *
 * What a node's relay learns about an endpoint (failures, circuit, pacing,
 * disabling after 410 or disable_after) stays that node's; a resume on the
 * coordinator clears it everywhere, unless it was rolled back to a
 * savepoint.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/backend_status.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "compat.h"
#include "outbox.h"
#include "shards.h"

/* A destination changed in this transaction, to send to the workers at commit. */
typedef struct DestNote
{
	char	   *name;
	bool		resumed;		/* idem_destination_resume ran on it */
	SubTransactionId resumed_subid; /* in this subtransaction, or a child
									 * that committed into it */
	bool		created;		/* made by idem_destination_create here */
	SubTransactionId created_subid; /* in this subtransaction, or a child
									 * that committed into it */
	char	   *dropped;		/* its definition at the start, if dropped */
	int32		dropped_id;		/* and the id of that destination */
} DestNote;

static List *dest_notes = NIL;	/* in TopTransactionContext */
static bool dest_sync_registered = false;

static void dest_sync_xact_callback(XactEvent event, void *arg);
static void dest_sync_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
									   SubTransactionId parentSubid, void *arg);
static char *dest_sync_definition(const char *name, bool dropped, int32 *id);

/*
 * Mark note resumed, if resumed, in the current subtransaction: a rollback
 * of the resume (to a savepoint) must not clear what the workers' relays
 * learned.  The first resume that still stands is the one that counts.
 */
static void
dest_sync_note_resumed(DestNote *note, bool resumed)
{
	if (!resumed || note->resumed)
		return;
	note->resumed = true;
	note->resumed_subid = GetCurrentSubTransactionId();
}

/*
 * Mark note created, if created, in the current subtransaction: a create
 * rolled back to a savepoint did not make the name this transaction's, and
 * a later drop of it (made by another session since) must reach the
 * workers' copies.
 */
static void
dest_sync_note_created(DestNote *note, bool created)
{
	if (!created || note->created)
		return;
	note->created = true;
	note->created_subid = GetCurrentSubTransactionId();
}

/*
 * The note of name in this transaction, made if there is none (created and
 * resumed say by which command); NULL without Citus.
 */
static DestNote *
dest_sync_find_note(text *name, bool created, bool resumed)
{
	MemoryContext old;
	ListCell   *lc;
	DestNote   *note;

	if (!OidIsValid(get_extension_oid("citus", true)))
		return NULL;
	if (!dest_sync_registered)
	{
		RegisterXactCallback(dest_sync_xact_callback, NULL);
		RegisterSubXactCallback(dest_sync_subxact_callback, NULL);
		dest_sync_registered = true;
	}
	foreach(lc, dest_notes)
	{
		note = lfirst(lc);
		if (strcmp(note->name, text_to_cstring(name)) == 0)
		{
			dest_sync_note_created(note, created);
			dest_sync_note_resumed(note, resumed);
			return note;
		}
	}
	old = MemoryContextSwitchTo(TopTransactionContext);
	note = palloc0(sizeof(DestNote));
	note->name = text_to_cstring(name);
	dest_sync_note_created(note, created);
	dest_sync_note_resumed(note, resumed);
	dest_notes = lappend(dest_notes, note);
	MemoryContextSwitchTo(old);
	return note;
}

/*
 * A destination command changed name on this node: note it, so that the
 * workers get the destination at commit, if this is a Citus coordinator.
 */
void
dest_sync_note(text *name, bool created, bool resumed)
{
	(void) dest_sync_find_note(name, created, resumed);
}

/*
 * idem_destination_drop is about to drop name on this node: keep the
 * definition that the name had at its first drop in this transaction (the
 * commands before it keep kind, target and roles), so that the
 * workers drop their copies of that destination and no other destination
 * of theirs that has the name (one made there, say).  A name that this
 * transaction created had none: nothing of the workers' is dropped.
 */
void
dest_sync_note_drop(text *name)
{
	DestNote   *note;

	if (!OidIsValid(get_extension_oid("citus", true)) || !shard_citus_coordinator())
		return;
	note = dest_sync_find_note(name, false, false);
	if (note->created || note->dropped != NULL)
		return;
	/* Commands other than create and drop keep kind, target and roles. */
	note->dropped = dest_sync_definition(text_to_cstring(name), true, &note->dropped_id);
}

/*
 * The definition of destination name on this node, as idem_destination_sync
 * takes it (a jsonb text), or NULL if it does not exist; dropped marks it as
 * the definition of a destination dropped since.  The secrets and headers,
 * which the table keeps apart from the other options, go back into the
 * options.  Roles go by name (their OIDs are this node's): the role that
 * created the destination (a function destination runs as it), null if it
 * was dropped; and a function destination's function goes by schema, name
 * and owner (its signature is always (jsonb)), all null if it was dropped.
 * Sets *id to the destination's id (another one if it was made again).
 */
static char *
dest_sync_definition(const char *name, bool dropped, int32 *id)
{
	OutboxOwnerState owner;
	Oid			argtypes[2] = {TEXTOID, BOOLOID};
	Datum		values[2] = {CStringGetTextDatum(name), BoolGetDatum(dropped)};
	char	   *definition = NULL;

	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute_with_args("SELECT jsonb_build_object('kind', kind, 'target', target,"
							  "        'topics', topics::text, 'paused', paused,"
							  "        'search_path', search_path,"
							  "        'run_as', (SELECT rolname FROM pg_catalog.pg_roles WHERE oid = run_as),"
							  "        'func_schema', (SELECT n.nspname FROM pg_catalog.pg_proc p"
							  "            JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE p.oid = func),"
							  "        'func_name', (SELECT proname FROM pg_catalog.pg_proc WHERE oid = func),"
							  "        'func_owner', (SELECT r.rolname FROM pg_catalog.pg_proc p"
							  "            JOIN pg_catalog.pg_roles r ON r.oid = p.proowner WHERE p.oid = func),"
							  "        'dropped', $2,"
							  "        'options', options || jsonb_strip_nulls(jsonb_build_object("
							  "            'secrets', to_jsonb(secrets), 'headers', headers)))::text, id"
							  "  FROM idempotency.destinations WHERE name = $1",
							  2, argtypes, values, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read outbox destination \"%s\"", name);
	if (SPI_processed == 1)
	{
		char	   *d = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		bool		isnull;

		definition = MemoryContextStrdup(TopTransactionContext, d);
		*id = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	}
	SPI_finish();
	outbox_restore_user(&owner);
	return definition;
}

/*
 * Append to calls one call of idem_destination_sync, for name and
 * definition, which go as the next two parameters of the statement (values,
 * nvalues so far).  The calls are the arguments of one concat(), which
 * calls them in order.
 */
static void
dest_sync_append_call(StringInfo calls, const char **values, int *nvalues,
					  const char *schema, const char *name, const char *definition,
					  bool resumed)
{
	appendStringInfo(calls, "%s%s.idem_destination_sync($%d, $%d::pg_catalog.jsonb, %s)",
					 calls->len > 0 ? ", " : "SELECT pg_catalog.concat(",
					 quote_identifier(schema), *nvalues + 1, *nvalues + 2,
					 resumed ? "true" : "false");
	values[(*nvalues)++] = name;
	values[(*nvalues)++] = definition;
}

/*
 * Run the statement calls, with its nvalues parameters, on the workers as
 * the role the caller became (owner); a worker's error is reported with the
 * names of the nnames destinations sent, Citus's message (a worker's,
 * with the worker in the context), detail and hint as the detail, and the
 * same SQLSTATE, after going back to the caller's role.
 */
static void
dest_sync_run(const char *calls, int nvalues, const char **values,
			  const char *names, int nnames, OutboxOwnerState *owner)
{
	MemoryContext oldcontext = CurrentMemoryContext;

	shard_check_workers();
	PG_TRY();
	{
		shard_run_on_workers(calls, nvalues, values,
							 GetUserNameFromId(GetUserId(), false));
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(oldcontext);
		edata = CopyErrorData();
		FlushErrorState();
		outbox_restore_user(owner);
		/* A serialization failure or deadlock (class 40) is retried as anywhere. */
		ereport(ERROR,
				(errcode(edata->sqlerrcode),
				 nnames == 1 ?
				 errmsg("sending outbox destination %s to the Citus workers failed", names) :
				 errmsg("sending outbox destinations %s to the Citus workers failed", names),
				 errdetail("Citus reported: %s.%s%s%s%s", edata->message,
						   edata->detail ? " " : "", edata->detail ? edata->detail : "",
						   edata->hint ? " " : "", edata->hint ? edata->hint : ""),
				 edata->context ? errcontext("%s", edata->context) : 0,
				 ERRCODE_TO_CATEGORY(edata->sqlerrcode) == ERRCODE_TRANSACTION_ROLLBACK ?
				 errhint("Nothing changed on any node.  The transaction might succeed if retried.") :
				 errhint("Nothing changed on any node.  Once the failing worker is up, or has dropped a destination of its own that has such a name, run the same commands again.")));
	}
	PG_END_TRY();
}

/*
 * Send the noted destinations to every worker, as the extension's owner,
 * before this coordinator commits, inside its distributed transaction
 * (shard_run_on_workers): every worker commits them when this node
 * commits, or none does.  The definitions, secrets included, are
 * parameters of the statement (see shard_run_on_workers).
 */
static void
dest_sync_send(void)
{
	List	   *notes = dest_notes;
	ListCell   *lc;
	char	   *schema;
	OutboxOwnerState owner;
	StringInfoData calls;
	StringInfoData names;
	const char **values;
	int			nvalues = 0;
	int			nnames = 0;

	dest_notes = NIL;
	if (notes == NIL || !shard_citus_coordinator())
		return;
	schema = get_namespace_name(get_extension_schema(get_extension_oid("idempotency", false)));

	/*
	 * The command's privileges were checked here; the workers apply its
	 * result as the extension's owner, over connections of that role, so
	 * that an operator granted only the command needs no grant of
	 * idem_destination_sync on the workers (which would let it make any
	 * destination there).  The workers make the destination as the role
	 * that made it here, which a function destination's calls run as.  A
	 * destination dropped, and maybe made again, in this transaction is
	 * dropped on the workers first.
	 */
	initStringInfo(&calls);
	initStringInfo(&names);
	/* At most two calls a note (its drop, its definition), two values each. */
	values = palloc(sizeof(char *) * 4 * list_length(notes));
	outbox_become_owner(&owner);
	foreach(lc, notes)
	{
		DestNote   *note = lfirst(lc);
		int32		id = 0;
		char	   *definition = dest_sync_definition(note->name, false, &id);
		bool		send_drop;

		/* Not if the drop was rolled back (to a savepoint): the same one. */
		send_drop = note->dropped != NULL && (definition == NULL || id != note->dropped_id);
		if (send_drop)
			dest_sync_append_call(&calls, values, &nvalues, schema, note->name,
								  note->dropped, false);
		if (definition != NULL)
			dest_sync_append_call(&calls, values, &nvalues, schema, note->name,
								  definition, note->resumed);
		if (send_drop || definition != NULL)
		{
			appendStringInfo(&names, "%s\"%s\"", nnames > 0 ? ", " : "", note->name);
			nnames++;
		}
	}
	if (calls.len == 0)
	{
		outbox_restore_user(&owner);
		return;
	}
	appendStringInfoChar(&calls, ')');
	dest_sync_run(calls.data, nvalues, values, names.data, nnames, &owner);
	outbox_restore_user(&owner);
}

/* Before commit (or prepare): the workers get the destinations changed here. */
static void
dest_sync_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_PREPARE:

			/*
			 * The workers get the changes in Citus's distributed
			 * transaction, which Citus commits or aborts with this node's
			 * COMMIT or ROLLBACK: a prepared transaction of this node would
			 * leave them unsent.
			 */
			if (dest_notes == NIL)
				break;
			PushActiveSnapshot(GetTransactionSnapshot());
			if (shard_citus_coordinator())
				ereport(ERROR,
						(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
						 errmsg("cannot prepare a transaction that changed outbox destinations on a Citus coordinator")));
			PopActiveSnapshot();
			break;
		case XACT_EVENT_PRE_COMMIT:
			if (dest_notes != NIL)
			{
				PushActiveSnapshot(GetTransactionSnapshot());
				dest_sync_send();
				PopActiveSnapshot();
			}
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PREPARE:
			dest_notes = NIL;	/* its memory goes with the transaction */
			break;
		default:
			break;
	}
}

/*
 * A create or resume noted in a subtransaction belongs to its parent when
 * the subtransaction commits, and is undone when it aborts.
 */
static void
dest_sync_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						   SubTransactionId parentSubid, void *arg)
{
	ListCell   *lc;

	if (event != SUBXACT_EVENT_COMMIT_SUB && event != SUBXACT_EVENT_ABORT_SUB)
		return;
	foreach(lc, dest_notes)
	{
		DestNote   *note = lfirst(lc);

		if (note->created && note->created_subid == mySubid)
		{
			if (event == SUBXACT_EVENT_COMMIT_SUB)
				note->created_subid = parentSubid;
			else
				note->created = false;
		}
		if (note->resumed && note->resumed_subid == mySubid)
		{
			if (event == SUBXACT_EVENT_COMMIT_SUB)
				note->resumed_subid = parentSubid;
			else
				note->resumed = false;
		}
	}
}

/* A key of definition, or NULL. */
static JsonbValue *
dest_sync_field(Jsonb *definition, const char *key)
{
	return getKeyJsonValueFromContainer(&definition->root, key, strlen(key), NULL);
}

/* A text field of definition, which must be there. */
static char *
dest_sync_text(Jsonb *definition, const char *key)
{
	JsonbValue *v = dest_sync_field(definition, key);

	if (v == NULL || v->type != jbvString)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("destination definition has no \"%s\"", key)));
	return pnstrdup(v->val.string.val, v->val.string.len);
}

/* A field of definition as a jsonb of its own (an object or an array). */
static Datum
dest_sync_jsonb(Jsonb *definition, const char *key)
{
	JsonbValue *v = dest_sync_field(definition, key);

	if (v == NULL || v->type != jbvBinary)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("destination definition has no \"%s\"", key)));
	return JsonbPGetDatum(JsonbValueToJsonb(v));
}

/* The topics of definition (a text[] in its text form), validated. */
static Datum
dest_sync_topics(Jsonb *definition)
{
	/* array_in keeps a cache in its FmgrInfo: not a DirectFunctionCall. */
	Datum		topics = OidInputFunctionCall(F_ARRAY_IN, dest_sync_text(definition, "topics"),
											  TEXTOID, -1);

	dest_check_topics(DatumGetArrayTypeP(topics));
	return topics;
}

/* Run one statement on the destinations as their owner. */
static uint64
dest_sync_execute(const char *sql, int nargs, Oid *argtypes, Datum *values)
{
	OutboxOwnerState owner;
	uint64		processed;

	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute_with_args(sql, nargs, argtypes, values, NULL, false, 0) < 0)
		elog(ERROR, "could not update the outbox destinations");
	processed = SPI_processed;
	SPI_finish();
	outbox_restore_user(&owner);
	return processed;
}

/* This node's destination of a name, as idem_destination_sync compares it. */
typedef struct DestHere
{
	bool		exists;
	char	   *kind;
	char	   *target;
	Oid			run_as;
	Oid			func;			/* InvalidOid unless a function destination */
	char	   *func_text;		/* func as regprocedure text */
	bool		func_named;		/* its target still names func */
} DestHere;

/* Read (and lock) this node's destination name into here. */
static void
dest_sync_read_here(text *name, DestHere *here)
{
	OutboxOwnerState owner;
	MemoryContext outer = CurrentMemoryContext;
	Oid			argtypes[1] = {TEXTOID};
	Datum		values[1] = {PointerGetDatum(name)};

	memset(here, 0, sizeof(DestHere));
	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute_with_args("SELECT kind, target, run_as, func::oid, func::regprocedure::text,"
							  "       CASE WHEN kind = 'function' THEN func = to_regprocedure(target) END"
							  "  FROM idempotency.destinations WHERE name = $1 FOR UPDATE",
							  1, argtypes, values, NULL, false, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox destinations");
	here->exists = SPI_processed == 1;
	if (here->exists)
	{
		HeapTuple	tup = SPI_tuptable->vals[0];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		char	   *func_text = SPI_getvalue(tup, desc, 5);
		bool		isnull;
		Datum		d;

		/* SPI_finish frees what SPI_getvalue returns: copies outlive it. */
		here->kind = MemoryContextStrdup(outer, SPI_getvalue(tup, desc, 1));
		here->target = MemoryContextStrdup(outer, SPI_getvalue(tup, desc, 2));
		here->run_as = DatumGetObjectId(SPI_getbinval(tup, desc, 3, &isnull));
		d = SPI_getbinval(tup, desc, 4, &isnull);
		here->func = isnull ? InvalidOid : DatumGetObjectId(d);
		here->func_text = func_text ? MemoryContextStrdup(outer, func_text) :
			MemoryContextStrdup(outer, psprintf("%u", here->func));
		d = SPI_getbinval(tup, desc, 6, &isnull);
		here->func_named = !isnull && DatumGetBool(d);
	}
	SPI_finish();
	outbox_restore_user(&owner);
}

/*
 * The field of a definition that says which function the coordinator's
 * destination calls: its schema, null if that function was dropped; NULL
 * when the definition does not say (a superuser's own call).
 */
static JsonbValue *
dest_sync_func_field(Jsonb *definition)
{
	return dest_sync_field(definition, "func_schema");
}

/*
 * Whether this node's destination here is a copy of the coordinator's
 * definition: the same kind and target, made by the same role (or, the
 * coordinator's having been dropped, by a role that no longer exists here
 * either) and, for a function destination, calling a function of the same
 * schema, name and owner as the coordinator's (or, that one having been
 * dropped, none that exists here either).  A destination of this node's
 * own is never taken over.  With report, a difference is an error that
 * names it; otherwise the answer is false.
 */
static bool
dest_sync_is_copy(text *name, Jsonb *definition, const DestHere *here, bool report)
{
	char	   *kind = dest_sync_text(definition, "kind");
	char	   *target = dest_sync_text(definition, "target");
	JsonbValue *run_as_field;
	JsonbValue *func_field;
	char	   *here_role;
	HeapTuple	proc;

	if (strcmp(here->kind, kind) != 0 || strcmp(here->target, target) != 0)
	{
		if (report)
			ereport(ERROR,
					(errcode(ERRCODE_DUPLICATE_OBJECT),
					 errmsg("destination \"%s\" on this node is a %s destination to %s, not a %s destination to %s",
							text_to_cstring(name), here->kind, here->target, kind, target),
					 errhint("Drop it on this node first.")));
		return false;
	}

	/*
	 * The coordinator sends the role by name, or null when it was dropped
	 * there; a definition without it (a superuser's own call) means the
	 * caller.
	 */
	here_role = GetUserNameFromId(here->run_as, true);
	run_as_field = dest_sync_field(definition, "run_as");
	if (run_as_field != NULL && run_as_field->type == jbvNull)
	{
		if (here_role != NULL)
		{
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node belongs to role \"%s\", but the role that created it on the coordinator no longer exists",
								text_to_cstring(name), here_role),
						 errhint("Drop it on this node first.")));
			return false;
		}
	}
	else
	{
		Oid			run_as = run_as_field == NULL ? GetUserId() :
			get_role_oid(dest_sync_text(definition, "run_as"), !report);

		if (here->run_as != run_as)
		{
			if (!report)
				return false;
			if (here_role == NULL)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node belongs to a role that no longer exists, not to \"%s\"",
								text_to_cstring(name), GetUserNameFromId(run_as, false)),
						 errhint("Drop it on this node first.")));
			ereport(ERROR,
					(errcode(ERRCODE_DUPLICATE_OBJECT),
					 errmsg("destination \"%s\" on this node belongs to role \"%s\", not to \"%s\"",
							text_to_cstring(name), here_role, GetUserNameFromId(run_as, false)),
					 errhint("Drop it on this node first.")));
		}
	}
	if (strcmp(kind, "function") != 0)
		return true;

	/*
	 * The function: the coordinator's own, which a rename there (and here)
	 * may have moved away from the target's text; a definition without it
	 * (a superuser's own call) compares with the function the target names.
	 */
	func_field = dest_sync_func_field(definition);
	proc = SearchSysCache1(PROCOID, ObjectIdGetDatum(here->func));
	if (func_field == NULL)
	{
		if (HeapTupleIsValid(proc))
			ReleaseSysCache(proc);
		if (!here->func_named)
		{
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node calls %s, not %s",
								text_to_cstring(name), here->func_text, target),
						 errhint("Drop it on this node first.")));
			return false;
		}
		return true;
	}
	if (func_field->type == jbvNull)
	{
		/* Dropped on the coordinator: a copy calls none either. */
		if (HeapTupleIsValid(proc))
		{
			ReleaseSysCache(proc);
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node calls %s, but the function of the destination on the coordinator no longer exists",
								text_to_cstring(name), here->func_text),
						 errhint("Drop it on this node first.")));
			return false;
		}
		return true;
	}
	else
	{
		Form_pg_proc form;
		char	   *schema = dest_sync_text(definition, "func_schema");
		char	   *func_name = dest_sync_text(definition, "func_name");
		char	   *owner = dest_sync_text(definition, "func_owner");
		char	   *here_schema;
		char	   *here_owner;
		bool		same_name;

		if (!HeapTupleIsValid(proc))
		{
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node calls a function that no longer exists, not %s(jsonb)",
								text_to_cstring(name), quote_qualified_identifier(schema, func_name)),
						 errhint("Drop it on this node first.")));
			return false;
		}
		form = (Form_pg_proc) GETSTRUCT(proc);
		here_schema = get_namespace_name(form->pronamespace);
		here_owner = GetUserNameFromId(form->proowner, true);
		same_name = here_schema != NULL && strcmp(here_schema, schema) == 0 &&
			strcmp(NameStr(form->proname), func_name) == 0;
		ReleaseSysCache(proc);
		if (!same_name)
		{
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_DUPLICATE_OBJECT),
						 errmsg("destination \"%s\" on this node calls %s, not %s(jsonb)",
								text_to_cstring(name), here->func_text,
								quote_qualified_identifier(schema, func_name)),
						 errhint("Drop it on this node first.")));
			return false;
		}

		/*
		 * A function of the same name made here by another role than the
		 * coordinator's function's owner (where DDL does not propagate, say)
		 * would run that role's code as the destination's role.
		 */
		if (here_owner == NULL || strcmp(here_owner, owner) != 0)
		{
			if (report)
				ereport(ERROR,
						(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
						 errmsg("destination \"%s\" on this node calls %s, owned by role \"%s\", not by \"%s\" as on the coordinator",
								text_to_cstring(name), here->func_text,
								here_owner ? here_owner : "", owner),
						 errhint("Make the function on this node as the role that owns it on the coordinator.")));
			return false;
		}
	}
	return true;
}

PG_FUNCTION_INFO_V1(idem_destination_sync);

/*
 * idem_destination_sync(name, definition, resumed): make this node's
 * destination name the one definition describes, as the coordinator sends
 * it (see the file header).  A destination that is not here is created
 * with the coordinator's definition; a copy of it that is here gets its
 * topics, options and pause from it (a destination of this node's own that
 * is not a copy is refused); resumed clears what this node's relay learned
 * about the endpoint.  A definition marked dropped drops the copy, and
 * leaves a destination of this node's own alone.  NULL drops whatever
 * destination name is (a superuser's own call).  For the rest of its
 * transaction, an error does not log its statement.
 */
Datum
idem_destination_sync(PG_FUNCTION_ARGS)
{
	text	   *name;
	Jsonb	   *definition = PG_ARGISNULL(1) ? NULL : PG_GETARG_JSONB_P(1);
	bool		resumed = !PG_ARGISNULL(2) && PG_GETARG_BOOL(2);
	Oid			argtypes[2] = {TEXTOID, TEXTOID};
	Datum		values[2];
	char	   *kind;
	char	   *target;
	JsonbValue *run_as_field;
	JsonbValue *func_field;
	JsonbValue *paused;
	JsonbValue *dropped;
	DestHere	here;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("name must not be null")));
	name = PG_GETARG_TEXT_PP(0);

	/*
	 * The definition, secrets included, is part of the statement's text
	 * where Citus takes no parameters (built for PostgreSQL 16 and later):
	 * an error of this transaction does not log the statement, and
	 * pg_stat_activity (and with it a deadlock's report and the log line
	 * of a backend's crash) shows another text.
	 */
	(void) set_config_option("log_min_error_statement", "panic", PGC_SUSET, PGC_S_SESSION,
							 GUC_ACTION_LOCAL, true, 0, false);
	pgstat_report_activity(STATE_RUNNING, "SELECT idem_destination_sync(...) -- the definition is not shown");
	values[0] = PointerGetDatum(name);
	dest_sync_read_here(name, &here);

	if (definition == NULL)
	{
		if (here.exists)
			(void) DirectFunctionCall1(idem_destination_drop, PointerGetDatum(name));
		PG_RETURN_VOID();
	}
	dropped = dest_sync_field(definition, "dropped");
	if (dropped != NULL && dropped->type == jbvBool && dropped->val.boolean)
	{
		if (here.exists && dest_sync_is_copy(name, definition, &here, false))
			(void) DirectFunctionCall1(idem_destination_drop, PointerGetDatum(name));
		PG_RETURN_VOID();
	}

	kind = dest_sync_text(definition, "kind");
	target = dest_sync_text(definition, "target");
	if (!here.exists)
	{
		int			save_nestlevel = NewGUCNestLevel();
		Oid			run_as = GetUserId();
		Oid			save_userid;
		int			save_sec_context;
		Datum		topics;

		/*
		 * The destination is made by the role that made it on the
		 * coordinator (a function destination runs as it, and that role
		 * must be allowed to call the function here too), and a function
		 * destination resolves its target as there.  Neither a role nor a
		 * function dropped there can be made again here.
		 */
		run_as_field = dest_sync_field(definition, "run_as");
		if (run_as_field != NULL)
		{
			if (run_as_field->type == jbvNull)
				ereport(ERROR,
						(errcode(ERRCODE_UNDEFINED_OBJECT),
						 errmsg("the role that created destination \"%s\" no longer exists",
								text_to_cstring(name)),
						 errhint("Drop the destination and create it again.")));
			run_as = get_role_oid(dest_sync_text(definition, "run_as"), false);
		}
		func_field = dest_sync_func_field(definition);
		if (strcmp(kind, "function") == 0 && func_field != NULL && func_field->type == jbvNull)
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_FUNCTION),
					 errmsg("the function of destination \"%s\" no longer exists",
							text_to_cstring(name)),
					 errhint("Drop the destination and create it again.")));
		(void) set_config_option("search_path", dest_sync_text(definition, "search_path"),
								 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
		topics = dest_sync_topics(definition);
		GetUserIdAndSecContext(&save_userid, &save_sec_context);
		SetUserIdAndSecContext(run_as, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
		(void) DirectFunctionCall5(idem_destination_create, PointerGetDatum(name),
								   CStringGetTextDatum(kind), CStringGetTextDatum(target),
								   topics, dest_sync_jsonb(definition, "options"));
		SetUserIdAndSecContext(save_userid, save_sec_context);
		AtEOXact_GUC(true, save_nestlevel);

		/* Its target may name another role's function here than there. */
		dest_sync_read_here(name, &here);
		(void) dest_sync_is_copy(name, definition, &here, true);
	}
	else
	{
		(void) dest_sync_is_copy(name, definition, &here, true);
		(void) DirectFunctionCall2(idem_destination_alter, PointerGetDatum(name),
								   dest_sync_jsonb(definition, "options"));
		argtypes[1] = TEXTARRAYOID;
		values[1] = dest_sync_topics(definition);
		(void) dest_sync_execute("UPDATE idempotency.destinations SET topics = $2 WHERE name = $1",
								 2, argtypes, values);
		argtypes[1] = TEXTOID;
	}

	paused = dest_sync_field(definition, "paused");
	if (resumed)
		(void) DirectFunctionCall1(idem_destination_resume, PointerGetDatum(name));
	if (paused != NULL && paused->type == jbvBool)
	{
		values[1] = CStringGetTextDatum(paused->val.boolean ? "true" : "false");
		(void) dest_sync_execute("UPDATE idempotency.destinations SET paused = $2::boolean"
								 " WHERE name = $1", 2, argtypes, values);
	}
	outbox_dests_changed_at_commit();
	PG_RETURN_VOID();
}

PG_FUNCTION_INFO_V1(idem_citus_send_destinations);

/*
 * idem_citus_send_destinations(): every destination of this coordinator goes
 * to every worker at commit, as after a command on each: for workers that
 * joined since the destinations were made (idem_citus_distribute calls it).
 * Returns how many.
 */
Datum
idem_citus_send_destinations(PG_FUNCTION_ARGS)
{
	OutboxOwnerState owner;
	MemoryContext outer = CurrentMemoryContext;
	List	   *names = NIL;
	ListCell   *lc;

	outbox_become_owner(&owner);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT name FROM idempotency.destinations ORDER BY name", true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox destinations");
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		bool		isnull;
		Datum		d = SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1, &isnull);
		MemoryContext spi = MemoryContextSwitchTo(outer);

		/* SPI_finish frees SPI's memory: the list outlives it. */
		names = lappend(names, DatumGetTextPCopy(d));
		MemoryContextSwitchTo(spi);
	}
	SPI_finish();
	outbox_restore_user(&owner);
	foreach(lc, names)
		dest_sync_note(lfirst(lc), false, false);
	PG_RETURN_INT32(list_length(names));
}

