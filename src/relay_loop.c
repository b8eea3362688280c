/*-------------------------------------------------------------------------
 *
 * relay_loop.c
 *	  The per-database worker's relay loop: webhooks stay in flight from one
 *	  iteration to the next, and nothing waits for a whole batch.
 *
 * Each iteration (relay_loop_run, see relay.h) records what completed,
 * renews claims about to expire, claims for the destinations with room,
 * starts those webhooks and makes the function and notify deliveries in a
 * transaction of their own; the worker then sleeps in relay_loop_wait on
 * the requests' sockets and its latch.  The claiming, recording and
 * in-database delivery are relay.c's, the same code a synchronous pass
 * (idem_outbox_relay) runs; the requests are relay_http.c's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "commands/trigger.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "pgstat.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "outbox.h"
#include "relay.h"
#include "relay_http.h"
#include "relay_internal.h"
#include "stats.h"

/*
 * The shortest sleep of the loop when deliveries are due but none could be
 * claimed (held behind an earlier event of their key, or claimed by another
 * relay); completions and commits wake it earlier.
 */
#define RELAY_LOOP_MIN_NAP_MS	1000

/*
 * How long one slice of function and notify deliveries may go on before
 * the loop drives its webhooks again (a call that has begun runs to its
 * end, at most its destination's timeout).
 */
#define RELAY_LOCAL_SLICE_MS	100

/* How soon a loop that found another loop claiming tries again. */
#define RELAY_CLAIM_RETRY_MS	10

/*
 * The lock_timeout of the recording step: a row that another session holds
 * (a delivery locked FOR UPDATE) makes it give up after this, and the
 * outcomes are recorded at the next try, RELAY_LOOP_MIN_NAP_MS later.
 */
#define RELAY_RECORD_LOCK_TIMEOUT	"100ms"

/*
 * The worker's relay loop (see relay.h): requests stay in flight from one
 * iteration to the next, and nothing waits for a whole batch.
 *
 * Each claim's memory (its deliveries, its copy of the destinations, the
 * requests' strings) is a RelayBatch, freed when the last of its deliveries
 * is recorded.  held lists the claimed webhooks whose outcome is not
 * recorded yet: the front of each chain is in flight, the rest of the chain
 * waits behind it (chain_held).  done lists the outcomes to record.  local
 * lists the claimed function and notify deliveries still to be made (or
 * whose outcome is to be recorded): they are made in slices of about
 * RELAY_LOCAL_SLICE_MS, one slice per iteration, so that a slow destination
 * function holds up the webhooks for one call at most.
 */
typedef struct RelayBatch
{
	MemoryContext cxt;
	int			live;			/* its deliveries in held, local and done */
	uint64		dest_generation;	/* idem_stats_dest_generation() before the claim */
} RelayBatch;

static struct
{
	MemoryContext cxt;
	MemoryContext itercxt;		/* an iteration's own memory, reset at its end */
	bool		claim_needed;	/* something may be claimable: claim next time */
	TimestampTz record_retry_at;	/* a lock made recording give up: not before */
	TimestampTz due;			/* when something is due, as of the last claim */
	RelayItem **held;
	int			nheld;
	int			held_size;
	RelayItem **done;
	int			ndone;
	int			done_size;
	RelayItem **local;			/* claimed function and notify deliveries not made yet */
	int			nlocal;
	int			local_size;
	int			slice_size;		/* in-database deliveries a claim may hold: about a slice's */
	RelayBatch *claiming;		/* the claim under way's batch, until its items hold it */
} relay_loop;

/* Append it to one of the loop's arrays, growing it as needed. */
static void
relay_loop_push(RelayItem ***array, int *len, int *size, RelayItem *it)
{
	if (*len == *size)
	{
		*size = Max(64, *size * 2);
		*array = *array ? repalloc(*array, sizeof(RelayItem *) * *size)
			: MemoryContextAlloc(relay_loop.cxt, sizeof(RelayItem *) * *size);
	}
	(*array)[(*len)++] = it;
}

/* A held webhook leaves the loop: its batch goes when it was the last. */
static void
relay_loop_release_batch(RelayItem *it)
{
	RelayBatch *batch = it->batch;

	if (batch != NULL && --batch->live == 0)
	{
		MemoryContextDelete(batch->cxt);
		pfree(batch);
	}
}

/*
 * An outcome to record joins done, which keeps its batch until it is
 * recorded (a lock may hold that up for a few iterations, see
 * relay_loop_record_in_step).
 */
