# A three-phase payment survives a crash (kill -9 of the backend that owns the
# operation, then crash recovery) at every phase boundary, and still takes
# effect exactly once: one order row, one charge at the provider, one stored
# response.
#
# The Perl code below is the application.  One request handler attempt():
#   claim   idem_claim(..., lease => $LEASE); resume from its recovery_point,
#           skipping the phases already committed;
#   phase 1 insert the order row, checkpoint 'order_created';
#   phase 2 charge the card at the provider -- a table in a separate database
#           "provider", written through its own connection outside the phase
#           transaction, deduplicated by idem_downstream_key() (INSERT ... ON
#           CONFLICT DO NOTHING, then read the charge back) -- then, in a
#           transaction, record the charge id on the order and checkpoint
#           'charged';
#   phase 3 confirm the order and idem_succeed(..., token => t) with the
#           response, in one transaction.
# Every phase transaction begins with idem_extend(token): it renews the lease
# and takes the key's lock, so a fenced owner stops before it writes anything.
# The client (pay_until_done) retries after a crash at once and, on
# 'in_progress', sleeps for retry_after seconds before retrying.
#
# For each boundary -- after the claim, after phase 1's commit, after the
# provider call but before phase 2's checkpoint, after phase 2's commit, and
# before phase 3's commit -- an operation of its own (its own idempotency key)
# is killed there.  The retry finds the dead owner's lease still live
# ('in_progress'), waits it out, takes the operation over with the next token
# and the right recovery point, and runs only the missing phases.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use CrashRecovery;
use Time::HiRes qw(sleep);

my $SCOPE = 'shop-1:POST /orders';
my $REQUEST = '{"amount": 10}';
my $LEASE = '2 seconds';

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idempotency'\nrestart_after_crash = on");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
# No unique constraint on op_key: a repeated phase 1 would show as a 2nd row.
$node->safe_psql('postgres', q{
	CREATE TABLE orders (
		id			serial PRIMARY KEY,
		op_key		text NOT NULL,
		amount		int NOT NULL,
		charge_id	int,
		confirmed	boolean NOT NULL DEFAULT false
	)});
$node->safe_psql('postgres', 'CREATE DATABASE provider');
$node->safe_psql('provider', q{
	CREATE TABLE charges (
		id				serial,
		idempotency_key	text PRIMARY KEY,
		amount			int NOT NULL,
		charged_at		timestamptz NOT NULL DEFAULT now()
	)});

my %provider_calls;    # downstream key => calls made
my $crashes = 0;

# The external provider: idempotent by the key the caller sends.  Its own
# connection, committed on its own, whatever happens to the caller later.
sub provider_charge
{
	my ($dk, $amount) = @_;
	$provider_calls{$dk}++;
	return $node->safe_psql('provider', qq{
		INSERT INTO charges (idempotency_key, amount) VALUES ('$dk', $amount)
		ON CONFLICT (idempotency_key) DO NOTHING;
		SELECT id FROM charges WHERE idempotency_key = '$dk';});
}

# kill -9 the backend that owns the operation, and wait for crash recovery.
sub crash
{
	my ($app, $pid) = @_;
	my $offset = log_offset($node);

	kill 'KILL', $pid;
	$app->{run}->kill_kill;
	wait_for_crash_recovery($node, $offset);
	$crashes++;
}

