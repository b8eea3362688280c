/*-------------------------------------------------------------------------
 *
 * relay_http.h
 *	  What one relay pass works on, and its HTTP delivery.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_RELAY_HTTP_H
#define IDEM_RELAY_HTTP_H

#include "postgres.h"

#include "fmgr.h"
#include "nodes/pg_list.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

#include "outbox.h"

/* A destination as the relay uses it during one pass. */
typedef struct RelayDest
{
	int32		id;
	char	   *name;
	DestKind	kind;
	char	   *target;			/* channel, function signature or URL */
	Oid			func;			/* kind 'function' */
	Oid			run_as;
	char	   *search_path;
	List	   *secrets;		/* kind 'http': decoded HMAC keys (bytea *) */
	Jsonb	   *headers;		/* kind 'http': extra headers, or NULL */
	int32		max_attempts;
	int64		backoff_base_ms;
	int64		backoff_cap_ms;
	int64		timeout_ms;
	int32		max_in_flight;	/* kind 'http': requests open at once */
	int64		connect_timeout_ms; /* kind 'http': connecting, within timeout_ms */
	int32		failure_threshold;	/* kind 'http': failures in a row that open the circuit */
	int64		disable_after_ms;	/* kind 'http': open and failing this long: disabled */
	bool		circuit_open;	/* as loaded: the circuit was open */
	int32		consecutive_failures;	/* as loaded */
	bool		paced;			/* as loaded: paced_until was still ahead */
	int			in_flight;		/* http_deliver: its requests under way */
	FmgrInfo	flinfo;			/* kind 'function', once looked up */
	bool		flinfo_ready;
	char	   *disable_reason; /* set when the endpoint answered 410 Gone */
	bool		reference;		/* kind 'notify': send the event id, not the event */
} RelayDest;

/* What became of one claimed delivery. */
typedef enum RelayOutcome
{
	RELAY_PENDING,				/* not attempted yet */
	RELAY_DELIVERED,
	RELAY_FAILED,
	RELAY_SKIPPED,				/* another relay owns it now: record nothing */
	RELAY_RELEASED,				/* not attempted: its key's previous delivery was not
								 * delivered; the claim is given back */
	RELAY_ABANDONED				/* not attempted: its last allowed attempt was
								 * interrupted before its outcome was recorded; it
								 * is dead */
} RelayOutcome;

/* One claimed delivery. */
typedef struct RelayItem
{
	pg_uuid_t	event_id;
	int32		dest_id;
	RelayDest  *dest;			/* NULL if the destination was dropped */
	int32		attempts;		/* this attempt's number */
	int64		claim;			/* the delivery's claims counter as we claimed it: our
								 * claim's fencing token (attempts goes back on a
								 * redrive, this never does) */
	int64		seq;
	bool		interrupted;	/* the previous attempt's outcome was never recorded */
	char	   *topic;
	char	   *key;			/* NULL if the event has none */
	TimestampTz published_at;
	char	   *body;			/* http: the payload; notify: the envelope text */
	Jsonb	   *envelope;		/* function: the envelope */
	Jsonb	   *event_headers;	/* http: the event's headers, or NULL */

	struct RelayItem *chain_next;	/* the next delivery of the same key to the
									 * same destination in this batch */
	bool		chain_held;		/* waits for its predecessor in the batch */
	int			http_slot;		/* relay_http.c: its request */

	TimestampTz claimed_until;	/* the visibility deadline the claim set */
	bool		sent;			/* http: its request has started */
	bool		row_held;		/* not made: another session held its row, our
								 * claim still standing (relay_relock) */
	bool		is_http;		/* its destination was of kind 'http' when claimed */
	void	   *batch;			/* relay.c's loop: the claim it came with */
	int64		retry_after_ms; /* http: a 429 or 503 asked for this delay, or -1 */
	bool		while_open;		/* http: failed while its destination's circuit was open */
	bool		rescheduled;	/* http: the endpoint rescheduled it (429, or
								 * Retry-After): its attempt is not counted */
	bool		probe;			/* http: a probe of an open circuit, its attempt
								 * given back when claimed */
	TimestampTz retry_at;		/* http: when to try again, if not by backoff (0) */

	RelayOutcome outcome;
	int32		status;			/* HTTP status, 0 if none */
	char	   *error;			/* why it failed */
	TimestampTz finished_at;
} RelayItem;

/*
 * How a pass keeps its claims hidden from other relays while it runs.  A
 * claim hides a delivery for a window sized for the pass's waves of HTTP
 * requests; a pass that runs longer (a key's chain of webhooks goes out one
 * after the other) renews its claims before half the window has gone.  Only
 * a pass that committed its claims renews them: in the caller's transaction
 * (idem_outbox_relay) the claimed rows stay locked until it ends.
 */
typedef struct RelayLease
{
	bool		renewable;		/* the claims are committed */
	int64		window_us;		/* how long a claim or a renewal hides them */
	TimestampTz renew_at;		/* when to renew them next */
} RelayLease;

/* relay.c */
extern void relay_release_chain(RelayItem *it);
extern void relay_renew_claims(RelayItem **items, int n, RelayLease *lease);

/* relay_http.c */
extern const char *http_check_url(const char *url);
extern const char *http_check_url_host(const char *url);
extern int	http_max_in_flight(void);
extern bytea *http_decode_secret(const char *secret);
extern void http_deliver(RelayItem **items, int nitems, RelayLease *lease);
extern void http_async_start(RelayItem *it);
extern void http_async_kick(void);
extern int	http_async_in_flight(void);
extern List *http_async_collect(void);
extern void http_async_abandon(void);
extern bool http_async_wait(long timeout_ms, uint32 wait_event_info);

#endif							/* IDEM_RELAY_HTTP_H */
