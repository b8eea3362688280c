# Review of issue 11: one Retry-After makes every later delivery of the
# destination lock and rewrite its row, forever.
#
# relay_endpoint_states() writes a destination's row "only when it changes:
# a healthy endpoint costs no write".  But paced_until, once set by a 429 or
# 503 with Retry-After, is never cleared (the state write keeps the value it
# read; only idem_destination_resume clears it), and RelayDest.paced ("as
# loaded: paced_until was set") then makes every success "needed": the row
# is locked FOR UPDATE and updated in every recording transaction, long
# after the pacing ended.  Concurrent relays (helpers, callers of
# idem_outbox_relay) then serialise on that row, and a transaction holding
# it stalls the worker (see t/044) even for a healthy endpoint.
#
# Driven with idem_outbox_relay(): a 429 with "Retry-After: 1" (capped by
# backoff_cap to 1 ms; a "Retry-After: 0" paces nothing), then the endpoint
# is healthy; a successful delivery must not write the row.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $node = start_outbox_node('review_pacing');

my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

q1(sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{ep.*}',
	jsonb_build_object('secret', '%s', 'backoff_base', '1ms', 'backoff_cap', '1ms'))},
	$sink->url, $SECRET));

sub row_version { return q1(q{SELECT xmin || ' ' || ctid FROM idempotency.destinations WHERE name = 'ep'}); }

# Healthy from the start: a success writes nothing.
q1(q{SELECT idem_publish('ep.x', '{}')});
my $v0 = row_version();
is(q1('SELECT idem_outbox_relay()'), '1', 'delivered');
is(row_version(), $v0, 'a success of a healthy endpoint does not write its destination row');

# One 429 asking for a delay that backoff_cap cuts to 1 ms.
$sink->set_mode('429 retry-after 1');
my $e = q1(q{SELECT idem_publish('ep.x', '{}')});
is(q1('SELECT idem_outbox_relay()'), '1', 'the 429 was attempted');
is(q1(q{SELECT paced_until IS NOT NULL FROM idempotency.destinations WHERE name = 'ep'}), 't',
	'paced until the time asked (capped: 1 ms)');
$sink->set_mode('204');
$node->poll_query_until('postgres', q{SELECT idem_outbox_relay() = 1})
  or die 'the retry was not made';
is(q1("SELECT state FROM idempotency.deliveries WHERE event_id = '$e'"), 'delivered', 'then delivered');

# The pacing is long over; the endpoint is healthy.
for my $n (1 .. 3)
{
	q1(q{SELECT idem_publish('ep.x', '{}')});
	my $v = row_version();
	is(q1('SELECT idem_outbox_relay()'), '1', "healthy delivery $n");
	is(row_version(), $v, "healthy delivery $n did not write the destination row");
}

$sink->stop;
$node->stop;
done_testing();
