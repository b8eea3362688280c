--
-- Bad input: every one gets a clear error with a documented SQLSTATE, and
-- nothing is written.  \echo :SQLSTATE shows the code after each error.
--
-- (How many records earlier tests of the run left, so that this file runs
-- alone too.)
SELECT count(*) AS records_before FROM idempotency.records \gset

-- NULL arguments: 22004 (null_value_not_allowed).
SELECT * FROM idem_claim(NULL, 'k', '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', NULL, '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', NULL::jsonb);
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', NULL::text);
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', NULL::bytea);
\echo :SQLSTATE
SELECT idem_succeed(NULL, 'k', 200);
\echo :SQLSTATE
SELECT idem_succeed('s', 'k', NULL);
\echo :SQLSTATE
SELECT idem_release('s', NULL);
\echo :SQLSTATE
SELECT * FROM idem_replay(NULL, 'k');
\echo :SQLSTATE

-- Empty, overlong and non-printable scope and key: 22023 (invalid_parameter_value).
SELECT * FROM idem_claim('', 'k', '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim(repeat('s', 256), 'k', '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', '', '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', repeat('k', 256), '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'tab' || chr(9) || 'key', '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'del' || chr(127), '{}');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'clé', '{}');
\echo :SQLSTATE
-- A scope is quoted in error messages and the server log: no control
-- characters, so that it cannot forge log lines.
SELECT * FROM idem_claim('tenant' || chr(10) || 'ERROR:  forged', 'k', '{}');
\echo :SQLSTATE
SELECT * FROM idem_replay('s' || chr(27) || '[2J', 'k');
\echo :SQLSTATE
SELECT idem_inbox_accept('topic' || chr(13), 'm');
\echo :SQLSTATE
-- Non-ASCII scopes are fine.
SELECT count(*) FROM idem_replay('café:POST /x', 'k');
SELECT * FROM idem_replay('s', '');
\echo :SQLSTATE

-- Malformed JSON through the text overload: jsonb's own 22P02.
SELECT * FROM idem_claim('s', 'k', '{"amount": }');
\echo :SQLSTATE

-- A fingerprint must have 1 to 64 bytes.
SELECT * FROM idem_claim('s', 'k', ''::bytea);
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', decode(repeat('ab', 65), 'hex'));
\echo :SQLSTATE

-- ttl must be positive: 22023.
SELECT * FROM idem_claim('s', 'k', '{}', '0 seconds');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', '{}', '-5 minutes');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', '{}', interval '1 day' - interval '2 days');
\echo :SQLSTATE
-- So are ttls and leases far enough back to end before 4713 BC: 22023, not
-- the 22008 of the timestamp they would give.
SELECT * FROM idem_claim('s', 'k', '{}', '-7000 years');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', '{}', NULL, '-7000 years');
\echo :SQLSTATE
SELECT * FROM idem_claim('s', 'k', '{}', '-7000 years 1 second');
\echo :SQLSTATE
SELECT idem_inbox_accept('s', 'm', '-7000 years');
\echo :SQLSTATE

-- succeed and release without a claim held by this transaction: 55000
-- (object_not_in_prerequisite_state).
SELECT idem_succeed('s', 'never-claimed', 200);
\echo :SQLSTATE
SELECT idem_release('s', 'never-claimed');
\echo :SQLSTATE
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 200);
-- Already completed in this transaction.
SELECT idem_succeed('s', 'k', 200);
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_release('s', 'k');
SELECT idem_release('s', 'k');
\echo :SQLSTATE
ROLLBACK;
-- Claiming a key this transaction already holds is a bug in the caller.
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT outcome FROM idem_claim('s', 'k', '{}');
\echo :SQLSTATE
ROLLBACK;

-- A status outside 100..599: 22023; the claim stays held, so nothing commits.
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 99);
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 600);
\echo :SQLSTATE
ROLLBACK;
-- Headers must be a JSON object.
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 200, '{}', '["Location", "/x"]');
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 200, '{}', '"text"');
\echo :SQLSTATE
ROLLBACK;

-- A response larger than idempotency.max_response_bytes: 54000
-- (program_limit_exceeded).
SET idempotency.max_response_bytes = '1kB';
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
SELECT idem_succeed('s', 'k', 200, jsonb_build_object('blob', repeat('x', 2000)));
\echo :SQLSTATE
ROLLBACK;
BEGIN;
SELECT outcome FROM idem_claim('s', 'k', '{}');
-- Headers count too.
SELECT idem_succeed('s', 'k', 200, '{}', jsonb_build_object('X-Blob', repeat('x', 2000)));
\echo :SQLSTATE
ROLLBACK;
-- Just under the limit is stored.
BEGIN;
SELECT outcome FROM idem_claim('s', 'k-small', '{}');
SELECT idem_succeed('s', 'k-small', 200, jsonb_build_object('blob', repeat('x', 900)));
ROLLBACK;
RESET idempotency.max_response_bytes;

-- The GUCs validate their own units and limits.  (PostgreSQL 16 and later
-- print the range with its units: expected/errors_1.out.)
SET idempotency.wait_timeout = -1;
\echo :SQLSTATE
SET idempotency.default_ttl = 0;
\echo :SQLSTATE
SET idempotency.wait_timeout = '2s';
SHOW idempotency.wait_timeout;
SET idempotency.default_ttl = '7d';
SHOW idempotency.default_ttl;
RESET idempotency.wait_timeout;
RESET idempotency.default_ttl;
SHOW idempotency.max_response_bytes;
-- The prefix is reserved: a misspelt setting is an error, not a silent placeholder.
SET idempotency.wait_timout = '1s';
\echo :SQLSTATE

-- Claims need a writable transaction: 25006 (read_only_sql_transaction).
BEGIN READ ONLY;
SELECT * FROM idem_claim('s', 'k', '{}');
\echo :SQLSTATE
ROLLBACK;

-- Nothing above was written.
SELECT count(*) - :records_before AS records_written FROM idempotency.records;
