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
static SPIPlanPtr state_lock_plan = NULL;
static SPIPlanPtr state_write_plan = NULL;
static SPIPlanPtr probe_plan = NULL;
static SPIPlanPtr disable_plan = NULL;

/*
 * The endpoint state of the 'http' destinations whose deliveries in items
 * have an outcome to record, in the recording transaction and before the
 * outcomes: consecutive failures, the circuit, pacing by Retry-After, and
 * disabling after disable_after.  The rows are locked (in id order) and
 * written only for destinations with a failure or a Retry-After now, or a
 * state to clear: a healthy endpoint costs no write.  Outcomes are taken in
 * the order they came.  A success closes the circuit and clears the
 * failures; a failure (a 429 aside: a rate limit is not a failure of the
 * endpoint) counts, and the one that reaches failure_threshold opens the
 * circuit; a failure while it is open does not use up the delivery's
 * attempts (it->while_open) and waits for the next probe, which comes after
 * a destination-level backoff: min(backoff_cap, backoff_base * 2^k), k the
 * failures beyond the threshold.  A 429 or 503 with Retry-After paces the
 * whole destination until then (capped by backoff_cap), and the delivery
 * is tried again no earlier (it->retry_at).  A destination open and failing
 * for longer than its disable_after is disabled with a reason.
 */
