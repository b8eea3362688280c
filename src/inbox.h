/*-------------------------------------------------------------------------
 *
 * inbox.h
 *	  The consumer inbox: idem_inbox_accept marks a message as processed in
 *	  the consumer's own transaction.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_INBOX_H
#define IDEM_INBOX_H

#include "postgres.h"

#include "storage/lock.h"

/* Longest source and message id, in bytes. */
#define IDEM_MAX_SOURCE_LEN		255
#define IDEM_MAX_MESSAGE_ID_LEN 255

/*
 * pg_locks shows an inbox mark's lock as locktype 'advisory' with this
 * objsubid; claims use IDEM_LOCK_CLASS (0x1DE0).
 */
#define IDEM_INBOX_LOCK_CLASS	0x1DE1

/* Column numbers of idempotency.inbox, in the order the upgrade script declares them. */
#define Anum_inbox_source		1
#define Anum_inbox_message_id	2
#define Anum_inbox_accepted_at	3
#define Anum_inbox_expires_at	4
#define Anum_inbox_owner		5
#define Natts_inbox				5

extern void InboxInit(void);
extern void inbox_locktag(LOCKTAG *tag, text *source, text *message_id);

#endif							/* IDEM_INBOX_H */
