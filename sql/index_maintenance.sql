--
-- The extension writes records' heap tuples itself (records.c, as catalog
-- code does) and so maintains their indexes itself.  From PostgreSQL 16 on,
-- an update that changes no indexed column but expires_at, which only a
-- BRIN index covers, can be HOT; the BRIN index must still learn the new
-- value, or a scan by expires_at (cleanup's) would skip the row's pages.
-- In a database of its own, so that the first block range holds only the
-- rows made here.
--
\set origdb :DBNAME
CREATE DATABASE idem_index_maintenance;
\c idem_index_maintenance
SET client_min_messages = warning;
CREATE EXTENSION idempotency;
RESET client_min_messages;

-- A multi-phase claim writes its row at once.
SELECT outcome, token FROM idem_claim('brin', 'k', '{}', interval '30 days', lease => '1 hour') \gset
SELECT :'outcome' AS outcome;
SELECT expires_at AS claimed_expires_at FROM idempotency.records \gset
-- Summarize the range now, while it holds only the claim's expires_at.
SELECT brin_summarize_range('idempotency.records_expires_at_brin', 0);
-- Success changes expires_at (and columns no index covers).
SELECT idem_succeed('brin', 'k', 201, token => :token);
SELECT state, expires_at > :'claimed_expires_at'::timestamptz AS later
  FROM idempotency.records;

-- Found through the BRIN index as by reading the table.
CREATE FUNCTION plan_uses(query text, index_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
	line text;
BEGIN
	FOR line IN EXECUTE 'EXPLAIN (COSTS OFF) ' || query LOOP
		IF line LIKE '%Bitmap Index Scan on ' || index_name || '%' THEN
			RETURN true;
		END IF;
	END LOOP;
	RETURN false;
END
$$;
SET enable_seqscan = off;
SELECT plan_uses(format('SELECT count(*) FROM idempotency.records WHERE expires_at > %L', :'claimed_expires_at'),
				 'records_expires_at_brin') AS through_brin;
SELECT count(*) AS by_index FROM idempotency.records WHERE expires_at > :'claimed_expires_at';
RESET enable_seqscan;
SET enable_bitmapscan = off;
SELECT count(*) AS by_table FROM idempotency.records WHERE expires_at > :'claimed_expires_at';
RESET enable_bitmapscan;

\c :origdb
DROP DATABASE idem_index_maintenance;
