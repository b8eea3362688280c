/*-------------------------------------------------------------------------
 *
 * relay_circuit.c
 *	  Per-destination endpoint state of the outbox relay: consecutive
 *	  failures, the circuit (closed, open with one probe at a time), pacing
 *	  by Retry-After, and disabling (after disable_after, or on 410 Gone).
 *
 * The state lives in idempotency.destinations (circuit,
 * consecutive_failures, failing_since, next_probe_at, paced_until,
 * disabled_at, disabled_reason), so that a restart keeps it and every relay
 * process sees the same.  It is written in the transaction that records the
 * outcomes that changed it (relay_endpoint_states), and a probe is claimed
 * in the claiming transaction (relay_claim_probes).  A change that meets
 * the row held by another transaction is kept in this backend's memory
 * (EndpointDelta) and written at the next opportunity.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "relay_http.h"
#include "relay_internal.h"

/* The saved statements. */
static SPIPlanPtr state_read_plan = NULL;
static SPIPlanPtr state_lock_plan = NULL;
static SPIPlanPtr state_write_plan = NULL;
static SPIPlanPtr probe_plan = NULL;
static SPIPlanPtr probe_attempt_plan = NULL;
static SPIPlanPtr disable_plan = NULL;
static SPIPlanPtr disable_check_plan = NULL;

/* An endpoint's state, as idempotency.destinations keeps it (0: NULL). */
typedef struct EndpointState
{
	bool		open;
	int32		failures;
	TimestampTz failing_since;
	TimestampTz next_probe;
	TimestampTz paced_until;
} EndpointState;

/*
 * Outcomes of an endpoint that could not be written to its row (another
 * transaction held it), summed up so that applying them to the row's state
 * later gives what applying each in turn would have: whether one succeeded
 * (then only what came after it counts), the failures since (429s aside),
 * the first failure or rate limit since, the latest Retry-After's end, and
 * the reason of a 410 Gone that disables it (empty if none).  With the
 * destination's options as last seen, for a delta applied without outcomes
 * of its own.
 */
typedef struct EndpointDelta
{
	int32		dest_id;
	char		name[OUTBOX_MAX_NAME_LEN + 1];
	int32		failure_threshold;
	int64		backoff_base_ms;
	int64		backoff_cap_ms;
	int64		disable_after_ms;
	bool		succeeded;
	int32		failures;
	TimestampTz first_failed_at;
	TimestampTz paced_until;
	char		last_error[256];
	char		disable_reason[128];
} EndpointDelta;

/*
 * The deltas not written yet (committed: what the last transaction that
 * recorded outcomes left), and those of the current transaction, which
 * replace them when it commits (staged, made in subtransaction staged_subid
 * or below it).
 */
static MemoryContext delta_cxt = NULL;
static List *deltas = NIL;
static List *staged = NIL;
static bool staged_valid = false;
static SubTransactionId staged_subid = InvalidSubTransactionId;

/* Read an endpoint's state from column 2 on of the current SPI row. */
static void
endpoint_state_read(HeapTuple tup, TupleDesc desc, EndpointState *st)
{
	bool		isnull;
	Datum		v;

	st->open = DatumGetBool(SPI_getbinval(tup, desc, 2, &isnull));
	st->failures = DatumGetInt32(SPI_getbinval(tup, desc, 3, &isnull));
	v = SPI_getbinval(tup, desc, 4, &isnull);
	st->failing_since = isnull ? 0 : DatumGetTimestampTz(v);
	v = SPI_getbinval(tup, desc, 5, &isnull);
	st->next_probe = isnull ? 0 : DatumGetTimestampTz(v);
	v = SPI_getbinval(tup, desc, 6, &isnull);
	st->paced_until = isnull ? 0 : DatumGetTimestampTz(v);
}

/* Whether it is an outcome of destination d's endpoint to apply. */
static inline bool
endpoint_outcome_of(const RelayItem *it, const RelayDest *d)
{
	return it->dest != NULL && it->dest_id == d->id &&
		(it->outcome == RELAY_DELIVERED || it->outcome == RELAY_FAILED);
}

