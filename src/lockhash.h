/*-------------------------------------------------------------------------
 *
 * lockhash.h
 *	  The advisory lock tags of keys: a keyed hash, so that nobody outside
 *	  the database can compute which keys share a lock.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LOCKHASH_H
#define IDEM_LOCKHASH_H

#include "postgres.h"

#include "storage/lock.h"

/* Bytes of the per-database secret in idempotency.lock_key. */
#define IDEM_LOCK_KEY_LEN	16

extern void LockHashInit(void);
extern uint64 idem_siphash24(const uint8 key[IDEM_LOCK_KEY_LEN],
							 const uint8 *data, size_t len);
extern void idem_lock_tag(LOCKTAG *tag, uint16 lock_class, text *a, text *b);

#endif							/* IDEM_LOCKHASH_H */
