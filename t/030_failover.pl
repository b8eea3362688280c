# Failover to a synchronous standby loses nothing that committed, and
# executes nothing twice.
#
# The primary streams to a synchronous standby (synchronous_commit =
# remote_apply).  On it the application completes payments (claim, domain
# write, outbox event and response in one transaction), accepts inbox
# messages, and runs three-phase checkouts: some completed, some stopped
# after the claim, after phase 1, after phase 2, and one inside phase 2.
# Every payment publishes an event to a function destination and to an http
# destination (a local webhook sink).  At the moment of the failover:
#
#  - the events of the first payments are delivered to both destinations;
#  - 20 webhooks are in flight: the relay claimed them (committed, so the
#    standby has the claims) and the sink holds them unanswered;
#  - the events of the last payments are delivered to the function
#    destination (a relay busy with webhooks holds up no in-database
#    delivery) and are waiting at the http destination, whose 20 requests
#    in flight are its max_in_flight;
#  - transactions are open: a payment, an inbox message, phase 2 of a
#    checkout, and an event being published.
#
# The primary is stopped with 'immediate' (no shutdown checkpoint, no
# goodbye to the standby), and the sink then answers the held webhooks: the
# consumer has processed them, the relay never learned it.  The standby,
# before its promotion, runs neither the relay nor the cleanup: no worker in
# pg_stat_activity or idem_stats, nothing delivered, nothing deleted,
# although events are due and records expired.  After the promotion:
#
#  - every completed payment and checkout replays its response byte for
#    byte, and the domain has one row per completed key;
#  - the open payment executes once, the open inbox message is applied once,
#    the others are redeliveries;
#  - each checkout left mid-way is taken over after its lease, with a later
#    token and its last committed recovery point, the dead owner's token
#    fenced;
#  - the worker starts, cleans up, and delivers every event: once to the
#    function destination; to the http destination at least once, the only
#    repeats being the 20 held webhooks, under their webhook-ids.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use ProofHelpers;

my $LEASE = '4 seconds';

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
# The primary's whole configuration; the standby inherits it with its base
# backup and overrides one line below.  The worker (idempotency.databases)
# is the relay, and makes one cleanup pass at start.  One wave of at most 20
# requests per pass makes the visibility deadline of a claim the http
# destination's timeout plus 1 s.  Replication becomes synchronous once the
# standby streams (synchronous_standby_names, set below).
$primary->append_conf('postgresql.conf', node_conf() . q{
idempotency.databases = 'postgres'
idempotency.cleanup_interval = '1h'
idempotency.relay_batch_size = 20
idempotency.relay_max_in_flight = 20
idempotency.relay_visibility_margin = '1s'
synchronous_commit = remote_apply
});
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');
$primary->safe_psql('postgres', app_sql());

my $sink = ProofHelpers::Sink->new(
	port => PostgreSQL::Test::Cluster::get_free_port(),
	dir => PostgreSQL::Test::Utils::tempdir(),
	secrets => [$SECRET])->start;
$primary->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('ledger', 'function', 'fdest(jsonb)', '{payment.*}');
	SELECT idem_destination_create('hook', 'http', '%s', '{payment.*}',
		jsonb_build_object('secret', '%s', 'timeout', '20s', 'max_in_flight', 20));}, $sink->url, $SECRET));
# A worker started before CREATE EXTENSION skips its first pass; after a
# restart it makes one at once, and then none for an hour.  So expired rows
# inserted after that pass are for a worker on the standby to delete, if one
# ran there, or for the worker of the new primary.
$primary->restart;
$primary->poll_query_until('postgres',
	q{SELECT cleanup_runs > 0 FROM idem_stats WHERE datname = 'postgres'})
  or die 'the primary worker made no pass';

$primary->backup('backup');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
# If a worker ran on the standby, it would clean up every second.
$standby->append_conf('postgresql.conf', q{
idempotency.cleanup_interval = 1
});
$standby->start;
$primary->append_conf('postgresql.conf', "synchronous_standby_names = 'standby'");
$primary->reload;
$primary->poll_query_until('postgres',
	q{SELECT sync_state = 'sync' FROM pg_stat_replication WHERE application_name = 'standby'})
  or die 'the standby never became synchronous';
