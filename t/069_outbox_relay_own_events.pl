# idem_outbox_relay() in the transaction that published: its webhooks would
# announce events that are not committed, and that a rollback takes back.
#
# The pass runs in the caller's transaction, whose snapshot sees the
# transaction's own events: it claimed them and POSTed them to the endpoint,
# and a rollback (of the transaction, of a savepoint, of an EXCEPTION block)
# then took the events back after the endpoint had them; a transaction that
# committed later had them announced before its writes were visible.  The
# pass is refused (55000) in a transaction with live events of its own; a
# savepoint rolled back takes its events, and the refusal, with it.
#
# No worker: only the session's own relay passes send.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use OutboxNode;

my $node = start_outbox_node('relay_own_events');
my $sink = start_sink();

sub q1 { return $node->safe_psql('postgres', $_[0]); }

# Run sql with psql; returns its stdout and stderr.
sub run
{
	my ($sql) = @_;
	my ($out, $err) = ('', '');
	$node->psql('postgres', $sql, stdout => \$out, stderr => \$err,
		extra_params => ['-v', 'VERBOSITY=verbose']);
	return ($out, $err);
}

q1(sprintf(q{SELECT idem_destination_create('ep', 'http', '%s', '{p.*}',
	jsonb_build_object('secret', '%s'))}, $sink->url, $SECRET));

# 1. The pass in the transaction that published, which then rolls back.
my ($out, $err) = run(q{BEGIN;
	SELECT idem_publish('p.x', '{"case": 1}');
	SELECT idem_outbox_relay();
	ROLLBACK;});
like($err, qr/55000: idem_outbox_relay\(\) cannot run in a transaction that published events/,
	'a pass in the publishing transaction is refused');

# 2. Published in a savepoint, the pass inside it.
($out, $err) = run(q{BEGIN;
	SAVEPOINT s;
	SELECT idem_publish('p.x', '{"case": 2}', key => 'k1');
	SELECT idem_outbox_relay();
	ROLLBACK TO s;
	COMMIT;});
like($err, qr/55000/, 'a pass in the savepoint that published is refused');

# 3. In a PL/pgSQL EXCEPTION block that catches the error.
($out, $err) = run(q{DO $$
BEGIN
	BEGIN
		PERFORM idem_publish('p.x', '{"case": 3}');
		PERFORM idem_outbox_relay();
		RAISE EXCEPTION 'boom';
	EXCEPTION WHEN object_not_in_prerequisite_state THEN
		RAISE WARNING 'refused';
	END;
END $$;});
like($err, qr/refused/, 'a pass in the block that published is refused');

# 4. Published and relayed in a transaction that commits later: nothing is
#    sent before its writes are visible to others.
q1('CREATE TABLE orders (id int)');
my $bg = $node->background_psql('postgres', on_error_stop => 0);
$bg->query(q{BEGIN; INSERT INTO orders VALUES (7);
	SELECT idem_publish('p.x', '{"case": 4}'); SELECT idem_outbox_relay();});
is(scalar($sink->accepted), 0, 'nothing was sent by any of the passes above');
$bg->query('ROLLBACK');
$bg->quit;

# 5. A savepoint rolled back takes its events and the refusal with it: the
#    pass after it delivers what committed before, and only that.
my $committed = q1(q{SELECT idem_publish('p.x', '{"case": 5}')});
($out, $err) = run(q{BEGIN;
	SAVEPOINT s;
	SELECT idem_publish('p.x', '{"case": 6}');
	ROLLBACK TO s;
	SELECT idem_outbox_relay() AS attempted;
	COMMIT;});
is($err, '', 'a pass after the savepoint that published was rolled back runs');
is(join(',', $sink->accepted), $committed, 'it sent the committed event, and nothing else');
is(q1(q{SELECT count(*) FROM idempotency.outbox}), '1', 'no event of the refused cases exists');

$sink->stop;
$node->stop;
done_testing();
