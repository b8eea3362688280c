# Review of issue 11: the endpoint state's row lock lets one transaction
# stall the worker's relay for every destination.
#
# Recording a failed webhook now locks its destination's row FOR UPDATE
# (relay_endpoint_states, in the loop's record transaction).  Whoever holds
# that row -- a caller of idem_outbox_relay() in a longer transaction (its
# pass records failures the same way, and keeps the lock until its
# transaction ends), or an idem_destination_alter() / pause() in an open
# transaction -- makes the worker wait on the lock, and while it waits its
# loop does nothing at all: no other destination's webhook is claimed, sent
# or recorded, and no function or notify delivery is made.  Before 1.3 the
# relay locked a destination row only to disable it on 410 Gone.
#
# A session alters the failing endpoint's destination in a transaction and
# stays in it, holding the row as a pass of idem_outbox_relay() that
# recorded a failure would (the test first used such a pass, over an event
# the session had published in the same transaction; a pass is refused in
# a transaction that published since).  The worker then records a failure
# of the same endpoint and must not wait; events to a healthy endpoint and
# to a function destination, published meanwhile, must still be delivered.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('review_dest_lock', worker => 1);

my $healthy = start_sink();
my $failing = start_sink();
$failing->set_mode('500');

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE received (event_id uuid);
	CREATE FUNCTION receive(event jsonb) RETURNS void LANGUAGE sql
		AS $$ INSERT INTO received VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('failing', 'http', '%s', '{failing.*}',
		jsonb_build_object('secret', '%s', 'failure_threshold', 1000, 'max_attempts', 1000,
			'backoff_base', '100ms', 'backoff_cap', '100ms'));
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s'));
	SELECT idem_destination_create('fn', 'function', 'receive(jsonb)', '{local.*}');},
	$failing->url, $SECRET, $healthy->url, $SECRET));

# The session holds the destination's row (the same options: the worker's
# view of the destination does not change).
my $app = $node->background_psql('postgres', on_error_stop => 0);
$app->query_safe('BEGIN');
$app->query_safe(sprintf(q{SELECT idem_destination_alter('failing',
	jsonb_build_object('secret', '%s', 'failure_threshold', 1000, 'max_attempts', 1000,
		'backoff_base', '100ms', 'backoff_cap', '100ms'))}, $SECRET));
my ($rc, $out, $err) = $node->psql('postgres',
	q{SELECT FROM idempotency.destinations WHERE name = 'failing' FOR UPDATE NOWAIT});
like($err, qr/could not obtain lock on row/, 'the session holds the destination row in an open transaction');

# A committed event to the same endpoint: the worker sends it, it fails, and
# recording it waits for the session.
my $failed = $node->safe_psql('postgres', q{SELECT idem_publish('failing.x', '{}')});
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
until (grep { $_->{what} eq 'answered' && $_->{id} eq $failed } $failing->entries)
{
	die 'the worker never sent the failing event' if time() > $deadline;
	sleep 0.05;
}
pass('the worker has sent the committed failing event, and got its 500');

# Other destinations' events, published now.
my @ids;
push @ids, $node->safe_psql('postgres', "SELECT idem_publish('healthy.x', jsonb_build_object('n', $_))")
  for 1 .. 3;
$node->safe_psql('postgres', q{SELECT idem_publish('local.x', '{}')});

# The healthy deliveries take milliseconds; give them far more.
$deadline = time() + 20;
my ($webhooks, $local);
while (time() < $deadline)
{
	my %got = map { $_ => 1 } $healthy->accepted;
	$webhooks = scalar(grep { $got{$_} } @ids);
	$local = $node->safe_psql('postgres', 'SELECT count(*) FROM received');
	last if $webhooks == 3 && $local == 1;
	sleep 0.1;
}
my $still_waiting = $node->safe_psql('postgres', q{
	SELECT count(*) FROM pg_stat_activity
	 WHERE application_name = 'idempotency cleanup' AND wait_event_type = 'Lock'});
diag("after 20 s: healthy webhooks $webhooks of 3, function deliveries $local of 1, worker waiting on a lock: $still_waiting");
is($webhooks, 3, 'the healthy destination\'s webhooks are delivered while one destination\'s row is locked');
is($local, '1', 'so is the function destination\'s event');

$app->query_safe('COMMIT');
$app->quit;
$node->poll_query_until('postgres', 'SELECT count(*) = 1 FROM received')
  or die 'the function delivery was never made';
pass('once the session commits, the worker goes on');

$healthy->stop;
$failing->stop;
$node->stop;
done_testing();