pass('the standby is synchronous');

my %completed;    # payment key => the response the client got
my %orders;       # checkout key => the response the client got
my ($dup_attempted, $dup_executed) = (0, 0);

# Requests to POST /payments, one transaction each, in one psql run.
# Returns { key => { outcome, response } }.
sub pay_many
{
	my ($node, @keys) = @_;
	my $out = $node->safe_psql('postgres', join '', map {
		"SELECT '$_', outcome, concat_ws('|', status, headers, body) FROM app_pay('$_', 10);\n"
	} @keys);
	my %r;
	for (split /\n/, $out)
	{
		my ($key, $outcome, $response) = split /\|/, $_, 3;
		$r{$key} = { outcome => $outcome, response => $response };
	}
	return \%r;
}

sub pay_new
{
	my $r = pay_many($primary, @_);
	for my $key (@_)
	{
		die "$key: $r->{$key}{outcome}" unless $r->{$key}{outcome} eq 'claimed';
		$completed{$key} = $r->{$key}{response};
	}
}

# Retry completed payments on $node: every one must replay, byte for byte.
sub retry_completed
{
	my ($node, $where, @keys) = @_;
	my $r = pay_many($node, @keys);
	my @wrong = grep { "$r->{$_}{outcome} $r->{$_}{response}" ne "replay $completed{$_}" } @keys;
	$dup_attempted += @keys;
	$dup_executed += grep { $r->{$_}{outcome} eq 'claimed' } @keys;
	is(scalar(@wrong), 0,
		"$where: all " . scalar(@keys) . " retries replay the stored response byte for byte")
	  or diag explain { map { $_ => [ $completed{$_}, $r->{$_} ] } @wrong[ 0 .. 2 ] };
}

sub delivered_all
{
	my ($node) = @_;
	return $node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state <> 'delivered'});
}

# ---- Expired rows, for the cleanup (see above).
$primary->safe_psql('postgres', q{
	INSERT INTO idempotency.records (scope, key, state, fingerprint, status, body, token,
									 created_at, completed_at, expires_at)
	SELECT 'expired', 'k' || g, 'completed', idem_fingerprint('{}'), 201, '{}', 1,
		   now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
	  FROM generate_series(1, 200) g;
	INSERT INTO idempotency.inbox (source, message_id, accepted_at, expires_at)
	SELECT 'expired', 'm' || g, now() - interval '2 days', now() - interval '1 day'
	  FROM generate_series(1, 50) g;
});
my $expired_sql = q{
	SELECT (SELECT count(*) FROM idempotency.records WHERE scope = 'expired') || ' '
		   || (SELECT count(*) FROM idempotency.inbox WHERE source = 'expired')};

# ---- Work on the primary.
# Payments whose events are delivered before the failover.
my @first = map { "p$_" } 1 .. 40;
pay_new(@first);
ok(delivered_all($primary), '40 payments; their events delivered to both destinations');

# Inbox messages.
my $accepted = $primary->safe_psql('postgres',
	join '', map { "SELECT app_consume('m$_');\n" } 1 .. 30);
is($accepted, join("\n", ('t') x 30), '30 inbox messages accepted and applied');

# Checkouts: three completed, four left mid-way.
for my $key (qw(o1 o2 o3))
{
	my $r = checkout($primary, $key, lease => $LEASE);
	$orders{$key} = $r->{response};
}
my %first_token;    # key => the token of the owner that dies at the failover
my %midway = (    # key => the last committed recovery point
	'o-claimed' => '',
	'o-phase1' => 'phase1',
	'o-phase2' => 'phase2',
	'o-inside' => 'phase1');
