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
 * in the claiming transaction (relay_claim_probes).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "relay_http.h"
#include "relay_internal.h"

/* The saved statements. */
static SPIPlanPtr state_read_plan = NULL;
static SPIPlanPtr state_lock_plan = NULL;
static SPIPlanPtr state_write_plan = NULL;
static SPIPlanPtr probe_plan = NULL;
static SPIPlanPtr disable_plan = NULL;

/* An endpoint's state, as idempotency.destinations keeps it (0: NULL). */
typedef struct EndpointState
{
	bool		open;
	int32		failures;
	TimestampTz failing_since;
	TimestampTz next_probe;
	TimestampTz paced_until;
} EndpointState;

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

/*
 * Apply the outcomes of destination d's deliveries in items, in the order
 * they came, to its state st (see relay_endpoint_states), and set each
 * delivery's while_open and retry_at.  *why becomes the reason to disable
 * it (or NULL); *opened says the circuit opened now.
 */
static void
endpoint_state_apply(EndpointState *st, RelayDest *d, RelayItem **items, int n,
					 TimestampTz now, char **why, bool *opened)
{
	bool		failed_open = false;
	bool		failed = false;
	const char *last_error = NULL;

	*why = NULL;
	*opened = false;
	/* Pacing that has run out is over. */
	if (st->paced_until != 0 && st->paced_until <= now)
		st->paced_until = 0;
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];

		if (it->dest != d ||
			(it->outcome != RELAY_DELIVERED && it->outcome != RELAY_FAILED))
			continue;
		it->while_open = false;
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
		if (it->status != 429)
		{
			if (st->open)
			{
				it->while_open = true;
				failed_open = true;
			}
			st->failures++;
			if (st->failing_since == 0)
				st->failing_since = it->finished_at;
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
		if (items[i]->dest == d && items[i]->while_open)
			items[i]->retry_at = Max(st->next_probe, items[i]->retry_at);

	if (st->open && failed && st->failing_since != 0 &&
		now - st->failing_since >= d->disable_after_ms * 1000)
		*why = psprintf("failing since %s, longer than disable_after (%lld ms); last error: %s",
						timestamptz_to_str(st->failing_since),
						(long long) d->disable_after_ms,
						last_error ? last_error : "?");
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
 * circuit and clears the failures; a failure (a 429 aside: a rate limit is
 * not a failure of the endpoint) counts, and the one that reaches
 * failure_threshold opens the circuit; a failure while it is open does not
 * use up the delivery's attempts (it->while_open) and waits for the next
 * probe, which comes after a destination-level backoff: min(backoff_cap,
 * backoff_base * 2^k), k the failures beyond the threshold.  A 429 or 503
 * with Retry-After paces the whole destination until then (capped by
 * backoff_cap), and the delivery is tried again no earlier (it->retry_at);
 * pacing that has run out is cleared.  A destination open and failing for
 * longer than its disable_after is disabled with a reason.
 *
 * Never waits for a lock: a row to write is locked FOR UPDATE SKIP LOCKED
 * (and its state read again as locked); one that another transaction holds
 * (a caller of idem_outbox_relay() in a long transaction, an
 * idem_destination_alter() not yet committed) is not written this time --
 * the next outcome of its endpoint applies to the state then -- and its
 * deliveries' outcomes are recorded as the state read says.
 */
void
relay_endpoint_states(RelayItem **items, int n)
{
	Datum	   *ids = palloc(sizeof(Datum) * Max(n, 1));
	RelayDest **dests = palloc(sizeof(RelayDest *) * Max(n, 1));
	EndpointState *read = palloc(sizeof(EndpointState) * Max(n, 1));
	EndpointState *next = palloc(sizeof(EndpointState) * Max(n, 1));
	bool	   *found = palloc0(sizeof(bool) * Max(n, 1));
	Datum	   *wids;
	int			nd = 0;
	int			nw = 0;
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

	/* The 'http' destinations with an outcome. */
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		RelayDest  *d = it->dest;
		int			j;

		it->while_open = false;
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
			ids[nd++] = Int32GetDatum(d->id);
		}
	}
	if (nd == 0)
		return;

	/* Their current state, unlocked; the outcomes applied to it. */
	plan = relay_prepare(&state_read_plan,
						 "SELECT id, circuit = 'open', consecutive_failures, failing_since,"
						 "       next_probe_at, paced_until"
						 "  FROM idempotency.destinations WHERE id = ANY ($1)",
						 1, argtypes);
	values[0] = relay_array(ids, NULL, nd, INT4OID);
	if (SPI_execute_plan(plan, values, NULL, true, 0) != SPI_OK_SELECT)
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
			continue;			/* dropped meanwhile */
		next[j] = read[j];
		endpoint_state_apply(&next[j], dests[j], items, n, now, &why, &opened);
		if (endpoint_state_differs(&read[j], &next[j]) || why != NULL)
			wids[nw++] = ids[j];
	}
	if (nw == 0)
		return;

	/* The rows to write, locked if no one else holds them, read again. */
	plan = relay_prepare(&state_lock_plan,
						 "SELECT id, circuit = 'open', consecutive_failures, failing_since,"
						 "       next_probe_at, paced_until"
						 "  FROM idempotency.destinations"
						 " WHERE id = ANY ($1) ORDER BY id FOR UPDATE SKIP LOCKED",
						 1, argtypes);
	values[0] = relay_array(wids, NULL, nw, INT4OID);
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not lock outbox destinations");
	nw = (int) SPI_processed;
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
		char	   *why;
		bool		opened;

		for (int j = 0; j < nd; j++)
			if (dests[j]->id == id)
				d = dests[j];
		Assert(d != NULL);
		endpoint_state_read(tup, SPI_tuptable->tupdesc, &st);
		endpoint_state_apply(&st, d, items, n, now, &why, &opened);
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
	if (nw == 0)
		return;

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

