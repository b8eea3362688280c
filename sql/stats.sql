--
-- idem_stats: shared-memory counters, one row per database; every call is
-- counted when it answers (a claim whose transaction later rolls back still
-- counts, as in pg_stat_statements).  idem_cleanup() runs one cleanup pass
-- in this transaction, as the background worker does in short ones.  No
-- worker runs in this test instance (idempotency.databases is empty).
--
-- Earlier tests may have left expired rows: clean them up first, so that the
-- cleanup counts below are this test's own.
SELECT idem_cleanup() >= 0 AS cleaned;
SELECT idem_stats_reset();
SELECT claims, replays, mismatches, in_progress, takeovers, fenced, releases,
       inbox_accepted, inbox_duplicates, rows_deleted,
       now() - stats_reset < interval '1 minute' AS just_reset, worker_pid
  FROM idem_stats WHERE datname = current_database();

-- Claims and their outcomes.
BEGIN;
SELECT outcome FROM idem_claim('stats:POST /x', 'k1', '{"a": 1}');
SELECT idem_succeed('stats:POST /x', 'k1', 201);
COMMIT;
SELECT outcome FROM idem_claim('stats:POST /x', 'k1', '{"a": 1}');
SELECT outcome FROM idem_claim('stats:POST /x', 'k1', '{"a": 1}');
SELECT outcome FROM idem_claim('stats:POST /x', 'k1', '{"a": 2}');
BEGIN;
SELECT outcome FROM idem_claim('stats:POST /x', 'k2', '{}');
SELECT idem_release('stats:POST /x', 'k2');
COMMIT;
BEGIN;
SELECT outcome FROM idem_claim('stats:POST /x', 'k-rolled-back', '{}');
ROLLBACK;
-- 'in_progress': a record still 'processing', as multi-phase operations write them.
INSERT INTO idempotency.records (scope, key, state, fingerprint, token, created_at,
                                 lease_expires_at, expires_at)
VALUES ('stats:POST /x', 'k3', 'processing', idem_fingerprint('{}'), 1, now(),
        now() + interval '30 seconds', now() + interval '1 day');
SELECT outcome, retry_after > 0 AS retry_after_ok FROM idem_claim('stats:POST /x', 'k3', '{}');
-- Inbox deliveries.
SELECT idem_inbox_accept('stats-topic', 'm1') AS first,
       idem_inbox_accept('stats-topic', 'm1') AS again,
       idem_inbox_accept('stats-topic', 'm2') AS other;

SELECT claims, replays, mismatches, in_progress, takeovers, fenced, releases,
       inbox_accepted, inbox_duplicates
  FROM idem_stats WHERE datname = current_database();

-- Cleanup: 5 expired records, 3 expired inbox marks, 1 expired record still
-- 'processing' (left in place and reported), live ones (kept).  A
-- multi-phase operation whose ttl has passed but whose lease is live is
-- running, not stuck: kept and not reported.  (It used to be counted in
-- expired_processing: 2.)
INSERT INTO idempotency.records (scope, key, state, fingerprint, token, created_at, expires_at,
                                 lease_expires_at)
VALUES ('stats:running', 'r1', 'processing', idem_fingerprint('{}'), 1,
        now() - interval '2 days', now() - interval '1 day', now() + interval '1 hour');
INSERT INTO idempotency.records (scope, key, state, fingerprint, status, token,
                                 created_at, completed_at, expires_at)
SELECT 'stats:expired', 'e' || g, 'completed', idem_fingerprint('{}'), 200, 1,
       now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, 5) g;
INSERT INTO idempotency.records (scope, key, state, fingerprint, token, created_at, expires_at)
VALUES ('stats:expired', 'p1', 'processing', idem_fingerprint('{}'), 1,
        now() - interval '2 days', now() - interval '1 day');
INSERT INTO idempotency.inbox (source, message_id, accepted_at, expires_at)
SELECT 'stats-expired', 'x' || g, now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, 3) g;
SELECT count(*) AS records, count(*) FILTER (WHERE expires_at < now()) AS expired
  FROM idempotency.records WHERE scope LIKE 'stats:%';
SELECT count(*) AS marks, count(*) FILTER (WHERE expires_at < now()) AS expired
  FROM idempotency.inbox WHERE source LIKE 'stats-%';
SELECT count(*) AS other_expired FROM idempotency.records WHERE expires_at < now() AND scope NOT LIKE 'stats:%';

-- Batches of 2: several batches, one pass.
SELECT idem_cleanup(2) AS deleted;
SELECT scope, key, state FROM idempotency.records WHERE expires_at < now() ORDER BY 1, 2;
SELECT count(*) AS expired_marks FROM idempotency.inbox WHERE expires_at < now();
SELECT count(*) AS live_records FROM idempotency.records
 WHERE expires_at >= now() AND scope LIKE 'stats:%';
SELECT cleanup_runs, rows_deleted, expired_processing,
       now() - last_cleanup_at < interval '1 minute' AS recent,
       last_cleanup_duration >= interval '0' AS duration_ok,
       cleanup_lag < interval '1 minute' AS small_lag
  FROM idem_stats WHERE datname = current_database();
DELETE FROM idempotency.records WHERE scope = 'stats:running';
-- Nothing left to delete: a second pass deletes nothing.
SELECT idem_cleanup() AS deleted;

-- cleanup_lag bounds the age of the oldest expired row not yet deleted.  A
-- row whose key is claimed by a transaction in flight is left alone (here the
-- claim is this transaction's own, which is how a test can hold one), and the
-- lag shows how old it is.
BEGIN;
SELECT outcome FROM idem_claim('stats:held', 'h1', '{}');
INSERT INTO idempotency.records (scope, key, state, fingerprint, status, token,
                                 created_at, completed_at, expires_at)
VALUES ('stats:held', 'h1', 'completed', idem_fingerprint('{}'), 200, 1,
        now() - interval '3 hours', now() - interval '3 hours', now() - interval '2 hours');
SELECT idem_cleanup() AS deleted;
SELECT count(*) AS still_there FROM idempotency.records WHERE scope = 'stats:held';
SELECT cleanup_lag > interval '2 hours' AS lag_shows_the_held_row,
       cleanup_lag < interval '3 hours' AS lag_bounded
  FROM idem_stats WHERE datname = current_database();
SELECT idem_release('stats:held', 'h1');
COMMIT;
SELECT idem_cleanup() AS deleted;
SELECT cleanup_lag < interval '1 minute' AS small_lag
  FROM idem_stats WHERE datname = current_database();

-- Bad batch size.
SELECT idem_cleanup(0);
\echo :SQLSTATE

-- Reset zeroes the counters; the last pass's results stay.
SELECT idem_stats_reset();
SELECT claims, replays, inbox_accepted, cleanup_runs, rows_deleted,
       last_cleanup_at IS NOT NULL AS last_cleanup_kept
  FROM idem_stats WHERE datname = current_database();

-- Everyone can read the view; resetting it and running a pass need a grant.
CREATE ROLE idem_watcher LOGIN;
SET ROLE idem_watcher;
SELECT count(*) > 0 AS visible FROM idem_stats WHERE datname = current_database();
SELECT idem_stats_reset();
\echo :SQLSTATE
SELECT idem_cleanup();
\echo :SQLSTATE
RESET ROLE;
DROP ROLE idem_watcher;

DELETE FROM idempotency.records WHERE scope LIKE 'stats:%';
DELETE FROM idempotency.inbox WHERE source LIKE 'stats-%';
