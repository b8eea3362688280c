--
-- 'http' destinations reach only public addresses, unless a superuser lists
-- others in idempotency.relay_allowed_networks: no role that may create a
-- destination can make the server post to itself, its private network or a
-- cloud metadata service and read the answer back from the dead letters.
-- A URL whose host is a forbidden address literal (in any spelling libcurl
-- accepts) or localhost is refused at creation (42501); the relay checks
-- every address it connects to, after name resolution, so a name that
-- resolves to a forbidden address is refused when delivering.  No network
-- is needed: refused connections are never attempted.
--
SHOW idempotency.relay_allowed_networks;
-- try_create: 'created', or the SQLSTATE and the error's detail.
CREATE FUNCTION try_create(url text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	detail text;
BEGIN
	PERFORM idem_destination_create('probe', 'http', url, '{probe}',
		'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "max_attempts": 1}');
	PERFORM idem_destination_drop('probe');
	RETURN 'created';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
	RETURN SQLSTATE || ': ' || detail;
END $$;

-- Forbidden literals, however they are written.
SELECT url, try_create(url) AS outcome FROM unnest(ARRAY[
	'http://127.0.0.1/hook',
	'http://127.1:8080/hook',
	'http://2130706433/hook',
	'http://0x7f.1/hook',
	'http://0/hook',
	'http://10.1.2.3/hook',
	'http://172.16.0.1/hook',
	'http://192.168.1.1/hook',
	'http://100.64.0.1/hook',
	'http://169.254.169.254/latest/meta-data/',
	'http://224.0.0.1/hook',
	'http://255.255.255.255/hook',
	'http://[::1]/hook',
	'http://[::]/hook',
	'http://[::ffff:127.0.0.1]/hook',
	'http://[::ffff:a9fe:a9fe]/hook',
	'http://[64:ff9b::10.0.0.1]/hook',
	'http://[fe80::1%25eth0]/hook',
	'http://[fd00::1]/hook',
	'http://[ff02::1]/hook',
	'http://[2001:db8::1]/hook',
	'http://localhost:8080/hook',
	'http://LocalHost./hook',
	'http://api.localhost/hook',
	'http://127.0.0.1./hook'
]) AS url;

-- Public addresses, and names (checked when the relay connects).
SELECT url, try_create(url) AS outcome FROM unnest(ARRAY[
	'https://93.184.216.34/hook',
	'https://[2606:2800:220:1:248:1893:25c8:1946]/hook',
	'http://[64:ff9b::5db8:d822]/hook',
	'https://partner.example.com/hook',
	'https://localhost.example.com/hook'
]) AS url;

-- The error as a caller sees it.
SELECT idem_destination_create('meta', 'http', 'http://169.254.169.254/latest/meta-data/', '{meta}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
\echo :SQLSTATE

-- The setting: IP addresses and CIDR networks only.
SET idempotency.relay_allowed_networks = 'localhost';
SET idempotency.relay_allowed_networks = '10.0.0.0/33';
SET idempotency.relay_allowed_networks = '10.0.0.0/';
SET idempotency.relay_allowed_networks = '10.0.0.0/8, 127.0.0.1, fd00::/8';
SHOW idempotency.relay_allowed_networks;
SELECT url, try_create(url) AS outcome FROM unnest(ARRAY[
	'http://10.200.0.1/hook',
	'http://127.0.0.1:9/hook',
	'http://[::ffff:127.0.0.1]/hook',
	'http://localhost:9/hook',
	'http://[fd12::1]/hook',
	'http://127.0.0.2/hook',
	'http://[::1]/hook',
	'http://192.168.0.1/hook'
]) AS url;

-- Delivering: the relay checks the address it connects to, after name
-- resolution.  Destinations created while the setting allowed loopback
-- (one by address, one by name) are refused once it no longer does, with a
-- clear error, and dead-lettered after max_attempts (1 here).
SELECT idem_destination_create('by_address', 'http', 'http://127.0.0.1:9/hook', '{probe}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "max_attempts": 1}');
SELECT idem_destination_create('by_name', 'http', 'http://localhost:9/hook', '{probe}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "max_attempts": 1}');
RESET idempotency.relay_allowed_networks;
SELECT idem_publish('probe', '{"steal": "metadata"}') IS NOT NULL AS published;
SELECT idem_outbox_relay() AS attempted;
SELECT destination, attempts, last_status,
	   regexp_replace(last_error, 'to (127\.0\.0\.1|::1): a loopback address \(([0-9.:/]+)\)',
					  'to <loopback>: a loopback address (<range>)') AS last_error
  FROM idem_outbox_dead ORDER BY destination;

-- Only a superuser can change the setting; a role granted
-- idem_destination_create cannot, and cannot reach loopback.
CREATE ROLE idem_ssrf_ops;
GRANT EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) TO idem_ssrf_ops;
SET ROLE idem_ssrf_ops;
SET idempotency.relay_allowed_networks = '0.0.0.0/0';
\echo :SQLSTATE
SELECT idem_destination_create('mine', 'http', 'http://127.0.0.1:9/hook', '{probe}',
	'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}');
\echo :SQLSTATE
RESET ROLE;

-- Leave nothing behind.
SELECT idem_destination_drop(name) FROM idem_destinations ORDER BY name;
TRUNCATE idempotency.outbox, idempotency.deliveries, idempotency.destination_stats;
REVOKE EXECUTE ON FUNCTION idem_destination_create(text, text, text, text[], jsonb) FROM idem_ssrf_ops;
DROP ROLE idem_ssrf_ops;
DROP FUNCTION try_create(text);
