# kill -9 of the relay in the middle of a batch.
#
# HTTP: the relay (SELECT idem_outbox_relay() in a session of its own) has
# ten webhooks in flight to a sink that takes three seconds to answer when
# its backend is killed with SIGKILL; the server goes through crash recovery.
# The relay's claims were in its transaction, so they roll back and every
# delivery is pending again.  Delivering everything afterwards shows that
# nothing is lost and that the only duplicates (webhook-ids the sink accepted
# twice) are exactly the ten requests that were in flight, counted.
#
# Function: the relay is killed while a destination function is running in
# the middle of a batch, after it has written earlier events of the batch.
# The calls and the marks "delivered" commit or vanish together, so after
# recovery the sink table has no row, and after the next passes exactly one
# row per event: exactly once across a crash.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('main', conf => q{
restart_after_crash = on
});

my $sink = start_sink();

sub relay_until_done
{
	my $deadline = time() + 30;
	while (time() < $deadline)
	{
		$node->safe_psql('postgres', 'SELECT idem_outbox_relay()');
		return 1 if $node->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'") eq '0';
		sleep 0.05;
	}
	return 0;
}

# Start a relay pass in a session of its own and return (session, pid).
sub start_relay
{
	my ($setup) = @_;
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	$s->query_safe($setup) if $setup;
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	chomp $pid;
	$s->query_until(qr/relaying/, "\\echo relaying\nSELECT idem_outbox_relay(30);\n");
	return ($s, $pid);
}

# SIGKILL a backend and wait until the server has gone through crash recovery.
sub crash
{
	my ($session, $pid) = @_;
	my $offset = log_offset($node);
	kill 'KILL', $pid;
	$session->{run}->kill_kill;
	wait_for_crash_recovery($node, $offset);
}

# ---- HTTP: ten in flight when the relay dies.
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('hook', 'http', '%s', '{*}',
		jsonb_build_object('secret', '%s', 'timeout', '20s'))}, $sink->url, $SECRET));
my @ids = split /\n/, $node->safe_psql('postgres',
	q{SELECT idem_publish('order.created', jsonb_build_object('n', n)) FROM generate_series(1, 30) n});
is(scalar(@ids), 30, '30 events published');

$sink->set_mode('sleep 3 204');
my ($relay, $pid) = start_relay('SET idempotency.relay_max_in_flight = 10');
my $deadline = time() + 20;
sleep 0.05 while time() < $deadline && (grep { $_->{what} eq 'received' } $sink->entries) < 10;
my @in_flight = map { $_->{id} } grep { $_->{what} eq 'received' } $sink->entries;
is(scalar(@in_flight), 10, 'ten requests in flight (idempotency.relay_max_in_flight)');
is(scalar(grep { $_->{what} eq 'answered' } $sink->entries), 0, 'none answered yet');
crash($relay, $pid);
ok($node->log_contains('terminated by signal 9'), 'the relay was killed and the server recovered');

is( $node->safe_psql('postgres', q{
		SELECT state || ' ' || attempts || ' ' || count(*) FROM idempotency.deliveries GROUP BY state, attempts}),
	'pending 0 30', "the killed relay's claims rolled back with its transaction: all 30 pending");

# The sink answers the abandoned requests (to closed connections) and from
# now on at once.
sleep 3.2;
$sink->set_mode('204');
ok(relay_until_done(), 'after recovery, the relay delivers everything');

my %accepted;
$accepted{$_}++ for $sink->accepted;
is(scalar(grep { $accepted{$_} } @ids), 30, 'nothing lost: every event accepted');
my @dups = sort grep { $accepted{$_} > 1 } keys %accepted;
is_deeply(\@dups, [ sort @in_flight ], 'the duplicates are exactly the requests in flight at the crash');
is(scalar(@dups), 10, 'counted: 10 duplicates');
ok(!(grep { $_ > 2 } values %accepted), 'none was accepted more than twice');
is($node->safe_psql('postgres', "SELECT delivered FROM idem_outbox_stats WHERE destination = 'hook'"),
	'30', 'the relay counts each delivery once');
$node->safe_psql('postgres', "SELECT idem_destination_drop('hook')");

# ---- Function: killed while a call in the middle of the batch runs.
$node->safe_psql('postgres', q{
	CREATE TABLE fsink (event_id uuid, n int);      -- no unique key: a repeat would show
	CREATE TABLE stall (on_n int);
	INSERT INTO stall VALUES (10);
	CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
	BEGIN
		INSERT INTO fsink VALUES ((event->>'id')::uuid, (event->'payload'->>'n')::int);
		IF (event->'payload'->>'n')::int = (SELECT on_n FROM stall) THEN
			PERFORM pg_sleep(60);
		END IF;
	END $$;
	SELECT idem_destination_create('fn', 'function', 'fdest(jsonb)');
});
@ids = split /\n/, $node->safe_psql('postgres',
	q{SELECT idem_publish('order.created', jsonb_build_object('n', n)) FROM generate_series(1, 20) n});
($relay, $pid) = start_relay();
$node->poll_query_until('postgres',
	"SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $pid AND wait_event = 'PgSleep'")
  or die 'the destination function never started sleeping';
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%idem_outbox_relay%' AND wait_event = 'PgSleep'}),
	'1', 'the relay is inside the tenth call of its batch');
crash($relay, $pid);
is($node->safe_psql('postgres', 'SELECT count(*) FROM fsink'), '0',
	'after the crash, the nine earlier calls left nothing behind');
is( $node->safe_psql('postgres', q{
		SELECT state || ' ' || count(*) FROM idempotency.deliveries GROUP BY state}),
	'pending 20', 'and all 20 deliveries are pending');
$node->safe_psql('postgres', 'UPDATE stall SET on_n = NULL');
ok(relay_until_done(), 'the next passes deliver everything');
is( $node->safe_psql('postgres', q{SELECT count(*) || ' ' || count(DISTINCT event_id) FROM fsink}),
	'20 20', 'exactly one row per event');
is( $node->safe_psql('postgres',
		"SELECT count(*) FROM fsink WHERE event_id NOT IN ('" . join("','", @ids) . "')"),
	'0', 'and only the published events');

$sink->stop;
$node->stop;
done_testing();
