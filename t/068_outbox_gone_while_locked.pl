# A 410 Gone answered while the destination's row is held by another
# transaction (an open idem_destination_alter) disables the destination
# once the row is free.
#
# The relay never waits for a destination row: it disabled the destination
# with FOR UPDATE SKIP LOCKED and, finding the row held, dropped the 410 on
# the floor; the destination stayed active for good.  Like the other
# endpoint state changes that meet a held row, the disable is kept in the
# relay process's memory and written at the next chance; it is not applied
# to a destination dropped meanwhile, nor to another one created with the
# same name.
#
# Driven by the worker's relay; every wait polls for a state.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep time);
use OutboxNode;

my $node = start_outbox_node('gone_while_locked', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

my $create = sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{ep.*}',
	jsonb_build_object('secret', '%s', 'max_attempts', 1))}, $sink->url, $SECRET);
my $alter = sprintf(q{SELECT idem_destination_alter('ep',
	jsonb_build_object('secret', '%s', 'max_attempts', 2))}, $SECRET);

# Publish one event while another session holds the destination's row (what
# $hold ran in its open transaction); returns once the relay has recorded
# its 410 (the delivery is dead: one attempt), the disable included.
sub gone_while_held
{
	my ($hold) = @_;
	$sink->set_mode('410');
	my $bg = $node->background_psql('postgres');
	$bg->query_safe("BEGIN; $hold");
	my $e = q1(q{SELECT idem_publish('ep.x', '{}')});
	ok($node->poll_query_until('postgres',
			"SELECT state = 'dead' AND last_status = 410 FROM idempotency.deliveries"
			  . " WHERE event_id = '$e'"),
		'the 410 was recorded while the row was held');
	return $bg;
}

# 1. Held by an idem_destination_alter, committed later.
q1($create);
my $bg = gone_while_held($alter);
is(q1(q{SELECT disabled_at IS NULL FROM idempotency.destinations WHERE name = 'ep'}),
	't', 'not disabled while the row is held');
$bg->query_safe('COMMIT');
$bg->quit;
ok($node->poll_query_until('postgres',
		q{SELECT disabled_at IS NOT NULL FROM idempotency.destinations WHERE name = 'ep'}),
	'disabled once the row is free');
is(q1(q{SELECT disabled_reason FROM idempotency.destinations WHERE name = 'ep'}),
	'the endpoint answered 410 Gone', 'with the 410 as its reason');
is(q1(q{SELECT max_attempts FROM idempotency.destinations WHERE name = 'ep'}),
	'2', 'the alter that held the row is kept');
is(q1(q{SELECT status FROM idem_outbox_stats WHERE destination = 'ep'}),
	'disabled', 'idem_outbox_stats shows it disabled');

# 2. Held by a transaction that drops the destination and creates another
#    of the same name: the 410 of the old one does not disable the new one.
q1(q{SELECT idem_destination_drop('ep')});
q1($create);
my $id2 = q1(q{SELECT id FROM idempotency.destinations WHERE name = 'ep'});
$bg = gone_while_held("$alter; SELECT idem_destination_drop('ep'); $create");
$sink->set_mode('204');
$bg->query_safe('COMMIT');
$bg->quit;
my $id3 = q1(q{SELECT id FROM idempotency.destinations WHERE name = 'ep'});
isnt($id3, $id2, 'the destination was re-created');
my $e = q1(q{SELECT idem_publish('ep.x', '{}')});
ok($node->poll_query_until('postgres',
		"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e'"),
	'the new destination delivers');
sleep 3;	# the relay has gone past the kept disable by now, several times
is(q1(q{SELECT disabled_at IS NULL FROM idempotency.destinations WHERE name = 'ep'}),
	't', 'the new destination of the same name is not disabled');
$e = q1(q{SELECT idem_publish('ep.x', '{}')});
ok($node->poll_query_until('postgres',
		"SELECT state = 'delivered' FROM idempotency.deliveries WHERE event_id = '$e'"),
	'and goes on delivering');

# The relay said so in the server log: both 410s were kept for later, and
# only the first destination was disabled.
my $log = slurp_file($node->logfile);
my @kept = ($log =~ /outbox destination "ep" to be disabled \(the endpoint answered 410 Gone\) once another transaction releases its row/g);
cmp_ok(scalar(@kept), '>=', 2, 'both 410s met a held row and were kept for later');
my @disabled = ($log =~ /outbox destination "ep" disabled:/g);
is(scalar(@disabled), 1, 'one destination disabled in all');

$sink->stop;
$node->stop;
done_testing();