static void
relay_loop_push_done(RelayItem *it)
{
	relay_loop_push(&relay_loop.done, &relay_loop.ndone, &relay_loop.done_size, it);
	((RelayBatch *) it->batch)->live++;
}

/* The outcomes in done are recorded, or forgotten: done lets their batches go. */
static void
relay_loop_clear_done(void)
{
	for (int i = 0; i < relay_loop.ndone; i++)
		relay_loop_release_batch(relay_loop.done[i]);
	relay_loop.ndone = 0;
}

/* Start a webhook's request, its strings in its batch's memory. */
static void
relay_loop_start(RelayItem *it)
{
	MemoryContext old = MemoryContextSwitchTo(((RelayBatch *) it->batch)->cxt);

	http_async_start(it);
	MemoryContextSwitchTo(old);
}

/*
 * A webhook's request completed: its outcome is to be recorded, and the next
 * delivery of its key goes now (its predecessor was delivered) or never (it
 * is given back).
 */
static void
relay_loop_finished(RelayItem *it)
{
	relay_loop_push_done(it);
	/* An endpoint that asks for a pause gets no further request meanwhile. */
	if (it->retry_after_ms >= 0 && it->dest != NULL)
		relay_inflight_pace(it->dest_id, it->finished_at +
							Min(it->retry_after_ms, it->dest->backoff_cap_ms) * 1000);

	/*
	 * The next of its chain goes, unless a destination was paused, altered,
	 * dropped or disabled since the claim, or its endpoint asked for a pause
	 * (Retry-After, received by any relay loop): then the rest of the chain
	 * is given back, and the next claim sees the destination as it is now.
	 */
	if (it->outcome == RELAY_DELIVERED && it->chain_next != NULL &&
		it->chain_next->outcome == RELAY_PENDING &&
		((RelayBatch *) it->batch)->dest_generation == idem_stats_dest_generation() &&
		!relay_inflight_paced(it->dest_id, GetCurrentTimestamp()))
	{
		it->chain_next->chain_held = false;
		relay_loop_start(it->chain_next);
		return;
	}
	for (RelayItem *next = it->chain_next; next != NULL; next = next->chain_next)
		if (next->outcome == RELAY_PENDING)
		{
			next->outcome = RELAY_RELEASED;
			relay_loop_push_done(next);
		}
}

/*
 * A claimed delivery not sent or made because another session held its row
 * (row_held) is given back: its outcome joins done, recorded once the row
 * is free.  Left to its claim, it would be taken for an interrupted attempt.
 */
static void
relay_loop_give_back_held(RelayItem *it)
{
	if (it->outcome != RELAY_SKIPPED || !it->row_held)
		return;
	it->row_held = false;
	it->outcome = RELAY_RELEASED;
	relay_loop_push_done(it);
}

/* Drop from held what is no longer pending (recorded, or not ours any more). */
static void
relay_loop_compact(void)
{
	int			k = 0;

	for (int i = 0; i < relay_loop.nheld; i++)
	{
		RelayItem  *it = relay_loop.held[i];

		if (it->outcome == RELAY_PENDING)
			relay_loop.held[k++] = it;
		else
		{
			relay_loop_give_back_held(it);
			relay_loop_release_batch(it);
		}
	}
	relay_loop.nheld = k;
}

/*
 * Record the outcomes of items (and the endpoint states kept for later) and
 * disable the destinations that answered 410, in a subtransaction whose
 * lock_timeout is RELAY_RECORD_LOCK_TIMEOUT.  Returns false, with nothing
 * recorded, if a lock another session holds made it give up.
 */
static bool
relay_loop_try_record(RelayItem **items, int n)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	volatile bool recorded = true;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		int			save_nestlevel = NewGUCNestLevel();

		(void) set_config_option("lock_timeout", RELAY_RECORD_LOCK_TIMEOUT, PGC_USERSET,
								 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
		relay_record_all(items, n, palloc(sizeof(RelayItem *) * Max(n, 1)));
		for (int i = 0; i < n; i++)
			if (items[i]->dest != NULL && items[i]->dest->disable_reason != NULL)
				relay_disable(list_make1(items[i]->dest));
		AtEOXact_GUC(true, save_nestlevel);
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		if (edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			PG_RE_THROW();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
		ereport(DEBUG1,
				(errmsg("outbox relay: %d outcomes not recorded yet: %s", n, edata->message)));
		FreeErrorData(edata);
		recorded = false;
	}
	PG_END_TRY();
	return recorded;
}