void
relay_endpoint_states(RelayItem **items, int n)
{
	Datum	   *ids = palloc(sizeof(Datum) * n);
	RelayDest **dests = palloc(sizeof(RelayDest *) * n);
	int			nd = 0;
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
	uint64		nrows;
	SPITupleTable *rows;

	/* Which destinations need their state read and written. */
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];
		RelayDest  *d = it->dest;
		bool		needed;
		int			j;

		it->while_open = false;
		it->retry_at = 0;
		if (d == NULL || d->kind != DEST_HTTP ||
			(it->outcome != RELAY_DELIVERED && it->outcome != RELAY_FAILED))
			continue;
		needed = it->outcome == RELAY_FAILED || d->circuit_open ||
			d->consecutive_failures > 0 || d->paced;
		if (!needed)
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

	plan = relay_prepare(&state_lock_plan,
						 "SELECT id, circuit = 'open', consecutive_failures, failing_since,"
						 "       next_probe_at, paced_until"
						 "  FROM idempotency.destinations"
						 " WHERE id = ANY ($1) ORDER BY id FOR UPDATE",
						 1, argtypes);
	values[0] = relay_array(ids, NULL, nd, INT4OID);
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not lock outbox destinations");
	nrows = SPI_processed;
	rows = SPI_tuptable;

	circuits = palloc(sizeof(Datum) * nrows + 1);
	failures = palloc(sizeof(Datum) * nrows + 1);
	since = palloc(sizeof(Datum) * nrows + 1);
	probes = palloc(sizeof(Datum) * nrows + 1);
	paces = palloc(sizeof(Datum) * nrows + 1);
	whys = palloc(sizeof(Datum) * nrows + 1);
	since_nulls = palloc(sizeof(bool) * nrows + 1);
	probe_nulls = palloc(sizeof(bool) * nrows + 1);
	pace_nulls = palloc(sizeof(bool) * nrows + 1);
	why_nulls = palloc(sizeof(bool) * nrows + 1);

	for (uint64 r = 0; r < nrows; r++)
	{
		HeapTuple	tup = rows->vals[r];
		bool		isnull;
		int32		id = DatumGetInt32(SPI_getbinval(tup, rows->tupdesc, 1, &isnull));
		bool		open = DatumGetBool(SPI_getbinval(tup, rows->tupdesc, 2, &isnull));
		int32		cf = DatumGetInt32(SPI_getbinval(tup, rows->tupdesc, 3, &isnull));
		Datum		v;
		TimestampTz failing_since;
		TimestampTz next_probe;
		TimestampTz paced_until;
		bool		failed_open = false;
		bool		opened = false;
		bool		failed = false;
		const char *last_error = NULL;
		RelayDest  *d = NULL;

		v = SPI_getbinval(tup, rows->tupdesc, 4, &isnull);
		failing_since = isnull ? 0 : DatumGetTimestampTz(v);
		v = SPI_getbinval(tup, rows->tupdesc, 5, &isnull);
		next_probe = isnull ? 0 : DatumGetTimestampTz(v);
		v = SPI_getbinval(tup, rows->tupdesc, 6, &isnull);
		paced_until = isnull ? 0 : DatumGetTimestampTz(v);
		ids[r] = Int32GetDatum(id);

		for (int i = 0; i < n; i++)
		{
			RelayItem  *it = items[i];

			if (it->dest == NULL || it->dest->id != id ||
				(it->outcome != RELAY_DELIVERED && it->outcome != RELAY_FAILED))
				continue;
			d = it->dest;
			if (it->outcome == RELAY_DELIVERED)
			{
				open = false;
				cf = 0;
				failing_since = 0;
				next_probe = 0;
				continue;
			}
			failed = true;
			last_error = it->error;
			if (it->status != 429)
			{
				if (open)
				{
					it->while_open = true;
					failed_open = true;
				}
				cf++;
				if (failing_since == 0)
					failing_since = it->finished_at;
				if (!open && cf >= d->failure_threshold)
				{
					open = true;
					opened = true;
				}
			}
			if (it->retry_after_ms >= 0)
			{
				TimestampTz until = it->finished_at +
					Min(it->retry_after_ms, d->backoff_cap_ms) * 1000;

				it->retry_at = until;
				paced_until = Max(paced_until, until);
			}
		}
		if (d == NULL)
			continue;			/* cannot happen: we asked for its id */

		if (open && (opened || failed_open))
		{
			int			k = Min(Max(cf - d->failure_threshold, 0), 30);
			double		wait = Min((double) d->backoff_base_ms * pow(2.0, k),
								   (double) d->backoff_cap_ms);

			next_probe = Max(now + (int64) wait * 1000, paced_until);
		}
		/* Failures while open wait for the next probe. */
		for (int i = 0; i < n; i++)
			if (items[i]->dest != NULL && items[i]->dest->id == id && items[i]->while_open)
				items[i]->retry_at = Max(next_probe, items[i]->retry_at);

		circuits[r] = CStringGetTextDatum(open ? "open" : "closed");
		failures[r] = Int32GetDatum(cf);
		since[r] = TimestampTzGetDatum(failing_since);
		since_nulls[r] = (failing_since == 0);
		probes[r] = TimestampTzGetDatum(next_probe);
		probe_nulls[r] = !open || next_probe == 0;
		paces[r] = TimestampTzGetDatum(paced_until);
		pace_nulls[r] = (paced_until == 0);
		why_nulls[r] = true;
		whys[r] = (Datum) 0;
		if (open && failed && failing_since != 0 &&
			now - failing_since >= d->disable_after_ms * 1000)
		{
			whys[r] = CStringGetTextDatum(psprintf("failing since %s, longer than disable_after (%lld ms); last error: %s",
												   timestamptz_to_str(failing_since),
												   (long long) d->disable_after_ms,
												   last_error ? last_error : "?"));
			why_nulls[r] = false;
			ereport(LOG,
					(errmsg("outbox destination \"%s\" disabled: it has failed since %s, longer than its disable_after",
							d->name, timestamptz_to_str(failing_since)),
					 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
		}
		else if (opened)
			ereport(LOG,
					(errmsg("outbox destination \"%s\": circuit open after %d consecutive failures",
							d->name, cf),
					 errdetail("One probe request at a time tests the endpoint; a success closes the circuit.")));
	}

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
	values[0] = relay_array(ids, NULL, nrows, INT4OID);
	values[1] = relay_array(circuits, NULL, nrows, TEXTOID);
	values[2] = relay_array(failures, NULL, nrows, INT4OID);
	values[3] = relay_array(since, since_nulls, nrows, TIMESTAMPTZOID);
	values[4] = relay_array(probes, probe_nulls, nrows, TIMESTAMPTZOID);
	values[5] = relay_array(paces, pace_nulls, nrows, TIMESTAMPTZOID);
	values[6] = relay_array(whys, why_nulls, nrows, TEXTOID);
	values[7] = TimestampTzGetDatum(now);
	if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
		elog(ERROR, "could not record the state of outbox destinations");
}

/*
 * Claims of deliveries to destinations whose circuit is open are probes:
 * one at a time, whichever relay claims it.  The first relay to claim one
 * moves next_probe_at to the probe's visibility deadline; a probe claimed
 * meanwhile by another relay (or a second one in this claim) is given back.
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
							 " WHERE id = $1 AND circuit = 'open' AND next_probe_at <= $2",
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

/* Disable the destinations whose endpoint answered 410 Gone in this pass. */
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
							 " WHERE id = $1 AND disabled_at IS NULL",
							 2, argtypes);
		values[0] = Int32GetDatum(d->id);
		values[1] = CStringGetTextDatum(d->disable_reason);
		if (SPI_execute_plan(plan, values, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not disable outbox destination");
		ereport(LOG,
				(errmsg("outbox destination \"%s\" disabled: %s", d->name, d->disable_reason),
				 errhint("Resume it with idem_destination_resume() once the endpoint is back.")));
	}
}