/*
 * Claims of deliveries to destinations whose circuit is open are probes:
 * one at a time, whichever relay claims it.  The first relay to claim one
 * moves next_probe_at to the probe's visibility deadline; a probe claimed
 * meanwhile by another relay (or a second one in this claim) is given back,
 * and so is one whose destination row another transaction holds (the
 * claim never waits for it).
 */
void
relay_claim_probes(RelayItem **items, int n, TimestampTz now)
{
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		Oid			argtypes[3] = {INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID};
		Datum		values[3];
		SPIPlanPtr	plan;

		if (it->dest == NULL || it->dest->kind != DEST_HTTP || !it->dest->circuit_open ||
			it->outcome != RELAY_PENDING || it->chain_held)
			continue;
		plan = relay_prepare(&probe_plan,
							 "UPDATE idempotency.destinations SET next_probe_at = $3"
							 " WHERE id = (SELECT t.id FROM idempotency.destinations t"
							 "              WHERE t.id = $1 AND t.circuit = 'open' AND t.next_probe_at <= $2"
							 "                FOR UPDATE SKIP LOCKED)",
							 3, argtypes);
		values[0] = Int32GetDatum(it->dest_id);
		values[1] = TimestampTzGetDatum(now);
		values[2] = TimestampTzGetDatum(it->claimed_until);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not claim a probe of an outbox destination");
		if (SPI_processed == 0)
		{
			it->outcome = RELAY_RELEASED;
			it->finished_at = now;
			relay_release_chain(it);
		}
	}
}

/*
 * Disable the destinations whose endpoint answered 410 Gone in this pass;
 * one whose row another transaction holds is not waited for (its next 410
 * disables it).
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
			continue;
		outbox_dests_changed_at_commit();	/* chains claimed for it stop */
		ereport(LOG,
				(errmsg("outbox destination \"%s\" disabled: %s", d->name, d->disable_reason),
				 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
	}
}
