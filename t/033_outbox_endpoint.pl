# An endpoint's state per destination (issue 11, items 3 to 5), driven with
# SELECT idem_outbox_relay():
#
#  - Retry-After on 503 (delta-seconds) and 429 (HTTP-date): the delivery is
#    not attempted before the time asked, capped by backoff_cap, and the
#    destination's other deliveries wait too (paced_until);
#  - the circuit: after failure_threshold consecutive failures it opens;
#    then one probe at a time, after the destination-level backoff; failed
#    probes do not use up max_attempts; a success closes it;
#  - disable_after: open and failing for longer, the destination is
#    disabled with a reason;
#  - timeout (total) ends an attempt to an endpoint that accepts and never
#    answers, and a shorter connect_timeout does not cut it short;
#  - connect_timeout ends an attempt whose connection never completes, long
#    before the total timeout: a listener with a backlog of 1 that never
#    accepts, its accept queue filled by the test, drops further SYNs (Linux
#    completes a loopback connection only while the accept queue has room).
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IO::Socket::INET;
use POSIX qw(strftime);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('endpoint');

my $sink = start_sink();

sub relay { return $node->safe_psql('postgres', 'SELECT idem_outbox_relay()'); }
sub q1 { return $node->safe_psql('postgres', $_[0]); }

sub create
{
	my ($name, $url, $options) = @_;
	q1(sprintf(q{SELECT idem_destination_create('%s', 'http', '%s', '{%s.*}',
		'%s'::jsonb || jsonb_build_object('secret', '%s'))}, $name, $url, $name, $options, $SECRET));
}

# ---- Retry-After, delta-seconds, on 503.
create('ra', $sink->url, '{"backoff_base": "10ms", "backoff_cap": "1h", "failure_threshold": 1000}');
$sink->set_mode('503 retry-after 3');
my $e1 = q1(q{SELECT idem_publish('ra.x', '{"n": 1}')});
is(relay(), '1', 'the first attempt is made');
is( q1(qq{SELECT extract(epoch FROM next_attempt_at - last_attempt_at) BETWEEN 2.9 AND 4
		FROM idempotency.deliveries WHERE event_id = '$e1'}),
	't', '503 with Retry-After: 3: the next attempt is 3 s later, not after the 10 ms backoff');
is( q1(q{SELECT paced_until > now() + interval '2 s' FROM idem_outbox_stats WHERE destination = 'ra'}),
	't', 'the destination is paced until then');
my $e2 = q1(q{SELECT idem_publish('ra.x', '{"n": 2}')});
is(relay(), '0', 'its other deliveries wait too');
is(q1("SELECT attempts FROM idempotency.deliveries WHERE event_id = '$e2'"), '0', 'not attempted');

# ---- Retry-After, HTTP-date, on 429; capped by backoff_cap.
q1(q{SELECT idem_destination_resume('ra')});    # clears the pacing
q1(q{UPDATE idempotency.deliveries SET next_attempt_at = now() WHERE state = 'pending'});
my $when = time() + 5;
$sink->set_mode('429 retry-after ' . strftime('%a, %d %b %Y %H:%M:%S GMT', gmtime($when)));
is(relay(), '2', 'both attempted once the pacing is cleared');
is( q1(qq{SELECT bool_and(next_attempt_at >= to_timestamp($when) - interval '1 s')
		FROM idempotency.deliveries WHERE event_id IN ('$e1', '$e2')}),
	't', '429 with an HTTP-date: not before that date');
q1(q{SELECT idem_destination_alter('ra', jsonb_build_object('secret', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw',
	'backoff_base', '10ms', 'backoff_cap', '2s', 'failure_threshold', 1000));
	SELECT idem_destination_resume('ra');
	UPDATE idempotency.deliveries SET next_attempt_at = now() WHERE state = 'pending';});
$sink->set_mode('503 retry-after 7200');
relay();
is( q1(qq{SELECT bool_and(extract(epoch FROM next_attempt_at - last_attempt_at) <= 3)
		FROM idempotency.deliveries WHERE event_id IN ('$e1', '$e2')}),
	't', 'Retry-After: 7200 is capped by backoff_cap (2 s)');
q1(q{SELECT idem_destination_drop('ra')});

# ---- The circuit.
$sink->set_mode('500');
$sink->clear_log;
create('cb', $sink->url,
	'{"backoff_base": "1s", "backoff_cap": "1s", "max_attempts": 2, "failure_threshold": 3}');
q1(q{SELECT idem_publish('cb.x', jsonb_build_object('n', n)) FROM generate_series(1, 3) n});
is(relay(), '3', 'three deliveries attempted');
is( q1(q{SELECT circuit || ' ' || consecutive_failures || ' ' || (next_probe_at IS NOT NULL)
		FROM idem_outbox_stats WHERE destination = 'cb'}),
	'open 3 true', 'after 3 consecutive failures the circuit is open, with a probe time');