for my $key (sort keys %midway)
{
	my $r = checkout($primary, $key, lease => $LEASE, claim_only => 1);
	my $upto = $key eq 'o-phase2' ? 2 : $key eq 'o-claimed' ? 0 : 1;
	$first_token{$key} = $r->{token};
	run_phases($primary, $key, $r->{token}, 1, $upto, $LEASE) if $upto;
}

# Payments whose events reach the function destination at once, while the
# http destination is paused; then the sink starts holding requests and the
# http destination is resumed: the relay claims the 20 webhooks and sends
# them, and waits for answers that will not come before the failover.
$primary->safe_psql('postgres', q{SELECT idem_destination_pause('hook')});
my @held = map { "p$_" } 41 .. 60;
pay_new(@held);
$primary->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.deliveries d JOIN idempotency.destinations t
	    ON t.id = d.destination_id WHERE t.name = 'ledger' AND state <> 'delivered'})
  or die 'the function destination did not get the events';
my $received_before = $sink->received;
$sink->hold(204);
$primary->safe_psql('postgres', q{SELECT idem_destination_resume('hook')});
my $deadline = time() + 60;
sleep 0.05 while time() < $deadline && $sink->received < $received_before + 20;
my @held_ids = ($sink->received)[ $received_before .. $sink->received - 1 ];
is(scalar(@held_ids), 20, 'the relay sent 20 webhooks; the sink holds them');

# Payments whose events wait at the http destination, which has its 20
# requests (its max_in_flight, and idempotency.relay_max_in_flight) in
# flight; the function destination gets them at once all the same: the
# relay's loop never waits for webhooks before in-database deliveries.
my @last = map { "p$_" } 61 .. 70;
pay_new(@last);
$primary->poll_query_until('postgres', q{
	SELECT count(*) = 0 FROM idempotency.deliveries d JOIN idempotency.destinations t
	    ON t.id = d.destination_id WHERE t.name = 'ledger' AND state <> 'delivered'})
  or die 'the function destination did not get the last events while webhooks were in flight';
pass('the function destination got the last events while 20 webhooks were in flight');

# Transactions open at the failover.
my @open;
my %open_sql = (
	payment => q{SELECT outcome FROM app_pay('p-open', 10)},
	message => q{SELECT app_consume('m-open')},
	phase => qq{SELECT app_phase('o-inside', $first_token{'o-inside'}, 2, '$LEASE')},
	publish => q{SELECT idem_publish('payment.created', '{"op_key": "ghost"}', key => 'ghost',
				 headers => '{"x-event-key": "ghost", "x-event-topic": "payment.created"}') IS NOT NULL});
for my $what (sort keys %open_sql)
{
	my $s = $primary->background_psql('postgres', on_error_stop => 0);
	$s->query_safe('BEGIN');
	$s->query_safe($open_sql{$what});
	push @open, $s;
}
is( $primary->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'}),
	'4', 'four transactions open: a payment, an inbox message, phase 2 of a checkout, a publish');
# Where every delivery stands, and how many calls the function destination
# has committed.
my $state_sql = q{
	SELECT string_agg(t.name || ' ' || state || ' ' || attempts || ' ' || (visible_until IS NOT NULL)
					  || ' ' || n, ', ' ORDER BY t.name, state, attempts)
		   || '; fsink ' || (SELECT count(*) FROM fsink)
	  FROM (SELECT destination_id, state, attempts, visible_until, count(*) AS n
			  FROM idempotency.deliveries GROUP BY 1, 2, 3, 4) d
	  JOIN idempotency.destinations t ON t.id = d.destination_id};
my $state_at_failover = 'hook delivered 1 false 40, hook pending 0 false 10, hook pending 1 true 20, '
  . 'ledger delivered 1 false 70; fsink 70';
is($primary->safe_psql('postgres', $state_sql), $state_at_failover,
	'at the failover: 40+70 delivered, 20 webhooks claimed and in flight, 10 waiting for them');
my $worker_on_primary = $primary->safe_psql('postgres',
	q{SELECT worker_pid FROM idem_stats WHERE datname = 'postgres'});
isnt($worker_on_primary, '', "the primary's worker runs");