/*
 * Record the outcomes in done, in the current step; disable the
 * destinations that answered 410; write the endpoint states kept for later
 * (relay_endpoint_deferred).  A row that another session holds (a delivery
 * locked FOR UPDATE) never stalls the loop: the statement gives up after
 * RELAY_RECORD_LOCK_TIMEOUT, then the outcomes whose rows are free are
 * recorded and those held stay in done, tried again RELAY_LOOP_MIN_NAP_MS
 * later (nothing lost; their claims keep their deliveries from being
 * claimed again meanwhile, see relay_loop_done_expired).  Returns false if
 * some outcome was left so; *attempted grows by the deliveries attempted.
 */
static bool
relay_loop_record_in_step(int64 *attempted)
{
	int			n = relay_loop.ndone;
	RelayItem **items = relay_loop.done;
	RelayItem **kept = NULL;
	int			nkept = 0;
	int			nrecorded = n;

	if (relay_loop.record_retry_at != 0 && GetCurrentTimestamp() < relay_loop.record_retry_at)
		return false;
	relay_loop.record_retry_at = 0;
	if (!relay_loop_try_record(items, n))
	{
		bool	   *held = palloc(sizeof(bool) * Max(n, 1));
		RelayItem **free_items = palloc(sizeof(RelayItem *) * Max(n, 1));
		int			nfree = 0;

		/* Those whose rows are free now (locked here), and those held. */
		kept = palloc(sizeof(RelayItem *) * Max(n, 1));
		relay_outcomes_held(items, n, held);
		for (int i = 0; i < n; i++)
		{
			if (held[i])
				kept[nkept++] = items[i];
			else
				free_items[nfree++] = items[i];
		}
		if (nkept == 0 || !relay_loop_try_record(free_items, nfree))
		{
			/* Something else held it up: all of it next time. */
			kept = items;
			nkept = n;
			nfree = 0;
		}
		items = free_items;
		nrecorded = nfree;
		relay_loop.record_retry_at =
			TimestampTzPlusMilliseconds(GetCurrentTimestamp(), RELAY_LOOP_MIN_NAP_MS);
	}

	for (int i = 0; i < nrecorded; i++)
	{
		RelayItem  *it = items[i];

		if (it->dest != NULL)
			it->dest->disable_reason = NULL;
		if (it->outcome == RELAY_DELIVERED || it->outcome == RELAY_FAILED)
			(*attempted)++;
		relay_loop_release_batch(it);
	}
	/* What is left: done keeps it (and its batch). */
	if (kept != relay_loop.done)
		for (int i = 0; i < nkept; i++)
			relay_loop.done[i] = kept[i];
	relay_loop.ndone = nkept;
	return nkept == 0;
}

/*
 * The destinations of outcomes in done (not recorded: a lock held them up)
 * whose claims ran out by now take nothing in the claim at now, which could
 * take those deliveries again; the other destinations' claims go on.
 */
static void
relay_loop_block_unrecorded(RelayRooms *rooms, TimestampTz now)
{
	for (int i = 0; i < relay_loop.ndone; i++)
		if (relay_loop.done[i]->claimed_until <= now)
			relay_rooms_block(rooms, relay_loop.done[i]->dest_id);
}

/*
 * Record the outcomes in done, in one short transaction for all that
 * completed together, with the endpoint states kept for later.  If the
 * outbox is gone, so are the deliveries.
 */
static int64
relay_loop_record(void)
{
	RelayStep	step;
	int64		attempted = 0;

	if ((relay_loop.ndone == 0 && !relay_endpoint_deferred()) ||
		GetCurrentTimestamp() < relay_loop.record_retry_at)
		return 0;
	step.own_xact = true;
	if (!relay_step_begin(&step, "idempotency relay: record", false))
	{
		relay_loop_clear_done();
		return 0;
	}
	(void) relay_loop_record_in_step(&attempted);
	relay_step_end(&step);
	return attempted;
}

/*
 * The chains the loop holds per destination (arrays in the current memory
 * context), for the claim's rooms; returns the total.
 */
