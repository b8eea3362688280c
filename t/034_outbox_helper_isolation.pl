# Relay helpers (idempotency.relay_workers > 1) run the worker's relay loop:
# a slow endpoint holds up only its own deliveries in a helper too.
#
# A backlog of a function destination whose calls take 20 ms (a full batch
# of relay_batch_size 1 each time) starts a helper and keeps it busy.  The
# worker is then kept away: a function destination's function waits on an
# advisory lock that the test holds, when the worker (not a helper) runs it.
# Then one event goes to a slow endpoint (it answers after 60 s): only the
# helper can take it.  20 events are published to a healthy endpoint: only
# the helper can deliver them, and it must do so while its own slow request
# is under way.  A helper that ran whole passes (claim, send, wait for every
# answer, record) sat in its slow request and delivered none of them before
# the slow endpoint answered.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $SLOW_S = 60;

my $node = start_outbox_node('helper_isolation', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
idempotency.relay_workers = 2
idempotency.relay_batch_size = 1
});

my $healthy = start_sink();
my $slow = start_sink();
$slow->set_mode("sleep $SLOW_S 204");

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE gated (event_id uuid, pid int);
	-- Run by the worker, the function waits for the test's advisory lock;
	-- run by a helper, it returns at once.
	CREATE FUNCTION gate(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		IF (SELECT backend_type FROM pg_stat_activity WHERE pid = pg_backend_pid())
		   = 'idempotency cleanup' THEN
			PERFORM pg_advisory_lock(4242);
			PERFORM pg_advisory_unlock(4242);
		END IF;
		INSERT INTO gated VALUES ((event->>'id')::uuid, pg_backend_pid());
	END $$;
	CREATE FUNCTION busy(event jsonb) RETURNS void LANGUAGE sql AS $$ SELECT pg_sleep(0.02) $$;
	SELECT idem_destination_create('slow', 'http', '%s', '{slow.*}',
		jsonb_build_object('secret', '%s', 'timeout', '120s', 'max_in_flight', 1));
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s', 'timeout', '120s'));
	SELECT idem_destination_create('gate', 'function', 'gate(jsonb)', '{gate.*}',
		jsonb_build_object('timeout', '120s'));
	SELECT idem_destination_create('busy', 'function', 'busy(jsonb)', '{busy.*}',
		jsonb_build_object('timeout', '120s'));},
	$slow->url, $SECRET, $healthy->url, $SECRET));

# The busy backlog (some 60 s of calls for one process) starts a helper.
$node->safe_psql('postgres',
	q{SELECT count(idem_publish('busy.x', jsonb_build_object('n', n))) FROM generate_series(1, 3000) n});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency relay'})
  or die 'no relay helper started for the backlog';
pass('a relay helper runs');

# Keep the worker busy in the gate function.  Whichever relay claims a gate
# event first runs it; a helper returns at once, so publish until the worker
# is the one waiting.
my $lock = $node->background_psql('postgres');
$lock->query_safe('SELECT pg_advisory_lock(4242)');
my $worker_waits = q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE backend_type = 'idempotency cleanup' AND wait_event_type = 'Lock' AND wait_event = 'advisory'};
my $blocked = 0;
for my $try (1 .. 20)
{
	my $id = $node->safe_psql('postgres', "SELECT idem_publish('gate.x', '{}')");
	$node->poll_query_until('postgres', qq{
		SELECT ($worker_waits) OR EXISTS (SELECT FROM gated WHERE event_id = '$id')})
	  or die 'the gate event was neither run by a helper nor waited on by the worker';
	$blocked = $node->safe_psql('postgres', $worker_waits) eq 't';
	last if $blocked;
}
ok($blocked, 'the worker waits in the gate function');

# Only the helper can take the slow event now.
$node->safe_psql('postgres', q{SELECT idem_publish('slow.x', '{}')});
my $slow_started = time();
my $waited = 0;
until (scalar(grep { $_->{what} eq 'received' } $slow->entries) >= 1)
{
	die 'the slow endpoint got no request' if $waited++ > 1200;
	sleep 0.05;
}
is($node->safe_psql('postgres', $worker_waits), 't', 'the helper took the slow request, the worker waits');

# Only the helper can deliver these now, next to its slow request.
my %published;
for my $n (1 .. 20)
{
	my $t0 = time();
	my $id = $node->safe_psql('postgres',
		"SELECT idem_publish('healthy.x', jsonb_build_object('n', $n), 'h-$n')");
	$published{$id} = $t0;
}
until (scalar(grep { $published{$_} } $healthy->accepted) >= 20)
{
	last if time() > $slow_started + $SLOW_S - 5;
	sleep 0.05;
}
my %received;
for my $e ($healthy->entries)
{
	$received{ $e->{id} } //= $e->{time} if $e->{what} eq 'received';
}
is(scalar(grep { defined $received{$_} } keys %published), 20,
	'the helper delivered all 20 healthy webhooks');
is(scalar(grep { $_->{what} eq 'answered' } $slow->entries), 0,
	'while its slow request (and the worker\'s) was still under way');
is($node->safe_psql('postgres', $worker_waits), 't', 'and the worker still waited in the gate function');
my @lat = sort { $a <=> $b } map { $received{$_} - $published{$_} } grep { defined $received{$_} } keys %published;
diag(sprintf('healthy latency publish -> receipt via the helper: median %.3f s, max %.3f s',
		$lat[int(@lat / 2)] // -1, $lat[-1] // -1));

$lock->query_safe('SELECT pg_advisory_unlock(4242)');
$lock->quit;
$healthy->stop;
$slow->stop;
$node->stop;
done_testing();
