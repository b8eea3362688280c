# Load soak: many clients for a while, with duplicates on purpose, at every
# isolation level, while the cleanup worker and the outbox relay run and the
# extension's tables are rewritten (VACUUM FULL, CLUSTER) now and then.
#
# Afterwards:
#   - every operation executed once: one domain row per key, and every replay
#     a client saw was that row's response (the clients check each replay
#     themselves and fail loudly otherwise);
#   - every event published by an operation was delivered exactly once to the
#     function destination;
#   - every inbox message was applied once;
#   - a key with a short ttl is executed again only after its record expired;
#   - no error but the documented conflicts (40001, 40P01, which pgbench
#     retries), no client aborted;
#   - nothing grows without bound: expired records and delivered events are
#     cleaned up.
#
# IDEM_SOAK_SECONDS sets the length (default 30 s, as the test suite runs it);
# `IDEM_SOAK_SECONDS=600 bash test/run.sh t/016` is the long run the README
# reports.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $seconds = $ENV{IDEM_SOAK_SECONDS} // 30;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = 2
idempotency.outbox_retention = 2
max_connections = 40
# The SERIALIZABLE clients' predicate locks: with the default of 64 per
# transaction the shared table ran out under a loaded machine now and then
# ("out of shared memory", 53200), which says nothing about idempotency.
max_pred_locks_per_transaction = 512
log_line_prefix = '%m [%p] %e '
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;

	-- The domain: one order per executed operation, one event per order.
	CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL, amount int NOT NULL,
						 at timestamptz NOT NULL DEFAULT clock_timestamp());
	CREATE TABLE received (event_id uuid PRIMARY KEY, key text NOT NULL, times int NOT NULL DEFAULT 1);
	CREATE TABLE applied (message_id text PRIMARY KEY);
	CREATE TABLE stats (what text, n bigint);

	CREATE FUNCTION soak_receive(event jsonb) RETURNS void LANGUAGE sql AS $$
		INSERT INTO received (event_id, key) VALUES ((event->>'id')::uuid, event->>'key')
		ON CONFLICT (event_id) DO UPDATE SET times = received.times + 1
	$$;
	SELECT idem_destination_create('soak', 'function', 'soak_receive(jsonb)', '{soak.*}');

	-- One request: claim; on 'claimed' write the order, publish its event and
	-- store the response; on 'replay' check the response names this key's
	-- one order.  Raises on anything else, which aborts the client.
	CREATE FUNCTION pay(k text, ttl interval) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
		n bigint;
	BEGIN
		c := idem_claim('soak', k, jsonb_build_object('amount', 10), ttl);
		IF c.outcome = 'claimed' THEN
			INSERT INTO orders (key, amount) VALUES (k, 10) RETURNING id INTO n;
			PERFORM idem_publish('soak.paid', jsonb_build_object('order', n), key => k);
			PERFORM idem_succeed('soak', k, 201, jsonb_build_object('order', n, 'key', k));
		ELSIF c.outcome = 'replay' THEN
			IF c.status <> 201 OR c.body->>'key' <> k OR NOT EXISTS
			   (SELECT FROM orders WHERE id = (c.body->>'order')::bigint AND key = k) THEN
				RAISE EXCEPTION 'key %: replayed %, not its order', k, c.body;
			END IF;
		ELSIF c.outcome <> 'in_progress' THEN
			RAISE EXCEPTION 'key %: unexpected outcome %', k, c.outcome;
		END IF;
		RETURN c.outcome;
	END $$;

	-- A consumer: apply each message once.
	CREATE FUNCTION consume(m text) RETURNS boolean LANGUAGE plpgsql AS $$
	BEGIN
		IF idem_inbox_accept('soak', m, interval '1 hour') THEN
			INSERT INTO applied VALUES (m);
			RETURN true;
		END IF;
		RETURN false;
	END $$;
});

# Long-lived keys from a small space, so that most requests are duplicates
# (of a committed record or of one in flight); short-lived keys, whose
# records expire while clients still retry them.
my %scripts = (
	rc => "\\set k random(1, 3000)\nSELECT pay('L' || :k, interval '1 hour');\n"
	  . "\\set s random(1, 200)\nSELECT pay('S' || :s, interval '300 ms');\n",
	rr => "\\set k random(1, 3000)\nBEGIN ISOLATION LEVEL REPEATABLE READ;\n"
	  . "SELECT pay('L' || :k, interval '1 hour');\nCOMMIT;\n",
	ser => "\\set k random(1, 3000)\nBEGIN ISOLATION LEVEL SERIALIZABLE;\n"
	  . "SELECT pay('L' || :k, interval '1 hour');\nCOMMIT;\n",
	inbox => "\\set m random(1, 5000)\nSELECT consume('m' || :m);\n",
	maint => "\\sleep 2 s\nVACUUM FULL idempotency.records;\n\\sleep 2 s\n"
	  . "CLUSTER idempotency.records USING records_pkey;\n\\sleep 2 s\n"
	  . "VACUUM FULL idempotency.inbox;\nVACUUM FULL idempotency.deliveries;\n",);
my %clients = (rc => 4, rr => 2, ser => 2, inbox => 2, maint => 1);