is(relay(), '0', 'before the probe time nothing is attempted');
# Probes: one at a time, each failing while open.
my $probes = 0;
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while ($probes < 3 && time() < $deadline)
{
	my $n = relay();
	cmp_ok($n, '<=', 1, 'one probe at a time') if $n > 0;
	$probes += $n;
	sleep 0.1 if $n == 0;
}
is($probes, 3, 'three probes were made, about a second apart');
is( q1(q{SELECT count(*) FILTER (WHERE state = 'dead') || ' ' || max(attempts)
		FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
		WHERE t.name = 'cb'}),
	'0 1', 'failed probes use up no attempts: nothing dead (max_attempts 2), attempts still 1');
is(q1(q{SELECT consecutive_failures FROM idem_outbox_stats WHERE destination = 'cb'}),
	'6', 'the failures are counted');
$sink->set_mode('204');
$deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while (time() < $deadline)
{
	relay();
	last if q1(q{SELECT backlog FROM idem_outbox_stats WHERE destination = 'cb'}) eq '0';
	sleep 0.1;
}
is( q1(q{SELECT circuit || ' ' || consecutive_failures || ' ' || backlog || ' ' || delivered
		FROM idem_outbox_stats WHERE destination = 'cb'}),
	'closed 0 0 3', 'a successful probe closes the circuit, and the rest is delivered');

# ---- disable_after.
$sink->set_mode('500');
create('da', $sink->url,
	'{"backoff_base": "100ms", "backoff_cap": "100ms", "failure_threshold": 1, "disable_after": "1s"}');
q1(q{SELECT idem_publish('da.x', '{}')});
$deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while (time() < $deadline)
{
	relay();
	last if q1(q{SELECT status FROM idem_outbox_stats WHERE destination = 'da'}) eq 'disabled';
	sleep 0.05;
}
like( q1(q{SELECT status || ': ' || disabled_reason FROM idem_destinations d JOIN idem_outbox_stats s
		ON s.destination = d.name WHERE d.name = 'da'}),
	qr/^disabled: failing since .*, longer than disable_after \(1000 ms\); last error: HTTP status 500$/,
	'failing for longer than disable_after while open: disabled, with the reason');
is(q1(q{SELECT state FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
		WHERE t.name = 'da'}), 'pending', 'its delivery waits, not dead');
q1(q{SELECT idem_destination_resume('da')});
is( q1(q{SELECT status || ' ' || circuit || ' ' || consecutive_failures FROM idem_outbox_stats WHERE destination = 'da'}),
	'active closed 0', 'resumed: active, circuit closed, failures cleared');
q1(q{SELECT idem_destination_drop('da')});

# ---- connect_timeout vs timeout.
# Accepts (the kernel does) and never answers: the total timeout.
my $bh_port = PostgreSQL::Test::Cluster::get_free_port();
my $bh = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => $bh_port,
	Proto => 'tcp', Listen => 128, ReuseAddr => 1) or die "cannot listen: $!";
create('bh', "http://127.0.0.1:$bh_port/hook",
	'{"connect_timeout": "200ms", "timeout": "1500ms", "max_attempts": 1}');
q1(q{SELECT idem_publish('bh.x', '{}')});
my $t0 = time();
relay();
my $took = time() - $t0;
cmp_ok($took, '>=', 1.4, sprintf('an endpoint that connects and never answers: the total timeout (%.1f s)', $took));
like(q1(q{SELECT last_error FROM idem_outbox_dead WHERE destination = 'bh'}),
	qr/(?i)operation timed out after 1[45]\d\d milliseconds/, 'the connect timeout did not cut it short');

# A connection that never completes: the connect timeout, not the total.
my $full = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => 0,
	Proto => 'tcp', Listen => 1, ReuseAddr => 1) or die "cannot listen: $!";
my $full_port = $full->sockport;
my @queued;
for (1 .. 16)
{
	my $c = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $full_port,
		Proto => 'tcp', Timeout => 2);
	last unless $c;    # the queue is full: this connect hung
	push @queued, $c;
}
cmp_ok(scalar(@queued), '<', 16, 'a connection to the full listener does not complete');
create('hang', "http://127.0.0.1:$full_port/hook",
	'{"connect_timeout": "1s", "timeout": "30s", "max_attempts": 1}');
q1(q{SELECT idem_publish('hang.x', '{}')});
$t0 = time();
relay();
$took = time() - $t0;
cmp_ok($took, '<', 20, sprintf('a connection that never completes: the connect timeout, not the 30-s total (%.1f s)', $took));
my $hang_error = q1(q{SELECT last_error FROM idem_outbox_dead WHERE destination = 'hang'});
like($hang_error, qr/(?i)connect/, "and the error says so ($hang_error)");
unlike($hang_error, qr/(?i)after (29|30)\d\d\d milli/, 'not the total timeout');

close $_ for @queued;
close $full;
close $bh;
$sink->stop;
$node->stop;
done_testing();
