--
-- Extension scripts that cannot be hijacked (PostgreSQL's "Security
-- Considerations for Extension Scripts").  CREATE EXTENSION and ALTER
-- EXTENSION UPDATE run the scripts with search_path = public, pg_temp, after
-- pg_catalog.  A role that can create objects in public can plant there a
-- function or operator whose argument types match an unqualified call better
-- than pg_catalog's (make_interval(secs numeric), cardinality(text[])): the
-- view or column default the script creates then binds the plant, which runs
-- as whoever queries it.
--
-- Here an untrusted role plants look-alikes of every pg_catalog function and
-- operator the extension uses, generated, not picked by hand: in public, with
-- the argument types that would win overload resolution; and, in a schema
-- that callers put before pg_catalog in their search_path, exact copies, for
-- the statements the C code runs (SPI).  Then the extension is installed and
-- updated every way there is, and nothing may bind or call a plant.  Runs in
-- a database of its own, since the test database already has the extension.
--
\set origdb :DBNAME
CREATE DATABASE idem_sec;
CREATE ROLE idem_sec_untrusted;
-- Every extension function call is counted (see sec.functions_not_called).
ALTER DATABASE idem_sec SET track_functions = 'all';
\c idem_sec

-- ---------------------------------------------------------------------------
-- Helpers, in a schema of the superuser's that no search_path below names.
-- Each runs with search_path = pg_catalog, pg_temp, so that the plants never
-- capture the test's own calls.
-- ---------------------------------------------------------------------------
CREATE SCHEMA sec;
GRANT USAGE ON SCHEMA sec TO idem_sec_untrusted;

-- The code of SQL text: comments blanked, string literals emptied and quoted
-- identifiers replaced, line breaks kept; dollar-quoted bodies stay code.
CREATE FUNCTION sec.code(src text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	out text := '';
	i int := 1;
	k int;
	j int;
	depth int;
	esc boolean;
	tag text;
BEGIN
	LOOP
		k := regexp_instr(src, '--|/\*|[''"$]', i);
		IF k = 0 THEN
			RETURN out || substr(src, i);
		END IF;
		out := out || substr(src, i, k - i);
		IF substr(src, k, 2) = '--' THEN
			j := strpos(substr(src, k), E'\n');
			IF j = 0 THEN
				RETURN out;
			END IF;
			i := k + j - 1;
		ELSIF substr(src, k, 2) = '/*' THEN
			depth := 1;
			j := k + 2;
			WHILE depth > 0 AND j <= length(src) LOOP
				IF substr(src, j, 2) = '/*' THEN
					depth := depth + 1;
					j := j + 2;
				ELSIF substr(src, j, 2) = '*/' THEN
					depth := depth - 1;
					j := j + 2;
				ELSE
					IF substr(src, j, 1) = E'\n' THEN
						out := out || E'\n';
					END IF;
					j := j + 1;
				END IF;
			END LOOP;
			out := out || ' ';
			i := j;
		ELSIF substr(src, k, 1) = '''' THEN
			esc := substr(src, k - 1, 1) IN ('E', 'e');
			j := k + 1;
			LOOP
				EXIT WHEN j > length(src);
				IF esc AND substr(src, j, 1) = '\' THEN
					j := j + 2;
				ELSIF substr(src, j, 2) = '''''' THEN
					j := j + 2;
				ELSIF substr(src, j, 1) = '''' THEN
					EXIT;
				ELSE
					IF substr(src, j, 1) = E'\n' THEN
						out := out || E'\n';
					END IF;
					j := j + 1;
				END IF;
			END LOOP;
			out := out || '''''';
			i := j + 1;
		ELSIF substr(src, k, 1) = '"' THEN
			j := strpos(substr(src, k + 1), '"');
			out := out || 'quoted_identifier';
			i := CASE WHEN j = 0 THEN length(src) + 1 ELSE k + j + 1 END;
		ELSE
			tag := substring(substr(src, k) FROM '^\$([A-Za-z_][A-Za-z0-9_]*)?\$');
			IF substr(src, k, 2) = '$$' OR tag IS NOT NULL THEN
				-- a dollar quote: its content is code (a function body)
				i := k + length(coalesce(tag, '')) + 2;
				out := out || ' ';
			ELSE
				out := out || '$';
				i := k + 1;
			END IF;
		END IF;
	END LOOP;
END $fn$;

-- The extension's install and upgrade scripts, as installed.
CREATE FUNCTION sec.scripts() RETURNS TABLE (file text, code text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	dir text := (SELECT setting FROM pg_config WHERE name = 'SHAREDIR') || '/extension';
BEGIN
	RETURN QUERY
	SELECT f, sec.code(pg_read_file(dir || '/' || f))
	  FROM pg_ls_dir(dir) f
	 WHERE f ~ '^idempotency--.*\.sql$'
	 ORDER BY f;
END $fn$;

-- The statements of the C code: SQL strings in the shared library.
CREATE FUNCTION sec.c_statements() RETURNS TABLE (code text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	so text := (SELECT setting FROM pg_config WHERE name = 'PKGLIBDIR') || '/idempotency.so';
BEGIN
	RETURN QUERY
	SELECT sec.code(s)
	  FROM regexp_split_to_table(encode(pg_read_binary_file(so), 'escape'), '\\000') s
	 WHERE s ~ '\m(SELECT|INSERT|UPDATE|DELETE|WITH)\M' AND s ~ '\midempotency\.[a-z]';
END $fn$;

-- Function names called in code: (name, whether schema-qualified).
CREATE FUNCTION sec.called_names(code text) RETURNS TABLE (name name, qualified boolean)
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT DISTINCT lower(m[2])::name, m[1] IS NOT NULL
	  FROM regexp_matches(code, '(\w+\s*\.\s*)?\m([A-Za-z_]\w*)\s*\(', 'g') m
$fn$;

-- Operator names used in code, schema-qualified or not.
CREATE FUNCTION sec.operator_names(code text) RETURNS TABLE (name name)
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT DISTINCT m[1]::name
	  FROM regexp_matches(regexp_replace(regexp_replace(replace(code, '@extschema@.', ' '),
														'=>|:=|::|\(\s*\*\s*\)|\.\*|(SELECT|RETURNING|,)\s*\*', ' ', 'gi'),
										 'OPERATOR\s*\(\s*\w+\s*\.\s*([^)\s]+)\s*\)', ' \1 ', 'gi'),
						  '([-+*/<>=~!@#%^&|`?]+)', 'g') m
	UNION
	-- IN, BETWEEN, IS DISTINCT FROM, a join's USING, CASE x WHEN: "=" and
	-- its kin, looked up by name
	SELECT '='::name WHERE code ~* '\m(IN|BETWEEN|DISTINCT|USING|NULLIF|CASE)\M'
$fn$;

-- Unqualified functions and operators of script code, with their lines.
-- OPERATOR(pg_catalog.x), CASE WHEN ..., COALESCE, IS NULL are fine; so are
-- a negative number and the * of count(*) and SELECT *.
CREATE FUNCTION sec.unqualified(code text) RETURNS TABLE (line int, what text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	l text;
	n int;
	m text[];
BEGIN
	FOR l, n IN SELECT t.l, t.n FROM regexp_split_to_table(code, E'\n') WITH ORDINALITY t(l, n) LOOP
		l := regexp_replace(l, 'OPERATOR\s*\(\s*pg_catalog\s*\.\s*[^)\s]+\s*\)', ' ', 'gi');
		-- @extschema@ names the extension's own schema, not an operator.
		l := replace(l, '@extschema@.', 'extschema.');
		FOR m IN SELECT regexp_matches(l, '(\w+\s+)?(\w+\s*\.\s*)?\m([A-Za-z_]\w*)\s*\(', 'g') LOOP
			IF m[2] IS NULL
			   AND upper(trim(coalesce(m[1], ''))) NOT IN ('FUNCTION', 'PROCEDURE', 'AGGREGATE', 'TABLE',
														  'VIEW', 'TYPE', 'INDEX', 'INTO', 'REFERENCES',
														  'ON', 'AS', 'EXISTS')
			   AND EXISTS (SELECT FROM pg_proc
							WHERE proname = lower(m[3]) AND pronamespace = 'pg_catalog'::regnamespace)
			   AND NOT (l ~* ('\m' || m[3] || '\s*\(\s*\d')
						AND EXISTS (SELECT FROM pg_type WHERE typname = lower(m[3])))
			THEN
				line := n;
				what := m[3] || '(';
				RETURN NEXT;
			END IF;
		END LOOP;
		-- A storage parameter's "=" (ALTER TABLE ... SET (fillfactor = 70)) is syntax, not an operator.
		l := regexp_replace(l, '(\m(SET|WITH)\s*\(\s*\w+\s*)=', '\1 ', 'gi');
		l := regexp_replace(l, '=>|:=|::|\(\s*\*\s*\)|\.\*|(SELECT|RETURNING|,)\s*\*|%(ROW)?TYPE', ' ', 'gi');
		l := regexp_replace(l, '(^|[(,]|\mDEFAULT|\mTHEN|\mELSE)(\s*)-(\s*\d)', '\1\2\3', 'gi');
		FOR m IN SELECT regexp_matches(l, '([-+*/<>=~!@#%^&|`?]+|\m(IS\s+(NOT\s+)?DISTINCT\s+FROM|BETWEEN|I?LIKE|SIMILAR\s+TO|IN\s*\(|NULLIF|USING\s*\(|NATURAL|CASE\s+(?!WHEN\M)\w+))', 'gi') LOOP
			line := n;
			what := m[1];
			RETURN NEXT;
		END LOOP;
	END LOOP;
END $fn$;

-- pg_catalog functions and operators named in code.
CREATE FUNCTION sec.catalog_targets(code text, OUT kind "char", OUT target oid)
RETURNS SETOF record
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT 'f', p.oid FROM pg_proc p JOIN sec.called_names(code) c ON c.name = p.proname
	 WHERE p.pronamespace = 'pg_catalog'::regnamespace
	UNION
	SELECT 'o', o.oid FROM pg_operator o JOIN sec.operator_names(code) c ON c.name = o.oprname
	 WHERE o.oprnamespace = 'pg_catalog'::regnamespace
$fn$;

-- What the planted look-alikes are checked against, collected below.
CREATE TABLE sec.target (
	kind		"char" NOT NULL,	-- 'f' function, 'o' operator
	target		oid NOT NULL,		-- in pg_catalog: pinned, the same in every database
	via			text NOT NULL,		-- 'scripts' or 'C'
	PRIMARY KEY (kind, target, via)
);
GRANT SELECT ON sec.target TO idem_sec_untrusted;

-- ---------------------------------------------------------------------------
-- What the extension uses, from a clean install.  pg_depend records no
-- dependency on pg_catalog's pinned objects, so the stored expressions
-- (views, column defaults, index expressions and predicates, constraints,
-- argument defaults) are read instead; calls only as the scripts spell them
-- (not the casts, looked up by type).  Functions that the scripts call and
-- that no stored expression keeps (pg_extension_config_dump) come from the
-- scripts' text, and the C code's statements from the shared library.
-- ---------------------------------------------------------------------------
CREATE EXTENSION idempotency;
INSERT INTO sec.target
WITH members AS (
	SELECT d.classid, d.objid FROM pg_depend d
	 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
	   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')),
rels AS (SELECT objid AS oid FROM members WHERE classid = 'pg_class'::regclass),
trees AS (
	SELECT ev_action::text AS tree FROM pg_rewrite WHERE ev_class IN (SELECT oid FROM rels)
	UNION ALL SELECT adbin::text FROM pg_attrdef WHERE adrelid IN (SELECT oid FROM rels)
	UNION ALL SELECT concat(indexprs::text, indpred::text) FROM pg_index WHERE indrelid IN (SELECT oid FROM rels)
	UNION ALL SELECT conbin::text FROM pg_constraint WHERE conrelid IN (SELECT oid FROM rels)
	UNION ALL SELECT concat(proargdefaults::text, prosqlbody::text) FROM pg_proc
	 WHERE oid IN (SELECT objid FROM members WHERE classid = 'pg_proc'::regclass)
	UNION ALL SELECT typdefaultbin::text FROM pg_type
	 WHERE oid IN (SELECT objid FROM members WHERE classid = 'pg_type'::regclass)),
refs AS (
	-- calls, but not casts (COERCE_EXPLICIT_CAST 1, COERCE_IMPLICIT_CAST 2)
	SELECT 'f'::"char" AS kind, m[1]::oid AS target
	  FROM trees, regexp_matches(tree, '\{FUNCEXPR :funcid (\d+) [^{}]*?:funcformat [03]', 'g') m
	UNION SELECT 'f', m[2]::oid FROM trees, regexp_matches(tree, ':(aggfnoid|winfnoid) (\d+)', 'g') m
	UNION SELECT 'o', m[1]::oid FROM trees, regexp_matches(tree, ':opno (\d+)', 'g') m
	UNION SELECT 'o', n::oid FROM trees, regexp_matches(tree, ':opnos \(o ([\d ]+)\)', 'g') m,
								  regexp_split_to_table(m[1], ' ') n)
SELECT r.kind, r.target, 'scripts' FROM refs r
 WHERE r.kind = 'f' AND r.target IN (SELECT oid FROM pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace)
    OR r.kind = 'o' AND r.target IN (SELECT oid FROM pg_operator WHERE oprnamespace = 'pg_catalog'::regnamespace)
UNION
SELECT 'f', p.oid, 'scripts'
  FROM sec.scripts() s, sec.called_names(s.code) c
  JOIN pg_proc p ON p.proname = c.name AND p.pronamespace = 'pg_catalog'::regnamespace
 WHERE c.name NOT IN (SELECT p2.proname FROM refs JOIN pg_proc p2 ON p2.oid = refs.target WHERE refs.kind = 'f')
UNION
SELECT t.kind, t.target, 'C' FROM sec.c_statements() s, sec.catalog_targets(s.code) t;
-- The counts follow the catalog: PostgreSQL 18 has more overloads of some
-- functions the C code names (min and max of record among them):
-- expected/script_security_1.out.
SELECT via, kind, count(*) FROM sec.target GROUP BY 1, 2 ORDER BY 1, 2;
-- The extension's own statements name these (functions with their
-- overloads as the scripts call them; operators as bound).
SELECT CASE kind WHEN 'f' THEN target::regprocedure::text ELSE target::regoperator::text END AS used_by_the_scripts
  FROM sec.target WHERE via = 'scripts' ORDER BY 1;
-- Every function and operator the scripts name is schema-qualified
-- (OPERATOR(pg_catalog.=), pg_catalog.now()).  What the check finds in a
-- sample first, then in the scripts: nothing.
SELECT * FROM sec.unqualified(sec.code($sample$
	SELECT now(), pg_catalog.now(), a IS DISTINCT FROM b, x BETWEEN 1 AND 2, t || u, count(*),
		   y OPERATOR(pg_catalog.=) z, CASE k WHEN 1 THEN -1 END, CASE WHEN k THEN 1 END,
		   coalesce(a, -2), x IN (1, 2), nullif(a, b), f(secs => 1), a::text, e.*, j->>'a',
		   '(now() + 1)' -- now() + 1 /* max(a) */
	  FROM a JOIN b USING (c), LATERAL unnest(x) WHERE k LIKE 'x%';
	CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN max(1); END $$;
$sample$));
SELECT s.file, u.line, u.what AS unqualified FROM sec.scripts() s, sec.unqualified(s.code) u ORDER BY 1, 2;
DROP EXTENSION idempotency;
-- An installation made before anything was planted, updated later (1. below).
CREATE EXTENSION idempotency VERSION '1.1';

-- ---------------------------------------------------------------------------
-- The look-alikes, generated.  For each parameter of a function or operator
-- used: in public, the types that would beat the catalog's (the type itself
-- and every type that casts to it implicitly: numeric and int8 for float8,
-- int4 for int8, varchar, name and bpchar for text; concrete types for a
-- polymorphic parameter), as long as pg_catalog has no function of that
-- exact signature; in schema evil, which callers below put before
-- pg_catalog, exact copies.  Each plant notes its call in evil.plant_log
-- (and says so in a WARNING), then returns what the catalog's would.
-- ---------------------------------------------------------------------------

-- Concrete types for a polymorphic parameter, or for "any".
CREATE FUNCTION sec.concrete_types() RETURNS regtype[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT '{text,int4,int8,numeric,bool,jsonb,uuid,timestamptz,interval,regrole}'::regtype[]
$fn$;

-- A polymorphic type with the binding of its family (NULL: none), else t.
CREATE FUNCTION sec.bind(t regtype, binding regtype) RETURNS regtype
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT CASE
		WHEN binding IS NULL THEN t
		WHEN t IN ('anyelement', 'anynonarray', 'anycompatible', 'anycompatiblenonarray') THEN binding
		WHEN t IN ('anyarray', 'anycompatiblearray') THEN (SELECT typarray FROM pg_type WHERE oid = binding)::regtype
		WHEN t IN ('anyenum', 'anyrange', 'anymultirange', 'anycompatiblerange',
				   'anycompatiblemultirange') THEN NULL
		ELSE t END
$fn$;

-- The types planted at a parameter of type t (variadic: its array type).
CREATE FUNCTION sec.choices(t regtype, variadic_any boolean, mode text, binding regtype) RETURNS regtype[]
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
	IF t = '"any"'::regtype THEN
		-- VARIADIC "any" gets VARIADIC arrays of these (see sec.plant)
		RETURN ARRAY(SELECT c FROM unnest(sec.concrete_types()) c
					 UNION ALL
					 SELECT typarray::regtype FROM unnest(sec.concrete_types()) c JOIN pg_type ON oid = c
					  WHERE NOT variadic_any);
	ELSIF (SELECT typtype = 'p' FROM pg_type WHERE oid = t) OR mode = 'exact' THEN
		RETURN ARRAY[sec.bind(t, binding)];
	END IF;
	RETURN t || ARRAY(SELECT c.castsource::regtype FROM pg_cast c JOIN pg_type s ON s.oid = c.castsource
					   WHERE c.casttarget = t AND c.castcontext = 'i' AND c.castsource <> t
						 AND s.typtype = 'b' AND s.typname NOT LIKE 'pg\_%'
					   ORDER BY c.castsource::regtype::text);
END $fn$;

-- The argument lists to plant for parameters of types argtypes: every
-- combination, or one parameter at a time beyond 32 of them.
CREATE FUNCTION sec.signatures(argtypes oid[], variadic_any boolean, mode text)
RETURNS TABLE (sig regtype[], binding regtype)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	n int := coalesce(cardinality(argtypes), 0);
	b regtype;
	c regtype[];
	choices regtype[];
	starts int[];
	lens int[];
	total int;
	r int;
	base regtype[];
BEGIN
	FOR b IN
		SELECT x FROM unnest(sec.concrete_types()) x
		 WHERE mode = 'variants' AND EXISTS (SELECT FROM unnest(argtypes) a
											  WHERE a::regtype IN ('anyelement', 'anynonarray', 'anyarray',
																   'anycompatible', 'anycompatiblenonarray',
																   'anycompatiblearray'))
		UNION ALL
		SELECT NULL WHERE mode = 'exact' OR NOT EXISTS (SELECT FROM unnest(argtypes) a
														 WHERE a::regtype IN ('anyelement', 'anynonarray', 'anyarray',
																			  'anycompatible', 'anycompatiblenonarray',
																			  'anycompatiblearray'))
	LOOP
		choices := '{}';
		starts := '{}';
		lens := '{}';
		total := 1;
		FOR i IN 1 .. n LOOP
			c := sec.choices(argtypes[i]::regtype, variadic_any AND i = n, mode, b);
			IF c IS NULL OR array_position(c, NULL) IS NOT NULL THEN
				total := 0;
				EXIT;
			END IF;
			starts[i] := cardinality(choices) + 1;
			lens[i] := cardinality(c);
			choices := choices || c;
			total := total * lens[i];
		END LOOP;
		binding := b;
		IF total = 0 THEN
			CONTINUE;
		ELSIF total <= 32 THEN
			FOR k IN 0 .. total - 1 LOOP
				sig := '{}';
				r := k;
				FOR i IN 1 .. n LOOP
					sig := sig || choices[starts[i] + r % lens[i]];
					r := r / lens[i];
				END LOOP;
				RETURN NEXT;
			END LOOP;
		ELSE
			base := ARRAY(SELECT choices[s] FROM unnest(starts) s);
			sig := base;
			RETURN NEXT;
			FOR i IN 1 .. n LOOP
				FOR j IN 2 .. lens[i] LOOP
					sig := base;
					sig[i] := choices[starts[i] + j - 1];
					RETURN NEXT;
				END LOOP;
			END LOOP;
		END IF;
	END LOOP;
END $fn$;

-- Why a type cannot be planted with, or NULL.
CREATE FUNCTION sec.unplantable(types regtype[]) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT types IS NULL OR array_position(types, NULL) IS NOT NULL OR EXISTS (
		SELECT FROM unnest(types) t JOIN pg_type ON oid = t
		 WHERE typtype = 'p' AND typname NOT IN ('anyelement', 'anynonarray', 'anyarray', 'anyenum',
												 'anyrange', 'anymultirange', 'anycompatible',
												 'anycompatiblearray', 'anycompatiblenonarray',
												 'anycompatiblerange', 'anycompatiblemultirange',
												 'record', 'void'))
$fn$;

-- Plant look-alikes of one pg_catalog function ('f') or operator ('o') in
-- schema: 'variants' or 'exact' signatures.  Returns how many were created;
-- what could not be is noted in sec.not_planted.
CREATE TABLE sec.not_planted (kind "char", target oid, schema text, sig text, error text);
GRANT INSERT ON sec.not_planted TO idem_sec_untrusted;
CREATE FUNCTION sec.plant(kind "char", target oid, schema text, mode text) RETURNS int
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	p pg_proc;
	o pg_operator;
	s record;
	ret regtype;
	name text;
	label text;
	params text;
	args text;
	body text;
	helper text;
	created int := 0;
	argtypes oid[];
	variadic_any boolean := false;
	ndefaults int;
	stmts text[];
BEGIN
	IF kind = 'f' THEN
		SELECT * INTO p FROM pg_proc WHERE oid = target;
		name := p.proname;
		argtypes := ARRAY(SELECT unnest(p.proargtypes));	-- from 1, not 0
		variadic_any := p.provariadic = '"any"'::regtype;
		-- not imitated: OUT parameters, ordered-set aggregates, procedures
		IF p.proargmodes && '{o,b,t}'::"char"[] OR p.prokind NOT IN ('f', 'a', 'w')
		   OR (p.prokind = 'a' AND (SELECT aggkind FROM pg_aggregate WHERE aggfnoid = target) <> 'n')
		   OR (p.prokind <> 'f' AND p.provariadic <> 0) THEN
			INSERT INTO sec.not_planted VALUES (kind, target, schema, NULL, 'not imitated');
			RETURN 0;
		END IF;
	ELSE
		SELECT * INTO o FROM pg_operator WHERE oid = target;
		name := o.oprname;
		argtypes := CASE WHEN o.oprleft = 0 THEN ARRAY[o.oprright] ELSE ARRAY[o.oprleft, o.oprright] END;
	END IF;

	FOR s IN SELECT * FROM sec.signatures(argtypes, variadic_any, mode) LOOP
		ret := sec.bind(CASE kind WHEN 'f' THEN p.prorettype ELSE o.oprresult END, s.binding);
		label := format('%s.%s(%s)', schema, name, array_to_string(s.sig, ','));
		IF sec.unplantable(s.sig || ret) THEN
			INSERT INTO sec.not_planted VALUES (kind, target, schema, label, 'type not imitated');
			CONTINUE;
		END IF;
		-- Beside the catalog's own overloads, only a better match can win.
		IF mode = 'variants' AND (kind = 'f' AND EXISTS (
				SELECT FROM pg_proc WHERE proname = p.proname AND pronamespace = 'pg_catalog'::regnamespace
									  AND ARRAY(SELECT unnest(proargtypes)) = s.sig::oid[])
			OR kind = 'o' AND EXISTS (
				SELECT FROM pg_operator WHERE oprname = o.oprname AND oprnamespace = 'pg_catalog'::regnamespace
										  AND ARRAY[oprleft, oprright] = CASE WHEN o.oprleft = 0 THEN 0::oid || s.sig::oid[]
																			   ELSE s.sig::oid[] END)) THEN
			CONTINUE;
		END IF;

		-- The parameters (names and defaults as the catalog's, so that named
		-- and defaulted calls match) and the arguments passed on.
		ndefaults := CASE WHEN kind = 'f' THEN p.pronargdefaults ELSE 0 END;
		SELECT string_agg(format('%s%s %s%s',
								 CASE WHEN kind = 'f' AND p.provariadic <> 0 AND i = cardinality(s.sig) THEN 'VARIADIC ' END,
								 coalesce(quote_ident(nullif(p.proargnames[i], '')), 'a' || i),
								 CASE WHEN variadic_any AND i = cardinality(s.sig)
									  THEN (SELECT typarray FROM pg_type WHERE oid = t)::regtype
									  ELSE t END,
								 ' DEFAULT ' || CASE WHEN i > cardinality(s.sig) - ndefaults
													 THEN pg_get_function_arg_default(target, i::int) END),
						  ', ' ORDER BY i),
			   string_agg(format('%s$%s%s',
								 CASE WHEN kind = 'f' AND p.provariadic <> 0 AND i = cardinality(s.sig) THEN 'VARIADIC ' END,
								 i,
								 CASE WHEN t <> argtypes[i] AND (SELECT typtype <> 'p' FROM pg_type WHERE oid = argtypes[i])
									  THEN '::' || argtypes[i]::regtype END),
						  ', ' ORDER BY i)
		  INTO params, args
		  FROM unnest(s.sig) WITH ORDINALITY AS a(t, i);
		IF variadic_any THEN
			label := format('%s.%s(%s)', schema, name,
							concat_ws(',', array_to_string(s.sig[1:cardinality(s.sig) - 1], ','),
									  'VARIADIC ' || (SELECT typarray FROM pg_type WHERE oid = s.sig[cardinality(s.sig)])::regtype));
		END IF;
		helper := 'evil.plant_' || nextval('evil.plant_seq');
		body := format('BEGIN PERFORM evil.plant_called(%L); ', label);

		IF kind = 'o' THEN
			stmts := ARRAY[
				format('CREATE FUNCTION %s(%s) RETURNS %s LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
					   helper, array_to_string(s.sig, ', '), ret,
					   body || format('RETURN %s OPERATOR(pg_catalog.%s) %s; END',
									  CASE WHEN o.oprleft <> 0 THEN split_part(args, ', ', 1) END, name,
									  CASE WHEN o.oprleft <> 0 THEN split_part(args, ', ', 2) ELSE args END)),
				format('CREATE OPERATOR %I.%s (%s RIGHTARG = %s, FUNCTION = %s)',
					   schema, name, CASE WHEN o.oprleft <> 0 THEN format('LEFTARG = %s,', s.sig[1]) END,
					   s.sig[cardinality(s.sig)], helper)];
		ELSIF p.prokind = 'f' THEN
			stmts := ARRAY[format('CREATE FUNCTION %I.%I(%s) RETURNS %s%s LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
					   schema, name, params, CASE WHEN p.proretset THEN 'SETOF ' END, ret,
					   body || CASE
						   WHEN p.proretset THEN format('RETURN QUERY SELECT * FROM pg_catalog.%I(%s);', name, args)
						   WHEN ret = 'void'::regtype THEN format('PERFORM pg_catalog.%I(%s); RETURN;', name, args)
						   ELSE format('RETURN pg_catalog.%I(%s);', name, args) END || ' END')];
		ELSE
			-- an aggregate (a window function, too, is imitated by one)
			stmts := ARRAY[
				format('CREATE FUNCTION %s_sfunc(%s) RETURNS %s LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
					   helper, array_to_string(ret || s.sig, ', '), ret, body || 'RETURN NULL; END'),
				format('CREATE FUNCTION %s_final(%s) RETURNS %s LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
					   helper, ret, ret, body || 'RETURN NULL; END'),
				format('CREATE AGGREGATE %I.%I(%s) (SFUNC = %s_sfunc, STYPE = %s, FINALFUNC = %s_final)',
					   schema, name, coalesce(nullif(array_to_string(s.sig, ', '), ''), '*'), helper, ret, helper)];
		END IF;
		BEGIN
			FOR i IN 1 .. cardinality(stmts) LOOP
				EXECUTE stmts[i];
			END LOOP;
			created := created + 1;
		EXCEPTION
			WHEN duplicate_function OR duplicate_object THEN
				NULL;			-- the same look-alike of another overload
			WHEN OTHERS THEN
				INSERT INTO sec.not_planted
				VALUES (kind, target, schema, label, regexp_replace(SQLERRM, 'plant_\d+', 'plant_N', 'g'));
		END;
	END LOOP;
	RETURN created;
END $fn$;

-- The untrusted role: may create objects in public (PostgreSQL 15 lets no
-- one by default; a database that lets some role is what this is about), and
-- has a schema of its own that callers put first in their search_path.
GRANT CREATE ON SCHEMA public TO idem_sec_untrusted;
CREATE SCHEMA evil AUTHORIZATION idem_sec_untrusted;
SET ROLE idem_sec_untrusted;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
CREATE SEQUENCE evil.plant_seq;
CREATE TABLE evil.plant_log (plant text, called_by name);
GRANT INSERT, SELECT ON evil.plant_log TO PUBLIC;
CREATE FUNCTION evil.plant_called(plant text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
	RAISE WARNING 'plant % called', plant;
	INSERT INTO evil.plant_log VALUES (plant, current_user);
END $fn$;
RESET ROLE;

-- Plant: look-alikes in public of what the scripts use; exact copies in evil
-- of what the scripts and the C code use.
SET ROLE idem_sec_untrusted;
SELECT sum(sec.plant(kind, target, 'public', 'variants') ORDER BY kind, target) AS public_plants
  FROM sec.target WHERE via = 'scripts';
SELECT sum(sec.plant(kind, target, 'evil', 'exact') ORDER BY kind, target) AS evil_plants
  FROM (SELECT DISTINCT kind, target FROM sec.target) t;
RESET ROLE;
SELECT n.nspname AS schema,
	   (SELECT count(*) FROM pg_proc WHERE pronamespace = n.oid AND prokind = 'f'
		   AND proowner = 'idem_sec_untrusted'::regrole AND proname !~ '^plant_') AS functions,
	   (SELECT count(*) FROM pg_proc WHERE pronamespace = n.oid AND prokind = 'a'
		   AND proowner = 'idem_sec_untrusted'::regrole) AS aggregates,
	   (SELECT count(*) FROM pg_operator WHERE oprnamespace = n.oid
		   AND oprowner = 'idem_sec_untrusted'::regrole) AS operators
  FROM pg_namespace n WHERE n.nspname IN ('public', 'evil') ORDER BY 1;
SELECT kind, CASE kind WHEN 'f' THEN target::regprocedure::text ELSE target::regoperator::text END AS catalog_object,
	   coalesce(sig, '(all)') AS look_alike, error
  FROM sec.not_planted ORDER BY 2, 3;

-- ---------------------------------------------------------------------------
-- What is checked, the same for each way of installing below.
-- ---------------------------------------------------------------------------

-- Objects that depend on a plant (bound it), other than the plants.
CREATE FUNCTION sec.bound_plants() RETURNS TABLE (dependent text, plant text)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	WITH plants AS (
		SELECT 'pg_proc'::regclass AS classid, oid FROM pg_proc WHERE proowner = 'idem_sec_untrusted'::regrole
		UNION ALL
		SELECT 'pg_operator'::regclass, oid FROM pg_operator WHERE oprowner = 'idem_sec_untrusted'::regrole)
	SELECT pg_describe_object(d.classid, d.objid, d.objsubid), pg_describe_object(d.refclassid, d.refobjid, 0)
	  FROM pg_depend d JOIN plants p ON p.classid = d.refclassid AND p.oid = d.refobjid
	 WHERE (d.classid, d.objid) NOT IN (SELECT classid, oid FROM plants)
	 ORDER BY 1, 2
$fn$;

-- The plants called since the log was last emptied, and empties it.
CREATE FUNCTION sec.plant_calls() RETURNS TABLE (plant text, calls bigint, by_a_superuser boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
	RETURN QUERY
	SELECT l.plant, count(*), bool_and(r.rolsuper)
	  FROM evil.plant_log l LEFT JOIN pg_roles r ON r.rolname = l.called_by
	 GROUP BY l.plant ORDER BY l.plant;
	TRUNCATE evil.plant_log;
END $fn$;

-- The extension's members in pg_class or pg_proc.
CREATE FUNCTION sec.members(classid regclass) RETURNS SETOF oid
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT d.objid FROM pg_depend d
	 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' AND d.classid = members.classid
	   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
$fn$;

-- Functions of the extension that nothing has called (in this database,
-- since the extension was created).  Needs a statistics flush first.  The
-- Citus setup functions need Citus (the Citus TAP tests call them); here
-- the check that their code names nothing unqualified stands for them.
CREATE FUNCTION sec.functions_not_called() RETURNS SETOF text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT oid::regprocedure::text FROM pg_proc
	 WHERE oid IN (SELECT sec.members('pg_proc')) AND coalesce(pg_stat_get_function_calls(oid), 0) = 0
	   AND proname NOT LIKE 'idem\_citus\_%'
	 ORDER BY 1
$fn$;

-- Functions of the extension that look names up when they run: not C, and
-- no search_path of their own.
CREATE FUNCTION sec.functions_without_search_path() RETURNS SETOF text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
	SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
	 WHERE p.oid IN (SELECT sec.members('pg_proc')) AND l.lanname NOT IN ('c', 'internal')
	   AND p.prosqlbody IS NULL
	   AND NOT coalesce(p.proconfig && '{"search_path=pg_catalog, pg_temp"}', false)
	 ORDER BY 1
$fn$;

-- Every view of the extension, each row computed in full, with the plants'
-- schemas first in search_path: whether it returned rows.
CREATE FUNCTION sec.query_views() RETURNS TABLE (view text, has_rows boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET idempotency.stuck_after = 0 AS $fn$
DECLARE
	q text;
	n bigint;
BEGIN
	FOR view IN SELECT oid::regclass::text FROM pg_class
				 WHERE oid IN (SELECT sec.members('pg_class')) AND relkind = 'v' ORDER BY relname LOOP
		q := format('SELECT pg_catalog.count(v) FROM %s v', view);
		PERFORM pg_catalog.set_config('search_path', 'evil, public, pg_catalog', true);
		EXECUTE q INTO n;
		PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
		has_rows := n > 0;
		RETURN NEXT;
	END LOOP;
END $fn$;

-- Destination functions and a handler for idem_execute.
CREATE TABLE sec.received (event jsonb);
CREATE FUNCTION sec.sink(event jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
	INSERT INTO sec.received VALUES (event);
END $fn$;
CREATE FUNCTION sec.refuse(event jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
	RAISE EXCEPTION 'refused';
END $fn$;
CREATE TABLE sec.events (event_id uuid);
-- The multi-phase operations' tokens (from the database's token sequence).
CREATE TABLE sec.tokens (k text, outcome text, token bigint);
CREATE FUNCTION sec.token(key text) RETURNS bigint
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
	SELECT token FROM sec.tokens WHERE k OPERATOR(pg_catalog.=) key
$$;

-- Call every SQL function of the extension (with data that makes every
-- view return rows), with the plants' schemas first in search_path: these
-- functions' own statements are parsed with it, and so are the C code's
-- unless it sets its own.  Each step in a transaction of its own.
CREATE FUNCTION sec.exercise_claims() RETURNS TABLE (step text, result text)
LANGUAGE plpgsql SET search_path = evil, public, pg_catalog AS $fn$
DECLARE
	s text := 'sec:POST /x';
BEGIN
	EXECUTE 'CREATE OR REPLACE FUNCTION sec.handler(request jsonb) RETURNS public.idem_response
			 LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
			 AS $h$ BEGIN RETURN ROW(200, NULL, request)::public.idem_response; END $h$';
	step := 'idem_canonical';
	result := idem_canonical('{"b": 1, "a": [true, null]}'::jsonb);
	RETURN NEXT;
	step := 'idem_fingerprint';
	result := pg_catalog.length(idem_fingerprint('{"a": 1}'::jsonb));
	RETURN NEXT;
	step := 'idem_claim(jsonb)';
	result := (SELECT outcome FROM idem_claim(s, 'k-jsonb', '{"a": 1}'::jsonb));
	RETURN NEXT;
	PERFORM idem_succeed(s, 'k-jsonb', 201, '{"id": 1}'::jsonb, '{"Location": "/x/1"}'::jsonb);
	step := 'idem_claim(jsonb) again';
	result := (SELECT outcome FROM idem_claim(s, 'k-jsonb', '{"a": 1}'::jsonb));
	RETURN NEXT;
	step := 'idem_replay';
	result := (SELECT state FROM idem_replay(s, 'k-jsonb'));
	RETURN NEXT;
	step := 'idem_claim(text)';
	result := (SELECT outcome FROM idem_claim(s, 'k-text', '{"a": 2}'::text));
	RETURN NEXT;
	PERFORM idem_release(s, 'k-text');
	step := 'idem_claim(bytea)';
	result := (SELECT outcome FROM idem_claim(s, 'k-bytea', '\x01'::bytea, '1 hour'::interval));
	RETURN NEXT;
	PERFORM idem_succeed(s, 'k-bytea', 200);
	step := 'idem_execute';
	result := (SELECT pg_catalog.concat(status, '/', replayed)
				 FROM idem_execute(s, 'k-exec', '{"a": 3}'::jsonb, 'sec.handler(jsonb)'::regprocedure));
	RETURN NEXT;
	step := 'idem_inbox_accept twice';
	result := pg_catalog.concat(idem_inbox_accept('sec-source', 'm-1'), '/', idem_inbox_accept('sec-source', 'm-1'));
	RETURN NEXT;
	step := 'idem_claim with a lease';
	INSERT INTO sec.tokens
	SELECT k, c.outcome, c.token
	  FROM pg_catalog.unnest('{p-1,p-2,p-3}'::text[]) k,
		   idem_claim(s, k, '{}'::jsonb, lease => '1 hour'::interval) c;
	result := (SELECT pg_catalog.string_agg(pg_catalog.concat(outcome, ':', token IS NOT NULL), ' ' ORDER BY k)
				 FROM sec.tokens);
	RETURN NEXT;
	PERFORM idem_checkpoint(s, 'p-1', sec.token('p-1'), 'step-1');
	step := 'idem_extend';
	result := idem_extend(s, 'p-1', sec.token('p-1'), '2 hours'::interval) IS NOT NULL;
	RETURN NEXT;
	step := 'idem_downstream_key';
	result := pg_catalog.length(idem_downstream_key(s, 'p-1', 'charge'));
	RETURN NEXT;
END $fn$;

CREATE FUNCTION sec.exercise_outbox() RETURNS TABLE (step text, result text)
LANGUAGE plpgsql SET search_path = evil, public, pg_catalog AS $fn$
BEGIN
	PERFORM idem_destination_create('sec-sink', 'function', 'sec.sink(jsonb)', '{sec.*}');
	PERFORM idem_destination_create('sec-refuser', 'function', 'sec.refuse(jsonb)', '{sec.order}');
	PERFORM idem_destination_alter('sec-refuser', '{"max_attempts": 1}'::jsonb);
	PERFORM idem_destination_create('sec-notify', 'notify', 'sec_events', '{sec.*}');
	PERFORM idem_destination_pause('sec-notify');
	PERFORM idem_destination_resume('sec-notify');
	-- never attempted: paused from the start
	PERFORM idem_destination_create('sec-http', 'http', 'https://example.com/hook', '{sec.*}',
									'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
									  "headers": {"X-Tenant": "t1"}}'::jsonb);
	PERFORM idem_destination_pause('sec-http');
	PERFORM idem_destination_create('sec-dropped', 'notify', 'sec_dropped');
	PERFORM idem_destination_drop('sec-dropped');
	-- what a Citus coordinator sends its workers: a definition, then none
	PERFORM idem_destination_sync('sec-synced', '{"kind": "notify", "target": "sec_synced",
		"topics": "{sec.other}", "paused": true, "search_path": "pg_catalog", "options": {}}'::jsonb, false);
	PERFORM idem_destination_sync('sec-synced', NULL, false);
	step := 'destinations';
	result := (SELECT pg_catalog.string_agg(name, ',' ORDER BY name) FROM idem_destinations);
	RETURN NEXT;
	INSERT INTO sec.events
	SELECT idem_publish('sec.order', '{"n": 1}'::jsonb, 'k-1', '{"traceparent": "t"}'::jsonb)
	UNION ALL
	SELECT idem_publish('sec.order', '{"n": 2}'::jsonb);
	step := 'idem_publish';
	result := (SELECT pg_catalog.count(*) FROM sec.events);
	RETURN NEXT;
END $fn$;

CREATE FUNCTION sec.exercise_relay() RETURNS TABLE (step text, result text)
LANGUAGE plpgsql SET search_path = evil, public, pg_catalog AS $fn$
DECLARE
	s text := 'sec:POST /x';
BEGIN
	step := 'idem_outbox_relay';
	result := idem_outbox_relay();
	RETURN NEXT;
	step := 'idem_outbox_event';
	result := (SELECT pg_catalog.bool_and(idem_outbox_event(event_id) IS NOT NULL) FROM sec.events);
	RETURN NEXT;
	step := 'idem_outbox_redrive';
	result := (SELECT pg_catalog.sum(idem_outbox_redrive(event_id, 'sec-refuser')) FROM sec.events);
	RETURN NEXT;
	step := 'idem_outbox_relay again';
	result := idem_outbox_relay();
	RETURN NEXT;
	step := 'idem_outbox_redrive_dead';
	result := idem_outbox_redrive_dead('sec-refuser');
	RETURN NEXT;
	step := 'idem_outbox_relay again';
	result := idem_outbox_relay();
	RETURN NEXT;
	step := 'sink received';
	result := (SELECT pg_catalog.count(*) FROM sec.received);
	RETURN NEXT;
	step := 'idem_outbox_cleanup';
	result := idem_outbox_cleanup();
	RETURN NEXT;
	-- the multi-phase operations' owners give up: stuck, for idem_stuck
	PERFORM idem_release(s, k, sec.token(k)) FROM pg_catalog.unnest('{p-1,p-2,p-3}'::text[]) k;
END $fn$;

CREATE FUNCTION sec.exercise_resolve() RETURNS TABLE (step text, result text)
LANGUAGE plpgsql SET search_path = evil, public, pg_catalog AS $fn$
DECLARE
	s text := 'sec:POST /x';
BEGIN
	step := 'idem_resolve_complete';
	result := idem_resolve_complete(s, 'p-1', 201, '{"found": true}'::jsonb, note => 'reconciled') IS NOT NULL;
	RETURN NEXT;
	step := 'idem_resolve_release';
	result := idem_resolve_release(s, 'p-2', 'retry') IS NOT NULL;
	RETURN NEXT;
	step := 'idem_cleanup';
	result := idem_cleanup();
	RETURN NEXT;
	step := 'idem_stats';
	result := (SELECT pg_catalog.count(*) FROM idem_stats()) OPERATOR(pg_catalog.>) 0;
	RETURN NEXT;
	PERFORM idem_stats_reset();
END $fn$;

-- The functions of schema idem_citus, which take the scope (the inbox's
-- source) as a tenant id (1.4), each called once for bigint and once for
-- uuid, through EXECUTE with the same search_path.
CREATE FUNCTION sec.exercise_tenants() RETURNS TABLE (step text, result text)
LANGUAGE plpgsql SET search_path = evil, public, pg_catalog AS $fn$
DECLARE
	s text;
	tok bigint;
	answer text;
BEGIN
	FOREACH s IN ARRAY ARRAY['42::bigint', '''a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11''::uuid'] LOOP
		EXECUTE pg_catalog.format('SELECT outcome FROM idem_citus.idem_claim(%s, ''t-jsonb'', ''{"a": 1}''::jsonb)', s);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_succeed(%s, ''t-jsonb'', 201)', s);
		EXECUTE pg_catalog.format('SELECT outcome FROM idem_citus.idem_claim(%s, ''t-text'', ''{"a": 2}''::text)', s);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_release(%s, ''t-text'')', s);
		EXECUTE pg_catalog.format('SELECT outcome FROM idem_citus.idem_claim(%s, ''t-bytea'', ''\x01''::bytea)', s);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_release(%s, ''t-bytea'')', s);
		EXECUTE pg_catalog.format('SELECT state FROM idem_citus.idem_replay(%s, ''t-jsonb'')', s) INTO answer;
		step := s OPERATOR(pg_catalog.||) ': claim, succeed, replay';
		result := answer;
		RETURN NEXT;
		EXECUTE pg_catalog.format('SELECT status FROM idem_citus.idem_execute(%s, ''t-exec'', ''{}''::jsonb, ''sec.handler(jsonb)''::regprocedure)', s)
			INTO answer;
		step := s OPERATOR(pg_catalog.||) ': execute';
		result := answer;
		RETURN NEXT;
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_inbox_accept(%s, ''t-m1'')', s) INTO answer;
		step := s OPERATOR(pg_catalog.||) ': inbox';
		result := answer;
		RETURN NEXT;
		EXECUTE pg_catalog.format('SELECT token FROM idem_citus.idem_claim(%s, ''t-p1'', ''{}''::jsonb, lease => ''1 hour''::interval)', s)
			INTO tok;
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_checkpoint(%s, ''t-p1'', %s, ''step-1'')', s, tok);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_extend(%s, ''t-p1'', %s, ''2 hours''::interval)', s, tok);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_release(%s, ''t-p1'', %s)', s, tok);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_resolve_release(%s, ''t-p1'', ''retry'') IS NOT NULL', s);
		EXECUTE pg_catalog.format('SELECT idem_citus.idem_resolve_complete(%s, ''t-p1'', 201, note => ''done'') IS NOT NULL', s)
			INTO answer;
		step := s OPERATOR(pg_catalog.||) ': phases, resolved';
		result := answer;
		RETURN NEXT;
	END LOOP;
END $fn$;

-- Re-create the extension's views and column defaults as the scripts before
-- 1.2 did: names unqualified, literals untyped, run with search_path =
-- public, pg_temp.  Returns how many it re-created.
CREATE FUNCTION sec.recreate_as_before_1_2() RETURNS int
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	untyped text := '(''(?:[^'']|'''')*'')::(text|regclass)\M';
	stmt text;
	n int := 0;
BEGIN
	FOR stmt IN
		SELECT format('CREATE OR REPLACE VIEW %s AS %s', oid::regclass,
					  regexp_replace(pg_get_viewdef(oid), untyped, '\1', 'g'))
		  FROM pg_class WHERE oid IN (SELECT sec.members('pg_class')) AND relkind = 'v'
		UNION ALL
		SELECT format('ALTER TABLE %s ALTER COLUMN %I SET DEFAULT %s', d.adrelid::regclass, a.attname,
					  regexp_replace(pg_get_expr(d.adbin, d.adrelid), untyped, '\1', 'g'))
		  FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		 WHERE d.adrelid IN (SELECT sec.members('pg_class'))
		 ORDER BY 1
	LOOP
		PERFORM pg_catalog.set_config('search_path', 'public, pg_temp', true);
		EXECUTE stmt;
		PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
		n := n + 1;
	END LOOP;
	RETURN n;
END $fn$;

-- Control: an unqualified call, as the scripts before 1.2 made them, finds a
-- plant (and the plant says so).
SELECT make_interval(secs => 0.5) AS unqualified_call;
SELECT * FROM sec.plant_calls();

-- ---------------------------------------------------------------------------
-- 1. The installation made before the plants (version 1.1), updated with the
-- plants in place.  A new session for each way of installing: the C code
-- prepares its statements once per session.
-- ---------------------------------------------------------------------------
ALTER EXTENSION idempotency UPDATE;
\c idem_sec
SELECT extversion FROM pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency';
SELECT * FROM sec.bound_plants();
SELECT * FROM sec.exercise_claims();
SELECT * FROM sec.exercise_outbox();
SELECT * FROM sec.exercise_relay();
SELECT * FROM sec.exercise_resolve();
SELECT * FROM sec.exercise_tenants();
SELECT * FROM sec.query_views();
SELECT * FROM sec.plant_calls();
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT * FROM sec.functions_not_called();
DROP EXTENSION idempotency CASCADE;
TRUNCATE sec.received, sec.events, sec.tokens;

-- ---------------------------------------------------------------------------
-- 2. CREATE EXTENSION (1.0, then the updates to 1.1 and 1.2) with the plants
-- in place.
-- ---------------------------------------------------------------------------
\c idem_sec
CREATE EXTENSION idempotency;
SELECT extversion FROM pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency';
SELECT * FROM sec.bound_plants();
SELECT * FROM sec.functions_without_search_path();
SELECT * FROM sec.exercise_claims();
SELECT * FROM sec.exercise_outbox();
SELECT * FROM sec.exercise_relay();
SELECT * FROM sec.exercise_resolve();
SELECT * FROM sec.exercise_tenants();
SELECT * FROM sec.query_views();
SELECT * FROM sec.plant_calls();
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT * FROM sec.functions_not_called();
DROP EXTENSION idempotency CASCADE;
TRUNCATE sec.received, sec.events, sec.tokens;

-- ---------------------------------------------------------------------------
-- 3. CREATE EXTENSION ... VERSION '1.0', then ALTER EXTENSION UPDATE, with
-- the plants in place.
-- ---------------------------------------------------------------------------
\c idem_sec
CREATE EXTENSION idempotency VERSION '1.0';
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency';
SELECT * FROM sec.bound_plants();
SELECT * FROM sec.exercise_claims();
SELECT * FROM sec.exercise_outbox();
SELECT * FROM sec.exercise_relay();
SELECT * FROM sec.exercise_resolve();
SELECT * FROM sec.exercise_tenants();
SELECT * FROM sec.query_views();
SELECT * FROM sec.plant_calls();
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT * FROM sec.functions_not_called();
DROP EXTENSION idempotency CASCADE;

-- ---------------------------------------------------------------------------
-- 4. An installation whose views bound plants, as the scripts before 1.2
-- let them: ALTER EXTENSION UPDATE repairs it.
-- ---------------------------------------------------------------------------
CREATE EXTENSION idempotency VERSION '1.1';
SELECT sec.recreate_as_before_1_2() AS recreated;
SELECT * FROM sec.bound_plants();
ALTER EXTENSION idempotency UPDATE;
SELECT * FROM sec.bound_plants();
DROP EXTENSION idempotency;

\c :origdb
DROP DATABASE idem_sec;
DROP ROLE idem_sec_untrusted;
