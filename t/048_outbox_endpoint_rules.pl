# The endpoint rules of issue 11, as settled after its review:
#
#  A. A delivery that the endpoint reschedules -- a 429 (with or without
#     Retry-After) or a 503 with Retry-After -- does not use up an attempt:
#     an endpoint that rate-limits for hours does not dead-letter its queue.
#  B. That is bounded: a rate limit starts the destination's failing streak
#     (failing_since), so an endpoint that answers 429 forever is disabled
#     after disable_after, with a reason.
#  C. disable_after counts from failing_since whatever the circuit: with a
#     failure_threshold never reached, a destination failing longer than
#     disable_after is disabled too.
#  D. An endpoint state change that meets the destination row held by
#     another transaction is kept, not dropped: the circuit opens after
#     failure_threshold failures once the row is free, without another
#     failure.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('endpoint_rules', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

sub create_dest
{
	my ($name, $sink, $options) = @_;
	q1(sprintf(q{SELECT idem_destination_create('%s', 'http', '%s', '{%s.*}',
		jsonb_build_object('secret', '%s') || '%s'::jsonb)},
		$name, $sink->url, $name, $SECRET, $options));
}

# Wait until the sink answered $count requests with $status, or $stop (a
# query) is true.
sub wait_answers
{
	my ($sink, $status, $count, $stop) = @_;
	my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
	while (scalar(grep { $_->{what} eq 'answered' && $_->{status} eq $status } $sink->entries) < $count)
	{
		return if q1($stop) eq 't';
		return fail("the sink never answered $count times $status") if time() > $deadline;
		sleep 0.1;
	}
}

# ---- A. Rescheduled attempts are not used up.
my $sink_a = start_sink();
$sink_a->set_mode('429 retry-after 1');
create_dest('limited', $sink_a,
	'{"max_attempts": 2, "backoff_base": "1s", "backoff_cap": "1s", "failure_threshold": 1000}');
