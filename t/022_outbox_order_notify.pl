# Per-key order while publishers write concurrently, and a NOTIFY consumer.
#
# pgbench publishes keyed events from four connections, 100 transactions a
# second in all (some publish two events of the same key), while the test
# runs relay passes; for
# a while the webhook sink answers 500, so deliveries are retried with
# backoff in the middle of the stream.  For every key, the order in which the
# sink accepted the events and the order in which a function destination
# received them is the publish order (seq), and every event arrives once.
#
# A session that LISTENs on a 'notify' destination's channel receives small
# events as their envelope and events too large for NOTIFY as a reference,
# which it reads back with idem_outbox_event().
#
# A transaction that keeps a key's publishing lock holds the other
# publishers of that key for idempotency.wait_timeout at most.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IPC::Run;
use JSON::PP;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('main');

my $sink = start_sink();

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE fsink (n bigserial PRIMARY KEY, event_id uuid, key text);
	CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE sql AS $$
		INSERT INTO fsink (event_id, key) VALUES ((event->>'id')::uuid, event->>'key')
	$$;
	SELECT idem_destination_create('fn', 'function', 'fdest(jsonb)', '{order.*}');
	SELECT idem_destination_create('hook', 'http', '%s', '{order.*}',
		jsonb_build_object('secret', '%s', 'backoff_base', '20ms', 'backoff_cap', '100ms',
			'max_attempts', 1000));}, $sink->url, $SECRET));

# ---- Per-key order under concurrent publishers.
my $dir = PostgreSQL::Test::Utils::tempdir();
my $script = "$dir/publish.sql";
open(my $fh, '>', $script) or die;
print $fh q{\set k random(1, 8)
\set two random(0, 1)
BEGIN;
SELECT idem_publish('order.step', jsonb_build_object('k', :k), 'key-' || :k, jsonb_build_object('x-event-key', 'key-' || :k, 'x-event-topic', 'order.step'));
SELECT idem_publish('order.step', jsonb_build_object('k', :k), 'key-' || :k, jsonb_build_object('x-event-key', 'key-' || :k, 'x-event-topic', 'order.step')) WHERE :two = 1;
COMMIT;
};
close $fh;
my ($out, $err) = ('', '');
my $pgbench = IPC::Run::start(
	[ 'pgbench', '-n', '-c', '4', '-j', '2', '-T', '4', '-R', '100', '-f', $script,
	  '-h', $node->host, '-p', $node->port, 'postgres' ],
	'>', \$out, '2>', \$err);

# The sink fails from the first second on, for a second and at least until
# a pass has had a webhook rescheduled (a loaded machine may run no pass in
# a given second).
my $t0 = time();
my $failing = 0;
my $failed = 0;
my $retried = q{SELECT retried FROM idem_outbox_stats WHERE destination = 'hook'};
while ($pgbench->pumpable)
{
	my $elapsed = time() - $t0;
	if (!$failing && !$failed && $elapsed > 1.0)
	{
		$sink->set_mode('500');
		$failing = 1;
	}
	$node->safe_psql('postgres', 'SELECT idem_outbox_relay(200)');
	if ($failing && time() - $t0 >= 2.0 && $node->safe_psql('postgres', $retried) > 0)
	{
		$sink->set_mode('204');
		($failing, $failed) = (0, 1);
	}
	$pgbench->pump_nb;
	sleep 0.01;
}
$pgbench->finish;
is($pgbench->result(0), 0, 'pgbench published without errors') or diag($err);
$sink->set_mode('204');
my $deadline = time() + 30;
while (time() < $deadline)
{
	$node->safe_psql('postgres', 'SELECT idem_outbox_relay()');
	last if $node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.deliveries WHERE state <> 'delivered'") eq '0';
	sleep 0.02;
}

my %seq;
my %key;
for my $row (split /\n/, $node->safe_psql('postgres', 'SELECT event_id, seq, key FROM idempotency.outbox'))
{
	my ($id, $s, $k) = split /\|/, $row;
	$seq{$id} = $s;
	$key{$id} = $k;
}
my $events = scalar(keys %seq);
cmp_ok($events, '>', 300, "$events events published concurrently");
is( $node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.deliveries WHERE state = 'delivered'}),
	2 * $events, 'all delivered to both destinations');
cmp_ok($node->safe_psql('postgres', q{SELECT retried FROM idem_outbox_stats WHERE destination = 'hook'}),
	'>', 0, 'webhooks were retried in the middle of the stream');

