# A resume ends a Retry-After pause for the chains of webhooks too.
#
# The relay keeps a pause an endpoint asked for in memory (shared and per
# process) so that chains already claimed stop at once (t/073).
# idem_destination_resume clears paced_until ("the endpoint starts afresh:
# no pacing"), but a first version of that change kept the pause in memory
# until it ran out: every chain claimed after the resume was cut after its
# first request, one delivery per claim (found by an adversarial review:
# 20 claims for a chain of 20, 19 s instead of 0.2 s).  A pause now counts
# only in the destination generation it came in, which a resume moves on.
#
# Here a 429 with Retry-After: 120 paces the destination, the endpoint then
# answers 204, the destination is resumed and 20 events of one key follow:
# they must go as one chain, in one claim each.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $node = start_outbox_node('pace_after_resume', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});
sub q1 { return $node->safe_psql('postgres', $_[0]); }
my $sink = start_sink();
$sink->set_mode('429 retry-after 120');
q1(sprintf(q{SELECT idem_destination_create('d', 'http', '%s', '{d}',
	jsonb_build_object('secret', '%s', 'backoff_cap', '1h'))}, $sink->url('/d'), $SECRET));
q1(q{SELECT idem_publish('d', '{}', 'a', '{"x-event-key": "a"}')});
$node->poll_query_until('postgres', q{SELECT paced_until > now() FROM idempotency.destinations WHERE name = 'd'})
  or die 'not paced';
$sink->set_mode('204');
q1(q{SELECT idem_destination_resume('d')});
note('after resume: ' . q1(q{SELECT coalesce(paced_until::text, 'null') FROM idempotency.destinations WHERE name = 'd'}));
q1(q{SELECT count(idem_publish('d', jsonb_build_object('n', g), 'b', '{"x-event-key": "b"}')) FROM generate_series(1, 20) g});
$node->poll_query_until('postgres', q{SELECT count(*) = 20 FROM idempotency.deliveries WHERE key = 'b' AND state = 'delivered'})
  or die 'b not delivered';
my $claims = q1(q{SELECT sum(claims) || ' claims, max ' || max(claims) FROM idempotency.deliveries WHERE key = 'b'});
note("key b: $claims");
is(q1(q{SELECT max(claims) FROM idempotency.deliveries WHERE key = 'b'}), '1',
	'after a resume, the chain of key b goes in one claim');
$sink->stop;
$node->stop;
done_testing();