/*
 * Apply to destination d's state st the delta not written yet (x, or NULL),
 * then the outcomes of its deliveries in items, in the order they came, and
 * set each delivery's while_open, rescheduled and retry_at (see
 * relay_endpoint_states).  *why becomes the reason to disable it (or NULL);
 * *opened says the circuit opened now.
 */
static void
endpoint_state_apply(EndpointState *st, const RelayDest *d, const EndpointDelta *x,
					 RelayItem **items, int n, TimestampTz now, char **why, bool *opened)
{
	bool		failed_open = false;
	bool		failed = false;
	const char *last_error = NULL;

	*why = NULL;
	*opened = false;
	if (x != NULL)
	{
		if (x->succeeded)
		{
			st->open = false;
			st->failures = 0;
			st->failing_since = 0;
			st->next_probe = 0;
		}
		if (x->first_failed_at != 0)
		{
			failed = true;
			last_error = x->last_error;
			if (st->failing_since == 0)
				st->failing_since = x->first_failed_at;
		}
		if (x->failures > 0)
		{
			if (st->open)
				failed_open = true;
			st->failures = (int32) Min((int64) st->failures + x->failures, PG_INT32_MAX);
			if (!st->open && st->failures >= d->failure_threshold)
			{
				st->open = true;
				*opened = true;
			}
		}
		st->paced_until = Max(st->paced_until, x->paced_until);
	}
	/* Pacing that has run out is over. */
	if (st->paced_until != 0 && st->paced_until <= now)
		st->paced_until = 0;
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];

		if (!endpoint_outcome_of(it, d))
			continue;
		it->while_open = false;
		it->rescheduled = false;
		it->retry_at = 0;
		if (it->outcome == RELAY_DELIVERED)
		{
			st->open = false;
			st->failures = 0;
			st->failing_since = 0;
			st->next_probe = 0;
			continue;
		}
		failed = true;
		last_error = it->error;
		/* A failure or a rate limit: the endpoint is failing since then. */
		if (st->failing_since == 0)
			st->failing_since = it->finished_at;
		/* The endpoint rescheduled it: not a failure of the event. */
		it->rescheduled = (it->status == 429 || it->retry_after_ms >= 0);
		if (it->status != 429)
		{
			if (st->open)
			{
				it->while_open = true;
				failed_open = true;
			}
			st->failures++;
			if (!st->open && st->failures >= d->failure_threshold)
			{
				st->open = true;
				*opened = true;
			}
		}
		if (it->retry_after_ms >= 0)
		{
			TimestampTz until = it->finished_at +
				Min(it->retry_after_ms, d->backoff_cap_ms) * 1000;

			it->retry_at = until;
			st->paced_until = Max(st->paced_until, until);
		}
	}

	if (st->open && (*opened || failed_open))
	{
		int			k = Min(Max(st->failures - d->failure_threshold, 0), 30);
		double		wait = Min((double) d->backoff_base_ms * pow(2.0, k),
							   (double) d->backoff_cap_ms);

		st->next_probe = Max(now + (int64) wait * 1000, st->paced_until);
	}
	if (!st->open)
		st->next_probe = 0;
	/* Failures while open wait for the next probe. */
	for (int i = 0; i < n; i++)
		if (endpoint_outcome_of(items[i], d) && items[i]->while_open)
			items[i]->retry_at = Max(st->next_probe, items[i]->retry_at);

	/* A 410 Gone kept for later disables it, whatever the rest. */
	if (x != NULL && x->disable_reason[0] != '\0')
		*why = pstrdup(x->disable_reason);
	/* Failing (or rate limited) since longer than disable_after, open or not. */
	else if (failed && st->failing_since != 0 &&
			 now - st->failing_since >= d->disable_after_ms * 1000)
		*why = psprintf("failing since %s, longer than disable_after (%lld ms); last error: %s",
						timestamptz_to_str(st->failing_since),
						(long long) d->disable_after_ms,
						last_error ? last_error : "?");
}

