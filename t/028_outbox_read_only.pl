# default_transaction_read_only = on: a server made read-only on purpose
# gets no writes from the worker.  Cleanup already skipped its passes; the
# relay (whose claim is an UPDATE, run even when the outbox is empty) and
# outbox retention must skip theirs too, quietly: no error in the log, the
# worker stays up.  Set back to off, delivery resumes at once.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $node = PostgreSQL::Test::Cluster->new('read_only');
$node->init;
# debug1 shows each skipped cleanup pass: the test counts them to know that
# the worker has been through its loop a few times.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1s'
log_min_messages = debug1
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE received (event_id uuid PRIMARY KEY);
	CREATE FUNCTION consume(event jsonb) RETURNS void LANGUAGE sql AS
		$$ INSERT INTO received VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('local', 'function', 'consume(jsonb)', '{orders.*}');
});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'the per-database worker did not start';
my $pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});

# Events published before the switch are delivered by then.
$node->safe_psql('postgres', q{SELECT idem_publish('orders.created', '{"n": 1}')});
$node->poll_query_until('postgres', q{SELECT count(*) = 1 FROM received})
  or die 'the first event was not delivered';

my $offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET default_transaction_read_only = on;
	SELECT pg_reload_conf();
});
# A publisher that opts out of the default: its commit wakes the worker.
my $id = $node->safe_psql('postgres', q{
	BEGIN READ WRITE;
	SELECT idem_publish('orders.created', '{"n": 2}');
	COMMIT;
});

# Wait for three skipped cleanup passes after the publish.
my $skipped = qr/idempotency cleanup of database "postgres" skipped: default_transaction_read_only is on/;
my $waited = 0;
while ((() = slurp_file($node->logfile, $offset) =~ /$skipped/g) < 3)
{
	die 'the worker did not skip three cleanup passes' if $waited++ > 10 * $PostgreSQL::Test::Utils::timeout_default;
	usleep(100_000);
}

my $log = slurp_file($node->logfile, $offset);
my @errors = grep { /\[$pid\] (?:ERROR|FATAL)/ } split /\n/, $log;
is(scalar(@errors), 0, 'the worker logged no error while the server was read-only')
  or diag(join("\n", @errors));
unlike($log, qr/background worker "idempotency cleanup" \(PID \d+\) exited/, 'it never exited');
is(scalar(() = $log =~ /LOG:  idempotency relay of database "postgres" is paused: default_transaction_read_only is on/g),
	1, 'it said once that the relay is paused');
is( $node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'}),
	$pid, 'the same worker is still running');
is($node->safe_psql('postgres', "SELECT count(*) FROM received WHERE event_id = '$id'"),
	'0', 'the event waits');
is( $node->safe_psql('postgres', "SELECT attempts FROM idempotency.deliveries WHERE event_id = '$id'"),
	'0', 'unclaimed');

# Read-write again: the reload wakes the worker, which delivers at once.
$offset = -s $node->logfile;
$node->safe_psql('postgres', q{
	ALTER SYSTEM RESET default_transaction_read_only;
	SELECT pg_reload_conf();
});
ok($node->poll_query_until('postgres', "SELECT count(*) = 1 FROM received WHERE event_id = '$id'"),
	'delivery resumes once the server is read-write again');
ok($node->log_contains(qr/LOG:  idempotency relay of database "postgres" resumes/, $offset),
	'and the worker says so');
is( $node->safe_psql('postgres',
		q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'}),
	$pid, 'in the same process');

$node->stop;
done_testing();
