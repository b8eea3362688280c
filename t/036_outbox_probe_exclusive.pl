# One probe at a time across relays (issue 11, item 4): while a
# destination's circuit is open, the worker's loop claims the probe (moving
# next_probe_at past the probe's visibility deadline, in a transaction it
# commits at once, relay_claim_probes), and another relay -- here sessions
# calling idem_outbox_relay() while the probe is under way -- claims none of
# the destination's other due deliveries: one request in flight between
# them.
#
# (Two synchronous passes, both in their callers' transactions, cannot show
# it: the first pass's claim keeps every candidate row it looked at locked
# until its transaction ends, so the second finds nothing to claim anyway.)
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('probe_exclusive', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

my $sink = start_sink();
$sink->set_mode('500');

sub q1 { return $node->safe_psql('postgres', $_[0]); }

# Open the circuit: one failure is the threshold.
q1(sprintf(q{SELECT idem_destination_create('down', 'http', '%s', '{down.*}',
	jsonb_build_object('secret', '%s', 'failure_threshold', 1, 'timeout', '60s',
		'backoff_base', '1s', 'backoff_cap', '1s', 'max_attempts', 100))},
	$sink->url, $SECRET));
q1(q{SELECT idem_publish('down.x', jsonb_build_object('n', 0), 'k0')});
$node->poll_query_until('postgres',
	q{SELECT circuit = 'open' FROM idem_outbox_stats WHERE destination = 'down'})
  or die 'the circuit did not open';
pass('the worker failed once: the circuit is open');

# The next probe takes 5 s to fail; several deliveries are due meanwhile
# (distinct keys, so none waits behind another).
$sink->set_mode('sleep 5 500');
$sink->clear_log;
q1(q{SELECT idem_publish('down.x', jsonb_build_object('n', n), 'k' || n) FROM generate_series(1, 5) n});
my $waited = 0;
until (scalar(grep { $_->{what} eq 'received' } $sink->entries) >= 1)
{
	die 'no probe request came' if $waited++ > 1200;
	sleep 0.05;
}
# While it is under way, another relay finds nothing it may claim.
my $other = 0;
my $tries = 0;
while (!grep { $_->{what} eq 'answered' } $sink->entries)
{
	$other += q1('SELECT idem_outbox_relay()');
	die 'the probe was never answered' if ++$tries > 1200;
	sleep 0.2;
}
cmp_ok($tries, '>', 0, "another relay ran $tries times during the probe");
is($other, 0, 'and attempted nothing');

my ($open, $most, $requests) = (0, 0, 0);
for my $e ($sink->entries)
{
	$requests++ if $e->{what} eq 'received';
	$open += $e->{what} eq 'received' ? 1 : -1;
	$most = $open if $open > $most;
}
is($most, 1, 'never more than one request under way while the circuit was open');
cmp_ok($requests, '>=', 1, "one probe after the other ($requests)");
is(q1(q{SELECT circuit FROM idem_outbox_stats WHERE destination = 'down'}), 'open',
	'the failed probe left the circuit open');

$sink->stop;
$node->stop;
done_testing();
