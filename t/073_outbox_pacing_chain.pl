# A Retry-After pause holds for the chains of webhooks already claimed.
#
# README ("Retry schedule"): a 429 or 503 with Retry-After "paces the
# destination: none of its deliveries is claimed before then".  A key's
# deliveries claimed together go out one after the other (a chain); the
# loop started each next one as soon as its predecessor was delivered, and
# never asked whether the endpoint had meanwhile asked for a pause, so a
# chain of another key kept sending all through it (found by an adversarial
# review: 19 to 21 requests within a 5-s Retry-After, with one relay
# process and with three).
#
# Here the endpoint answers 429 with Retry-After: 5 to the first request of
# key 'a' (after 1 s, or 3 s with helpers) and 204 after 0.2 s to the
# others; one event of key 'a' and 30 of key 'b' are published together, so
# that the head of 'a' and the chain of 'b' are in flight together
# (max_in_flight 2).  Once the 429 has come, no
# request may reach the endpoint before the 5 s are over (0.3 s of slack for
# a request that was already on its way).  Then every event of 'b' is
# delivered in order, and 'a' after its pause.  Once with the worker alone,
# once with relay helpers (relay_workers 3, relay_max_in_flight 1 so that a
# backlog starts them).  Driven by the worker's relay; waits poll for states.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $node = start_outbox_node('pacing_chain', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

# wait_for(what, seconds, sub): poll until sub returns true.
sub wait_for
{
	my ($what, $secs, $check) = @_;
	my $until = time() + $secs;
	while (time() < $until)
	{
		return 1 if $check->();
		sleep 0.1;
	}
	return 0;
}

my $sink = start_sink();

for my $round (['the worker alone', 1, 64, 1], ['with relay helpers', 3, 1, 3])
{
	my ($label, $workers, $max_in_flight, $answer_after) = @$round;
	my $dest = "paced$workers";
	my $helpers = 0;

	$sink->set_mode("key a 429 retry-after 5 after $answer_after else sleep 0.2");

	q1(qq{ALTER SYSTEM SET idempotency.relay_workers = $workers});
	q1(qq{ALTER SYSTEM SET idempotency.relay_max_in_flight = $max_in_flight});
	q1(q{SELECT pg_reload_conf()});
	q1(sprintf(q{SELECT idem_destination_create('%s', 'http', '%s', '{%s}',
		jsonb_build_object('secret', '%s', 'max_in_flight', 2, 'backoff_cap', '1h'))},
		$dest, $sink->url("/$dest"), $dest, $SECRET));
	q1(qq{SELECT idem_destination_pause('$dest')});
	q1(qq{SELECT idem_publish('$dest', '{}', 'a', '{"x-event-key": "a"}')});
	q1(qq{SELECT count(idem_publish('$dest', jsonb_build_object('n', g), 'b', '{"x-event-key": "b"}'))
		FROM generate_series(1, 30) g});
	my $from = time();
	q1(qq{SELECT idem_destination_resume('$dest')});

	# The 429 of this round.
	my $paced_at;
	ok(wait_for('the 429', 30, sub {
		my $h = q1(q{SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency relay'});
		$helpers = $h if $h > $helpers;
		($paced_at) = map { $_->{time} }
		  grep { $_->{what} eq 'answered' && $_->{status} == 429 && $_->{time} >= $from }
		  $sink->entries;
		return defined $paced_at;
	}), "$label: the endpoint answered 429 with Retry-After: 5");
	$paced_at //= time();
	# With one request in flight per relay process, the chain of 'b' went
	# out from another process than the head of 'a'.
	cmp_ok($helpers, '>=', 1, "$label: a relay helper ran before the 429") if $workers > 1;
	# After its pause, 'a' is answered as the others are.
	$sink->set_mode('sleep 0.2 204');

	# Nothing within the pause; everything after it.
	ok(wait_for('all delivered', 60, sub {
		q1(qq{SELECT count(*) FROM idempotency.deliveries d
			JOIN idempotency.destinations t ON t.id = d.destination_id
			WHERE t.name = '$dest' AND d.state = 'delivered'}) == 31;
	}), "$label: every event delivered after the pause");
	my @during = grep {
		$_->{what} eq 'received' && $_->{time} > $paced_at + 0.3 && $_->{time} < $paced_at + 5
	} $sink->entries;
	is(scalar(@during), 0, "$label: no request reached the endpoint within the 5 s it asked for")
	  or diag(sprintf('%d requests within the pause, the first %.3f s after the 429',
		scalar(@during), $during[0]{time} - $paced_at));

	# Key order held: the events of 'b' were answered 204 in publish order.
	my @b = map { $_->{id} } grep {
		$_->{what} eq 'answered' && $_->{status} == 204 && $_->{key} eq 'b' && $_->{time} >= $from
	} $sink->entries;
	my $order = q1(qq{SELECT string_agg(d.event_id::text, ' ' ORDER BY d.seq)
		FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
		WHERE t.name = '$dest' AND d.key = 'b'});
	my %seen;
	my @first = grep { !$seen{$_}++ } @b;
	is(join(' ', @first), $order, "$label: the events of key b delivered in publish order");
	q1(qq{SELECT idem_destination_drop('$dest')});
}

$sink->stop;
$node->stop;
done_testing();
