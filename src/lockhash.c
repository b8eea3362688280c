/*-------------------------------------------------------------------------
 *
 * lockhash.c
 *	  Advisory lock tags of keys, from a keyed hash.
 *
 * A claim, an inbox delivery and a keyed publish lock a hash of their key,
 * since a lock tag has room for 64 bits, not for the key.  Two keys with the
 * same hash wait for each other: harmless between honest keys (a false
 * 'in_progress' or 55P03 once in 2^64), but with an unkeyed hash anyone
 * could compute colliding pairs offline and plant one key of a pair to stall
 * or deadlock the other.  So the hash is SipHash-2-4 (Aumasson and
 * Bernstein's PRF for exactly this purpose) keyed with 128 random bits that
 * CREATE EXTENSION draws and keeps in idempotency.lock_key, which only the
 * extension's owner can read.  Without the key, finding a collision takes
 * about 2^64 tries against the server itself.
 *
 * Every backend of a database must use the same key, and does: the key is
 * read from the table on first use, and read again whenever the table is
 * invalidated (dropped and re-created with the extension).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/snapmgr.h"

#include "lockhash.h"
#include "records.h"

/* idempotency.lock_key, its one row and column. */
static IdemRelCache lock_key_rels = IDEM_RELCACHE("lock_key");
static uint8 lock_key[IDEM_LOCK_KEY_LEN];
static bool lock_key_loaded = false;

/* Register the cached OID of idempotency.lock_key; called once from _PG_init. */
void
LockHashInit(void)
{
	idem_relcache_register(&lock_key_rels);
}

#define ROTL64(x, b)	(((x) << (b)) | ((x) >> (64 - (b))))

#define SIPROUND \
	do { \
		v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32); \
		v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2; \
		v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0; \
		v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32); \
	} while (0)

/* Eight bytes as a little-endian 64-bit integer. */
static inline uint64
load_le64(const uint8 *p)
{
	return (uint64) p[0] | (uint64) p[1] << 8 | (uint64) p[2] << 16 |
		(uint64) p[3] << 24 | (uint64) p[4] << 32 | (uint64) p[5] << 40 |
		(uint64) p[6] << 48 | (uint64) p[7] << 56;
}

/*
 * SipHash-2-4 of data under a 128-bit key, as specified by its authors
 * (key 00..0f and message 00..0e give a129ca6149be45e5).
 */
uint64
idem_siphash24(const uint8 key[IDEM_LOCK_KEY_LEN], const uint8 *data, size_t len)
{
	uint64		k0 = load_le64(key);
	uint64		k1 = load_le64(key + 8);
	uint64		v0 = UINT64CONST(0x736f6d6570736575) ^ k0;
	uint64		v1 = UINT64CONST(0x646f72616e646f6d) ^ k1;
	uint64		v2 = UINT64CONST(0x6c7967656e657261) ^ k0;
	uint64		v3 = UINT64CONST(0x7465646279746573) ^ k1;
	uint64		last = (uint64) len << 56;
	size_t		full = len - len % 8;

	for (size_t i = 0; i < full; i += 8)
	{
		uint64		m = load_le64(data + i);

		v3 ^= m;
		SIPROUND;
		SIPROUND;
		v0 ^= m;
	}
	for (size_t i = full; i < len; i++)
		last |= (uint64) data[i] << (8 * (i - full));
	v3 ^= last;
	SIPROUND;
	SIPROUND;
	v0 ^= last;
	v2 ^= 0xff;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

/* Read this database's lock key, if not read since the table last changed. */
static void
lock_key_load(void)
{
	Relation	rel;
	SysScanDesc scan;
	HeapTuple	tuple;
	bool		found = false;

	if (!lock_key_rels.stale && lock_key_loaded)
		return;
	lock_key_loaded = false;
	if (!idem_relcache_resolve(&lock_key_rels))
		idem_report_missing("lock_key");

	rel = table_open(lock_key_rels.oids[0], AccessShareLock);
	scan = systable_beginscan(rel, InvalidOid, false, SnapshotSelf, 0, NULL);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		bool		isnull;
		Datum		value = heap_getattr(tuple, 1, RelationGetDescr(rel), &isnull);
		bytea	   *key = isnull ? NULL : DatumGetByteaPP(value);

		if (key != NULL && VARSIZE_ANY_EXHDR(key) == IDEM_LOCK_KEY_LEN)
		{
			memcpy(lock_key, VARDATA_ANY(key), IDEM_LOCK_KEY_LEN);
			found = true;
		}
	}
	systable_endscan(scan);
	table_close(rel, NoLock);

	if (!found)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.lock_key holds no valid key"),
				 errdetail("It must hold one row of %d random bytes.", IDEM_LOCK_KEY_LEN),
				 errhint("Restore it from a backup of the database, or re-create the extension.")));
	lock_key_loaded = true;
}

/* Append a length-prefixed field, so that ("ab", "c") and ("a", "bc") differ. */
static size_t
append_field(uint8 *buf, size_t pos, text *value)
{
	uint32		len = value ? VARSIZE_ANY_EXHDR(value) : PG_UINT32_MAX;

	memcpy(buf + pos, &len, sizeof(len));
	pos += sizeof(len);
	if (value != NULL)
	{
		memcpy(buf + pos, VARDATA_ANY(value), VARSIZE_ANY_EXHDR(value));
		pos += VARSIZE_ANY_EXHDR(value);
	}
	return pos;
}

/*
 * The advisory lock tag of (a, b) in lock class lock_class (b may be NULL)
 * in this database: shown in pg_locks as locktype 'advisory' with objsubid
 * lock_class.  Call it after opening the table the key belongs to, so that
 * an upgrade that re-creates the key cannot come in between.
 */
void
idem_lock_tag(LOCKTAG *tag, uint16 lock_class, text *a, text *b)
{
	uint8		stackbuf[1024];
	size_t		need = sizeof(lock_class) + 2 * sizeof(uint32) +
		VARSIZE_ANY_EXHDR(a) + (b ? VARSIZE_ANY_EXHDR(b) : 0);
	uint8	   *buf = need <= sizeof(stackbuf) ? stackbuf : palloc(need);
	size_t		pos = 0;
	uint64		h;

	lock_key_load();
	memcpy(buf, &lock_class, sizeof(lock_class));
	pos = append_field(buf, sizeof(lock_class), a);
	pos = append_field(buf, pos, b);
	h = idem_siphash24(lock_key, buf, pos);
	if (buf != stackbuf)
		pfree(buf);
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 lock_class);
}