my $ev = q1(q{SELECT idem_publish('limited.x', '{}')});
my $dead = "SELECT state = 'dead' FROM idempotency.deliveries WHERE event_id = '$ev'";
my $row = sub {
	return q1("SELECT state || ' ' || attempts || ' ' || coalesce(last_status, 0)
				 FROM idempotency.deliveries WHERE event_id = '$ev'");
};
wait_answers($sink_a, 429, 3, $dead);
$node->poll_query_until('postgres',
	"SELECT visible_until IS NULL FROM idempotency.deliveries WHERE event_id = '$ev'")
  or fail('the third 429 was not recorded');
is($row->(), 'pending 0 429',
	'A: three 429s with Retry-After and max_attempts 2: pending, no attempt used up');

$sink_a->set_mode('503 retry-after 1');
wait_answers($sink_a, 503, 3, $dead);
$node->poll_query_until('postgres',
	"SELECT visible_until IS NULL AND last_status = 503 FROM idempotency.deliveries WHERE event_id = '$ev'")
  or fail('the 503s were not recorded');
is($row->(), 'pending 0 503', 'A: three 503s with Retry-After: still pending, no attempt used up');

$sink_a->set_mode('429');
wait_answers($sink_a, 429, 6, $dead);
$node->poll_query_until('postgres',
	"SELECT visible_until IS NULL AND last_status = 429 FROM idempotency.deliveries WHERE event_id = '$ev'")
  or fail('the 429s without Retry-After were not recorded');
is($row->(), 'pending 0 429', 'A: three 429s without Retry-After: still pending, no attempt used up');

$sink_a->set_mode('204');
$node->poll_query_until('postgres',
	"SELECT state <> 'pending' FROM idempotency.deliveries WHERE event_id = '$ev'")
  or fail('the delivery was not delivered');
is($row->(), 'delivered 1 204', 'A: delivered at last, its one counted attempt the success');
is(q1(q{SELECT circuit || ' ' || consecutive_failures || ' ' || (failing_since IS NULL)
		   FROM idem_outbox_stats WHERE destination = 'limited'}),
	'closed 0 true', 'A: the success ended the streak');

# ---- B. An endpoint that answers 429 forever is disabled after disable_after.
my $sink_b = start_sink();
$sink_b->set_mode('429 retry-after 1');
create_dest('forever', $sink_b,
	'{"max_attempts": 100, "backoff_base": "1s", "backoff_cap": "1s", "disable_after": "3s"}');
my $ev_b = q1(q{SELECT idem_publish('forever.x', '{}')});

# Until it is disabled, or an attempt claimed after the streak had lasted
# disable_after was recorded (it had to disable it).
$node->poll_query_until('postgres', qq{
	SELECT t.disabled_at IS NOT NULL
	    OR (d.visible_until IS NULL
	        AND d.last_attempt_at > coalesce(t.failing_since, d.first_attempt_at) + interval '3s')
	  FROM idempotency.destinations t JOIN idempotency.deliveries d ON d.destination_id = t.id
	 WHERE t.name = 'forever'})
  or fail('the rate-limited destination was neither disabled nor attempted after disable_after');
is(q1(q{SELECT status FROM idem_outbox_stats WHERE destination = 'forever'}), 'disabled',
	'B: a destination rate-limited for longer than disable_after is disabled');
like(q1(q{SELECT disabled_reason FROM idem_destinations WHERE name = 'forever'}),
	qr/^failing since .*longer than disable_after \(3000 ms\); last error: .*429/,
	'B: with a reason');
is(q1("SELECT state FROM idempotency.deliveries WHERE event_id = '$ev_b'"), 'pending',
	'B: its delivery is still pending, not dead');

# ---- C. disable_after whatever the circuit.
my $sink_c = start_sink();
$sink_c->set_mode('500');
create_dest('failing', $sink_c,
	'{"max_attempts": 1000, "backoff_base": "1s", "backoff_cap": "1s", "disable_after": "3s",
	  "failure_threshold": 1000000}');
q1(q{SELECT idem_publish('failing.x', '{}')});
$node->poll_query_until('postgres', qq{
	SELECT t.disabled_at IS NOT NULL
	    OR (d.visible_until IS NULL AND d.last_attempt_at > t.failing_since + interval '3s')
	  FROM idempotency.destinations t JOIN idempotency.deliveries d ON d.destination_id = t.id
	 WHERE t.name = 'failing'})
  or fail('the failing destination was neither disabled nor attempted after disable_after');
is(q1(q{SELECT status || ' ' || circuit FROM idem_outbox_stats WHERE destination = 'failing'}),
	'disabled closed',
	'C: failing longer than disable_after with its circuit closed: disabled');
like(q1(q{SELECT disabled_reason FROM idem_destinations WHERE name = 'failing'}),
	qr/^failing since .*last error: .*500/, 'C: with a reason');

# ---- D. The circuit opens although the row was held when the failures came.
my $sink_d = start_sink();
$sink_d->set_mode('500');
create_dest('busy', $sink_d, '{"max_attempts": 1, "failure_threshold": 2}');
my $holder = $node->background_psql('postgres');
$holder->query_safe(q{BEGIN; SELECT id FROM idempotency.destinations WHERE name = 'busy' FOR UPDATE});
q1(q{SELECT idem_publish('busy.x', jsonb_build_object('n', n)) FROM generate_series(1, 2) n});
$node->poll_query_until('postgres', q{
	SELECT count(*) = 2 FROM idempotency.deliveries d JOIN idempotency.destinations t
	    ON t.id = d.destination_id
	 WHERE t.name = 'busy' AND d.state = 'dead' AND d.last_status = 500})
  or fail('the two failures were not recorded');
is(q1(q{SELECT circuit || ' ' || consecutive_failures FROM idem_outbox_stats WHERE destination = 'busy'}),
	'closed 0', 'D: two failures recorded while the row is held: not written yet');
$holder->query_safe('COMMIT');
$holder->quit;
$node->poll_query_until('postgres', q{
	SELECT circuit = 'open' FROM idem_outbox_stats WHERE destination = 'busy'})
  or fail('the circuit did not open once the row was free');
is(q1(q{SELECT circuit || ' ' || consecutive_failures || ' ' || (failing_since IS NOT NULL)
		   FROM idem_outbox_stats WHERE destination = 'busy'}),
	'open 2 true', 'D: once the row is free the circuit opens on the two failures');
is(scalar(grep { $_->{what} eq 'answered' } $sink_d->entries), 2,
	'D: without another request');

# ---- E. A plain 429 uses up no attempt, but it is asked less and less
# often: its backoff grows with the times the delivery was tried (with
# backoff_base 200 ms, 12 tries within 4 s need the random delays drawn
# from windows of 0.2 s to 205 s to be tiny; with a backoff that did not
# grow, they came within about 2 s).
my $sink_e = start_sink();
$sink_e->set_mode('429');
create_dest('slowing', $sink_e, '{"backoff_base": 0.2, "disable_after": "1h"}');
q1(q{SELECT idem_publish('slowing.x', '{}')});
my $first = time();
sleep 0.1 until scalar(grep { $_->{what} eq 'answered' } $sink_e->entries) >= 1 || time() > $first + 60;
sleep 4;
my $tries = scalar(grep { $_->{what} eq 'answered' } $sink_e->entries);
note("E: requests answered 429 in the first 4 s: $tries");
cmp_ok($tries, '<', 12, 'E: a plain 429 backs off exponentially');
is(q1(q{SELECT d.attempts FROM idempotency.deliveries d JOIN idempotency.destinations t
		 ON t.id = d.destination_id WHERE t.name = 'slowing'}), '0', 'E: and uses up no attempt');

$_->stop for ($sink_a, $sink_b, $sink_c, $sink_d, $sink_e);
$node->stop;
done_testing();
