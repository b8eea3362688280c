/*-------------------------------------------------------------------------
 *
 * relay_inflight.c
 *	  Requests in flight per destination, shared by every relay loop of a
 *	  database, so that max_in_flight bounds what one endpoint sees.
 *
 * Each relay loop (the per-database worker's and its helpers') holds chains
 * of webhooks in flight across iterations.  Counting only its own would let
 * N relay processes open N times a destination's max_in_flight: exactly
 * what a slow endpoint with a backlog provokes, since a backlog is what
 * starts helpers.  So each loop publishes, in shared memory, how many chains
 * it holds per destination, and a claim counts the other loops' chains
 * against the destination's room as well as its own.
 *
 * Claims of a database's loops are serialised by a transaction-level lock
 * (relay_inflight_try_lock, RELAY_CLAIM_LOCK_CLASS) held from before the
 * rooms are read until the claim, with its new chains published, commits:
 * two loops never both see the same room free.  A loop never waits for it
 * (a claim can wait for a row that some session holds, and the other loops
 * must go on collecting, recording and renewing meanwhile): one that finds
 * it taken claims a little later.
 *
 * A loop publishes its counts again when they change (as its requests
 * complete), withdraws them all when it abandons its requests after an
 * error, and at process exit (before_shmem_exit).  A crash reinitialises
 * shared memory.  When the table is full (RELAY_INFLIGHT_MAX destinations
 * with requests in flight in all databases), a destination that finds no
 * entry is bounded per relay process, as before.
 *
 * A synchronous pass (idem_outbox_relay) neither publishes nor reads the
 * counts: it bounds only its own requests to a destination.
 *
 * The entry of a destination also carries a pause that its endpoint asked
 * for (a 429 or 503 with Retry-After) as soon as a loop receives it, so
 * that every loop holding chains of webhooks for it stops sending their
 * next requests at once (relay_inflight_paced), not only after the outcome
 * is recorded; each process also keeps the pauses it received itself, for
 * a destination that found no entry.  A pause counts only until the
 * destinations next change (stats.c's destination generation): resuming
 * or altering a destination ends its pacing, and the chains claimed before
 * the change are given back anyway.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

#include "relay.h"
#include "relay_internal.h"
#include "stats.h"

/* Destinations with requests in flight, in all databases, that the table holds. */
#define RELAY_INFLIGHT_MAX	8192

/* A destination of a database. */
typedef struct InflightKey
{
	Oid			dbid;
	int32		dest_id;
} InflightKey;

/* The chains in flight to it, summed over the relay loops that published them. */
typedef struct InflightEntry
{
	InflightKey key;
	int32		chains;
	TimestampTz paced_until;	/* its endpoint asked for a pause until then (0: none) */
	uint64		paced_generation;	/* the destination generation it was asked in */
} InflightEntry;

/* A pause this process received: destination id, until when. */
typedef struct LocalPace
{
	int32		dest_id;
	TimestampTz until;
	uint64		generation;		/* the destination generation it was asked in */
} LocalPace;

/* Pauses this process received that may still run (expired ones are reused). */
#define RELAY_LOCAL_PACES	64
static LocalPace local_paces[RELAY_LOCAL_PACES];

static HTAB *inflight_table = NULL;
static LWLock *inflight_lock = NULL;

/* relay_inflight_add_others' copy of the table's entries, read under the LWLock. */
static InflightEntry *others_copy = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* What this process has published: destination ids and their chains. */
static int32 *published_ids = NULL;
static int32 *published_chains = NULL;
/* relay_inflight_publish's scratch: what it published before, and their pauses. */
static int32 *scratch_ids = NULL;
static TimestampTz *scratch_paces = NULL;
static uint64 *scratch_generations = NULL;
static int	scratch_size = 0;
static int	npublished = 0;
static int	published_size = 0;
static bool exit_registered = false;

/* shmem_request_hook: reserve the table and its LWLock. */
static void
relay_inflight_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(hash_estimate_size(RELAY_INFLIGHT_MAX, sizeof(InflightEntry)));
	RequestNamedLWLockTranche("idempotency relay in flight", 1);
}

/* shmem_startup_hook: create (or attach to) the table. */
static void
relay_inflight_shmem_startup(void)
{
	HASHCTL		info;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	memset(&info, 0, sizeof(info));
	info.keysize = sizeof(InflightKey);
	info.entrysize = sizeof(InflightEntry);
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	inflight_table = ShmemInitHash("idempotency relay in flight",
								   RELAY_INFLIGHT_MAX, RELAY_INFLIGHT_MAX,
								   &info, HASH_ELEM | HASH_BLOBS);
	inflight_lock = &(GetNamedLWLockTranche("idempotency relay in flight"))->lock;
	LWLockRelease(AddinShmemInitLock);
}