# ---- Failover.
$primary->stop('immediate');
$_->{run}->kill_kill for @open;
$sink->release;    # the consumer processes the held webhooks; nobody records it

is($standby->safe_psql('postgres', $state_sql), $state_at_failover,
	'the standby has all of it, the claims of the webhooks in flight included');
my $expired_at_failover = $standby->safe_psql('postgres', $expired_sql);
is($expired_at_failover, '200 50', 'the standby has the 200 expired records and 50 expired marks');
my $received_at_failover = $sink->received;

# The standby, not promoted: wait until it has been up for three cleanup
# intervals and the waiting events have been due for two seconds.
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'), 't', 'the standby is in recovery');
$standby->poll_query_until('postgres', q{
	SELECT now() - pg_postmaster_start_time() > interval '3 seconds'
	   AND now() - (SELECT max(published_at) FROM idempotency.outbox) > interval '2 seconds'})
  or die 'time does not pass';
is( $standby->safe_psql('postgres',
		q{SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'}),
	'0', 'no launcher, no worker on the standby');
is( $standby->safe_psql('postgres',
		q{SELECT count(*) FROM idem_stats WHERE worker_pid IS NOT NULL OR cleanup_runs > 0}),
	'0', 'idem_stats on the standby: no worker pid, no cleanup pass');
is($standby->safe_psql('postgres', $state_sql), $state_at_failover,
	'the standby delivered nothing: deliveries and the function sink unchanged');
is(scalar($sink->received), $received_at_failover, 'and sent no webhook');
is($standby->safe_psql('postgres', $expired_sql), '200 50', 'and deleted nothing');
retry_completed($standby, 'the standby', sort keys %completed);

# Promotion.
$standby->promote;
$standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()')
  or die 'the standby was not promoted';
my $node = $standby;
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency cleanup'})
  or die 'no worker after the promotion';
$node->poll_query_until('postgres', $expired_sql, '0 0')
  or die 'no cleanup after the promotion';
pass('after the promotion the worker starts and deletes the expired records and marks');
isnt($node->safe_psql('postgres', q{SELECT worker_pid FROM idem_stats WHERE datname = 'postgres'}),
	'', 'idem_stats shows the worker');

# ---- Retries on the new primary.
retry_completed($node, 'the new primary', sort keys %completed);
my $r = pay_many($node, 'p-open');
is($r->{'p-open'}{outcome}, 'claimed', 'the payment open at the failover executes on retry');
$completed{'p-open'} = $r->{'p-open'}{response};
retry_completed($node, 'the open payment, completed now', 'p-open');

my $redelivered = $node->safe_psql('postgres',
	join '', map { "SELECT app_consume('m$_');\n" } 1 .. 30, 'open');
is($redelivered, join("\n", ('f') x 30, 't'),
	'inbox: the 30 accepted messages are redeliveries; the open one is applied now');
$dup_attempted += 30;
$dup_executed += grep { $_ eq 't' } (split /\n/, $redelivered)[ 0 .. 29 ];
is($node->safe_psql('postgres', q{SELECT count(*) || ' ' || count(DISTINCT message_id) FROM shipments}),
	'31 31', 'one shipment per message');

for my $key (sort keys %orders)
{
	my $c = checkout($node, $key, lease => $LEASE);
	$dup_attempted++;
	$dup_executed++ if $c->{attempts}[-1]{outcome} eq 'claimed';
	is($c->{response}, $orders{$key}, "checkout $key: the retry replays the response byte for byte");
}
for my $key (sort keys %midway)
{
	my $dead_lease = $node->safe_psql('postgres',
		qq{SELECT lease_expires_at FROM idempotency.records WHERE scope = '$ORDER_SCOPE' AND key = '$key'});
	my $c = checkout($node, $key, lease => $LEASE, claim_only => 1);
	my $takeover = $c->{attempts}[-1];
	my ($old, $new) = ($first_token{$key}, $takeover->{token});
	is( "$takeover->{outcome} from '$takeover->{recovery_point}'",
		"claimed from '$midway{$key}'",
		"checkout $key: taken over from its last committed recovery point");
	cmp_ok($new, '>', $old, "checkout $key: with a later token");
	is( $node->safe_psql('postgres', qq{SELECT '$takeover->{lease_expires_at}'::timestamptz
						 - interval '$LEASE' >= '$dead_lease'::timestamptz}),
		't', "checkout $key: after the dead owner's lease expired");
	my ($ret, $out, $err) = $node->psql('postgres',
		qq{SELECT idem_extend('$ORDER_SCOPE', '$key', $old, '$LEASE')},
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/IK001/, "checkout $key: the old owner's token is fenced");
	$orders{$key} = run_phases($node, $key, $new, $c->{next_phase}, 3, $LEASE);
	my $expected = join ',', map { $_ <= ($c->{next_phase} - 1) ? "$_:$old" : "$_:$new" } 1 .. 3;
	is( $node->safe_psql('postgres', qq{
			SELECT string_agg(phase || ':' || token, ',' ORDER BY phase) FROM phase_writes WHERE op_key = '$key'}),
		$expected, "checkout $key: each phase's write exists once");
	my $again = checkout($node, $key, lease => $LEASE);
	$dup_attempted++;
	is($again->{response}, $orders{$key}, "checkout $key: then replays");
}

# ---- Events.
ok(delivered_all($node), 'the new primary delivers every event');
my $published = $node->safe_psql('postgres', 'SELECT count(*) FROM idempotency.outbox');
is($published, scalar(keys %completed), 'one event per completed payment, and no other');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM idempotency.outbox o
		 WHERE (SELECT count(*) FROM fsink f WHERE f.event_id = o.event_id) <> 1}),
	'0', 'function destination: every event exactly once');