static int
relay_loop_active(RelayRooms *rooms)
{
	int			total = 0;

	memset(rooms, 0, sizeof(*rooms));
	rooms->limit = true;
	for (int i = 0; i < relay_loop.nheld; i++)
	{
		RelayItem  *it = relay_loop.held[i];

		if (it->outcome == RELAY_PENDING && !it->chain_held)
		{
			relay_rooms_take(rooms, &it, 0, 1);
			total++;
		}
	}
	rooms->http_room = http_max_in_flight() - total;
	rooms->local_room = relay_loop.slice_size;
	/* In-database deliveries not made yet take their destination's room. */
	for (int i = 0; i < relay_loop.nlocal; i++)
		if (relay_loop.local[i]->outcome == RELAY_PENDING)
		{
			relay_rooms_count(rooms, relay_loop.local[i]->dest_id);
			rooms->local_room--;
		}
	return total;
}

/* Publish the chains the loop holds per destination (relay_inflight.c). */
static void
relay_loop_publish(void)
{
	RelayRooms	held;

	(void) relay_loop_active(&held);
	relay_inflight_publish(&held);
}

/*
 * When the loop next has work to claim (see relay_next_due_except): the
 * destinations whose requests are all in flight are left out, so their
 * backlog does not keep the loop awake; their completions wake it.
 */
static TimestampTz
relay_loop_next_due(void)
{
	RelayRooms	rooms;
	int32	   *full_ids;
	int			nfull = 0;

	(void) relay_loop_active(&rooms);
	relay_loop_block_unrecorded(&rooms, GetCurrentTimestamp());
	full_ids = palloc(sizeof(int32) * Max(rooms.n, 1));
	for (int i = 0; i < rooms.n; i++)
	{
		RelayDest  *d = NULL;
		int32		room = PG_INT32_MAX / 2;	/* blocked, see relay_rooms_block */

		for (int j = 0; j < relay_loop.nheld && d == NULL; j++)
			if (relay_loop.held[j]->dest_id == rooms.ids[i])
				d = relay_loop.held[j]->dest;
		if (d != NULL)
			room = Min(room, d->circuit_open ? 1 : d->max_in_flight);
		if (rooms.http_room <= 0 || rooms.active[i] >= room)
			full_ids[nfull++] = rooms.ids[i];
	}
	return relay_next_due_except(full_ids, nfull);
}

/*
 * Record the outcomes in done, claim what may go now and act on it, in one
 * transaction: webhooks start (and stay in flight) once the claim has
 * committed; function and notify deliveries join local, to be made in
 * slices (relay_loop_local_slice).  Returns the deliveries claimed,
 * or -1 if the claim could not begin (the deliveries are locked, or the
 * outbox is gone), with done left for relay_loop_record, or -2 if another
 * relay loop of the database is claiming (done recorded).  *attempted grows
 * by the deliveries attempted; *due becomes when the loop next has work to
 * claim, *backlog whether some destination had more due than it could
 * take, *local whether in-database deliveries were claimed.
 */
