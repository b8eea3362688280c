# idem_outbox_redrive_dead(destination, since) redrives the deliveries
# dead-lettered at or after since, as the README says, including one whose
# last attempt was already in flight at since (the endpoint slow) and was
# dead-lettered after it.  It compared since with last_attempt_at, when
# that attempt was claimed, and missed it: an operator redriving what died
# since an incident began missed what was in flight when it began (up to a
# destination's timeout, which may be an hour).  Found by an adversarial
# review.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $node = start_outbox_node('redrive_dead_since', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});
my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{p.*}',
	jsonb_build_object('secret', '%s', 'max_attempts', 1, 'timeout', '30s'))}, $sink->url, $SECRET));

$sink->set_mode('sleep 5 500');
my $e = q1(q{SELECT idem_publish('p.x', '{}')});
# The request is in flight: received, no outcome recorded.
my $received = 0;
for (1 .. 600)
{
	$received = grep { $_->{what} eq 'received' && $_->{id} eq $e } $sink->entries;
	last if $received;
	select(undef, undef, undef, 0.05);
}
$received or die 'the request never arrived';
is(q1("SELECT state || ' ' || (visible_until IS NOT NULL) FROM idempotency.deliveries WHERE event_id = '$e'"),
	'pending true', 'the last attempt is in flight, not dead yet');
my $since = q1('SELECT clock_timestamp()');
$node->poll_query_until('postgres',
	"SELECT state = 'dead' FROM idempotency.deliveries WHERE event_id = '$e'")
  or die 'not dead-lettered';
$sink->set_mode('204');
is(q1("SELECT count(*) FROM idem_outbox_dead WHERE event_id = '$e'"), '1',
	'dead-lettered after since');
is(q1("SELECT idem_outbox_redrive_dead('ep', '$since')"), '1',
	'redrive_dead(destination, since) redrives a delivery dead-lettered after since')
  or diag(q1("SELECT 'since ' || '$since' || ', last_attempt_at ' || last_attempt_at FROM idempotency.deliveries WHERE event_id = '$e'"));

$node->poll_query_until('postgres',
	"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e'")
  or die 'the redriven delivery was not delivered';

# One dead-lettered before since is left alone.
$sink->set_mode('500');
my $e2 = q1(q{SELECT idem_publish('p.x', '{}')});
$node->poll_query_until('postgres',
	"SELECT state = 'dead' FROM idempotency.deliveries WHERE event_id = '$e2'")
  or die 'not dead-lettered';
my $later = q1('SELECT clock_timestamp()');
is(q1("SELECT idem_outbox_redrive_dead('ep', '$later')"), '0',
	'a delivery dead-lettered before since is not redriven');
is(q1("SELECT idem_outbox_redrive_dead('ep')"), '1', 'without since it is');

$sink->stop;
$node->stop;
done_testing();