# Order per key as received, compared with seq.
sub in_order
{
	my (@ids) = @_;
	my %last;
	my $ok = 1;
	for my $id (@ids)
	{
		my $k = $key{$id};
		$ok = 0 if defined $last{$k} && $seq{$id} <= $last{$k};
		$last{$k} = $seq{$id};
	}
	return $ok;
}
my @accepted = $sink->accepted;
is(scalar(@accepted), $events, 'the sink accepted as many webhooks as there are events');
my %once;
$once{$_}++ for @accepted;
is(scalar(grep { $once{$_} == 1 } keys %seq), $events, 'each event exactly once');
ok(in_order(@accepted), 'webhooks of each key were accepted in publish order');
my @received = split /\n/, $node->safe_psql('postgres', 'SELECT event_id FROM fsink ORDER BY n');
is(scalar(@received), $events, 'the function destination got every event');
ok(in_order(@received), 'function calls of each key came in publish order');
my $keys_with_many = $node->safe_psql('postgres',
	q{SELECT count(*) FROM (SELECT key FROM idempotency.outbox GROUP BY key HAVING count(*) > 20) k});
is($keys_with_many, '8', 'each of the 8 keys had many events');

# ---- NOTIFY: small events as envelopes, large ones as references.
$node->safe_psql('postgres',
	q{SELECT idem_destination_create('chan', 'notify', 'shop_events', '{shop.*}')});
my $listener = $node->background_psql('postgres');
$listener->query_safe('LISTEN shop_events');
my $small = $node->safe_psql('postgres', q{SELECT idem_publish('shop.small', '{"size": "small"}', 'cart-1')});
my $large = $node->safe_psql('postgres',
	q{SELECT idem_publish('shop.large', jsonb_build_object('blob', repeat('y', 20000)), 'cart-1')});
# Same key: one pass takes both, and sends them in order.
is($node->safe_psql('postgres', 'SELECT idem_outbox_relay()'), '2', 'one pass sends both events of the key');
my $got = '';
$deadline = time() + 10;
while (time() < $deadline && ($got =~ tr/\n//) < 2)
{
	my $o = $listener->query_safe('SELECT 1');
	$got .= join("\n", grep { /Asynchronous notification/ } split /\n/, $o);
	$got .= "\n" if $got ne '' && $got !~ /\n$/;
	sleep 0.05;
}
my @payloads = map { /with payload "(.*)" received from server process/ ? decode_json($1) : () }
  split /\n/, $got;
is(scalar(@payloads), 2, 'the listener received two notifications');
is($payloads[0]{id}, $small, 'first the small event, under its event id');
is_deeply($payloads[0]{payload}, { size => 'small' }, 'with its payload');
is($payloads[0]{topic} . ' ' . $payloads[0]{key}, 'shop.small cart-1', 'topic and key');
is($payloads[1]{id}, $large, 'then the large event, under its event id');
ok($payloads[1]{reference} && !exists $payloads[1]{payload}, 'as a reference, without the payload');
is( $listener->query_safe("SELECT length(idem_outbox_event('$payloads[1]{id}')->'payload'->>'blob')"),
	'20000', 'which the consumer reads back in full');
$listener->quit;

# ---- Per-key order costs publishers of a key a wait for one another; a
# transaction that keeps the key's publishing lock (any role can publish)
# holds the others for at most idempotency.wait_timeout (or lock_timeout,
# if shorter), then they fail with 55P03 and a hint.
my $holder = $node->background_psql('postgres');
$holder->query_safe(q{BEGIN; SELECT idem_publish('shop.held', '{}', 'held-key')});
my ($timed_out, $stdout, $stderr);
my $ret = $node->psql('postgres', q{
	\set VERBOSITY verbose
	SET idempotency.wait_timeout = '200ms';
	SELECT idem_publish('shop.held', '{"n": 2}', 'held-key');},
	stdout => \$stdout, stderr => \$stderr,
	timeout => $PostgreSQL::Test::Utils::timeout_default, timed_out => \$timed_out);
ok(!$timed_out, 'a publisher of the same key does not wait as long as the holder stays open');
isnt($ret, 0, 'it fails');
like($stderr, qr/ERROR:  55P03: could not lock event key "held-key" for publishing/, 'with 55P03');
like($stderr, qr/DETAIL:  Another transaction has held it for longer than idempotency\.wait_timeout \(200 ms\)\./,
	'saying why');
like($stderr, qr/HINT:  Retry once that transaction has ended\./, 'and what to do');
$ret = $node->psql('postgres', q{
	\set VERBOSITY verbose
	SET idempotency.wait_timeout = '10s';
	SET lock_timeout = '100ms';
	SELECT idem_publish('shop.held', '{"n": 3}', 'held-key');},
	stdout => \$stdout, stderr => \$stderr,
	timeout => $PostgreSQL::Test::Utils::timeout_default, timed_out => \$timed_out);
like($stderr, qr/ERROR:  55P03: canceling statement due to lock timeout/,
	'a shorter lock_timeout of the waiter applies as usual');
is($node->safe_psql('postgres', q{SELECT idem_publish('shop.free', '{}', 'other-key') IS NOT NULL}),
	't', 'publishers of other keys are not held up');
$holder->query_safe('COMMIT');
$holder->quit;
is($node->safe_psql('postgres', q{SELECT idem_publish('shop.held', '{"n": 4}', 'held-key') IS NOT NULL}),
	't', 'once the holder has committed, the key is free');

$sink->stop;
$node->stop;
done_testing();