static int
relay_loop_claim(int max_events, int64 *attempted, TimestampTz *due, bool *backlog,
				 bool *local_claimed)
{
	RelayStep	step;
	RelayRooms	rooms;
	RelayBatch *batch;
	RelayItem **items;
	RelayItem **local;
	int			n;
	int			nlocal = 0;
	TimestampTz now = GetCurrentTimestamp();
	uint64		dest_generation = idem_stats_dest_generation();	/* before the claim's snapshot */

	*backlog = false;
	*local_claimed = false;
	step.own_xact = true;
	if (!relay_step_begin(&step, "idempotency relay: claim", true))
		return -1;
	/* Outcomes first (those a lock holds up block their destination below). */
	if (relay_loop.ndone > 0 || relay_endpoint_deferred())
		(void) relay_loop_record_in_step(attempted);
	if (!relay_schema_current(true))
	{
		/*
		 * The library is newer than the extension's objects: look again
		 * shortly, so that the backlog flows once ALTER EXTENSION UPDATE
		 * has committed (nothing else wakes the loop then).
		 */
		relay_step_end(&step);
		*due = TimestampTzPlusMilliseconds(now, RELAY_LOOP_MIN_NAP_MS);
		return 0;
	}
	batch = MemoryContextAllocZero(relay_loop.cxt, sizeof(RelayBatch));
	batch->dest_generation = dest_generation;
	batch->cxt = AllocSetContextCreate(relay_loop.cxt, "outbox relay claim",
									   ALLOCSET_DEFAULT_SIZES);
	relay_loop.claiming = batch;	/* an error before its items hold it: abandoned */
	/* Rooms count the chains every relay loop of the database holds. */
	if (!relay_inflight_try_lock())
	{
		relay_loop.claiming = NULL;
		MemoryContextDelete(batch->cxt);
		pfree(batch);
		relay_step_end(&step);
		return -2;				/* another loop is claiming: a little later */
	}
	(void) relay_loop_active(&rooms);
	relay_inflight_add_others(&rooms);
	relay_loop_block_unrecorded(&rooms, now);
	n = relay_claim(max_events, 1, &rooms, now, batch->cxt, &items, backlog);
	if (n > 0)
	{
		List	   *dests = relay_load_dests(batch->cxt, items, n);

		for (int i = 0; i < n; i++)
		{
			items[i]->dest = relay_find_dest(dests, items[i]->dest_id);
			items[i]->batch = batch;
		}
		relay_abandon_interrupted(items, n, batch->cxt);
		relay_claim_probes(items, n, now);
	}

	local = MemoryContextAlloc(batch->cxt, sizeof(RelayItem *) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		RelayItem  *it = items[i];

		if (it->dest == NULL)
			it->outcome = RELAY_SKIPPED;	/* dropped since, with its deliveries */
		else if (it->outcome != RELAY_PENDING || it->dest->kind != DEST_HTTP)
			local[nlocal++] = it;
		else
		{
			relay_loop_push(&relay_loop.held, &relay_loop.nheld, &relay_loop.held_size, it);
			batch->live++;
		}
	}

	/*
	 * When next to claim, while the claim's transaction is open: in-database
	 * deliveries just claimed are made next, and the loop comes back at once
	 * after them.
	 */
	*local_claimed = nlocal > 0;
	*due = relay_loop_next_due();
	relay_loop_publish();
	relay_step_end(&step);

	/* The fronts of the chains go now. */
	for (int i = 0; i < n; i++)
		if (items[i]->dest != NULL && items[i]->dest->kind == DEST_HTTP &&
			items[i]->outcome == RELAY_PENDING && !items[i]->chain_held)
			relay_loop_start(items[i]);
	http_async_kick();

	/* In-database deliveries: made in slices (relay_loop_local_slice). */
	for (int i = 0; i < nlocal; i++)
	{
		relay_loop_push(&relay_loop.local, &relay_loop.nlocal, &relay_loop.local_size, local[i]);
		batch->live++;
	}
	relay_loop.claiming = NULL;
	if (batch->live == 0)
	{
		MemoryContextDelete(batch->cxt);
		pfree(batch);
	}
	return n;
}

/*
 * Renew the claims of the webhooks in flight and of the in-database
 * deliveries not made yet, if one could expire before a slice of function
 * calls that may last slice_ms ends: each is then hidden from other relays
 * for slice_ms, the margin and the longest timeout of those destinations
 * more.  What is no longer ours is not sent or made.
 */
static void
relay_loop_renew_for(int64 slice_ms)
{
	RelayItem **items;
	int			n = 0;
	int64		longest = 0;
	TimestampTz soonest = 0;
	TimestampTz now = GetCurrentTimestamp();
	RelayLease	lease = {true, 0, 0};

	items = palloc(sizeof(RelayItem *) * Max(relay_loop.nheld + relay_loop.nlocal, 1));
	for (int i = 0; i < relay_loop.nheld; i++)
		if (relay_loop.held[i]->outcome == RELAY_PENDING)
			items[n++] = relay_loop.held[i];
	for (int i = 0; i < relay_loop.nlocal; i++)
		if (relay_loop.local[i]->outcome == RELAY_PENDING)
			items[n++] = relay_loop.local[i];
	for (int i = 0; i < n; i++)
	{
		if (soonest == 0 || items[i]->claimed_until < soonest)
			soonest = items[i]->claimed_until;
		longest = Max(longest, items[i]->dest->timeout_ms);
	}
	if (n == 0 || soonest > now + (slice_ms + relay_visibility_margin) * 1000)
		return;
	lease.window_us = (slice_ms + relay_visibility_margin + longest) * 1000;
	relay_renew_claims(items, n, &lease);
	for (int i = 0; i < relay_loop.nheld; i++)
		if (relay_loop.held[i]->outcome == RELAY_RELEASED)
			relay_loop_push_done(relay_loop.held[i]);
}