# One attempt of the request handler.  $crash_at names the boundary at which
# the owning backend is killed (or undef).  Returns what happened: the claim's
# answer, the phases this attempt committed, the crash, the response.
sub attempt
{
	my ($key, $crash_at) = @_;
	$crash_at //= '';
	my $app = $node->background_psql('postgres');
	my $pid = $app->query_safe('SELECT pg_backend_pid()');
	my %r = (phases => []);
	my $q = sub { $app->query_safe($_[0]) };
	my $crash = sub {
		return 0 unless $_[0] eq $crash_at;
		crash($app, $pid);
		$r{crashed} = $_[0];
		return 1;
	};

	@r{qw(outcome token recovery_point retry_after status body)} = split /\|/,
	  $q->(qq{SELECT outcome, token, recovery_point, retry_after, status, body
			  FROM idem_claim('$SCOPE', '$key', '$REQUEST', lease => '$LEASE')}), -1;
	if ($r{outcome} ne 'claimed')
	{
		$app->quit;
		return \%r;
	}
	my $t = $r{token};
	my $rp = $r{recovery_point};
	my $renew = qq{SELECT idem_extend('$SCOPE', '$key', $t, '$LEASE') IS NOT NULL};
	return \%r if $crash->('after claim');

	if ($rp eq '')
	{
		$q->('BEGIN');
		$q->($renew);
		$q->(qq{INSERT INTO orders (op_key, amount) VALUES ('$key', 10)});
		$q->(qq{SELECT idem_checkpoint('$SCOPE', '$key', $t, 'order_created')});
		$q->('COMMIT');
		push @{ $r{phases} }, 1;
		$rp = 'order_created';
		return \%r if $crash->('after phase 1 commit');
	}
	if ($rp eq 'order_created')
	{
		$r{dk} = $q->(qq{SELECT idem_downstream_key('$SCOPE', '$key', 'charge')});
		my $charge = provider_charge($r{dk}, 10);
		return \%r if $crash->('after provider call');
		$q->('BEGIN');
		$q->($renew);
		$q->(qq{UPDATE orders SET charge_id = $charge WHERE op_key = '$key'});
		$q->(qq{SELECT idem_checkpoint('$SCOPE', '$key', $t, 'charged')});
		$q->('COMMIT');
		push @{ $r{phases} }, 2;
		$rp = 'charged';
		return \%r if $crash->('after phase 2 commit');
	}
	die "unexpected recovery point '$rp'" unless $rp eq 'charged';
	$q->('BEGIN');
	$q->($renew);
	$q->(qq{UPDATE orders SET confirmed = true WHERE op_key = '$key'});
	$q->(qq{SELECT idem_succeed('$SCOPE', '$key', 201,
			(SELECT jsonb_build_object('order_id', id, 'charge_id', charge_id)
			   FROM orders WHERE op_key = '$key'),
			NULL, token => $t)});
	return \%r if $crash->('before phase 3 commit');
	$q->('COMMIT');
	push @{ $r{phases} }, 3;
	@r{qw(status body)} = split /\|/,
	  $q->(qq{SELECT status, body FROM idem_replay('$SCOPE', '$key')}), -1;
	$app->quit;
	return \%r;
}

# The client: retry at once after a crash (a lost connection), sleep
# retry_after seconds on 'in_progress', stop at a response.  @crash_at: the
# boundary at which each successive owner dies.
sub pay_until_done
{
	my ($key, @crash_at) = @_;
	my @attempts;

	while (@attempts < 20)
	{
		my $r = attempt($key, $crash_at[0]);
		push @attempts, $r;
		if ($r->{crashed})
		{
			shift @crash_at;
			next;
		}
		if ($r->{outcome} eq 'in_progress')
		{
			die 'retry_after must be at least 1' unless $r->{retry_after} >= 1;
			sleep($r->{retry_after});
			next;
		}
		last;
	}
	return @attempts;
}

# The tokens the attempts got, in the order they were handed out.  Tokens
# come from a database-wide sequence, so the trace calls them t1, t2, ...
sub claimed_tokens
{
	return sort { $a <=> $b } map { $_->{outcome} eq 'claimed' ? $_->{token} : () } @_;
}

# One line per attempt: outcome, token, recovery point, phases it committed, crash.
sub trace
{
	my @tokens = claimed_tokens(@_);
	my %ordinal = map { $tokens[$_] => $_ + 1 } 0 .. $#tokens;
	return join ' | ', map {
		my $r = $_;
		$r->{outcome} eq 'claimed'
		  ? "claimed t$ordinal{$r->{token}} from "
		  . ($r->{recovery_point} eq '' ? 'start' : $r->{recovery_point})
		  . ' phases ' . (join(',', @{ $r->{phases} }) || '-')
		  . ($r->{crashed} ? " KILLED $r->{crashed}" : '')
		  : $r->{outcome}
	} @_;
}

my $db = sub { $node->safe_psql('postgres', $_[0]) };

