/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  The transactional outbox: events, destinations, deliveries.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_OUTBOX_H
#define IDEM_OUTBOX_H

#include "postgres.h"

#include "fmgr.h"
#include "utils/array.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

/* Column numbers of idempotency.outbox, in the order the script declares them. */
#define Anum_outbox_event_id		1
#define Anum_outbox_seq				2
#define Anum_outbox_topic			3
#define Anum_outbox_key				4
#define Anum_outbox_payload			5
#define Anum_outbox_headers			6
#define Anum_outbox_published_at	7
#define Natts_outbox				7

/* Column numbers of idempotency.deliveries. */
#define Anum_deliveries_event_id			1
#define Anum_deliveries_destination_id		2
#define Anum_deliveries_seq					3
#define Anum_deliveries_key					4
#define Anum_deliveries_state				5
#define Anum_deliveries_attempts			6
#define Anum_deliveries_next_attempt_at		7
#define Anum_deliveries_visible_until		8
#define Anum_deliveries_first_attempt_at	9
#define Anum_deliveries_last_attempt_at		10
#define Anum_deliveries_delivered_at		11
#define Anum_deliveries_last_status			12
#define Anum_deliveries_last_error			13
#define Anum_deliveries_claims				14	/* version 1.2 */
#define Natts_deliveries					14

/* The columns of idempotency.destinations that idem_publish reads. */
#define Anum_destinations_id		1
#define Anum_destinations_topics	5

/* Longest topic, event key and destination name, in bytes. */
#define OUTBOX_MAX_NAME_LEN		255

/*
 * pg_locks shows the per-key publishing lock as locktype 'advisory' with this
 * objsubid (claims use 0x1DE0).
 */
#define OUTBOX_LOCK_CLASS		0x1DE2

/* Destination kinds. */
typedef enum DestKind
{
	DEST_NOTIFY,
	DEST_FUNCTION,
	DEST_HTTP
} DestKind;

/* Options every kind understands, with their defaults. */
#define DEST_DEFAULT_MAX_ATTEMPTS	10
#define DEST_DEFAULT_BACKOFF_BASE	1000		/* ms */
#define DEST_DEFAULT_BACKOFF_CAP	3600000		/* ms: one hour */
#define DEST_DEFAULT_TIMEOUT		10000		/* ms: a function call, an HTTP request */

/* Options of 'http' destinations (version 1.3), with their defaults. */
#define DEST_DEFAULT_MAX_IN_FLIGHT	16			/* requests open to one endpoint */
#define DEST_DEFAULT_CONNECT_TIMEOUT 5000		/* ms: connecting, within the timeout */
#define DEST_DEFAULT_FAILURE_THRESHOLD 10		/* consecutive failures that open the circuit */
#define DEST_DEFAULT_DISABLE_AFTER	(3 * 86400 * 1000L) /* ms: failing this long while open */

/* GUCs */
extern int	outbox_retention;
extern int	relay_batch_size;
extern int	relay_max_in_flight;
extern int	outbox_max_event_bytes;
extern int	relay_visibility_margin;
extern int	relay_workers;
extern char *relay_allowed_networks;

/* Most relay processes per database (idempotency.relay_workers). */
#define RELAY_MAX_WORKERS	16

/* Running SQL as the extension's owner, with a safe search_path. */
typedef struct OutboxOwnerState
{
	Oid			save_userid;
	int			save_sec_context;
	int			save_nestlevel;
} OutboxOwnerState;

/* outbox.c */
extern void OutboxInit(void);
extern Oid	outbox_relid(const char *relname);
extern bool outbox_installed(void);
extern void outbox_become_owner(OutboxOwnerState *state);
extern void outbox_restore_user(OutboxOwnerState *state);
extern bool outbox_published(void);
extern void outbox_wake_at_commit(void);
extern void outbox_dests_changed_at_commit(void);
extern bool outbox_topic_matches(Datum topics, text *topic);
extern void outbox_check_headers(Jsonb *headers, const char *what);
extern void outbox_check_name(text *value, const char *what);

/* relay_http.c: the hooks of idempotency.relay_allowed_networks */
extern bool http_check_allowed_networks(char **newval, void **extra, GucSource source);
extern void http_assign_allowed_networks(const char *newval, void *extra);

/* destinations.c */
extern DestKind dest_kind_from_name(const char *kind);
extern const char *dest_kind_name(DestKind kind);
extern void dest_check_topics(ArrayType *topics);
extern PGDLLEXPORT Datum idem_destination_create(PG_FUNCTION_ARGS);
extern PGDLLEXPORT Datum idem_destination_alter(PG_FUNCTION_ARGS);
extern PGDLLEXPORT Datum idem_destination_drop(PG_FUNCTION_ARGS);
extern PGDLLEXPORT Datum idem_destination_resume(PG_FUNCTION_ARGS);

/* dest_sync.c: destinations reach every node of a Citus cluster */
extern void dest_sync_note(text *name, bool created, bool resumed);
extern void dest_sync_note_drop(text *name);

#endif							/* IDEM_OUTBOX_H */
