# A delivery row that another session holds must not stall the worker's
# relay for every destination.
#
# While a webhook is in flight, the worker renews its claim (so that other
# relays leave it alone) once half of the claim's window has passed.  The
# renewal updated the row and so waited, without limit, for any session
# that held it -- an operator's SELECT ... FOR UPDATE on
# idempotency.deliveries, say -- and while it waited its loop claimed,
# sent and recorded nothing for any destination.  Renewal now passes over a
# row that is held (the webhook is not sent if it has not been, and its
# claim runs out: it is claimed again later).
#
# A slow endpoint keeps one webhook in flight past its renewal time while a
# session holds that delivery's row; events to a healthy endpoint and to a
# function destination, published meanwhile, must still be delivered.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

# A claim's window is the margin plus the destination's timeout: 1 s + 4 s,
# renewed 2.5 s after the claim.
my $node = start_outbox_node('held_delivery_row', worker => 1, conf => q{
idempotency.relay_visibility_margin = '1s'
});

my $healthy = start_sink();
my $slow = start_sink();
$slow->set_mode('sleep 3.5 204');

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE received (event_id uuid);
	CREATE FUNCTION receive(event jsonb) RETURNS void LANGUAGE sql
		AS $$ INSERT INTO received VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('slow', 'http', '%s', '{slow.*}',
		jsonb_build_object('secret', '%s', 'timeout', '4s'));
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s'));
	SELECT idem_destination_create('fn', 'function', 'receive(jsonb)', '{local.*}');},
	$slow->url, $SECRET, $healthy->url, $SECRET));

# The slow webhook goes out; then a session takes its row.
my $held = $node->safe_psql('postgres', q{SELECT idem_publish('slow.x', '{}')});
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
until (grep { $_->{what} eq 'received' && $_->{id} eq $held } $slow->entries)
{
	die 'the worker never sent the slow event' if time() > $deadline;
	sleep 0.05;
}
my $claimed_at = time();
my $app = $node->background_psql('postgres', on_error_stop => 0);
$app->query_safe('BEGIN');
is($app->query_safe(qq{SELECT event_id FROM idempotency.deliveries
	WHERE event_id = '$held' FOR UPDATE}), $held, 'a session holds the in-flight delivery\'s row');

# Past the renewal time (2.5 s after the claim, the request still in flight).
sleep(3 - (time() - $claimed_at)) if time() - $claimed_at < 3;

my @ids;
push @ids, $node->safe_psql('postgres', "SELECT idem_publish('healthy.x', jsonb_build_object('n', $_))")
  for 1 .. 3;
$node->safe_psql('postgres', q{SELECT idem_publish('local.x', '{}')});

# They take milliseconds; the session holds the row for longer.
$deadline = time() + 2.5;
my ($webhooks, $local);
while (time() < $deadline)
{
	my %got = map { $_ => 1 } $healthy->accepted;
	$webhooks = scalar(grep { $got{$_} } @ids);
	$local = $node->safe_psql('postgres', 'SELECT count(*) FROM received');
	last if $webhooks == 3 && $local == 1;
	sleep 0.1;
}
# Recording an outcome may wait up to 100 ms for a row (its lock_timeout),
# never longer: within a second the worker is seen not waiting.
my $waiting;
for (1 .. 10)
{
	$waiting = $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_stat_activity
		 WHERE backend_type = 'idempotency cleanup' AND wait_event_type = 'Lock'});
	last if $waiting eq '0';
	sleep 0.1;
}
diag("healthy webhooks $webhooks of 3, function deliveries $local of 1, worker waiting on a lock: $waiting");
is($webhooks, 3, 'the healthy destination\'s webhooks are delivered while a delivery row is held');
is($local, '1', 'so is the function destination\'s event');
is($waiting, '0', 'the worker is not waiting for the row');

# The slow webhook's answer has come (3.5 s), and its outcome cannot be
# recorded while the row is held.  Once its claim has run out (at 7.5 s,
# as renewed at 2.5 s), the loop must not claim that delivery again while
# its outcome waits -- and used to claim nothing at all for any destination
# until the outcome was recorded.  Only the slow destination waits now.
sleep(9 - (time() - $claimed_at)) if time() - $claimed_at < 9;
my @later;
push @later, $node->safe_psql('postgres', "SELECT idem_publish('healthy.later', jsonb_build_object('n', $_))")
  for 1 .. 3;
$node->safe_psql('postgres', q{SELECT idem_publish('local.later', '{}')});
$deadline = time() + 10;
while (time() < $deadline)
{
	my %got = map { $_ => 1 } $healthy->accepted;
	$webhooks = scalar(grep { $got{$_} } @later);
	$local = $node->safe_psql('postgres', 'SELECT count(*) FROM received');
	last if $webhooks == 3 && $local == 2;
	sleep 0.1;
}
diag("after the held claim ran out: healthy webhooks $webhooks of 3, function deliveries $local of 2");
is($webhooks, 3, 'after the held delivery\'s claim ran out, the healthy webhooks still go');
is($local, '2', 'so do function deliveries');
is(scalar(grep { $_->{what} eq 'received' && $_->{id} eq $held } $slow->entries), 1,
	'the held delivery is not sent again while its outcome waits');

# Once the session lets go, the outcome is recorded.
$app->query_safe('COMMIT');
$app->quit;
$node->poll_query_until('postgres', qq{
	SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$held'})
  or die 'the slow delivery was never recorded';
pass('the held delivery is delivered once its row is free');

$healthy->stop;
$slow->stop;
$node->stop;
done_testing();
