# Webhook delivery ('http' destinations) to a real HTTP server on loopback
# (t/WebhookSink.pm), which verifies every signature as the Standard Webhooks
# specification says and records every webhook-id it accepts:
#
#  - a relay's later passes reuse its kept-alive connections, and a receiver
#    slower than the destination's timeout makes the attempt fail;
#  - each event is delivered once, signed, with its webhook-id, the
#    destination's extra headers and the event's own headers; during a secret
#    rotation the receiver that knows only the new secret verifies it, and a
#    destination whose secret the receiver does not know is refused (401) and
#    retried, never counted as delivered;
#  - the sink is down for a while, then up: deliveries fail, are retried
#    with exponential backoff and full jitter (the schedule is checked against
#    the window of each attempt), and are delivered once it is back;
#  - the sink answers 500: dead letter after max_attempts, then a redrive
#    delivers it under the same webhook-id;
#  - the sink answers 410: the destination disables itself; resumed, it
#    delivers what accumulated.
#
# The relay is driven with SELECT idem_outbox_relay().  The destination
# "hook" has a failure_threshold high enough that its circuit never opens:
# this test is about each delivery's own retries (t/033 tests the circuit).
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $OLD_SECRET = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';
my $NEW_SECRET = 'whsec_c2VjcmV0LWtleS1udW1iZXItdHdvLTEyMzQ1Njc4';
my $UNKNOWN_SECRET = 'whsec_dW5rbm93bi10by10aGUtcmVjZWl2ZXItMTIzNA==';

my $node = start_outbox_node('main');

# The receiver knows only the new secret.
my $sink = start_sink($NEW_SECRET);

# Run relay passes until nothing is left to attempt now; returns the total.
sub relay_until_idle
{
	my $total = 0;
	for (1 .. 100)
	{
		my $n = $node->safe_psql('postgres', 'SELECT idem_outbox_relay()');
		last if $n == 0;
		$total += $n;
	}
	return $total;
}

sub publish
{
	my ($topic, $payload, $key) = @_;
	my $k = defined $key ? "'$key'" : 'NULL';
	my $kh = defined $key ? $key : '-';
	return $node->safe_psql('postgres',
		"SELECT idem_publish('$topic', '$payload', $k, "
		  . "jsonb_build_object('x-event-key', '$kh', 'x-event-topic', '$topic'))");
}

sub count_of { my %c; $c{$_}++ for @_; return \%c; }

# ---- Every event delivered once, signed; rotation; a refused signature.
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('hook', 'http', '%s', '{order.*}',
		jsonb_build_object('secrets', jsonb_build_array('%s', '%s'),
			'timeout', '2s', 'backoff_base', '100ms', 'backoff_cap', '400ms', 'max_attempts', 20,
			'failure_threshold', 1000,
			'headers', jsonb_build_object('x-destination', 'hook')));
	SELECT idem_destination_create('stranger', 'http', '%s', '{other.*}',
		jsonb_build_object('secret', '%s', 'backoff_base', '1ms', 'backoff_cap', '1ms',
			'max_attempts', 2));},
	$sink->url('/hook'), $OLD_SECRET, $NEW_SECRET, $sink->url('/stranger'), $UNKNOWN_SECRET));

my @ids = map { publish("order.created", qq({"order": $_}), "order-$_") } 1 .. 50;
is(relay_until_idle(), 50, 'the relay attempts each of the 50 events once');
my $accepted = count_of($sink->accepted);
is(scalar(grep { ($accepted->{$_} // 0) == 1 } @ids), 50, 'the sink accepted each webhook-id exactly once');
is(scalar(keys %$accepted), 50, 'and nothing else');
my @answered = grep { $_->{what} eq 'answered' } $sink->entries;
is(scalar(grep { $_->{verified} } @answered), 50,
	'every signature verified with the new secret alone (rotation: both are sent)');
is(scalar(grep { $_->{topic} eq 'order.created' && $_->{key} =~ /^order-\d+$/ } @answered), 50,
	'the event headers reached the receiver as HTTP headers');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(state || ':' || n, ',') FROM (
			SELECT state, count(*) AS n FROM idempotency.deliveries GROUP BY state) s}),
	'delivered:50', 'all 50 deliveries are recorded as delivered');
is( $node->safe_psql('postgres', q{
		SELECT delivered || ' ' || retried || ' ' || backlog FROM idem_outbox_stats WHERE destination = 'hook'}),
	'50 0 0', 'statistics: 50 delivered, no retry, no backlog');

$sink->clear_log;
my $stranger = publish('other.thing', '{}');
relay_until_idle();
sleep 0.05;
relay_until_idle();
my @refused = grep { $_->{what} eq 'answered' } $sink->entries;
is(scalar(@refused), 2, 'a destination signing with a secret the receiver does not know: two attempts');
ok(!(grep { $_->{verified} || $_->{status} != 401 } @refused), 'both refused as unverified (401)');
is( $node->safe_psql('postgres', "SELECT state || ' ' || last_status || ' ' || last_error FROM idempotency.deliveries WHERE event_id = '$stranger'"),
	'dead 401 HTTP status 401', 'and dead-lettered, not delivered');

# ---- Keep-alive: a relay's later passes reuse its connections.
$sink->clear_log;
my $relay = $node->background_psql('postgres');
$node->safe_psql('postgres', q{SELECT idem_publish('order.kept', jsonb_build_object('n', n)) FROM generate_series(1, 10) n});
is($relay->query_safe('SELECT idem_outbox_relay()'), '10', 'a first pass in a session');
my %first = map { $_->{conn} => 1 } grep { $_->{what} eq 'received' } $sink->entries;
$sink->clear_log;
$node->safe_psql('postgres', q{SELECT idem_publish('order.kept', jsonb_build_object('n', n)) FROM generate_series(11, 20) n});
is($relay->query_safe('SELECT idem_outbox_relay()'), '10', 'a second pass in the same session');
my @second = map { $_->{conn} } grep { $_->{what} eq 'received' } $sink->entries;
is(scalar(@second), 10, 'ten requests');
is(scalar(grep { !$first{$_} } @second), 0,
	'all on connections the first pass opened (' . scalar(keys %first) . ' of them)');
$relay->quit;

# ---- A receiver slower than the destination's timeout: a failed attempt.
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('impatient', 'http', '%s', '{slow.*}',
		jsonb_build_object('secret', '%s', 'timeout', '200ms', 'max_attempts', 1))},
	$sink->url('/slow'), $NEW_SECRET));