/* See relay.h. */
void
RelayInflightInit(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = relay_inflight_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = relay_inflight_shmem_startup;
}

/*
 * Serialise this claim with the other relay loops' claims in this database,
 * until the end of the transaction; false, without waiting, if another
 * loop is claiming.
 */
bool
relay_inflight_try_lock(void)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 0, RELAY_CLAIM_LOCK_CLASS);
	return LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
}

/* The chains this process has published for destination id. */
static int32
relay_inflight_mine(int32 id)
{
	for (int i = 0; i < npublished; i++)
		if (published_ids[i] == id)
			return published_chains[i];
	return 0;
}

/*
 * Add to rooms the chains the other relay loops of this database hold per
 * destination, so that the claim takes them into its rooms.
 */
void
relay_inflight_add_others(RelayRooms *rooms)
{
	HASH_SEQ_STATUS status;
	InflightEntry *e;
	int			n = 0;

	if (inflight_table == NULL)
		return;
	/* Copied under the LWLock, counted after it: nothing may fail under it. */
	if (others_copy == NULL)
		others_copy = MemoryContextAlloc(TopMemoryContext,
										 sizeof(InflightEntry) * RELAY_INFLIGHT_MAX);
	LWLockAcquire(inflight_lock, LW_SHARED);
	hash_seq_init(&status, inflight_table);
	while ((e = hash_seq_search(&status)) != NULL)
		if (e->key.dbid == MyDatabaseId && n < RELAY_INFLIGHT_MAX)
			others_copy[n++] = *e;
	LWLockRelease(inflight_lock);

	for (int i = 0; i < n; i++)
	{
		int32		others = others_copy[i].chains - relay_inflight_mine(others_copy[i].key.dest_id);

		for (int32 k = 0; k < others; k++)
			relay_rooms_count(rooms, others_copy[i].key.dest_id);
	}
}

/* Destination id's shared entry, or NULL; the caller holds the LWLock. */
static InflightEntry *
relay_inflight_entry(int32 id)
{
	InflightKey key;

	memset(&key, 0, sizeof(key));
	key.dbid = MyDatabaseId;
	key.dest_id = id;
	return hash_search(inflight_table, &key, HASH_FIND, NULL);
}

/*
 * The pause that destination id's shared entry carries for destination
 * generation *generation (0: none, or no entry), after raising it to until
 * if that is later (a pause of an older generation is replaced); the
 * caller holds the LWLock (exclusively if until is not 0).  A pause of
 * another generation reads as none.
 */
static TimestampTz
relay_inflight_entry_pace(int32 id, TimestampTz until, uint64 generation)
{
	InflightEntry *e = relay_inflight_entry(id);

	if (e == NULL)
		return 0;
	if (until != 0 && (e->paced_generation != generation || until > e->paced_until))
	{
		e->paced_until = until;
		e->paced_generation = generation;
	}
	return e->paced_generation == generation ? e->paced_until : 0;
}

/*
 * Add delta to destination id's shared count; the caller holds the LWLock
 * exclusively.  Returns false if the table is full and had no entry for it.
 */
static bool
relay_inflight_adjust(int32 id, int32 delta)
{
	InflightKey key;
	InflightEntry *e;
	bool		found;

	memset(&key, 0, sizeof(key));
	key.dbid = MyDatabaseId;
	key.dest_id = id;
	e = hash_search(inflight_table, &key, delta > 0 ? HASH_ENTER_NULL : HASH_FIND, &found);
	if (e == NULL)
		return false;			/* table full: this destination is bounded per process */
	if (!found)
	{
		e->chains = 0;
		e->paced_until = 0;
		e->paced_generation = 0;
	}
	e->chains += delta;
	if (e->chains <= 0)
		(void) hash_search(inflight_table, &key, HASH_REMOVE, NULL);
	return true;
}

/* before_shmem_exit: withdraw what this process published. */
static void
relay_inflight_at_exit(int code, Datum arg)
{
	relay_inflight_withdraw();
}

/*
 * Publish the chains this process now holds per destination (held, as
 * relay_loop_active counts them, in rooms), replacing what it published
 * before.  Takes the LWLock only when something changed.
 */
