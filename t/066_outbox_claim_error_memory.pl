# A claim that fails leaves no memory behind in the worker.
#
# Each claim of the relay loop gets a memory context of its own for what it
# claims (the "outbox relay claim" context), deleted once the last of its
# deliveries has been recorded.  A claim that failed before its deliveries
# joined the loop left its context behind, in the worker's long-lived
# memory, for as long as the worker ran: one more with every failed claim.
#
# A trigger makes every claim of the deliveries fail; after three failed
# claims, the worker's memory contexts (pg_log_backend_memory_contexts)
# must hold no claim context.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

my $node = PostgreSQL::Test::Cluster->new('claim_error_memory');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE received (event_id uuid);
	CREATE FUNCTION receive(event jsonb) RETURNS void LANGUAGE sql
		AS $$ INSERT INTO received VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('fn', 'function', 'receive(jsonb)', '{local.*}');
	CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$;
	CREATE TRIGGER refuse_claims BEFORE UPDATE ON idempotency.deliveries
		FOR EACH ROW EXECUTE FUNCTION refuse_claims();
	SELECT idem_publish('local.x', '{}');
});

# The worker backs off after each failure: 1 s, then 2 s, then 4 s.
my $failures = 0;
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while ($failures < 3)
{
	die 'the claims did not fail three times' if time() > $deadline;
	$failures = () = slurp_file($node->logfile) =~ /claims refused by the test/g;
	sleep 1;
}
pass("the worker's claims failed $failures times");

my $pid = $node->safe_psql('postgres',
	q{SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'});
my $log_offset = -s $node->logfile;
$node->safe_psql('postgres', "SELECT pg_log_backend_memory_contexts($pid)");
my $dump = '';
$deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
until ($dump =~ /Grand total/)
{
	die 'the worker did not log its memory contexts' if time() > $deadline;
	sleep 0.2;
	$dump = substr(slurp_file($node->logfile), $log_offset);
}
my $claims = () = $dump =~ /outbox relay claim:/g;
ok($dump =~ /outbox relay loop:/, 'the dump shows the relay loop\'s memory');
is($claims, 0, 'no claim context is left behind by the failed claims');

# Without the trigger the delivery is made.
$node->safe_psql('postgres', 'DROP TRIGGER refuse_claims ON idempotency.deliveries');
$node->poll_query_until('postgres', 'SELECT count(*) = 1 FROM received')
  or die 'the delivery was never made';
pass('once claims work again, the delivery is made');

$node->stop;
done_testing();