# Check the end state of one operation after the client got its response.
sub check_done
{
	my ($key, $name, $tokens, $calls, @attempts) = @_;
	my $last = $attempts[-1];
	my $dk = $db->(qq{SELECT idem_downstream_key('$SCOPE', '$key', 'charge')});
	my $expected_body = $db->(qq{
		SELECT jsonb_build_object('order_id', id, 'charge_id', charge_id)
		  FROM orders WHERE op_key = '$key'});

	is("$last->{status} $last->{body}", "201 $expected_body",
		"$name: the client got the response");
	is( $db->(qq{SELECT count(*) || ' order, confirmed ' || bool_and(confirmed)
				 FROM orders WHERE op_key = '$key'}),
		'1 order, confirmed true', "$name: exactly one order row");
	is( $node->safe_psql('provider',
			qq{SELECT count(*) || ' charge of ' || sum(amount) FROM charges WHERE idempotency_key = '$dk'}),
		'1 charge of 10', "$name: exactly one charge for the downstream key");
	is( $node->safe_psql('provider', qq{SELECT id FROM charges WHERE idempotency_key = '$dk'}),
		$db->(qq{SELECT charge_id FROM orders WHERE op_key = '$key'}),
		"$name: the order records that charge");
	is($provider_calls{$dk}, $calls, "$name: provider called $calls time(s)");
	my @dks = map { $_->{dk} // () } @attempts;
	is_deeply(\@dks, [ ($dk) x $calls ],
		"$name: every owner sent the same downstream key");
	my @tokens = claimed_tokens(@attempts);
	is(scalar(@tokens), $tokens, "$name: $tokens owner(s), each with a token of its own");
	is( $db->(qq{SELECT state || ' token ' || token || ' at ' || recovery_point
				 FROM idempotency.records WHERE scope = '$SCOPE' AND key = '$key'}),
		"completed token $tokens[-1] at charged",
		"$name: completed with the last owner's token");

	my $replay = attempt($key);
	is("$replay->{outcome} $replay->{status} $replay->{body}", "replay 201 $expected_body",
		"$name: a later retry replays the response");
}

# Without a crash: one owner runs the three phases.
my @a = pay_until_done('op-nocrash');
is(trace(@a), 'claimed t1 from start phases 1,2,3', 'no crash: one attempt, three phases');
check_done('op-nocrash', 'no crash', 1, 1, @a);

# A crash at each boundary: the retry waits out the dead owner's lease, then
# takes over (token 2) from the last committed recovery point.
my @cases = (
	[ 'op-claim', 'after claim', 'start', '1,2,3', 1 ],
	[ 'op-phase1', 'after phase 1 commit', 'order_created', '2,3', 1 ],
	[ 'op-provider', 'after provider call', 'order_created', '2,3', 2 ],
	[ 'op-phase2', 'after phase 2 commit', 'charged', '3', 1 ],
	[ 'op-commit3', 'before phase 3 commit', 'charged', '3', 1 ],);

for my $case (@cases)
{
	my ($key, $point, $from, $phases, $calls) = @$case;
	my $done = { 'after claim' => '-', 'after phase 1 commit' => '1',
		'after provider call' => '1', 'after phase 2 commit' => '1,2',
		'before phase 3 commit' => '1,2' }->{$point};
	my @attempts = pay_until_done($key, $point);

	is( trace(@attempts),
		"claimed t1 from start phases $done KILLED $point | in_progress"
		  . " | claimed t2 from $from phases $phases",
		"killed $point: the retry waits for the lease, then takes over from $from");
	check_done($key, "killed $point", 2, $calls, @attempts);
}

# Two owners die in a row: the token grows with each takeover (1, 2, 3), and
# the provider, called by owners 2 and 3, still charges once.
@a = pay_until_done('op-twice', 'after phase 1 commit', 'after provider call');
is( trace(@a),
	'claimed t1 from start phases 1 KILLED after phase 1 commit | in_progress'
	  . ' | claimed t2 from order_created phases - KILLED after provider call | in_progress'
	  . ' | claimed t3 from order_created phases 2,3',
	'killed twice: two takeovers, tokens 1, 2, 3');
check_done('op-twice', 'killed twice', 3, 2, @a);

# The dead owners' tokens are fenced.
my $second = (claimed_tokens(@a))[1];
my ($ret, $out, $err) = $node->psql('postgres',
	qq{SELECT idem_checkpoint('$SCOPE', 'op-twice', $second, 'late')},
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/IK001: idem_checkpoint: token $second .* is no longer current/,
	'a dead owner\'s token is fenced with IK001');

is($crashes, 7, 'seven crashes');
is( scalar(() = slurp_file($node->logfile) =~ /terminated by signal 9: Killed/g),
	7, 'the server went through crash recovery seven times');
is($node->safe_psql('provider', 'SELECT count(*) FROM charges'),
	'7', 'one charge per operation, seven operations');

$node->stop;
done_testing();
