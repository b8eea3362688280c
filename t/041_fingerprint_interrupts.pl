# Fingerprinting a large request can be cancelled: statement_timeout (or
# pg_cancel_backend) stops idem_fingerprint, idem_canonical, idem_claim and
# idem_execute within a small part of the time the uninterrupted call takes.
#
# The machine may be slow and shared, so nothing here depends on absolute
# speed: for each shape of document the uninterrupted duration T is measured
# first, in this test, and grown until it is at least a second; then every
# function is run with statement_timeout = T/10 and must be cancelled
# (SQLSTATE 57014) in less than T/10 + (T - T/10)/2.  Before the loops
# checked for interrupts, the cancel arrived only after the whole work, at
# about T.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('interrupts');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE docs (shape text PRIMARY KEY, doc jsonb);
	CREATE FUNCTION handler(request jsonb) RETURNS idem_response LANGUAGE sql AS
		$$ SELECT ROW(200, NULL, NULL)::idem_response $$;
});

# The documents: numbers with 19 to 25 significant digits that are exactly
# doubles (i * 2^60), which take the slow exact-double path of the canonical
# form; in an array, and as the values of an object (the member loops).
my %generator = (
	array => 'SELECT jsonb_agg(i::numeric * 1152921504606846976) FROM generate_series(1, %d) i',
	object => q{SELECT jsonb_object_agg('k' || i, i::numeric * 1152921504606846976) FROM generate_series(1, %d) i},
);

# Run one statement under psql's \timing; return (milliseconds, SQLSTATE or
# '' on success).
sub timed
{
	my ($sql, $timeout_ms) = @_;
	my ($out, $err) = ('', '');
	my $set = defined $timeout_ms ? "SET statement_timeout = '${timeout_ms}ms';" : '';
	$node->psql('postgres', "\\set VERBOSITY verbose\n$set\n\\timing on\n$sql;\n",
		stdout => \$out, stderr => \$err, on_error_stop => 0);
	my ($ms) = $out =~ /Time: ([0-9.]+) ms/;
	die "no timing in output of $sql: $out $err" unless defined $ms;
	my ($state) = $err =~ /ERROR:  ([0-9A-Z]{5}):/;
	return ($ms, $state // '');
}

# The calls under test; each fingerprints (or canonicalises) the document.
# One statement each (psql's \timing times each statement): a claim that is
# not cancelled fails at commit, which the test reports as a wrong SQLSTATE.
my %call = (
	idem_fingerprint => q{SELECT length(idem_fingerprint(doc)) FROM docs WHERE shape = '%s'},
	idem_canonical => q{SELECT length(idem_canonical(doc)) FROM docs WHERE shape = '%s'},
	idem_claim => q{SELECT outcome FROM docs, idem_claim('s', 'k', doc) WHERE shape = '%s'},
	idem_execute => q{SELECT status FROM docs, idem_execute('s', 'k', doc, 'handler(jsonb)') WHERE shape = '%s'},
);

for my $shape (sort keys %generator)
{
	my $n = 100000;
	my ($uninterrupted, $state);
	while (1)
	{
		$node->safe_psql('postgres', sprintf(
			"INSERT INTO docs VALUES ('%s', (%s)) ON CONFLICT (shape) DO UPDATE SET doc = excluded.doc",
			$shape, sprintf($generator{$shape}, $n)));
		($uninterrupted, $state) = timed(sprintf($call{idem_fingerprint}, $shape));
		is($state, '', "$shape of $n numbers: fingerprinted without a timeout");
		last if $uninterrupted >= 1000 || $n >= 3200000;
		$n *= 2;
	}
	cmp_ok($uninterrupted, '>=', 1000,
		"$shape of $n numbers: uninterrupted fingerprint takes ${uninterrupted} ms, long enough to measure a cancel");

	my $timeout = int($uninterrupted / 10);
	my $bound = $timeout + ($uninterrupted - $timeout) / 2;
	for my $function (sort keys %call)
	{
		my ($ms, $st) = timed(sprintf($call{$function}, $shape), $timeout);
		is($st, '57014', "$function, $shape: cancelled by statement_timeout = $timeout ms");
		cmp_ok($ms, '<', $bound,
			"$function, $shape: cancel arrived after $ms ms, less than $bound ms (uninterrupted: $uninterrupted ms)");
	}
}

# A cancel in the middle leaves nothing behind: no leaked context warnings, and
# the session's next claim works.
is($node->safe_psql('postgres', q{
	BEGIN;
	SELECT outcome FROM idem_claim('s', 'after', '{"a": 1}'::jsonb);
	SELECT 'stored' FROM idem_succeed('s', 'after', 200);
	COMMIT;
	SELECT outcome FROM idem_claim('s', 'after', '{"a": 1}'::jsonb)}),
	"claimed\nstored\nreplay", 'claims work after the cancels');
my $log = slurp_file($node->logfile);
unlike($log, qr/leaked|still referenced|TRAP|terminated by signal/,
	'no leak warning, assertion or crash in the server log');

$node->stop;
done_testing();
