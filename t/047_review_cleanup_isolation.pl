# Review of issue 11: a cleanup pass holds up every delivery of the worker.
#
# The worker runs cleanup (worker_pass: records and inbox, batch after
# batch with idempotency.cleanup_delay between them) in the same process and
# loop as the relay, and does not return to relay_loop_run() until the pass
# is over.  Meanwhile no webhook is claimed, sent or recorded, requests in
# flight are not driven and their claims are not renewed.  A pass over a
# large backlog of expired rows (a million records at the default batch of
# 1000 and 10 ms: a thousand batches) stalls the outbox for as long.
#
# Here the pass is made long by settings rather than by volume: 300 expired
# inbox marks, batches of 10, 300 ms between batches (about 9 s).  While the
# pass is under way (some marks deleted, most not), 3 events are published
# to a healthy endpoint; they must be received while the pass still has
# marks to delete.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('review_cleanup_isolation', worker => 1, conf => q{
idempotency.cleanup_interval = '1s'
idempotency.cleanup_batch_size = 10
idempotency.cleanup_delay = '300ms'
});

my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(sprintf(q{SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
	jsonb_build_object('secret', '%s'))}, $sink->url, $SECRET));
# The relay works before the backlog.
my $warm = q1(q{SELECT idem_publish('healthy.warm', '{}')});
$node->poll_query_until('postgres', "SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$warm'")
  or die 'the relay does not deliver';

q1(q{SELECT count(idem_inbox_accept('review', 'm' || n, interval '1 ms')) FROM generate_series(1, 300) n});
# The next pass has begun: marks are going, most are left.
$node->poll_query_until('postgres', q{SELECT count(*) < 290 FROM idempotency.inbox})
  or die 'no cleanup pass began';
my $left = q1('SELECT count(*) FROM idempotency.inbox');
cmp_ok($left, '>', 100, "a cleanup pass is under way ($left marks left)");

my @ids = map { q1("SELECT idem_publish('healthy.x', jsonb_build_object('n', $_))") } 1 .. 3;
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
my $received;
while (time() < $deadline)
{
	my %got = map { $_ => 1 } $sink->accepted;
	$received = scalar(grep { $got{$_} } @ids);
	$left = q1('SELECT count(*) FROM idempotency.inbox');
	last if $received == 3 || $left == 0;
	sleep 0.05;
}
diag("healthy webhooks received: $received of 3; inbox marks left: $left");
is($received, 3, 'the webhooks were received ...');
cmp_ok($left, '>', 0, '... while the cleanup pass was still under way');

$sink->stop;
$node->stop;
done_testing();