$sink->set_mode('sleep 1 204');
my $slow = publish('slow.thing', '{}');
my $t_slow = time();
relay_until_idle();
cmp_ok(time() - $t_slow, '<', 0.9, 'the relay gave up after the timeout, not the answer');
like($node->safe_psql('postgres', "SELECT state || ': ' || last_error FROM idempotency.deliveries WHERE event_id = '$slow'"),
	qr/^dead: .*(?i)timed? ?out/, 'the attempt failed with a timeout');
sleep 1.1;
$sink->set_mode('204');
$node->safe_psql('postgres', q{SELECT idem_destination_drop('impatient')});

# ---- The sink is down for a while, then up.
$sink->stop;
$sink->clear_log;
my @down = map { publish('order.updated', qq({"n": $_})) } 1 .. 5;
my %attempts;    # event id => { attempt number => [last_attempt_at, next_attempt_at, pass end] } (epoch)
my $t0 = time();
my $seen_attempt = 0;
# A second and a half, and on a loaded machine as long as it takes the
# events to reach their third attempt.
while (time() - $t0 < 1.5 || ($seen_attempt < 3 && time() - $t0 < 60))
{
	$node->safe_psql('postgres', 'SELECT idem_outbox_relay()');
	# No worker relays here: what the query finds recorded, this pass did,
	# before this moment.
	my $pass_end = time();
	for my $row (split /\n/, $node->safe_psql('postgres', q{
			SELECT event_id, attempts, extract(epoch FROM last_attempt_at), extract(epoch FROM next_attempt_at), state
			  FROM idempotency.deliveries WHERE state = 'pending' AND attempts > 0 AND visible_until IS NULL}))
	{
		my ($id, $n, $last, $next) = split /\|/, $row;
		$attempts{$id}{$n} //= [ $last, $next, $pass_end ];
		$seen_attempt = $n if $n > $seen_attempt;
	}
	sleep 0.02;
}
my $errors = $node->safe_psql('postgres',
	"SELECT DISTINCT last_error FROM idempotency.deliveries WHERE event_id IN ('" . join("','", @down) . "')");
like($errors, qr/(?i)connect/, "while the sink is down, attempts fail to connect: $errors");
# The delay runs from the failure, which the table does not keep: it lies
# between the attempt's claim (last_attempt_at) and the end of the pass that
# recorded it, however long a loaded machine made that pass.  So the next
# attempt is due no earlier than the claim and no later than the window
# after the pass's end (1 ms for the clocks' rounding).
my $max_attempt = 0;
my $window_ok = 1;
my $longest_late = 0;    # longest delay scheduled after attempt 3 or later
for my $id (@down)
{
	my $sched = $attempts{$id} // {};
	for my $n (sort { $a <=> $b } keys %$sched)
	{
		my ($last, $next, $pass_end) = @{ $sched->{$n} };
		my $delay = $next - $last;
		my $window = 0.1 * 2**($n - 1);
		$window = 0.4 if $window > 0.4;
		note(sprintf("event %s attempt %d claimed at +%.3fs, recorded by +%.3fs, next attempt after %.3fs (window %.1fs)",
				substr($id, 0, 13), $n, $last - $t0, $pass_end - $t0, $delay, $window));
		$window_ok = 0 if $next < $last || $next > $pass_end + $window + 0.001;
		$longest_late = $delay if $n >= 3 && $delay > $longest_late;
		$max_attempt = $n if $n > $max_attempt;
	}
}
ok($window_ok, 'every retry was scheduled within [0, min(cap, base * 2^(attempt-1))]');
cmp_ok($max_attempt, '>=', 3, "events were retried while the sink was down (up to attempt $max_attempt)");
cmp_ok($longest_late, '>', 0.15, 'later retries waited longer than the first window allows: the window grows');
is($node->safe_psql('postgres', "SELECT count(*) FROM idempotency.deliveries WHERE state = 'dead'") , '1',
	'none of them was dead-lettered (max_attempts 20; only the stranger is dead)');

