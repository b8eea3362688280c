# Claims, multi-phase operations and inbox deliveries under load while
# VACUUM FULL rewrites the extension's tables every 50 ms.  A rewrite gives
# every row a new TID; a function that found a row, let go of its table lock
# and then deleted or updated the TID it had found acted on another key's row
# (or past the page's last item, or past the end of the file).  Before the
# fix this lost committed records and raised internal errors ("attempted to
# delete invisible tuple", "could not read block", duplicate keys).  Now the
# functions keep their locks until the transaction ends: no committed key is
# lost, and nothing fails but the documented retryable conflicts.
#
# Clients, for 20 seconds:
#   - 3 claim keys of a small set with a 1-microsecond ttl: every claim finds
#     an expired record, deletes it and writes its own;
#   - 1 runs multi-phase operations with 1-microsecond leases and ttls on a
#     small set (takeover, checkpoint and completion update by TID);
#   - 1 accepts inbox messages with a 1-microsecond ttl on a small set;
#   - 1 creates long-lived keys and inbox marks, remembering each one in a
#     table in the same transaction;
#   - 1 runs VACUUM FULL on the records and inbox tables every 50 ms;
# and the cleanup worker deletes expired rows every second.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
idempotency.cleanup_interval = 1
max_connections = 30
log_line_prefix = '%m [%p] %e '
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE created (key text PRIMARY KEY);
	CREATE TABLE accepted (message_id text PRIMARY KEY);

	CREATE FUNCTION short_op(k text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		o text;
	BEGIN
		SELECT outcome INTO o FROM idem_claim('short', k, '{}'::jsonb, interval '1 microsecond');
		IF o = 'claimed' THEN
			PERFORM idem_succeed('short', k, 200);
		END IF;
		RETURN o;
	END $$;

	CREATE FUNCTION phase_op(k text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim_result;
	BEGIN
		c := idem_claim('phase', k, '{}'::jsonb, interval '1 microsecond', interval '1 microsecond');
		IF c.outcome = 'claimed' THEN
			PERFORM idem_checkpoint('phase', k, c.token, 'p1');
			PERFORM idem_succeed('phase', k, 200, NULL, NULL, c.token);
		END IF;
		RETURN c.outcome;
	END $$;

	CREATE FUNCTION long_op(k text) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		o text;
	BEGIN
		SELECT outcome INTO o FROM idem_claim('long', k, '{}'::jsonb, interval '1 day');
		IF o = 'claimed' THEN
			INSERT INTO created VALUES (k);
			PERFORM idem_succeed('long', k, 201);
		END IF;
		IF idem_inbox_accept('long', k, interval '1 day') THEN
			INSERT INTO accepted VALUES (k);
		END IF;
		RETURN o;
	END $$;
});

my $dir = PostgreSQL::Test::Utils::tempdir;
my %scripts = (
	short => qq{\\set k random(1, 50)\nSELECT short_op('k' || :k);\n},
	phase => qq{\\set k random(1, 20)\nSELECT phase_op('k' || :k);\n},
	inbox => qq{\\set k random(1, 50)\nSELECT idem_inbox_accept('short', 'm' || :k, interval '1 microsecond');\n},
	long => qq{\\set k random(1, 1000000000)\nSELECT long_op('l' || :k);\n},
	rewrite => qq{VACUUM FULL idempotency.records;\nVACUUM FULL idempotency.inbox;\n\\sleep 50 ms\n},);
my %clients = (short => 3, phase => 1, inbox => 1, long => 1, rewrite => 1);

# Start every pgbench at once; retryable conflicts (40001, 40P01) are retried.
my %runs;
for my $name (sort keys %scripts)
{
	my $file = "$dir/$name.sql";
	open my $fh, '>', $file or die "could not write $file: $!";
	print $fh $scripts{$name};
	close $fh;
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[
			'pgbench', '--no-vacuum', '--client' => $clients{$name},
			'--time' => 20, '--max-tries' => 100, '--file' => $file,
			$node->connstr('postgres')
		],
		'>', \$out, '2>', \$err);
	$runs{$name} = { h => $h, out => \$out, err => \$err };
}
for my $name (sort keys %runs)
{
	my $run = $runs{$name};
	$run->{h}->finish;
	my $out = ${ $run->{out} };
	my ($tx) = $out =~ /number of transactions actually processed: (\d+)/;
	note "$name: " . ($tx // 'no') . ' transactions';
	is($run->{h}->result(0), 0, "$name clients ran to the end without an unexpected error")
	  or diag ${ $run->{err} };
	cmp_ok($tx // 0, '>', 0, "$name clients got work done");
}

# Every long-lived key and inbox mark that committed is still there.
my $created = $node->safe_psql('postgres', 'SELECT count(*) FROM created');
my $accepted = $node->safe_psql('postgres', 'SELECT count(*) FROM accepted');
cmp_ok($created, '>', 100, "$created long-lived keys were created");
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM created c
		 WHERE NOT EXISTS (SELECT FROM idempotency.records r
							WHERE r.scope = 'long' AND r.key = c.key)}),
	'0', 'no committed record was lost');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM idempotency.records WHERE scope = 'long'}),
	$created, 'and no record was created twice or without its domain row');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM accepted a
		 WHERE NOT EXISTS (SELECT FROM idempotency.inbox i
							WHERE i.source = 'long' AND i.message_id = a.message_id)}),
	'0', "no committed inbox mark was lost ($accepted marks)");

# The server log has no error but retryable conflicts: no internal error, no
# unreadable block, no duplicate key.
my @errors = grep { /\bERROR:/ && !/ (40001|40P01) +ERROR:/ } split /\n/,
  slurp_file($node->logfile);
is(scalar(@errors), 0, 'no error in the server log but retryable conflicts')
  or diag join("\n", @errors[ 0 .. ($#errors < 9 ? $#errors : 9) ]);

$node->stop;
done_testing();