void
relay_inflight_publish(RelayRooms *held)
{
	bool		same = true;
	int			nheld = 0;
	int			nold;

	if (inflight_table == NULL)
		return;
	for (int i = 0; i < held->n; i++)
		if (held->active[i] > 0)
		{
			nheld++;
			if (relay_inflight_mine(held->ids[i]) != held->active[i])
				same = false;
		}
	if (same && nheld == npublished)
		return;

	if (!exit_registered)
	{
		before_shmem_exit(relay_inflight_at_exit, (Datum) 0);
		exit_registered = true;
	}
	if (published_size < held->n)
	{
		published_size = Max(held->n, 16);
		if (published_ids == NULL)
		{
			published_ids = MemoryContextAlloc(TopMemoryContext, sizeof(int32) * published_size);
			published_chains = MemoryContextAlloc(TopMemoryContext, sizeof(int32) * published_size);
		}
		else
		{
			published_ids = repalloc(published_ids, sizeof(int32) * published_size);
			published_chains = repalloc(published_chains, sizeof(int32) * published_size);
		}
	}
	if (scratch_size < published_size)
	{
		if (scratch_ids != NULL)
		{
			pfree(scratch_ids);
			pfree(scratch_paces);
			pfree(scratch_generations);
		}
		scratch_ids = MemoryContextAlloc(TopMemoryContext, sizeof(int32) * published_size);
		scratch_paces = MemoryContextAlloc(TopMemoryContext, sizeof(TimestampTz) * published_size);
		scratch_generations = MemoryContextAlloc(TopMemoryContext, sizeof(uint64) * published_size);
		scratch_size = published_size;
	}

	LWLockAcquire(inflight_lock, LW_EXCLUSIVE);
	/* What was published goes; an entry that comes back keeps its pause. */
	nold = npublished;
	for (int i = 0; i < npublished; i++)
	{
		InflightEntry *e = relay_inflight_entry(published_ids[i]);

		scratch_ids[i] = published_ids[i];
		scratch_paces[i] = e ? e->paced_until : 0;
		scratch_generations[i] = e ? e->paced_generation : 0;
		(void) relay_inflight_adjust(published_ids[i], -published_chains[i]);
	}
	npublished = 0;
	for (int i = 0; i < held->n; i++)
		if (held->active[i] > 0 && relay_inflight_adjust(held->ids[i], held->active[i]))
		{
			published_ids[npublished] = held->ids[i];
			published_chains[npublished] = held->active[i];
			npublished++;
			for (int j = 0; j < nold; j++)
				if (scratch_ids[j] == held->ids[i] && scratch_paces[j] != 0)
					(void) relay_inflight_entry_pace(held->ids[i], scratch_paces[j],
													 scratch_generations[j]);
		}
	LWLockRelease(inflight_lock);
}

/* Withdraw everything this process published (its requests are abandoned, or it exits). */
void
relay_inflight_withdraw(void)
{
	if (inflight_table == NULL || npublished == 0 || LWLockHeldByMe(inflight_lock))
		return;
	LWLockAcquire(inflight_lock, LW_EXCLUSIVE);
	for (int i = 0; i < npublished; i++)
		(void) relay_inflight_adjust(published_ids[i], -published_chains[i]);
	npublished = 0;
	LWLockRelease(inflight_lock);
}

/*
 * Destination id's endpoint asked for a pause until then: the loops'
 * chains of webhooks for it stop (see relay_inflight_paced).
 */
void
relay_inflight_pace(int32 id, TimestampTz until)
{
	int			slot = -1;
	TimestampTz now = GetCurrentTimestamp();
	uint64		generation = idem_stats_dest_generation();

	for (int i = 0; i < RELAY_LOCAL_PACES; i++)
	{
		bool		running = local_paces[i].until > now &&
			local_paces[i].generation == generation;

		if (running && local_paces[i].dest_id == id)
		{
			slot = i;
			break;
		}
		if (slot < 0 && !running)
			slot = i;
	}
	/* All taken by other running pauses: the shared entry has to do. */
	if (slot >= 0)
	{
		if (local_paces[slot].dest_id == id && local_paces[slot].until > now &&
			local_paces[slot].generation == generation)
			until = Max(until, local_paces[slot].until);
		local_paces[slot].dest_id = id;
		local_paces[slot].until = until;
		local_paces[slot].generation = generation;
	}
	if (inflight_table == NULL)
		return;
	LWLockAcquire(inflight_lock, LW_EXCLUSIVE);
	(void) relay_inflight_entry_pace(id, until, generation);
	LWLockRelease(inflight_lock);
}

/* Whether destination id's endpoint asked for a pause that runs at now. */
bool
relay_inflight_paced(int32 id, TimestampTz now)
{
	bool		paced;
	uint64		generation = idem_stats_dest_generation();

	for (int i = 0; i < RELAY_LOCAL_PACES; i++)
		if (local_paces[i].dest_id == id && local_paces[i].until > now &&
			local_paces[i].generation == generation)
			return true;
	if (inflight_table == NULL)
		return false;
	LWLockAcquire(inflight_lock, LW_SHARED);
	paced = relay_inflight_entry_pace(id, 0, generation) > now;
	LWLockRelease(inflight_lock);
	return paced;
}