/* Add the outcomes of destination d's deliveries in items to its delta x. */
static void
endpoint_delta_add(EndpointDelta *x, const RelayDest *d, RelayItem **items, int n)
{
	x->dest_id = d->id;
	strlcpy(x->name, d->name, sizeof(x->name));
	x->failure_threshold = d->failure_threshold;
	x->backoff_base_ms = d->backoff_base_ms;
	x->backoff_cap_ms = d->backoff_cap_ms;
	x->disable_after_ms = d->disable_after_ms;
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];

		if (!endpoint_outcome_of(it, d))
			continue;
		if (it->outcome == RELAY_DELIVERED)
		{
			x->succeeded = true;
			x->failures = 0;
			x->first_failed_at = 0;
			x->last_error[0] = '\0';
			continue;
		}
		if (x->first_failed_at == 0)
			x->first_failed_at = it->finished_at;
		if (it->status != 429 && x->failures < PG_INT32_MAX)
			x->failures++;
		strlcpy(x->last_error, it->error ? it->error : "?", sizeof(x->last_error));
		if (it->retry_after_ms >= 0)
			x->paced_until = Max(x->paced_until, it->finished_at +
								 Min(it->retry_after_ms, d->backoff_cap_ms) * 1000);
	}
}

/* The deltas as the current transaction sees them (staged, or committed). */
static List *
endpoint_deltas_current(void)
{
	return staged_valid ? staged : deltas;
}

/* The current delta of destination id, or NULL. */
static EndpointDelta *
endpoint_delta_find(int32 id)
{
	ListCell   *lc;

	foreach(lc, endpoint_deltas_current())
	{
		EndpointDelta *x = lfirst(lc);

		if (x->dest_id == id)
			return x;
	}
	return NULL;
}

/* The staged deltas replace the committed ones when the transaction commits. */
static void
endpoint_deltas_xact(XactEvent event, void *arg)
{
	if (!staged_valid)
		return;
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT)
	{
		list_free_deep(deltas);
		deltas = staged;
	}
	else if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
			 event == XACT_EVENT_PREPARE)
		list_free_deep(staged);	/* prepared: its outcomes went with it */
	else
		return;
	staged = NIL;
	staged_valid = false;
}

/* A subtransaction that staged deltas and is rolled back takes them with it. */
static void
endpoint_deltas_subxact(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	if (staged_valid && event == SUBXACT_EVENT_ABORT_SUB && staged_subid >= mySubid)
	{
		list_free_deep(staged);
		staged = NIL;
		staged_valid = false;
	}
}

/*
 * Stage the deltas the current transaction leaves: those it neither wrote
 * (written) nor added to (add, with their destination in add_dests), and
 * the added ones.
 */
static void
endpoint_deltas_stage(int32 *written, int nwritten, RelayDest **add_dests, int nadd,
					  RelayItem **items, int n)
{
	List	   *next = NIL;
	ListCell   *lc;
	MemoryContext old;

	if (delta_cxt == NULL)
	{
		delta_cxt = AllocSetContextCreate(TopMemoryContext, "outbox endpoint deltas",
										  ALLOCSET_SMALL_SIZES);
		RegisterXactCallback(endpoint_deltas_xact, NULL);
		RegisterSubXactCallback(endpoint_deltas_subxact, NULL);
	}
	old = MemoryContextSwitchTo(delta_cxt);
	foreach(lc, endpoint_deltas_current())
	{
		EndpointDelta *x = lfirst(lc);
		bool		gone = false;

		for (int j = 0; j < nwritten && !gone; j++)
			gone = (written[j] == x->dest_id);
		for (int j = 0; j < nadd && !gone; j++)
			gone = (add_dests[j]->id == x->dest_id);
		if (!gone)
			next = lappend(next, memcpy(palloc(sizeof(EndpointDelta)), x, sizeof(EndpointDelta)));
	}
	for (int j = 0; j < nadd; j++)
	{
		EndpointDelta *x = palloc0(sizeof(EndpointDelta));
		EndpointDelta *had = endpoint_delta_find(add_dests[j]->id);

		if (had != NULL)
			memcpy(x, had, sizeof(EndpointDelta));
		endpoint_delta_add(x, add_dests[j], items, n);
		next = lappend(next, x);
	}
	MemoryContextSwitchTo(old);
	if (staged_valid)
		list_free_deep(staged);
	staged = next;
	staged_valid = true;
	staged_subid = GetCurrentSubTransactionId();
}

