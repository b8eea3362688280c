# Second review of issue 11: idem_destination_pause() does not stop a key's
# chain that the worker's loop has claimed; it goes on being sent, one
# request after the other, until the whole chain is delivered.
#
# A claim takes a key's head and the deliveries behind it (up to the batch,
# relay_claim_followers), and relay_loop_finished starts the next one of the
# chain as soon as its predecessor answers 2xx, from the copy of the
# destination loaded at claim time: nothing looks at the destination again
# (paused, disabled, dropped, its options altered) before the request goes.
# README: pause "stops ... delivery"; an operator pausing an endpoint (it is
# being hammered, it is being moved) sees it go on receiving for as long as
# the chain lasts -- up to relay_batch_size requests.
#
# 10 events on one key to an endpoint that takes 1 s per request; once the
# first has arrived, the destination is paused: at most the request then in
# flight may still arrive.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep);
use OutboxNode;

my $EVENTS = 10;

my $node = start_outbox_node('review2_pause', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

my $sink = start_sink();
$sink->set_mode('sleep 1 204');

$node->safe_psql('postgres', sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{ep.*}',
	jsonb_build_object('secret', '%s', 'timeout', '60s'))},
	$sink->url, $SECRET));

sub received
{
	my %ids = map { $_->{id} => 1 } grep { $_->{what} eq 'received' } $sink->entries;
	return scalar keys %ids;
}

# One commit: the head of the key and the 9 behind it are claimed together.
$node->safe_psql('postgres',
	"SELECT idem_publish('ep.x', '{}', key => 'k') FROM generate_series(1, $EVENTS)");

# The first request has arrived: pause.
for (1 .. 1800)
{
	last if received() >= 1;
	sleep 0.1;
}
ok(received() >= 1, 'the first event arrived');
$node->safe_psql('postgres', q{SELECT idem_destination_pause('ep')});
my $at_pause = received();
note("received when the pause committed: $at_pause");

# Wait until no delivery of ep is claimed any more: the chain was given back
# (what pause should do), or it ran to its end (what it does).
$node->poll_query_until('postgres', qq{
	SELECT count(*) = $EVENTS
	    OR NOT EXISTS (SELECT FROM idempotency.deliveries
	                    WHERE state = 'pending' AND visible_until > now())
	  FROM idempotency.deliveries WHERE state = 'delivered'})
  or die 'the chain is still claimed';

my $after = received();
note("received in all: $after");
cmp_ok($after, '<=', $at_pause + 1,
	'after the pause, at most the request in flight reached the endpoint');
is($node->safe_psql('postgres',
		q{SELECT count(*) >= 8 FROM idempotency.deliveries WHERE state = 'pending'}),
	't', 'the rest of the key waits, pending, while the destination is paused');

$sink->stop;
$node->stop;
done_testing();