my $dir = PostgreSQL::Test::Utils::tempdir;
my %runs;
for my $name (sort keys %scripts)
{
	my $file = "$dir/$name.sql";
	open my $fh, '>', $file or die "could not write $file: $!";
	print $fh $scripts{$name};
	close $fh;
	my ($out, $err) = ('', '');
	$runs{$name} = {
		out => \$out,
		err => \$err,
		h => IPC::Run::start(
			[
				'pgbench', '--no-vacuum', '--client' => $clients{$name},
				'--time' => $seconds, '--max-tries' => 1000, '--file' => $file,
				$node->connstr('postgres')
			],
			'>', \$out, '2>', \$err)
	};
}
my ($requests, $retried) = (0, 0);
for my $name (sort keys %runs)
{
	my $run = $runs{$name};
	$run->{h}->finish;
	my ($tx) = ${ $run->{out} } =~ /number of transactions actually processed: (\d+)/;
	my ($re) = ${ $run->{out} } =~ /number of transactions retried: (\d+)/;
	$requests += $tx // 0 unless $name eq 'maint';
	$retried += $re // 0;
	is($run->{h}->result(0), 0, "$name: every client ran to the end")
	  or diag ${ $run->{err} };
	cmp_ok($tx // 0, '>', 0, "$name: " . ($tx // 0) . ' transactions');
}

my $q = sub { $node->safe_psql('postgres', $_[0]) };

# Exactly once: one order per long key claimed, each the key's record.
my $keys = $q->(q{SELECT count(DISTINCT key) FROM orders WHERE key LIKE 'L%'});
my $claims = $q->(q{SELECT claims FROM idem_stats WHERE datname = 'postgres'});
my $replays = $q->(q{SELECT replays FROM idem_stats WHERE datname = 'postgres'});
is($q->(q{SELECT count(*) FROM orders WHERE key LIKE 'L%'}), $keys,
	"one order per long-lived key ($keys keys)");
is( $q->(q{
		SELECT count(*) FROM orders o
		 WHERE o.key LIKE 'L%' AND NOT EXISTS (
			SELECT FROM idempotency.records r
			 WHERE r.scope = 'soak' AND r.key = o.key AND r.state = 'completed'
			   AND (r.body->>'order')::bigint = o.id)}),
	'0', 'every long-lived key\'s record stores its order');
cmp_ok($replays, '>', $keys, "duplicates were replayed ($replays replays)");

# Short keys: executed again only after their record had expired, 300 ms
# after the response was stored, so never sooner than that after the last
# execution (some slack for the clock read before the insert).
my $short = $q->(q{SELECT count(*) FROM orders WHERE key LIKE 'S%'});
cmp_ok($short, '>', $q->(q{SELECT count(DISTINCT key) FROM orders WHERE key LIKE 'S%'}),
	"short-lived keys were executed again after expiry ($short executions)");
is( $q->(q{
		SELECT count(*) FROM (
			SELECT at - lag(at) OVER (PARTITION BY key ORDER BY id) AS gap
			  FROM orders WHERE key LIKE 'S%') g
		 WHERE gap < interval '250 ms'}),
	'0', 'no short-lived key executed twice while its record lived');

# Let the relay catch up, then every event is delivered exactly once.
my $events = $q->(q{SELECT count(*) FROM orders});
$node->poll_query_until('postgres', qq{SELECT count(*) >= $events FROM received})
  or diag 'the relay did not deliver every event';
is($q->(q{SELECT count(*) FROM received}), $events, "every event delivered ($events events)");
is($q->(q{SELECT count(*) FROM received WHERE times > 1}), '0', 'none delivered twice');
is( $q->(q{
		SELECT count(*) FROM orders o
		 WHERE NOT EXISTS (SELECT FROM received r WHERE r.key = o.key)}),
	'0', 'each order\'s event reached the destination');

# The inbox applied each message once.
my $applied = $q->(q{SELECT count(*) FROM applied});
is($q->(q{SELECT count(*) FROM idempotency.inbox WHERE source = 'soak'}), $applied,
	"one inbox mark per applied message ($applied messages)");

# Nothing but documented conflicts in the server log.
my @errors = grep { /\bERROR:/ && !/ (40001|40P01) +ERROR:/ } split /\n/,
  slurp_file($node->logfile);
is(scalar(@errors), 0, 'no error in the server log but retryable conflicts')
  or diag join("\n", @errors[ 0 .. ($#errors < 9 ? $#errors : 9) ]);

# No unbounded growth: once cleanup has run, expired records and delivered
# events past their retention are gone.
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.records WHERE expires_at < now() - interval '5 s'})
  or diag 'expired records were not cleaned up';
is($q->(q{SELECT count(*) FROM idempotency.records WHERE expires_at < now() - interval '5 s'}),
	'0', 'expired records are cleaned up');
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.outbox WHERE published_at < now() - interval '10 s'})
  or diag 'delivered events were not cleaned up';
is($q->(q{SELECT count(*) FROM idempotency.outbox WHERE published_at < now() - interval '10 s'}),
	'0', 'delivered events are cleaned up after their retention');

my $duplicates = $q->(q{SELECT count(*) - count(DISTINCT key) FROM orders WHERE key LIKE 'L%'});
diag sprintf('soak %d s: %d requests (%d retried after 40001/40P01), %d executions of %d '
	  . 'long-lived keys and %d of short-lived keys, %d replays, %d duplicates executed, '
	  . '%d events published, %d lost, %d inbox messages applied',
	$seconds, $requests, $retried, $keys + $duplicates, $keys, $short, $replays, $duplicates, $events,
	$events - $q->(q{SELECT count(*) FROM received}), $applied);

$node->stop;
done_testing();