/* See relay_internal.h. */
bool
relay_endpoint_deferred(void)
{
	return deltas != NIL;
}

/* Whether two states differ (what would be written). */
static bool
endpoint_state_differs(const EndpointState *a, const EndpointState *b)
{
	return a->open != b->open || a->failures != b->failures ||
		a->failing_since != b->failing_since || a->next_probe != b->next_probe ||
		a->paced_until != b->paced_until;
}

/*
 * The endpoint state of the 'http' destinations whose deliveries in items
 * have an outcome to record, in the recording transaction and before the
 * outcomes: consecutive failures, the circuit, pacing by Retry-After, and
 * disabling after disable_after.  Each destination's current state is read
 * (not the copy loaded when its deliveries were claimed: a request stays in
 * flight while others of its endpoint fail or succeed), the outcomes are
 * applied to it in the order they came, and the row is written only when
 * that changes it: a healthy endpoint costs no write.  A success closes the
 * circuit and clears the failures and the streak (failing_since); a failure
 * counts (a 429 aside: a rate limit is not a failure of the endpoint), and
 * the one that reaches failure_threshold opens the circuit; a failure while
 * it is open does not use up the delivery's attempts (it->while_open) and
 * waits for the next probe, which comes after a destination-level backoff:
 * min(backoff_cap, backoff_base * 2^k), k the failures beyond the
 * threshold.  A 429, and a 503 with Retry-After, is the endpoint
 * rescheduling the delivery: it does not use up an attempt either
 * (it->rescheduled), but it starts the streak as a failure does.  A
 * Retry-After paces the whole destination until then (capped by
 * backoff_cap), and the delivery is tried again no earlier (it->retry_at);
 * pacing that has run out is cleared.  A destination failing (or rate
 * limited) since longer than its disable_after, whatever its circuit, is
 * disabled with a reason: an endpoint that answers 429 forever ends so.
 *
 * Never waits for a lock: a row to write is locked FOR UPDATE SKIP LOCKED
 * (and its state read again as locked); one that another transaction holds
 * (a caller of idem_outbox_relay() in a long transaction, an
 * idem_destination_alter() not yet committed) is not written this time: the
 * outcomes are kept in this backend's memory (an EndpointDelta, once the
 * transaction commits) and applied to the row's state at the next
 * opportunity, with the next outcomes or alone (items may be empty: the
 * relay loop comes back for them, see relay_endpoint_deferred).  So is a
 * 410 Gone that relay_disable could not write: the delta then disables the
 * destination (unless it is disabled already); a delta whose destination
 * is gone (dropped, or created again: another id) is forgotten.  The
 * deliveries' own outcomes are recorded as the state read says.
 */
