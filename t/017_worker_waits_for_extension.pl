# A cleanup worker whose database lacks the extension (or has an older
# version of it than the library) starts cleaning within seconds of CREATE
# EXTENSION (or ALTER EXTENSION UPDATE), not a whole cleanup_interval later.
# It used to set its next pass an interval ahead even when it had found no
# extension, so with the interval at an hour nothing was cleaned for an hour.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.cleanup_interval = '1h'
});
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE fresh');
$node->safe_psql('postgres', 'CREATE DATABASE older');
$node->safe_psql('older', q{CREATE EXTENSION idempotency VERSION '1.1'});
$node->append_conf('postgresql.conf', "idempotency.databases = 'fresh, older'");
$node->reload;
ok($node->wait_for_log(qr/extension "idempotency" is not installed in database "fresh"/),
	'the worker of a database without the extension says so');
ok($node->wait_for_log(qr/extension "idempotency" in database "older" is older than its library/),
	'the worker of a database with an older version says so');

my $expired = q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, token,
									 created_at, completed_at, expires_at)
	SELECT 'late', 'k' || g, 'completed', idem_fingerprint('{}'), 201, 1,
		   now() - interval '1 day', now() - interval '1 day', now() - interval '1 hour'
	  FROM generate_series(1, 50) g;
};

# Whether the expired rows are gone within 30 s.
sub cleaned_soon
{
	my ($db) = @_;
	for (1 .. 60)
	{
		return 1 if $node->safe_psql($db, q{SELECT count(*) FROM idempotency.records}) eq '0';
		usleep(500_000);
	}
	return 0;
}

$node->safe_psql('fresh', 'CREATE EXTENSION idempotency');
$node->safe_psql('fresh', $expired);
ok(cleaned_soon('fresh'), 'CREATE EXTENSION: cleanup starts within seconds');

$node->safe_psql('older', $expired);
$node->safe_psql('older', 'ALTER EXTENSION idempotency UPDATE');
ok(cleaned_soon('older'), 'ALTER EXTENSION UPDATE: cleanup starts within seconds');
ok($node->log_contains('extension "idempotency" is now installed in database "fresh"; cleanup starts'),
	'the worker says that cleanup starts');

$node->stop;
done_testing();