/*
 * One slice of the in-database deliveries in local, in a transaction of its
 * own, as a pass's step 3b makes them: each effect and its mark "delivered"
 * commit together, after the claim is checked again (relay_relock).  The
 * slice ends after RELAY_LOCAL_SLICE_MS (a call that has begun runs to its
 * end: a destination function is bounded by its destination's timeout), so
 * that the loop drives its webhooks between slices; before it begins, the
 * loop's claims are renewed to outlast it.  Records what the slice made and
 * what it gave back; the rest waits for the next slice.  Returns the
 * deliveries attempted.
 */
static int64
relay_loop_local_slice(void)
{
	RelayStep	step;
	int64		attempted = 0;
	int64		slice_ms = RELAY_LOCAL_SLICE_MS;
	bool		any_local;
	bool		ran_out = false;
	TimestampTz start;
	int			k = 0;
	int			made = 0;

	for (int i = 0; i < relay_loop.nlocal; i++)
		if (relay_loop.local[i]->outcome == RELAY_PENDING &&
			relay_loop.local[i]->dest->kind == DEST_FUNCTION)
			slice_ms = Max(slice_ms, RELAY_LOCAL_SLICE_MS + relay_loop.local[i]->dest->timeout_ms);
	relay_loop_renew_for(slice_ms);

	step.own_xact = true;
	if (!relay_step_begin(&step, "idempotency relay: deliver", false))
	{
		/* The outbox is gone: so are the deliveries. */
		for (int i = 0; i < relay_loop.nlocal; i++)
			relay_loop_release_batch(relay_loop.local[i]);
		relay_loop.nlocal = 0;
		return 0;
	}
	relay_relock(relay_loop.local, relay_loop.nlocal, &any_local);
	if (any_local)
	{
		ConstraintsSetStmt *immediate = makeNode(ConstraintsSetStmt);

		relay_watch_cancel();
		immediate->constraints = NIL;
		immediate->deferred = false;
		AfterTriggerSetState(immediate);
	}
	/* On error, relay_loop_run gives SIGINT back. */
	start = GetCurrentTimestamp();
	for (int i = 0; any_local && i < relay_loop.nlocal; i++)
	{
		RelayItem  *it = relay_loop.local[i];

		CHECK_FOR_INTERRUPTS();
		if (it->outcome != RELAY_PENDING)
			continue;
		if (TimestampDifferenceExceeds(start, GetCurrentTimestamp(), RELAY_LOCAL_SLICE_MS))
		{
			ran_out = true;
			break;				/* the rest in the next slice */
		}
		made++;
		if (it->dest->kind == DEST_NOTIFY)
			relay_notify(it);
		else if (it->dest->kind == DEST_FUNCTION)
			relay_call_function(it, ((RelayBatch *) it->batch)->cxt);
		if (it->outcome != RELAY_DELIVERED)
			relay_release_chain(it);
	}
	relay_unwatch_cancel();
	relay_record_all(relay_loop.local, relay_loop.nlocal,
					 palloc(sizeof(RelayItem *) * Max(relay_loop.nlocal, 1)));
	relay_step_end(&step);

	/*
	 * The next claims take about what a slice makes: as many as this one
	 * made when it ran out of time, twice as many when it made all it held
	 * in less than half its time.
	 */
	if (ran_out)
		relay_loop.slice_size = Max(made, 1);
	else if (made > 0 && !TimestampDifferenceExceeds(start, GetCurrentTimestamp(),
													   RELAY_LOCAL_SLICE_MS / 2))
		relay_loop.slice_size = Min(relay_loop.slice_size * 2, relay_batch_size);

	/*
	 * What was made, given back or is no longer ours leaves local.  One whose
	 * row another session held was not made: it is given back, recorded
	 * once the row is free (see relay_loop_record_in_step).
	 */
	for (int i = 0; i < relay_loop.nlocal; i++)
	{
		RelayItem  *it = relay_loop.local[i];

		if (it->outcome == RELAY_PENDING)
			relay_loop.local[k++] = it;
		else
		{
			relay_loop_give_back_held(it);
			if (it->outcome == RELAY_DELIVERED || it->outcome == RELAY_FAILED)
				attempted++;
			relay_loop_release_batch(it);
		}
	}
	relay_loop.nlocal = k;
	return attempted;
}

