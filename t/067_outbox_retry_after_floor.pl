# Retry-After values at the edges: none asks the relay to hammer the
# endpoint, and none that asks for the longest wait is ignored.
#
# A 429 or 503 with "Retry-After: 0", or with an HTTP date in the past,
# asks for no wait at all.  Taken literally (retry at once, the 429 using no
# attempt and no circuit failure) one event was sent hundreds of times a
# second, forever.  Such a Retry-After counts as absent: a 429 waits the
# growing backoff by claims, a 503 is an ordinary failure (attempts used up,
# then dead).  A delta-seconds value too large for a number
# ("Retry-After: 99999999999999999999") asks for the longest wait: it is
# capped by backoff_cap, not ignored (which made the 503 an ordinary
# failure, dead-lettered within seconds).
#
# Driven by the worker's relay.  The counts are of requests over periods of
# seconds with bounds far from both behaviours, so a loaded machine does not
# change the verdict.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $node = start_outbox_node('retry_after_floor', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{ep.*}',
	jsonb_build_object('secret', '%s', 'max_attempts', 3,
					   'backoff_base', '1s', 'backoff_cap', '1h'))},
	$sink->url, $SECRET));

# Requests for event $id answered so far.
sub requests
{
	my ($id) = @_;
	return scalar(grep { $_->{what} eq 'answered' && $_->{id} eq $id } $sink->entries);
}

# Publish one event with the sink answering $mode; wait for its first request.
sub publish
{
	my ($mode) = @_;
	$sink->set_mode($mode);
	q1(q{SELECT idem_destination_resume('ep')});
	my $id = q1(q{SELECT idem_publish('ep.x', '{}')});
	my $deadline = time() + 60;
	sleep 0.1 while requests($id) == 0 && time() < $deadline;
	ok(requests($id) > 0, "[$mode] the event was sent");
	return $id;
}

# Stop the destination and forget its deliveries before the next case.
sub done_with
{
	q1(q{SELECT idem_destination_pause('ep')});
	sleep 1;
	q1(q{DELETE FROM idempotency.deliveries});
}

# A 429 asking for no wait: the growing backoff by claims (base 1s: windows
# of 1, 2, 4, 8 s...), a handful of requests in 8 s, not thousands.
for my $mode ('429 retry-after 0', '429 retry-after Wed, 21 Oct 2015 07:28:00 GMT')
{
	my $id = publish($mode);
	sleep 8;
	my $n = requests($id);
	cmp_ok($n, '<=', 15, "[$mode] the endpoint was not hammered ($n requests in 8 s)");
	is(q1(q{SELECT paced_until IS NULL FROM idempotency.destinations WHERE name = 'ep'}),
		't', "[$mode] the destination is not paced");
	# Paused, with no request in flight: no attempt was used up.
	q1(q{SELECT idem_destination_pause('ep')});
	ok($node->poll_query_until('postgres',
			"SELECT state = 'pending' AND attempts = 0 FROM idempotency.deliveries"
			  . " WHERE event_id = '$id'"),
		"[$mode] still pending, no attempt used up");
	done_with();
}

# A 503 asking for no wait: an ordinary failure; three attempts, then dead.
{
	my $mode = '503 retry-after 0';
	my $id = publish($mode);
	ok($node->poll_query_until('postgres',
			"SELECT state = 'dead' FROM idempotency.deliveries WHERE event_id = '$id'"),
		"[$mode] dead-lettered after its attempts");
	is(q1("SELECT attempts FROM idempotency.deliveries WHERE event_id = '$id'"),
		'3', "[$mode] all three attempts used up");
	sleep 2;
	is(requests($id), 3, "[$mode] three requests in all");
	done_with();
}

# A 503 asking for more seconds than a number holds: the longest wait, the
# cap (1 hour), and the delivery is rescheduled, not failed.
{
	my $mode = '503 retry-after 99999999999999999999';
	my $id = publish($mode);
	sleep 5;
	is(requests($id), 1, "[$mode] one request in 5 s");
	is(q1("SELECT state || ' ' || attempts || ' ' || (next_attempt_at > now() + interval '50 min')"
		  . " FROM idempotency.deliveries WHERE event_id = '$id'"),
		'pending 0 true', "[$mode] pending, no attempt used up, retried after the cap");
	is(q1(q{SELECT paced_until > now() + interval '50 min' FROM idempotency.destinations WHERE name = 'ep'}),
		't', "[$mode] the destination is paced until the cap");
	done_with();
}

# A positive Retry-After is honoured as before.
{
	my $mode = '429 retry-after 3600';
	my $id = publish($mode);
	sleep 3;
	is(requests($id), 1, "[$mode] one request in 3 s");
	is(q1("SELECT next_attempt_at > now() + interval '50 min' FROM idempotency.deliveries"
		  . " WHERE event_id = '$id'"),
		't', "[$mode] retried no earlier than asked");
	done_with();
}

$sink->stop;
$node->stop;
done_testing();