void
relay_endpoint_states(RelayItem **items, int n)
{
	List	   *pending = endpoint_deltas_current();
	int			size = Max(n + list_length(pending), 1);
	Datum	   *ids = palloc(sizeof(Datum) * size);
	RelayDest **dests = palloc(sizeof(RelayDest *) * size);
	EndpointDelta **had = palloc0(sizeof(EndpointDelta *) * size);
	EndpointState *read = palloc(sizeof(EndpointState) * size);
	EndpointState *next = palloc(sizeof(EndpointState) * size);
	bool	   *found = palloc0(sizeof(bool) * size);
	bool	   *locked = palloc0(sizeof(bool) * size);
	int32	   *written = palloc(sizeof(int32) * size);
	RelayDest **skipped = palloc(sizeof(RelayDest *) * size);
	Datum	   *wids;
	int			nd = 0;
	int			nw = 0;
	int			nwritten = 0;
	int			nskipped = 0;
	Oid			argtypes[8] = {INT4ARRAYOID, TEXTARRAYOID, INT4ARRAYOID, TIMESTAMPTZARRAYOID,
		TIMESTAMPTZARRAYOID, TIMESTAMPTZARRAYOID, TEXTARRAYOID, TIMESTAMPTZOID};
	Datum		values[8];
	Datum	   *circuits;
	Datum	   *failures;
	Datum	   *since;
	Datum	   *probes;
	Datum	   *paces;
	Datum	   *whys;
	bool	   *since_nulls;
	bool	   *probe_nulls;
	bool	   *pace_nulls;
	bool	   *why_nulls;
	TimestampTz now = GetCurrentTimestamp();
	SPIPlanPtr	plan;
	ListCell   *lc;

	/* The 'http' destinations with an outcome, then those with a delta only. */
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		RelayDest  *d = it->dest;
		int			j;

		it->while_open = false;
		it->rescheduled = false;
		it->retry_at = 0;
		if (d == NULL || d->kind != DEST_HTTP ||
			(it->outcome != RELAY_DELIVERED && it->outcome != RELAY_FAILED))
			continue;
		for (j = 0; j < nd; j++)
			if (dests[j]->id == d->id)
				break;
		if (j == nd)
		{
			dests[nd] = d;
			had[nd] = endpoint_delta_find(d->id);
			ids[nd++] = Int32GetDatum(d->id);
		}
	}
	foreach(lc, pending)
	{
		EndpointDelta *x = lfirst(lc);
		RelayDest  *d;
		int			j;

		for (j = 0; j < nd; j++)
			if (dests[j]->id == x->dest_id)
				break;
		if (j < nd)
			continue;
		d = palloc0(sizeof(RelayDest));
		d->id = x->dest_id;
		d->name = pstrdup(x->name);
		d->kind = DEST_HTTP;
		d->failure_threshold = x->failure_threshold;
		d->backoff_base_ms = x->backoff_base_ms;
		d->backoff_cap_ms = x->backoff_cap_ms;
		d->disable_after_ms = x->disable_after_ms;
		dests[nd] = d;
		had[nd] = x;
		ids[nd++] = Int32GetDatum(x->dest_id);
	}
	if (nd == 0)
		return;

	/* Their current state, unlocked; the deltas and outcomes applied to it. */
	plan = relay_prepare(&state_read_plan,
						 "SELECT id, circuit = 'open', consecutive_failures, failing_since,"
						 "       next_probe_at, paced_until"
						 "  FROM idempotency.destinations WHERE id = ANY ($1)",
						 1, argtypes);
	values[0] = relay_array(ids, NULL, nd, INT4OID);
	/* Not read-only: with a snapshot that sees what this transaction wrote. */
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the state of outbox destinations");
	for (uint64 r = 0; r < SPI_processed; r++)
	{
		int32		id = DatumGetInt32(spi_value(SPI_tuptable->vals[r], 1, 0));

		for (int j = 0; j < nd; j++)
			if (dests[j]->id == id)
			{
				endpoint_state_read(SPI_tuptable->vals[r], SPI_tuptable->tupdesc, &read[j]);
				found[j] = true;
			}
	}
	wids = palloc(sizeof(Datum) * nd);
	for (int j = 0; j < nd; j++)
	{
		char	   *why;
		bool		opened;

		if (!found[j])
		{
			/* Dropped meanwhile: its delta goes too. */
			written[nwritten++] = dests[j]->id;
			continue;
		}
		next[j] = read[j];
		endpoint_state_apply(&next[j], dests[j], had[j], items, n, now, &why, &opened);
		if (endpoint_state_differs(&read[j], &next[j]) || why != NULL)
			wids[nw++] = ids[j];
		else
			written[nwritten++] = dests[j]->id; /* nothing to write: delta done */
	}

	if (nw > 0)
	{
		/* The rows to write, locked if no one else holds them, read again. */
		plan = relay_prepare(&state_lock_plan,
							 "SELECT id, circuit = 'open', consecutive_failures, failing_since,"
							 "       next_probe_at, paced_until, disabled_at IS NOT NULL"
							 "  FROM idempotency.destinations"
							 " WHERE id = ANY ($1) ORDER BY id FOR UPDATE SKIP LOCKED",
							 1, argtypes);
		values[0] = relay_array(wids, NULL, nw, INT4OID);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not lock outbox destinations");
		for (uint64 r = 0; r < SPI_processed; r++)
		{
			int32		id = DatumGetInt32(spi_value(SPI_tuptable->vals[r], 1, 0));

			for (int j = 0; j < nd; j++)
				if (dests[j]->id == id)
					locked[j] = true;
		}
		/* Those another transaction holds keep their outcomes for later. */
		for (int w = 0; w < nw; w++)
			for (int j = 0; j < nd; j++)
				if (ids[j] == wids[w] && !locked[j])
					skipped[nskipped++] = dests[j];
	}
	nw = (int) (nw > 0 ? SPI_processed : 0);
	circuits = palloc(sizeof(Datum) * (nw + 1));
	failures = palloc(sizeof(Datum) * (nw + 1));
	since = palloc(sizeof(Datum) * (nw + 1));
	probes = palloc(sizeof(Datum) * (nw + 1));
	paces = palloc(sizeof(Datum) * (nw + 1));
	whys = palloc(sizeof(Datum) * (nw + 1));
	since_nulls = palloc(sizeof(bool) * (nw + 1));
	probe_nulls = palloc(sizeof(bool) * (nw + 1));
	pace_nulls = palloc(sizeof(bool) * (nw + 1));
	why_nulls = palloc(sizeof(bool) * (nw + 1));
	for (int r = 0; r < nw; r++)
	{
		HeapTuple	tup = SPI_tuptable->vals[r];
		int32		id = DatumGetInt32(spi_value(tup, 1, 0));
		EndpointState st;
		RelayDest  *d = NULL;
		EndpointDelta *x = NULL;
		char	   *why;
		bool		opened;

		for (int j = 0; j < nd; j++)
			if (dests[j]->id == id)
			{
				d = dests[j];
				x = had[j];
			}
		Assert(d != NULL);
		endpoint_state_read(tup, SPI_tuptable->tupdesc, &st);
		endpoint_state_apply(&st, d, x, items, n, now, &why, &opened);
		/* Disabled already (by an operator, say): nothing to disable. */
		if (DatumGetBool(spi_value(tup, 7, BoolGetDatum(false))))
			why = NULL;
		written[nwritten++] = id;
		wids[r] = Int32GetDatum(id);
		circuits[r] = CStringGetTextDatum(st.open ? "open" : "closed");
		failures[r] = Int32GetDatum(st.failures);
		since[r] = TimestampTzGetDatum(st.failing_since);
		since_nulls[r] = (st.failing_since == 0);
		probes[r] = TimestampTzGetDatum(st.next_probe);
		probe_nulls[r] = (st.next_probe == 0);
		paces[r] = TimestampTzGetDatum(st.paced_until);
		pace_nulls[r] = (st.paced_until == 0);
		whys[r] = why ? CStringGetTextDatum(why) : (Datum) 0;
		why_nulls[r] = (why == NULL);
		if (why != NULL)
			outbox_dests_changed_at_commit();	/* chains claimed for it stop */
		if (why != NULL && x != NULL && x->disable_reason[0] != '\0')
			ereport(LOG,
					(errmsg("outbox destination \"%s\" disabled: %s", d->name, why),
					 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
		else if (why != NULL)
			ereport(LOG,
					(errmsg("outbox destination \"%s\" disabled: it has failed since %s, longer than its disable_after",
							d->name, timestamptz_to_str(st.failing_since)),
					 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
		else if (opened)
			ereport(LOG,
					(errmsg("outbox destination \"%s\": circuit open after %d consecutive failures",
							d->name, st.failures),
					 errdetail("One probe request at a time tests the endpoint; a success closes the circuit.")));
	}
	if (nw > 0)
	{
		plan = relay_prepare(&state_write_plan,
							 "UPDATE idempotency.destinations t"
							 "   SET circuit = u.circuit, consecutive_failures = u.failures,"
							 "       failing_since = u.since, next_probe_at = u.probe, paced_until = u.pace,"
							 "       disabled_at = CASE WHEN u.why IS NOT NULL AND t.disabled_at IS NULL"
							 "                          THEN $8 ELSE t.disabled_at END,"
							 "       disabled_reason = CASE WHEN u.why IS NOT NULL AND t.disabled_at IS NULL"
							 "                              THEN u.why ELSE t.disabled_reason END"
							 "  FROM unnest($1::int4[], $2::text[], $3::int4[], $4::timestamptz[],"
							 "              $5::timestamptz[], $6::timestamptz[], $7::text[])"
							 "       AS u(id, circuit, failures, since, probe, pace, why)"
							 " WHERE t.id = u.id",
							 8, argtypes);
		values[0] = relay_array(wids, NULL, nw, INT4OID);
		values[1] = relay_array(circuits, NULL, nw, TEXTOID);
		values[2] = relay_array(failures, NULL, nw, INT4OID);
		values[3] = relay_array(since, since_nulls, nw, TIMESTAMPTZOID);
		values[4] = relay_array(probes, probe_nulls, nw, TIMESTAMPTZOID);
		values[5] = relay_array(paces, pace_nulls, nw, TIMESTAMPTZOID);
		values[6] = relay_array(whys, why_nulls, nw, TEXTOID);
		values[7] = TimestampTzGetDatum(now);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not record the state of outbox destinations");
	}

	/* What is left for later, once this transaction commits. */
	if (nskipped > 0 || (pending != NIL && nwritten > 0))
		endpoint_deltas_stage(written, nwritten, skipped, nskipped, items, n);
}

/*
 * Claims of deliveries to destinations whose circuit is open are probes:
 * one at a time, whichever relay claims it.  The first relay to claim one
 * moves next_probe_at to the probe's visibility deadline.  The probe is
 * exclusive by the claims themselves: a delivery of the destination still
 * claimed by a relay (its visibility deadline ahead, as a renewal keeps it
 * while the request is under way) keeps the others from probing, even
 * once next_probe_at has passed; a relay that finds one gives its probe
 * back and moves next_probe_at to that deadline.  So is a probe claimed
 * meanwhile by another relay (or a second one in this claim), and one
 * whose destination row another transaction holds (the claim never waits
 * for it).  A probe does not use up an attempt: its attempt is given back
 * in the claiming transaction (it->probe), so that a probe interrupted by a
 * crash neither counts nor makes the next claim dead-letter the delivery
 * (the "last attempt interrupted" rule); a delivered probe counts when its
 * outcome is recorded.  Deliveries already dead-lettered by that rule
 * (RELAY_ABANDONED) are not probes: call this after it.
 */
void
relay_claim_probes(RelayItem **items, int n, TimestampTz now)
{
	Datum	   *claimed_ids = palloc(sizeof(Datum) * Max(n, 1));

	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		Oid			argtypes[4] = {INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID, UUIDARRAYOID};
		Oid			giveargs[3] = {UUIDOID, INT4OID, INT8OID};
		Datum		values[4];
		SPIPlanPtr	plan;
		bool		isnull;
		int			nclaimed = 0;

		if (it->dest == NULL || it->dest->kind != DEST_HTTP || !it->dest->circuit_open ||
			it->outcome != RELAY_PENDING || it->chain_held)
			continue;
		/* The deliveries of this claim are not another relay's probe. */
		for (int j = 0; j < n; j++)
			if (items[j]->dest_id == it->dest_id)
				claimed_ids[nclaimed++] = UUIDPGetDatum(&items[j]->event_id);
		plan = relay_prepare(&probe_plan,
							 "WITH t AS ("
							 " SELECT t.id FROM idempotency.destinations t"
							 "  WHERE t.id = $1 AND t.circuit = 'open' AND t.next_probe_at <= $2"
							 "    FOR UPDATE SKIP LOCKED),"
							 " busy AS ("
							 " SELECT max(e.visible_until) AS until FROM idempotency.deliveries e"
							 "  WHERE e.destination_id = $1 AND e.state = 'pending'"
							 "    AND e.next_attempt_at > $2 AND e.visible_until > $2"
							 "    AND e.event_id <> ALL ($4))"
							 " UPDATE idempotency.destinations d"
							 "    SET next_probe_at = coalesce(busy.until, $3)"
							 "   FROM t, busy WHERE d.id = t.id"
							 " RETURNING busy.until IS NULL",
							 4, argtypes);
		values[0] = Int32GetDatum(it->dest_id);
		values[1] = TimestampTzGetDatum(now);
		values[2] = TimestampTzGetDatum(it->claimed_until);
		values[3] = relay_array(claimed_ids, NULL, nclaimed, UUIDOID);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE_RETURNING)
			elog(ERROR, "could not claim a probe of an outbox destination");
		if (SPI_processed == 0 ||
			!DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull)))
		{
			it->outcome = RELAY_RELEASED;
			it->finished_at = now;
			relay_release_chain(it);
			continue;
		}

		/* Its attempt given back now: a probe uses none. */
		plan = relay_prepare(&probe_attempt_plan,
							 "UPDATE idempotency.deliveries SET attempts = attempts - 1"
							 " WHERE event_id = $1 AND destination_id = $2 AND claims = $3",
							 3, giveargs);
		values[0] = UUIDPGetDatum(&it->event_id);
		values[1] = Int32GetDatum(it->dest_id);
		values[2] = Int64GetDatum(it->claim);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not claim a probe of an outbox destination");
		it->probe = true;
		it->attempts--;
	}
}