/* Forget everything in flight (after an error): the claims expire and are taken again. */
static void
relay_loop_abandon(void)
{
	/* A claim that failed: its batch goes with it unless items of it joined the loop. */
	if (relay_loop.claiming != NULL && relay_loop.claiming->live == 0)
	{
		MemoryContextDelete(relay_loop.claiming->cxt);
		pfree(relay_loop.claiming);
	}
	relay_loop.claiming = NULL;
	http_async_abandon();
	for (int i = 0; i < relay_loop.nheld; i++)
	{
		relay_loop.held[i]->outcome = RELAY_SKIPPED;
		relay_loop.held[i]->row_held = false;	/* nothing is given back */
	}
	for (int i = 0; i < relay_loop.nlocal; i++)
		relay_loop_release_batch(relay_loop.local[i]);
	relay_loop.nlocal = 0;
	relay_loop_clear_done();
	relay_loop_compact();
	relay_inflight_withdraw();
}

/* The time by which a held webhook's claim should be renewed (0: none held). */
static TimestampTz
relay_loop_renew_at(void)
{
	TimestampTz renew_at = 0;

	for (int i = 0; i < relay_loop.nheld; i++)
	{
		RelayItem  *it = relay_loop.held[i];
		int64		half = ((int64) relay_visibility_margin + it->dest->timeout_ms) * 500;

		if (renew_at == 0 || it->claimed_until - half < renew_at)
			renew_at = it->claimed_until - half;
	}
	return renew_at;
}

/*
 * One iteration (see relay.h), in the iteration's own memory context.  A
 * claim is made only when something may be claimable: the latch was set (a
 * publishing commit), requests completed (their destinations have room
 * again), the next due time has come, or the last claim made in-database
 * deliveries (whose outcomes change what is due).
 */
static int64
relay_loop_iteration(int max_events, TimestampTz *wake_at, bool *full, bool *backlog)
{
	int64		attempted = 0;
	List	   *finished;
	ListCell   *lc;
	TimestampTz now;
	TimestampTz renew_at;
	int			claimed = 0;
	bool		claim_tried = false;
	bool		held_up;

	/* (a) The requests that completed, recorded together (with the claim). */
	finished = http_async_collect();
	foreach(lc, finished)
		relay_loop_finished(lfirst(lc));
	if (relay_loop.ndone > 0)
		relay_loop.claim_needed = true;

	/* Claims that would expire before their outcome comes are renewed. */
	now = GetCurrentTimestamp();
	renew_at = relay_loop_renew_at();
	if (renew_at != 0 && now >= renew_at)
	{
		RelayLease	lease = {true, 0, 0};

		attempted += relay_loop_record();
		relay_loop_compact();
		relay_renew_claims(relay_loop.held, relay_loop.nheld, &lease);
		for (int i = 0; i < relay_loop.nheld; i++)
			if (relay_loop.held[i]->outcome == RELAY_RELEASED)
				relay_loop_push_done(relay_loop.held[i]);
		renew_at = 0;
	}

	/* (b, c) Claim for the destinations with room (none when draining). */
	if (max_events > 0 &&
		(relay_loop.claim_needed || (relay_loop.due != 0 && now >= relay_loop.due)))
	{
		bool		local_claimed;

		relay_loop.claim_needed = false;
		claimed = relay_loop_claim(max_events, &attempted, &relay_loop.due, backlog,
								   &local_claimed);
		if (claimed == -2)
		{
			/* Another loop is claiming: come back shortly. */
			claimed = 0;
			relay_loop.due = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														 RELAY_CLAIM_RETRY_MS);
		}
		else if (claimed < 0)
		{
			claimed = 0;
			relay_loop.claim_needed = true;
		}
		else
		{
			claim_tried = true;
			/* Their outcomes may have changed what is due next. */
			if (local_claimed)
				relay_loop.claim_needed = true;
		}
	}
	attempted += relay_loop_record();
	relay_loop_compact();

	/* A slice of the function and notify deliveries claimed; the rest next time. */
	if (relay_loop.nlocal > 0)
	{
		/*
		 * A destination function may keep the loop from its requests for as
		 * long as a call takes (up to its timeout): the requests in flight
		 * get RELAY_LOCAL_SLICE_MS to complete first, and their outcomes
		 * are recorded before the slice.
		 */
		TimestampTz until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														 RELAY_LOCAL_SLICE_MS);

		while (http_async_in_flight() > 0)
		{
			long		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), until);

			if (left <= 0)
				break;
			(void) relay_loop_wait(left, PG_WAIT_EXTENSION);
			finished = http_async_collect();
			foreach(lc, finished)
				relay_loop_finished(lfirst(lc));
			http_async_kick();	/* the next of their chains */
		}
		attempted += relay_loop_record();
		relay_loop_compact();
		attempted += relay_loop_local_slice();
		attempted += relay_loop_record();	/* what a renewal gave back */
		relay_loop_compact();
		if (relay_loop.nlocal > 0)
			relay_loop.claim_needed = true;
	}
	if (renew_at == 0)
		renew_at = relay_loop_renew_at();
	relay_loop_publish();		/* the chains that ended since the claim */
	*full = max_events > 0 && claimed >= max_events;

	/* (d) When to come back, besides a socket, a timer of libcurl or the latch. */
	now = GetCurrentTimestamp();
	held_up = relay_loop.ndone > 0 && relay_loop.record_retry_at > now;
	if (max_events == 0)
		*wake_at = renew_at;
	else if (*full || (relay_loop.claim_needed && !held_up))
		*wake_at = GetCurrentTimestamp();
	else
	{
		*wake_at = relay_loop.due;
		/* Due, but nothing could be claimed (held behind its key, or locked). */
		if (claim_tried && claimed == 0 && *wake_at != 0 && *wake_at <= GetCurrentTimestamp())
			*wake_at = relay_loop.due =
				TimestampTzPlusMilliseconds(GetCurrentTimestamp(), RELAY_LOOP_MIN_NAP_MS);
		if (renew_at != 0 && (*wake_at == 0 || renew_at < *wake_at))
			*wake_at = renew_at;
	}
	/* Outcomes or endpoint states a lock held up: tried again a little later. */
	if (relay_loop.ndone > 0 || relay_endpoint_deferred())
	{
		TimestampTz again = held_up ? relay_loop.record_retry_at :
			TimestampTzPlusMilliseconds(now, RELAY_LOOP_MIN_NAP_MS);

		if (*wake_at == 0 || again < *wake_at)
			*wake_at = again;
	}
	return attempted;
}

