/*-------------------------------------------------------------------------
 *
 * relay_internal.h
 *	  What the relay's own files share: relay.c (claims, in-database
 *	  deliveries, recording, the synchronous pass, cleanup), relay_loop.c
 *	  (the worker's loop) and relay_circuit.c (per-destination endpoint
 *	  state).  Only those files include it; others use relay.h.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_RELAY_INTERNAL_H
#define IDEM_RELAY_INTERNAL_H

#include "postgres.h"

#include "executor/spi.h"
#include "nodes/pg_list.h"

#include "outbox.h"
#include "relay_http.h"

/* A transaction step of a pass, in its own transaction or in the caller's. */
typedef struct RelayStep
{
	bool		own_xact;
	OutboxOwnerState owner;
	MemoryContext caller_cxt;	/* own_xact: current again after the commit */
} RelayStep;

/*
 * How many more requests a claim may open: to each destination (in the
 * worker's loop, whose requests stay in flight, its max_in_flight less the
 * chains of its deliveries the loop holds; a destination whose circuit is
 * open, one probe) and to all 'http' destinations together; and, in the
 * loop, how many function and notify deliveries it may take (about what
 * one slice makes, so that a crash interrupts no more than that).
 */
typedef struct RelayRooms
{
	bool		limit;			/* apply each destination's max_in_flight */
	int			n;				/* destinations with chains held */
	int			size;
	int32	   *ids;
	int32	   *active;			/* chains held per destination */
	int			http_room;		/* 'http' heads the claim may still take */
	int			local_room;		/* with limit: in-database deliveries it may take */
} RelayRooms;

/* Whether a relay pass or the loop runs in this backend (a destination may not start another). */
extern bool relay_pass_running;

/* relay.c: statements and transaction steps */
extern SPIPlanPtr relay_prepare(SPIPlanPtr *plan, const char *sql, int nargs, Oid *argtypes);
extern int	relay_plan_settings(void);
extern bool relay_step_begin(RelayStep *step, const char *activity, bool skippable);
extern bool relay_schema_current(bool own_xact);
extern void relay_step_end(RelayStep *step);
extern Datum spi_value(HeapTuple tuple, int col, Datum def);
extern Datum relay_array(Datum *values, bool *nulls, int n, Oid typid);

/* relay.c: claiming */
extern List *relay_load_dests(MemoryContext cxt, RelayItem **items, int n);
extern RelayDest *relay_find_dest(List *dests, int32 id);
extern void relay_rooms_count(RelayRooms *rooms, int32 id);
extern void relay_rooms_block(RelayRooms *rooms, int32 id);
extern void relay_rooms_take(RelayRooms *rooms, RelayItem **items, int first, int n);
extern int	relay_claim(int max_events, int waves, RelayRooms *rooms, TimestampTz now,
						MemoryContext cxt, RelayItem ***items, bool *backlog);

/* relay.c: in-database deliveries and outcomes */
extern void relay_relock(RelayItem **items, int n, bool *any);
extern void relay_fail(RelayItem *it, MemoryContext cxt, int32 status, const char *error);
extern void relay_notify(RelayItem *it);
extern void relay_watch_cancel(void);
extern void relay_unwatch_cancel(void);
extern void relay_call_function(RelayItem *it, MemoryContext cxt);
extern void relay_record_all(RelayItem **items, int n, RelayItem **missed);
extern void relay_outcomes_held(RelayItem **items, int n, bool *held);
extern void relay_abandon_interrupted(RelayItem **items, int n, MemoryContext cxt);

/* relay_inflight.c: chains in flight per destination, shared by the relay loops */
#define RELAY_CLAIM_LOCK_CLASS	0x1DE3	/* advisory objsubid of the loops' claim lock */
extern bool relay_inflight_try_lock(void);
extern void relay_inflight_add_others(RelayRooms *rooms);
extern void relay_inflight_publish(RelayRooms *held);
extern void relay_inflight_withdraw(void);
extern void relay_inflight_pace(int32 id, TimestampTz until);
extern bool relay_inflight_paced(int32 id, TimestampTz now);

/* relay_circuit.c: per-destination endpoint state */
extern void relay_endpoint_states(RelayItem **items, int n);
extern void relay_claim_probes(RelayItem **items, int n, TimestampTz now);
extern void relay_disable(List *dests);
extern bool relay_endpoint_deferred(void);

#endif							/* IDEM_RELAY_INTERNAL_H */