/*
 * Keep destination d's 410 Gone for later, its row held by another
 * transaction: relay_endpoint_states writes it once the row is free (and
 * forgets it if the destination is gone by then; a destination created
 * again has another id).
 */
static void
endpoint_disable_later(RelayDest *d)
{
	EndpointDelta *x;

	endpoint_deltas_stage(NULL, 0, &d, 1, NULL, 0);
	x = endpoint_delta_find(d->id);
	Assert(x != NULL);
	strlcpy(x->disable_reason, d->disable_reason, sizeof(x->disable_reason));
}

/*
 * Disable the destinations whose endpoint answered 410 Gone in this pass.
 * One whose row another transaction holds is not waited for: the disable
 * is kept in this backend's memory, like the endpoint states, and written
 * at the next opportunity (see relay_endpoint_states).
 */
void
relay_disable(List *dests)
{
	ListCell   *lc;

	foreach(lc, dests)
	{
		RelayDest  *d = lfirst(lc);
		Oid			argtypes[2] = {INT4OID, TEXTOID};
		Datum		values[2];
		SPIPlanPtr	plan;
		int			ret;

		if (d->disable_reason == NULL)
			continue;
		plan = relay_prepare(&disable_plan,
							 "UPDATE idempotency.destinations"
							 "   SET disabled_at = clock_timestamp(), disabled_reason = $2"
							 " WHERE id = (SELECT t.id FROM idempotency.destinations t"
							 "              WHERE t.id = $1 AND t.disabled_at IS NULL"
							 "                FOR UPDATE SKIP LOCKED)",
							 2, argtypes);
		values[0] = Int32GetDatum(d->id);
		values[1] = CStringGetTextDatum(d->disable_reason);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not disable outbox destination");
		if (SPI_processed == 0)
		{
			/* Disabled already, dropped, or held: only the last waits. */
			plan = relay_prepare(&disable_check_plan,
								 "SELECT 1 FROM idempotency.destinations"
								 " WHERE id = $1 AND disabled_at IS NULL",
								 1, argtypes);
			ret = SPI_execute_plan(plan, values, NULL, false, 1);
			if (ret != SPI_OK_SELECT)
				elog(ERROR, "could not read outbox destination");
			if (SPI_processed > 0)
			{
				endpoint_disable_later(d);
				ereport(LOG,
						(errmsg("outbox destination \"%s\" to be disabled (%s) once another transaction releases its row",
								d->name, d->disable_reason)));
			}
			continue;
		}
		outbox_dests_changed_at_commit();	/* chains claimed for it stop */
		ereport(LOG,
				(errmsg("outbox destination \"%s\" disabled: %s", d->name, d->disable_reason),
				 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
	}
}