$sink->start;
my $deadline = time() + 10;
while (time() < $deadline)
{
	relay_until_idle();
	last if $node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.deliveries WHERE state = 'pending'") eq '0';
	sleep 0.05;
}
$accepted = count_of($sink->accepted);
is(scalar(grep { ($accepted->{$_} // 0) == 1 } @down), 5, 'back up: each of the 5 events delivered once');
is( $node->safe_psql('postgres',
		"SELECT min(attempts) > 1 FROM idempotency.deliveries WHERE event_id IN ('" . join("','", @down) . "')"),
	't', 'each after more than one attempt');

# ---- 500: dead letter after max_attempts, then redrive.
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_alter('hook',
		jsonb_build_object('secrets', jsonb_build_array('%s', '%s'),
			'timeout', '2s', 'backoff_base', '100ms', 'backoff_cap', '400ms', 'max_attempts', 4,
			'headers', jsonb_build_object('x-destination', 'hook')))}, $OLD_SECRET, $NEW_SECRET));
$sink->clear_log;
$sink->set_mode('500');
my $e500 = publish('order.failed', '{"n": 1}', 'order-500');
# The next event of its key: each pass claims it behind the first, and gives
# it back unsent when the first fails.
my $after500 = publish('order.after', '{"n": 2}', 'order-500');
$deadline = time() + 10;
while (time() < $deadline)
{
	relay_until_idle();
	last if $node->safe_psql('postgres', "SELECT state FROM idempotency.deliveries WHERE event_id = '$e500'") eq 'dead';
	sleep 0.05;
}
is( $node->safe_psql('postgres', "SELECT state || ' ' || attempts || ' ' || last_status FROM idempotency.deliveries WHERE event_id = '$e500'"),
	'dead 4 500', 'answered 500 four times: dead after max_attempts');
is(scalar(grep { $_->{what} eq 'answered' && $_->{id} eq $e500 && $_->{status} == 500 } $sink->entries),
	4, 'the sink saw four attempts with the same webhook-id');
is($node->safe_psql('postgres', "SELECT count(*) FROM idem_outbox_dead WHERE event_id = '$e500'"),
	'1', 'listed in idem_outbox_dead');
ok(!(grep { $_->{id} eq $after500 } $sink->entries), 'the next event of its key was never sent meanwhile');
$sink->set_mode('204');
relay_until_idle();
is($node->safe_psql('postgres', "SELECT attempts FROM idempotency.deliveries WHERE event_id = '$after500'"),
	'0', 'nor is it while the first is dead');
is($node->safe_psql('postgres', "SELECT idem_outbox_redrive('$e500')"), '1', 'redrive');
relay_until_idle();
relay_until_idle();
my @ok = $sink->accepted;
is_deeply(\@ok, [ $e500, $after500 ], 'redriven under the same webhook-id, then the event behind it');
is( $node->safe_psql('postgres', "SELECT string_agg(state, ',' ORDER BY seq) FROM idempotency.deliveries WHERE key = 'order-500'"),
	'delivered,delivered', 'both delivered');

# ---- 410: the destination disables itself; resumed, it delivers.
$sink->clear_log;
$sink->set_mode('410');
my $e410 = publish('order.gone', '{}');
relay_until_idle();
is( $node->safe_psql('postgres', "SELECT status FROM idem_outbox_stats WHERE destination = 'hook'"),
	'disabled', '410 Gone disables the destination');
like( $node->safe_psql('postgres', "SELECT disabled_reason FROM idem_destinations WHERE name = 'hook'"),
	qr/410/, 'and says why');
$sink->set_mode('204');
my $e410b = publish('order.while.disabled', '{}');
is(relay_until_idle(), 0, 'a disabled destination gets no delivery attempts');
is($node->safe_psql('postgres', "SELECT backlog FROM idem_outbox_stats WHERE destination = 'hook'"),
	'2', 'its events accumulate');
$node->safe_psql('postgres', "SELECT idem_destination_resume('hook')");
$deadline = time() + 10;
while (time() < $deadline)
{
	relay_until_idle();
	last if $node->safe_psql('postgres', "SELECT backlog FROM idem_outbox_stats WHERE destination = 'hook'") eq '0';
	sleep 0.05;
}
$accepted = count_of($sink->accepted);
ok($accepted->{$e410} && $accepted->{$e410b}, 'resumed: both delivered');

$sink->stop;
$node->stop;
done_testing();
