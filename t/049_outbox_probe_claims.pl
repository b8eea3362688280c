# Probes and row locks in the worker's relay loop (issue 11, after review):
#
#  A. The record step has a lock_timeout: a session holding a delivery row
#     FOR UPDATE does not stall the loop.  Other deliveries go on; the held
#     outcome is recorded once the row is free, sent once.
#  B. A probe stays exclusive while the loop renews its claim: the worker
#     is kept in a slow function call (its claims renewed to outlast it)
#     past the probe's first deadline, and another relay (here
#     idem_outbox_relay() in a session) then starts no second probe.
#  C. A probe interrupted by a crash (kill -9 while the request is in
#     flight) uses no attempt, so the "last attempt interrupted" rule does
#     not dead-letter it: the delivery is probed again and delivered.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use WebhookSink;
use ProofHelpers;
use CrashRecovery;

my $SECRET = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';

my $node = PostgreSQL::Test::Cluster->new('probe_claims');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.relay_allowed_networks = '127.0.0.1'
idempotency.relay_visibility_margin = '1s'
restart_after_crash = on
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

sub q1 { return $node->safe_psql('postgres', $_[0]); }

sub new_sink
{
	return ProofHelpers::Sink->new(
		port => PostgreSQL::Test::Cluster::get_free_port(),
		dir => PostgreSQL::Test::Utils::tempdir(),
		secrets => [$SECRET])->start;
}

sub create_dest
{
	my ($name, $sink, $options) = @_;
	q1(sprintf(q{SELECT idem_destination_create('%s', 'http', '%s', '{%s.*}',
		jsonb_build_object('secret', '%s') || '%s'::jsonb)},
		$name, $sink->url, $name, $SECRET, $options));
}

sub wait_received
{
	my ($sink, $count) = @_;
	my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
	until (scalar($sink->received) >= $count)
	{
		return fail("the sink never received $count requests") if time() > $deadline;
		sleep 0.05;
	}
}

