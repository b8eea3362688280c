/* idempotency--1.3--1.4.sql */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.4'" to load this file. \quit

/*
 * Version 1.4: scale-out on Citus.  Every function and operator below is
 * schema-qualified (PostgreSQL's "Security Considerations for Extension
 * Scripts"), in the functions' bodies too.
 */

-- ---------------------------------------------------------------------------
-- Citus: records and inbox distributed with the tenant tables.
-- ---------------------------------------------------------------------------

/*
 * The functions that take a scope (or an inbox source) first, again with the
 * scope as a tenant id of type bigint or uuid, in a schema of their own.
 * Citus delegates a call of a distributed function to the node of its first
 * argument's shard only when that argument converts to the type of the
 * tenant column by assignment: a text scope does not convert to a bigint or
 * uuid tenant.  The same C functions behind them read the argument as text
 * (its output form), so idem_citus.idem_claim(42, ...) and
 * idem_claim('42', ...) name the same record.  A bigint scope also serves
 * tenant columns of type integer and smallint.  Their own schema keeps them
 * out of the overload resolution of every other call: with them beside the
 * text functions, each call written with literals cost some 5% more to
 * parse (bench/instructions.sh).
 */
CREATE SCHEMA idem_citus;
GRANT USAGE ON SCHEMA idem_citus TO PUBLIC;