my %event_of = map { split /\|/ } split /\n/,
  $node->safe_psql('postgres', q{SELECT payload->>'op_key', event_id FROM idempotency.outbox});
my (%accepted, %ids_of_key);
for my $e (grep { $_->{what} eq 'answered' && $_->{status} =~ /^2/ } $sink->entries)
{
	$accepted{ $e->{id} }++;
	$ids_of_key{ $e->{key} }{ $e->{id} } = 1;
}
my @lost = grep { !$accepted{ $event_of{$_} } } sort keys %event_of;
is(scalar(@lost), 0, 'http destination: every event accepted at least once');
is_deeply([ sort grep { $accepted{$_} > 1 } keys %accepted ], [ sort @held_ids ],
	'the repeats are exactly the 20 webhooks in flight at the failover');
ok(!(grep { $_ > 2 } values %accepted), 'each of them twice, no more');
is_deeply({ map { $_ => [ keys %{ $ids_of_key{$_} } ] } keys %ids_of_key },
	{ map { $_ => [ $event_of{$_} ] } keys %event_of },
	'every payment reached the sink under one webhook-id: its event id');
is( $node->safe_psql('postgres', q{SELECT redelivered FROM idem_outbox_stats WHERE destination = 'hook'}),
	'20', 'the relay counts the 20 repeats as redelivered');

# ---- Domain rows.
my $rows = $node->safe_psql('postgres',
	q{SELECT count(*) || ' ' || count(DISTINCT op_key) FROM payments});
is($rows, scalar(keys %completed) . ' ' . scalar(keys %completed),
	'one payment row per completed key');
$dup_executed += $node->safe_psql('postgres', q{SELECT count(*) - count(DISTINCT op_key) FROM payments});
is($dup_executed, 0, 'no duplicate executed');

report_figures('030_failover',
	'failovers survived' => 1,
	'operations completed' => scalar(keys %completed) + scalar(keys %orders),
	'inbox messages applied' => 31,
	'duplicates attempted' => $dup_attempted,
	'duplicates executed' => $dup_executed,
	'events published' => $published,
	'events lost' => scalar(@lost),
	'webhooks delivered twice' => scalar(grep { $_ > 1 } values %accepted));

$sink->stop;
$node->stop;
done_testing();