sub worker_pid
{
	$node->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
	  or fail('no worker');
	return q1(q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
}

# ---- A. A delivery row held FOR UPDATE does not stall the loop.
my $sink_a = new_sink();
create_dest('held', $sink_a, '{"timeout": "120s"}');
$sink_a->hold(204);
my $e1 = q1(q{SELECT idem_publish('held.x', '{"n": 1}')});
wait_received($sink_a, 1);
my $locker = $node->background_psql('postgres');
$locker->query_safe(qq{BEGIN; SELECT 1 FROM idempotency.deliveries WHERE event_id = '$e1' FOR UPDATE});
$sink_a->release;
# Its answer comes while its row is held; then another event.
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
until (grep { $_->{what} eq 'answered' && $_->{id} eq $e1 } $sink_a->entries)
{
	last if time() > $deadline;
	sleep 0.05;
}
my $e2 = q1(q{SELECT idem_publish('held.x', '{"n": 2}')});
$node->poll_query_until('postgres',
	"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e2'")
  or fail('the second event was not delivered while the first row was held');
is(q1("SELECT state || ' ' || (visible_until IS NOT NULL) FROM idempotency.deliveries WHERE event_id = '$e1'"),
	'pending true', 'A: the held outcome is not recorded yet, and another delivery went on');
$locker->query_safe('COMMIT');
$locker->quit;
$node->poll_query_until('postgres',
	"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e1'")
  or fail('the held outcome was not recorded once the row was free');
is(scalar(grep { $_ eq $e1 } $sink_a->accepted), 1, 'A: then recorded, and sent once');

# ---- B. One probe at a time while the loop renews the probe's claim.
my $sink_b = new_sink();
$sink_b->set_mode('500');
create_dest('down', $sink_b,
	'{"failure_threshold": 1, "timeout": "20s", "backoff_base": "1s", "backoff_cap": "1s",
	  "max_attempts": 100}');
q1(q{CREATE FUNCTION gate(event jsonb) RETURNS void LANGUAGE sql
	  AS $$ SELECT pg_advisory_xact_lock(4242) $$});
q1(q{SELECT idem_destination_create('gated', 'function', 'gate(jsonb)', '{gated.*}',
	'{"timeout": "600s"}')});
q1(q{SELECT idem_publish('down.x', '{}', 'k0')});
$node->poll_query_until('postgres', q{SELECT circuit = 'open' FROM idem_outbox_stats WHERE destination = 'down'})
  or fail('the circuit did not open');
$sink_b->clear_log;
$sink_b->hold(500);
q1(q{SELECT idem_publish('down.x', jsonb_build_object('n', n), 'k' || n) FROM generate_series(1, 3) n});
wait_received($sink_b, 1);
pass('B: the circuit is open and a probe is in flight');

# The worker goes into a function call that waits for the gate.
my $gate = $node->background_psql('postgres');
$gate->query_safe('SELECT pg_advisory_lock(4242)');
my $pid = worker_pid();
q1(q{SELECT idem_publish('gated.x', '{}')});
$node->poll_query_until('postgres',
	"SELECT wait_event = 'advisory' FROM pg_stat_activity WHERE pid = $pid")
  or fail('the worker never reached the gate');
$node->poll_query_until('postgres', q{
	SELECT next_probe_at < now() FROM idempotency.destinations WHERE name = 'down'})
  or fail('next_probe_at never passed');
is(q1(q{SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		   ON t.id = d.destination_id
		 WHERE t.name = 'down' AND d.state = 'pending' AND d.visible_until > now()}),
	'1', 'B: next_probe_at has passed, the probe is still claimed (renewed)');
is(q1('SELECT idem_outbox_relay()'), '0', 'B: another relay attempts nothing meanwhile');
is(scalar($sink_b->received), 1, 'B: no second probe reached the endpoint');
$gate->query_safe('SELECT pg_advisory_unlock(4242)');
$gate->quit;
$sink_b->release;
q1(q{SELECT idem_destination_pause('down')});

# ---- C. A probe interrupted by a crash uses no attempt.
my $sink_c = new_sink();
$sink_c->set_mode('500');
create_dest('crash', $sink_c,
	'{"failure_threshold": 1, "timeout": "5s", "backoff_base": "1s", "backoff_cap": "1s",
	  "max_attempts": 2}');
my $d = q1(q{SELECT idem_publish('crash.x', '{}')});
$node->poll_query_until('postgres', qq{
	SELECT t.circuit = 'open' AND d.attempts = 1 AND d.visible_until IS NULL
	  FROM idempotency.destinations t JOIN idempotency.deliveries d ON d.destination_id = t.id
	 WHERE t.name = 'crash' AND d.event_id = '$d'})
  or fail('the first failure did not open the circuit');
$sink_c->hold(500);
wait_received($sink_c, 2);
is(q1("SELECT state || ' ' || attempts || ' ' || (visible_until > now()) FROM idempotency.deliveries WHERE event_id = '$d'"),
	'pending 1 true', 'C: the probe is claimed, its attempt given back');
$pid = worker_pid();
my $offset = log_offset($node);
kill 'KILL', $pid;
wait_for_crash_recovery($node, $offset);
$sink_c->set_mode('204');
$sink_c->release;
$node->poll_query_until('postgres',
	"SELECT state <> 'pending' FROM idempotency.deliveries WHERE event_id = '$d'")
  or fail('the interrupted probe was not taken again');
is(q1("SELECT state || ' ' || attempts FROM idempotency.deliveries WHERE event_id = '$d'"),
	'delivered 2', 'C: probed again and delivered, not dead: the first failure and the success');
is(q1(q{SELECT circuit FROM idem_outbox_stats WHERE destination = 'crash'}), 'closed',
	'C: the circuit closed');

$_->stop for ($sink_a, $sink_b, $sink_c);
$node->stop;
done_testing();