-- The scope (the inbox's source) as a tenant of type bigint.
CREATE FUNCTION idem_citus.idem_claim(scope bigint, key text, request jsonb, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_jsonb'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_claim(scope bigint, key text, request text, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_text'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_claim(scope bigint, key text, fingerprint bytea, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_bytea'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_succeed(scope bigint, key text, status int4, body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL, token bigint DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_succeed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_release(scope bigint, key text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_release(scope bigint, key text, token bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release_token'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_replay(scope bigint, key text, OUT state text, OUT status int4, OUT headers jsonb, OUT body jsonb, OUT created_at timestamptz, OUT completed_at timestamptz, OUT expires_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_replay'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;
CREATE FUNCTION idem_citus.idem_execute(scope bigint, key text, request jsonb, handler regprocedure, ttl interval DEFAULT NULL)
RETURNS idem_execute_result
AS 'MODULE_PATHNAME', 'idem_execute'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_extend(scope bigint, key text, token bigint, lease interval)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_checkpoint(scope bigint, key text, token bigint, recovery_point text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_resolve_complete(scope bigint, key text, status int4, body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL, note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_citus.idem_resolve_complete(bigint, text, int4, jsonb, jsonb, text) FROM PUBLIC;
CREATE FUNCTION idem_citus.idem_resolve_release(scope bigint, key text, note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_citus.idem_resolve_release(bigint, text, text) FROM PUBLIC;
CREATE FUNCTION idem_citus.idem_inbox_accept(source bigint, message_id text, ttl interval DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_inbox_accept'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- The scope (the inbox's source) as a tenant of type uuid.
CREATE FUNCTION idem_citus.idem_claim(scope uuid, key text, request jsonb, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_jsonb'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_claim(scope uuid, key text, request text, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_text'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_claim(scope uuid, key text, fingerprint bytea, ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim_bytea'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_succeed(scope uuid, key text, status int4, body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL, token bigint DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_succeed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_release(scope uuid, key text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_release(scope uuid, key text, token bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release_token'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_replay(scope uuid, key text, OUT state text, OUT status int4, OUT headers jsonb, OUT body jsonb, OUT created_at timestamptz, OUT completed_at timestamptz, OUT expires_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_replay'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;
CREATE FUNCTION idem_citus.idem_execute(scope uuid, key text, request jsonb, handler regprocedure, ttl interval DEFAULT NULL)
RETURNS idem_execute_result
AS 'MODULE_PATHNAME', 'idem_execute'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_extend(scope uuid, key text, token bigint, lease interval)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_checkpoint(scope uuid, key text, token bigint, recovery_point text)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
CREATE FUNCTION idem_citus.idem_resolve_complete(scope uuid, key text, status int4, body jsonb DEFAULT NULL, headers jsonb DEFAULT NULL, note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_citus.idem_resolve_complete(uuid, text, int4, jsonb, jsonb, text) FROM PUBLIC;
CREATE FUNCTION idem_citus.idem_resolve_release(scope uuid, key text, note text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_resolve_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_citus.idem_resolve_release(uuid, text, text) FROM PUBLIC;
CREATE FUNCTION idem_citus.idem_inbox_accept(source uuid, message_id text, ttl interval DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_inbox_accept'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * The tenant column of a table of the extension (records or inbox), on this
 * node: the table's text key (scope, source) read as a value of tenant_type,
 * the type of the tenant tables' distribution column, added last and made
 * part of the primary key (Citus wants the distribution column in every
 * unique index; the key alone stays unique, since the tenant follows from
 * it).  idem_citus_distribute calls it on every node before it distributes
 * the table: Citus creates no shell of its own for a table of an
 * extension, and its metadata names the column by number on every node.
 * A node's own rows would be hidden behind the distributed table, so a
 * worker's table must be empty (must_be_empty); the coordinator's rows are
 * copied into the shards.  Calling it again with the same type does nothing;
 * on a node added after the table was distributed, it gives the table the
 * column.
 */
CREATE FUNCTION idem_citus_add_tenant(tbl text, tenant_type text, tenant_collation text,
									  must_be_empty boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $fn$
DECLARE
	rel			pg_catalog.regclass;
	key_column	text;
	id_column	text;
	want_type	pg_catalog.regtype;
	want_coll	pg_catalog.regcollation;
	have_type	pg_catalog.regtype;
	rows_here	int8;
	distributed_here boolean;
BEGIN
	IF tbl IS NULL OR tenant_type IS NULL OR must_be_empty IS NULL THEN
		RAISE EXCEPTION 'idem_citus_add_tenant: tbl, tenant_type and must_be_empty must not be null'
			USING ERRCODE := 'null_value_not_allowed';
	END IF;
	IF tbl OPERATOR(pg_catalog.=) 'records' THEN
		key_column := 'scope';
		id_column := 'key';
	ELSIF tbl OPERATOR(pg_catalog.=) 'inbox' THEN
		key_column := 'source';
		id_column := 'message_id';
	ELSE
		RAISE EXCEPTION 'idem_citus_add_tenant: no table "%" to distribute', tbl
			USING ERRCODE := 'invalid_parameter_value',
				  DETAIL := 'The tables are records and inbox.';
	END IF;
	rel := pg_catalog.format('idempotency.%I', tbl)::pg_catalog.regclass;
	BEGIN
		want_type := tenant_type::pg_catalog.regtype;
		want_coll := tenant_collation::pg_catalog.regcollation;
	EXCEPTION WHEN syntax_error OR undefined_object OR invalid_text_representation THEN
		RAISE EXCEPTION 'idem_citus_add_tenant: "%" is not a type, or "%" not a collation',
			tenant_type, tenant_collation
			USING ERRCODE := 'invalid_parameter_value';
	END;

	SELECT a.atttypid::pg_catalog.regtype INTO have_type
	  FROM pg_catalog.pg_attribute a
	 WHERE a.attrelid OPERATOR(pg_catalog.=) rel
	   AND a.attname OPERATOR(pg_catalog.=) 'tenant' AND NOT a.attisdropped;
	IF FOUND THEN
		IF have_type OPERATOR(pg_catalog.<>) want_type THEN
			RAISE EXCEPTION 'idempotency.% already has a tenant column of type %', tbl, have_type
				USING ERRCODE := 'object_not_in_prerequisite_state',
					  DETAIL := pg_catalog.format('The tenant tables are distributed by a column of type %s.', want_type);
		END IF;
		RETURN;
	END IF;

	/*
	 * A node added after the table was distributed knows it from Citus's
	 * metadata: Citus would route a query on it to the shards, and never
	 * wrote a row of its own into it.  Only its shape is changed, DDL not
	 * propagated.
	 */
	distributed_here := pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL
		AND EXISTS (SELECT FROM pg_catalog.pg_dist_partition p WHERE p.logicalrelid OPERATOR(pg_catalog.=) rel);
	IF distributed_here THEN
		PERFORM pg_catalog.set_config('citus.enable_ddl_propagation', 'off', true);
	ELSIF must_be_empty THEN
		EXECUTE pg_catalog.format('SELECT pg_catalog.count(*) FROM %s', rel) INTO rows_here;
		IF rows_here OPERATOR(pg_catalog.>) 0 THEN
			RAISE EXCEPTION 'idempotency.% on node %:% has % rows of its own', tbl,
				pg_catalog.current_setting('citus.local_hostname', true),
				pg_catalog.current_setting('port'), rows_here
				USING ERRCODE := 'object_not_in_prerequisite_state',
					  DETAIL := 'Once the table is distributed, the rows a worker kept locally would be hidden behind it.',
					  HINT := 'Move what is still needed to the coordinator, or delete it with idem_cleanup() once it has expired.';
		END IF;
	END IF;

	EXECUTE pg_catalog.format('ALTER TABLE %s ADD COLUMN tenant %s%s', rel, want_type,
							  CASE WHEN want_coll IS NULL THEN ''
								   ELSE ' COLLATE ' OPERATOR(pg_catalog.||) want_coll::text END);
	/*
	 * The scope read as the tenant type, as Citus reads a delegated call's
	 * first argument, and written back as that type writes it: the library
	 * finds a record only by the canonical text of its tenant ('42', not
	 * '042'; a uuid in lower case).  Two records of one key under two
	 * spellings of a tenant collide here (23505): one of them must go first.
	 */
	IF NOT distributed_here THEN
		EXECUTE pg_catalog.format('UPDATE %s SET tenant = %I::%s, %I = (%I::%s)::pg_catalog.text',
								  rel, key_column, want_type, key_column, key_column, want_type);
	END IF;
	EXECUTE pg_catalog.format('ALTER TABLE %s ALTER COLUMN tenant SET NOT NULL', rel);
	EXECUTE pg_catalog.format('ALTER TABLE %s DROP CONSTRAINT %I, ADD CONSTRAINT %I PRIMARY KEY (%I, %I, tenant)',
							  rel, tbl OPERATOR(pg_catalog.||) '_pkey', tbl OPERATOR(pg_catalog.||) '_pkey',
							  key_column, id_column);
END
$fn$;
REVOKE ALL ON FUNCTION idem_citus_add_tenant(text, text, text, boolean) FROM PUBLIC;

/*
 * idem_citus_distribute(tenant_table): on the coordinator of a Citus cluster,
 * distribute idempotency.records and idempotency.inbox colocated with
 * tenant_table (a hash-distributed table of the application), and make the
 * functions that take a scope (or the inbox's source) first delegated
 * functions of that colocation, force-delegated so that a client's
 * transaction of several statements stays on the tenant's node: those
 * whose scope has the tenant column's type (text for text types, bigint
 * for integer types, uuid).  The scope is then the tenant: the value of
 * tenant_table's distribution column (the operation goes into the key).  A tenant column of type text
 * COLLATE "C" distributes the tables by the scope itself; any other type
 * adds a column "tenant" of that type to both tables, on every node.  Run it
 * again after adding nodes: what is done already is left alone.
 */
CREATE FUNCTION idem_citus_distribute(tenant_table pg_catalog.regclass)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $fn$
DECLARE
	dist_type	oid;
	dist_typmod	int4;
	dist_coll	oid;
	by_key		boolean;
	scope_type	pg_catalog.regtype;
	type_name	text;
	coll_name	text;
	tbl			text;
	rel			pg_catalog.regclass;
	already		boolean;
	colocation	int4;
	fn			pg_catalog.regprocedure;
	failed		record;
	ext_schema	text := pg_catalog.quote_ident('@extschema@');
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'Citus is not installed in this database'
			USING ERRCODE := 'object_not_in_prerequisite_state',
				  HINT := 'Run CREATE EXTENSION citus on every node, and add the workers, first.';
	END IF;
	IF (SELECT g.groupid FROM pg_catalog.pg_dist_local_group g) OPERATOR(pg_catalog.<>) 0 THEN
		RAISE EXCEPTION 'idem_citus_distribute() must run on the coordinator'
			USING ERRCODE := 'object_not_in_prerequisite_state';
	END IF;

	SELECT a.atttypid, a.atttypmod, a.attcollation, p.colocationid
	  INTO dist_type, dist_typmod, dist_coll, colocation
	  FROM pg_catalog.pg_dist_partition p
	  JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) p.logicalrelid
	   AND a.attname OPERATOR(pg_catalog.=) pg_catalog.column_to_column_name(p.logicalrelid, p.partkey)
	 WHERE p.logicalrelid OPERATOR(pg_catalog.=) tenant_table
	   AND p.partmethod OPERATOR(pg_catalog.=) 'h';
	IF NOT FOUND THEN
		RAISE EXCEPTION 'table % is not hash-distributed by Citus', tenant_table
			USING ERRCODE := 'invalid_parameter_value',
				  HINT := 'Pass a tenant table distributed by its tenant column, e.g. after SELECT create_distributed_table(''orders'', ''tenant_id'').';
	END IF;
	/*
	 * The functions Citus can delegate by this tenant type: their first
	 * argument's type.  Only types whose equality is equality of the text
	 * they write: a record is found by the scope's text, so a type that
	 * calls two spellings equal (citext) or pads them (char(n)) would give
	 * one tenant several records.
	 */
	SELECT CASE WHEN t.oid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.text',
						'pg_catalog.varchar']::pg_catalog.regtype[]) THEN 'pg_catalog.text'::pg_catalog.regtype
				WHEN t.oid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.int8', 'pg_catalog.int4',
						'pg_catalog.int2']::pg_catalog.regtype[]) THEN 'pg_catalog.int8'::pg_catalog.regtype
				WHEN t.oid OPERATOR(pg_catalog.=) 'pg_catalog.uuid'::pg_catalog.regtype
				THEN 'pg_catalog.uuid'::pg_catalog.regtype END
	  INTO scope_type
	  FROM pg_catalog.pg_type t WHERE t.oid OPERATOR(pg_catalog.=) dist_type;
	IF scope_type IS NULL THEN
		RAISE EXCEPTION 'tenant columns of type % are not supported', pg_catalog.format_type(dist_type, dist_typmod)
			USING ERRCODE := 'feature_not_supported',
				  DETAIL := 'A scope can be a tenant of a text type (text, varchar), of an integer type (bigint, integer, smallint) or of type uuid.';
	END IF;
	by_key := dist_type OPERATOR(pg_catalog.=) 'pg_catalog.text'::pg_catalog.regtype
		AND dist_coll OPERATOR(pg_catalog.=) (SELECT c.oid FROM pg_catalog.pg_collation c
											   WHERE c.collname OPERATOR(pg_catalog.=) 'C'
												 AND c.collnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace);
	type_name := pg_catalog.format_type(dist_type, dist_typmod);
	SELECT pg_catalog.quote_ident(n.nspname) OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(c.collname)
	  INTO coll_name
	  FROM pg_catalog.pg_collation c JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.collnamespace
	 WHERE c.oid OPERATOR(pg_catalog.=) dist_coll;

	FOREACH tbl IN ARRAY ARRAY['records', 'inbox'] LOOP
		rel := pg_catalog.format('idempotency.%I', tbl)::pg_catalog.regclass;
		already := EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
							WHERE p.logicalrelid OPERATOR(pg_catalog.=) rel);
		IF already AND NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
									WHERE p.logicalrelid OPERATOR(pg_catalog.=) rel
									  AND p.colocationid OPERATOR(pg_catalog.=) colocation) THEN
			RAISE EXCEPTION 'idempotency.% is distributed already, but not colocated with %', tbl, tenant_table
				USING ERRCODE := 'object_not_in_prerequisite_state',
					  HINT := 'Undistribute it (SELECT undistribute_table(...)) first.';
		END IF;
		-- Every node, those added since a first run included, gets the tenant column.
		IF NOT by_key THEN
			IF NOT already THEN
				PERFORM @extschema@.idem_citus_add_tenant(tbl, type_name, coll_name, false);
			END IF;
			FOR failed IN
				SELECT w.nodename, w.nodeport, w.result
				  FROM pg_catalog.run_command_on_workers(
						pg_catalog.format('SELECT %s.idem_citus_add_tenant(%L, %L, %L, true)',
										  ext_schema, tbl, type_name, coll_name)) w
				 WHERE NOT w.success
			LOOP
				RAISE EXCEPTION 'could not add the tenant column of idempotency.% on node %:%', tbl,
					failed.nodename, failed.nodeport
					USING ERRCODE := 'object_not_in_prerequisite_state',
						  DETAIL := failed.result,
						  HINT := 'Install the extension at this version on every node first.';
			END LOOP;
		END IF;
		CONTINUE WHEN already;
		PERFORM pg_catalog.create_distributed_table(rel::text,
			CASE WHEN NOT by_key THEN 'tenant' WHEN tbl OPERATOR(pg_catalog.=) 'records' THEN 'scope' ELSE 'source' END,
			colocate_with => tenant_table::text);
		-- The coordinator's rows are in the shards now; the shell keeps none.
		PERFORM pg_catalog.truncate_local_data_after_distributing_table(rel);
	END LOOP;

	FOR fn IN
		SELECT p.oid::pg_catalog.regprocedure
		  FROM pg_catalog.pg_depend d
		  JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) d.objid
		  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
		 WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
		   AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		   AND e.extname OPERATOR(pg_catalog.=) 'idempotency'
		   AND p.proname OPERATOR(pg_catalog.=) ANY (ARRAY['idem_claim', 'idem_succeed', 'idem_release',
			   'idem_replay', 'idem_execute', 'idem_extend', 'idem_checkpoint',
			   'idem_resolve_complete', 'idem_resolve_release', 'idem_inbox_accept']::name[])
		   AND p.proargtypes[0] OPERATOR(pg_catalog.=) scope_type
		   AND p.pronamespace OPERATOR(pg_catalog.=) CASE WHEN scope_type OPERATOR(pg_catalog.=) 'pg_catalog.text'::pg_catalog.regtype
			   THEN '@extschema@'::pg_catalog.regnamespace ELSE 'idem_citus'::pg_catalog.regnamespace END
		 ORDER BY 1
	LOOP
		PERFORM pg_catalog.create_distributed_function(fn, '$1',
			colocate_with => tenant_table::text, force_delegation => true);
	END LOOP;
	-- Workers added since the destinations were made get them too.
	PERFORM @extschema@.idem_citus_send_destinations();
END
$fn$;
REVOKE ALL ON FUNCTION idem_citus_distribute(pg_catalog.regclass) FROM PUBLIC;

/*
 * idem_destination_sync(name, definition, resumed): on a worker of a Citus
 * cluster, make its outbox destination name the one the coordinator
 * describes (src/dest_sync.c).  The coordinator's destination commands call
 * it on every worker, as the extension's owner, before they commit; not for
 * direct use.
 */
CREATE FUNCTION idem_destination_sync(name text, definition jsonb, resumed boolean)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_destination_sync'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_destination_sync(text, jsonb, boolean) FROM PUBLIC;

/*
 * idem_citus_send_destinations(): every outbox destination of the
 * coordinator goes to every worker at commit, for workers that joined since
 * the destinations were made; idem_citus_distribute calls it.  Returns how
 * many.
 */
CREATE FUNCTION idem_citus_send_destinations()
RETURNS int4
AS 'MODULE_PATHNAME', 'idem_citus_send_destinations'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_citus_send_destinations() FROM PUBLIC;

/*
 * idem_stuck reads the records through idempotency.stuck_records(), as the
 * extension's owner, for a role that may read the view: on a Citus
 * coordinator, where idempotency.records is distributed, Citus reads the
 * shards on the workers over connections of the current role, and a
 * monitoring role granted only the view has no access to the extension's
 * schema there.  The function computes the horizon once, on the node the
 * view is read on, with the session's idempotency.stuck_after (the setting
 * does not travel to the workers).  Its EXECUTE stays with PUBLIC, as the
 * view's readers call it; it refuses a role that may not read the view,
 * and answers a role granted some of the view's columns with the others
 * null.
 * The same rows as before on one server.
 */
CREATE FUNCTION idempotency.stuck_records(OUT scope text, OUT key text, OUT token bigint,
										  OUT recovery_point text, OUT owner_age interval,
										  OUT lease_expired_for interval,
										  OUT lease_expires_at timestamptz,
										  OUT created_at timestamptz, OUT owner regrole)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stuck_records'
LANGUAGE C STABLE PARALLEL UNSAFE;

CREATE OR REPLACE VIEW idem_stuck AS
SELECT scope COLLATE pg_catalog."C" AS scope, key COLLATE pg_catalog."C" AS key, token,
	   recovery_point, owner_age, lease_expired_for, lease_expires_at, created_at, owner
  FROM idempotency.stuck_records();

-- (end of Citus section)
