-- Objects of the idempotency benchmark (run once on the throwaway cluster).

CREATE EXTENSION idempotency;

-- The domain table: one row per executed operation.  key holds the
-- idempotency key, so that duplicate executions can be counted afterwards.
CREATE TABLE bench_orders (
	id		bigserial PRIMARY KEY,
	key		text NOT NULL,
	amount	int NOT NULL
);

-- The FLOOR: the least any durable idempotency design must write per
-- operation.  Exactly the columns and types of idempotency.records, the same
-- primary key, and a plain btree index for expiry.  Its owner is written as
-- a constant OID ('10'), which costs no catalog lookup, as ours costs none.
CREATE TABLE floor_records (
	scope				text COLLATE "C" NOT NULL,
	key					text COLLATE "C" NOT NULL,
	state				text NOT NULL,
	fingerprint			bytea NOT NULL,
	status				int4,
	headers				jsonb,
	body				jsonb,
	token				int8 NOT NULL,
	recovery_point		text,
	lease_expires_at	timestamptz,
	created_at			timestamptz NOT NULL,
	completed_at		timestamptz,
	expires_at			timestamptz NOT NULL,
	claimed_at			timestamptz,
	owner				regrole,
	PRIMARY KEY (scope, key)
);
CREATE INDEX floor_records_expires_at ON floor_records (expires_at);

-- The idem_execute handler: one domain insert, a constant response.  The
-- idempotency key travels in the request so that the order row records it.
CREATE FUNCTION bench_handler(request jsonb) RETURNS idem_response
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO bench_orders (key, amount)
	VALUES (request->>'key', (request->>'amount')::int);
	RETURN ROW(201, '{"Location": "/orders/1"}'::jsonb, '{"order_id": 1}'::jsonb)::idem_response;
END $$;
