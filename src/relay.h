/*-------------------------------------------------------------------------
 *
 * relay.h
 *	  The outbox relay: what the per-database background worker calls.
 *
 * The worker's loop (not inside a transaction) calls relay_loop_run() when
 * its latch is set, a request has news or the relay's next due time has
 * come, and outbox_cleanup() now and then; relay helpers run the same
 * loop.  A relay pass (relay_pass: idem_outbox_relay in SQL) and
 * outbox_cleanup manage their own transactions when called outside one, and
 * work inside the caller's transaction otherwise (the SQL entry points
 * idem_outbox_relay and idem_outbox_cleanup).  An error propagates to the
 * caller, whose error handling must abort the transaction.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_RELAY_H
#define IDEM_RELAY_H

#include "postgres.h"

#include "datatype/timestamp.h"

/*
 * One relay pass in the current database: claim up to max_events due
 * deliveries across all active destinations, deliver them, record the
 * outcomes, waiting for every request of the batch.  Returns the number of
 * deliveries attempted.  Works within the caller's transaction
 * (idem_outbox_relay), or in transactions of its own when called outside
 * one.  Neither the worker nor the helpers use it (they run
 * relay_loop_run); only the relay harness of the test-only module
 * test/modules/idem_test calls it outside a transaction, in a process of
 * its own, which is why it is exported (PGDLLEXPORT): that module finds it
 * with load_external_function().  A pass does nothing on a hot standby,
 * outside a transaction while default_transaction_read_only is on, in a
 * database without the outbox, or while another session holds a lock on
 * the deliveries that it would wait for.
 */
extern PGDLLEXPORT int64 relay_pass(int max_events);

/*
 * One iteration of the worker's relay loop, outside any transaction:
 * record the outcomes of the webhooks whose requests completed, renew
 * claims that would expire first, then -- in the same transaction as the
 * outcomes -- claim what may go now: for each 'http' destination up to its
 * max_in_flight chains of requests, all of them below
 * idempotency.relay_max_in_flight, none for a destination paced by
 * Retry-After or whose open circuit is not due for a probe; start those
 * webhooks once the claim has committed, and make the function and notify
 * deliveries in a transaction of their own.  A claim is made only when
 * something may be claimable (a commit set the latch, requests completed,
 * the next due time came, or the last one made in-database deliveries).  Webhooks
 * stay in flight after it returns: a slow endpoint holds up nothing but
 * its own deliveries.  *full says the claim took max_events (call again at
 * once); *backlog that some destination had more deliveries due than the
 * loop could take (relay helpers could share them); *wake_at is when to
 * come back at the latest (0: when woken), besides what relay_loop_wait
 * waits for.  With max_events 0 it claims nothing: a relay helper that is
 * leaving collects and records the outcomes of its requests in flight.
 * Returns the deliveries attempted.  On error, every request in flight is
 * abandoned (their claims expire) and the error propagates.
 */
extern int64 relay_loop_run(int max_events, TimestampTz *wake_at, bool *full, bool *backlog);

/*
 * Sleep at most timeout_ms, until a request of the loop has news (a socket
 * is ready, or one of libcurl's timers is due) or the latch is set (reset
 * here): the worker's wait between iterations.  Returns whether the latch
 * was set.
 */
extern bool relay_loop_wait(long timeout_ms, uint32 wait_event_info);

/*
 * Make the loop's next iteration look for deliveries to claim, as a commit
 * that sets the latch does: for relay helpers, whose latch no commit sets.
 */
extern void relay_loop_look_again(void);

/* Requests of the relay loop in flight. */
extern int	relay_loop_in_flight(void);

/*
 * Whether the relay loop holds claims it has not settled: webhooks in
 * flight or waiting behind their key, function and notify deliveries not
 * made yet, or outcomes not recorded yet.  A relay process that exits
 * holding them leaves them to run out and to be taken for interrupted
 * attempts.
 */
extern bool relay_loop_holds_claims(void);

/*
 * Run unit(arg), a piece of a background worker's work (a relay pass, a
 * cleanup pass), so that an error ends only that piece: the error is
 * logged with what as its context, the transaction is aborted, and false
 * is returned; the worker backs off and goes on, as autovacuum does after
 * an error on one table.  A cancel (pg_cancel_backend) thus cancels the
 * piece at work; a terminate (pg_terminate_backend, FATAL) still ends the
 * process.  Called outside any transaction.
 */
/* Most deliveries one pass may claim: idempotency.relay_batch_size and idem_outbox_relay's bound. */
#define RELAY_MAX_BATCH		100000

extern bool bgworker_run_guarded(const char *what, void (*unit) (void *arg), void *arg);

/*
 * When the relay next has work: the earliest next_attempt_at of a pending
 * delivery of an active destination (the visibility deadline of a claimed
 * one included) that may be claimed now (neither paced by Retry-After nor
 * with an open circuit waiting for its probe time, nor among the nfull
 * destinations in full, whose requests are all in flight), or the end of
 * such a wait; 0 if none: the relay loop can sleep until then.  Exported
 * (PGDLLEXPORT) for the test-only module test/modules/idem_test, whose
 * idem_relay_next_due() calls it with no destination left out.
 */
extern PGDLLEXPORT TimestampTz relay_next_due_except(int32 *full, int nfull);

/*
 * Remove deliveries delivered longer than idempotency.outbox_retention ago,
 * and events older than that with no delivery left, in batches of batch
 * rows; fold the per-pass statistics rows.  Returns the number of events
 * removed.  Outside a transaction, does nothing while
 * default_transaction_read_only is on, and calls between (if not NULL)
 * after each batch, outside any transaction: the worker's relay goes on
 * meanwhile.
 */
extern int64 outbox_cleanup(int batch, void (*between) (void));

/*
 * Start relay helpers in the current database until idempotency.relay_workers
 * relay processes run, the caller included; the worker calls it after an
 * iteration of its loop that left due deliveries behind (a backlog).  Helpers run the same loop (relay_loop_run).
 * Defined in relay_helpers.c, with the helpers' entry point.
 */
extern void relay_start_helpers(const char *dbname);
extern PGDLLEXPORT void idem_relay_helper_main(Datum main_arg);

/*
 * Wake the relay of database dbid.  Called at commit (XACT_EVENT_COMMIT,
 * once per transaction) by every transaction that published an event for
 * some destination, redrove dead letters or resumed a destination.  It runs
 * after the commit record is written, so it must not raise an error: setting
 * the worker's latch is what it is for.  Defined in relay_wakeup.c.
 */
extern void WorkerWakeRelay(Oid dbid);

/*
 * Install the hook that wakes the relay after COMMIT PREPARED (a prepared
 * publisher's commit); called once from _PG_init.  In relay_wakeup.c.
 */
extern void RelayWakeupInit(void);

/* relay_inflight.c: reserve the shared table of requests in flight (when preloaded) */
extern void RelayInflightInit(void);

#endif							/* IDEM_RELAY_H */