/* See relay.h. */
int64
relay_loop_run(int max_events, TimestampTz *wake_at, bool *full, bool *backlog)
{
	int64		attempted = 0;
	MemoryContext entrycxt = CurrentMemoryContext;

	*full = false;
	*backlog = false;
	*wake_at = 0;
	if (RecoveryInProgress() || DefaultXactReadOnly)
		return 0;
	if (relay_loop.cxt == NULL)
	{
		relay_loop.cxt = AllocSetContextCreate(TopMemoryContext, "outbox relay loop",
											   ALLOCSET_DEFAULT_SIZES);
		relay_loop.itercxt = AllocSetContextCreate(relay_loop.cxt, "outbox relay iteration",
												   ALLOCSET_DEFAULT_SIZES);
		relay_loop.claim_needed = true;
		relay_loop.slice_size = 1;
	}
	if (relay_pass_running)
		elog(ERROR, "a relay loop cannot run inside a relay pass");
	relay_pass_running = true;
	PG_TRY();
	{
		MemoryContextSwitchTo(relay_loop.itercxt);
		attempted = relay_loop_iteration(max_events, wake_at, full, backlog);
	}
	PG_CATCH();
	{
		relay_pass_running = false;
		relay_unwatch_cancel();
		MemoryContextSwitchTo(entrycxt);
		relay_loop_abandon();
		MemoryContextReset(relay_loop.itercxt);
		relay_loop.claim_needed = true;
		PG_RE_THROW();
	}
	PG_END_TRY();
	relay_pass_running = false;
	MemoryContextSwitchTo(entrycxt);
	MemoryContextReset(relay_loop.itercxt);
	return attempted;
}

/* See relay.h. */
bool
relay_loop_wait(long timeout_ms, uint32 wait_event_info)
{
	bool		latch_set = http_async_wait(timeout_ms, wait_event_info);

	/* A publishing commit (or a resume, a redrive): look for work. */
	if (latch_set)
		relay_loop.claim_needed = true;
	return latch_set;
}

/* See relay.h. */
void
relay_loop_look_again(void)
{
	relay_loop.claim_needed = true;
}

/* See relay.h. */
int
relay_loop_in_flight(void)
{
	return http_async_in_flight();
}

/* See relay.h. */
bool
relay_loop_holds_claims(void)
{
	return relay_loop.nheld > 0 || relay_loop.nlocal > 0 || relay_loop.ndone > 0;
}
