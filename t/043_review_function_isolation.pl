# Review of issue 11: a slow function destination holds up the worker's
# whole relay loop.
#
# relay_loop_claim() makes the function and notify deliveries it claimed in
# one transaction, one call after the other, before it returns to the loop:
# while a destination function takes its time (up to its timeout, per
# event, for a whole batch), no webhook is claimed, sent or recorded, the
# requests already in flight are not driven (curl_multi_perform is not
# called), and the claims of those requests are not renewed.
#
# 1. Isolation: a function destination that takes 3 s per event gets 5
#    events; while the worker is in its first call, 5 events are published
#    to a healthy 'http' destination.  They must be received long before the
#    function's batch is over (15 s later), as the contract asks of every
#    destination ("requests to different destinations are independent").
#    A call that has begun runs to its end in the worker's backend (its
#    destination's timeout bounds it): the loop makes function deliveries in
#    slices of about 100 ms, so the webhooks go once the first call is over,
#    before the second ends -- at most two of the five function deliveries
#    are made by then.
#
# 2. A duplicate without any crash: a webhook claimed in the same iteration
#    as a slow function batch has a visibility deadline of its destination's
#    timeout plus the margin (1 s + 1 s here); the batch outlasts it, a
#    second relay (idem_outbox_relay(), as README allows) takes the delivery
#    and sends it, and the worker, once the batch is done, sends it again.
#    README promises renewals "so no other relay takes them while it runs".
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('review_fn_isolation', worker => 1, conf => q{
idempotency.relay_visibility_margin = '1s'
});

my $sink = start_sink();

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE calls (event_id uuid, at timestamptz DEFAULT clock_timestamp());
	CREATE FUNCTION slow(event jsonb) RETURNS void LANGUAGE sql
		AS $$ SELECT pg_sleep(3); INSERT INTO calls (event_id) VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('slowfn', 'function', 'slow(jsonb)', '{fn.*}');
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s', 'timeout', '1s'));},
	$sink->url, $SECRET));

sub q1 { return $node->safe_psql('postgres', $_[0]); }

sub worker_sleeping
{
	$node->poll_query_until('postgres', q{
		SELECT count(*) >= 1 FROM pg_stat_activity
		 WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()})
	  or die 'the relay never called the function';
}

sub fn_delivered
{
	return q1(q{SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t
		ON t.id = d.destination_id WHERE t.name = 'slowfn' AND d.state = 'delivered'});
}

# ---- 1. Isolation.
q1(q{SELECT idem_publish('fn.x', jsonb_build_object('n', n)) FROM generate_series(1, 5) n});
worker_sleeping();
my %published;
for my $n (1 .. 5)
{
	my $id = q1("SELECT idem_publish('healthy.x', jsonb_build_object('n', $n))");
	$published{$id} = time();
}
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
my ($received, $fn_done);
while (time() < $deadline)
{
	$fn_done = fn_delivered();
	$received = scalar(grep { $published{$_} } $sink->accepted);
	last if $received == 5 || $fn_done > 2;
	sleep 0.05;
}
diag("healthy webhooks received $received of 5, function deliveries done $fn_done of 5");
is($received, 5, 'the healthy webhooks were all received ...');
cmp_ok($fn_done, '<=', 2, '... while the slow function destination was still at work (one call in, at most two)');
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'})
  or die 'the deliveries were not all made';
my %first;
for my $e ($sink->entries)
{
	$first{ $e->{id} } //= $e->{time} if $e->{what} eq 'received';
}
my $last_call = q1(q{SELECT extract(epoch FROM max(at)) FROM calls});
my @after = grep { $first{$_} > $last_call - 0.5 } keys %published;
diag(sprintf('%d of the 5 healthy webhooks were first received after the function batch ended',
		scalar @after));

# ---- 2. No duplicate: the webhook's claim outlasts the function batch.
# Claimed with the batch, its visibility deadline is its destination's
# timeout plus the margin (2 s); the loop renews the claims it holds before
# each slice of function calls, to outlast the slice, so no other relay
# takes it while the batch (15 s) runs.
$sink->clear_log;
# One transaction: the worker claims them in one iteration.
my $hook = q1(q{
	WITH f AS (SELECT idem_publish('fn.x', jsonb_build_object('n', n)) FROM generate_series(6, 10) n)
	SELECT idem_publish('healthy.y', '{}') FROM (SELECT count(*) FROM f) c});
worker_sleeping();
# Past the deadline the claim was made with, the worker still in the batch.
$node->poll_query_until('postgres', qq{
	SELECT now() > last_attempt_at + interval '2.5 s' FROM idempotency.deliveries
	 WHERE event_id = '$hook' AND attempts = 1})
  or die 'the webhook was not claimed by the worker';
my $worker_busy = q1(q{
	SELECT count(*) >= 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()});
is($worker_busy, 't', 'the function batch is still under way past the webhook\'s first deadline');
is(q1(qq{SELECT state = 'delivered' OR visible_until > now() FROM idempotency.deliveries
	WHERE event_id = '$hook'}), 't', 'its claim was renewed (or it is delivered)');
my $taken = q1('SELECT idem_outbox_relay()');
diag("a second relay (idem_outbox_relay) attempted $taken deliveries");
$node->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'})
  or die 'the deliveries were not all made';
# The worker's copy goes once its batch is over: wait for the function batch
# to end and the loop to have driven its requests (its delivery is recorded
# or refused by now), then count.
$deadline = time() + 10;
my $receipts;
while (time() < $deadline)
{
	$receipts = scalar(grep { $_->{what} eq 'received' && $_->{id} eq $hook } $sink->entries);
	last if $receipts > 1;
	sleep 0.1;
}
is($receipts, 1, "the webhook was sent once, with no crash anywhere (sent $receipts times)");
is(q1(qq{SELECT claims FROM idempotency.deliveries WHERE event_id = '$hook'}), '1',
	'claimed once');

$sink->stop;
$node->stop;
done_testing();
