# Isolation of destinations in the worker's relay loop (issue 11, item 1).
#
# Three misbehaving 'http' endpoints -- one that answers after 20 s, one that
# refuses connections, one that accepts connections and never answers (a
# blackhole) -- have requests in flight when 20 events are published, one
# transaction each, to a healthy endpoint, and a few to a function and a
# notify destination.  All of those are delivered while the slow requests
# are still under way: the healthy webhooks are all received before the slow
# endpoint could have answered once, and the in-database deliveries are
# recorded as delivered meanwhile.  The contract is 2 s from commit to
# receipt; the pass/fail line is drawn at the 20-s gap (a loaded 2-core
# machine must not make the test fail), and the measured latencies are
# printed.  The slow endpoint and the blackhole have a backlog of 2,000 due
# events each behind their requests in flight, and a paused destination has
# 2,000 more: a claim must not walk (or lock) the backlog of a destination
# that may take nothing to find the healthy one's deliveries.  Whatever the
# machine's speed: auto_explain logs the plan of each claim statement with
# the rows its scans of the deliveries returned or filtered out, and no
# claim may touch anywhere near those 6,000 rows.
#
# Then per-destination concurrency: a destination with max_in_flight 3 and
# a 1-s endpoint has 12 deliveries due; the sink never has more than 3 of
# its requests under way at once, and has several.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use IO::Socket::INET;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);
use OutboxNode;

my $node = start_outbox_node('isolation', worker => 1, preload => 'idempotency,auto_explain', conf => q{
auto_explain.log_min_duration = 0
auto_explain.log_analyze = on
auto_explain.log_timing = off
auto_explain.log_nested_statements = on
});

my $healthy = start_sink();
my $slow = start_sink();
$slow->set_mode('sleep 20 204');

# Nothing listens here: connections are refused.
my $refused_port = PostgreSQL::Test::Cluster::get_free_port();

# A blackhole: the kernel accepts connections into the backlog, nobody
# reads or answers.
my $blackhole_port = PostgreSQL::Test::Cluster::get_free_port();
my $blackhole = IO::Socket::INET->new(
	LocalAddr => '127.0.0.1',
	LocalPort => $blackhole_port,
	Proto => 'tcp',
	Listen => 128,
	ReuseAddr => 1) or die "cannot listen: $!";

$node->safe_psql('postgres', sprintf(q{
	CREATE TABLE received (event_id uuid, at timestamptz DEFAULT clock_timestamp());
	CREATE FUNCTION receive(event jsonb) RETURNS void LANGUAGE sql
		AS $$ INSERT INTO received (event_id) VALUES ((event->>'id')::uuid) $$;
	SELECT idem_destination_create('slow', 'http', '%s', '{slow.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s'));
	SELECT idem_destination_create('refused', 'http', 'http://127.0.0.1:%d/hook', '{refused.*}',
		jsonb_build_object('secret', '%s', 'backoff_base', '100ms', 'backoff_cap', '200ms',
			'max_attempts', 1000));
	SELECT idem_destination_create('blackhole', 'http', 'http://127.0.0.1:%d/hook', '{black.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s'));
	SELECT idem_destination_create('healthy', 'http', '%s', '{healthy.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s'));
	SELECT idem_destination_create('parked', 'http', '%s', '{parked.*}',
		jsonb_build_object('secret', '%s'));
	SELECT idem_destination_pause('parked');
	SELECT idem_destination_create('fn', 'function', 'receive(jsonb)', '{local.*}');
	SELECT idem_destination_create('ui', 'notify', 'isolation_events', '{local.*}');},
	$slow->url, $SECRET, $refused_port, $SECRET, $blackhole_port, $SECRET,
	$healthy->url, $SECRET, $healthy->url, $SECRET));

# The misbehaving endpoints get their requests first: 5 each, on distinct keys.
# No slow answer can come before 20 s after this.
my $slow_started = time();
$node->safe_psql('postgres', q{
	SELECT idem_publish(t || '.x', jsonb_build_object('n', n), t || '-' || n)
	  FROM unnest('{slow,refused,black}'::text[]) t, generate_series(1, 5) n;});
# Then a backlog for the slow endpoint and the blackhole, older than
# anything the healthy destination will get.
$node->safe_psql('postgres', q{
	SELECT count(idem_publish(t || '.backlog', jsonb_build_object('n', n)))
	  FROM unnest('{slow,black,parked}'::text[]) t, generate_series(1, 2000) n;});
# Wait until the slow endpoint has as many requests under way as its
# max_in_flight (16) allows (and so the relay is in the middle of them).
my $waited = 0;
until (scalar(grep { $_->{what} eq 'received' } $slow->entries) >= 16)
{
	die 'the slow endpoint did not get its requests' if $waited++ > 600;
	sleep 0.1;
}
my $refused_attempts = $node->safe_psql('postgres', q{
	SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
	 WHERE t.name = 'refused' AND d.attempts >= 1});
cmp_ok($refused_attempts, '>=', 1, 'the refusing endpoint has been tried');

# Now the healthy destination's events, one transaction each, and local ones.
my $log_offset = -s $node->logfile;
my %published;
for my $n (1 .. 20)
{
	my $t0 = time();
	my $id = $node->safe_psql('postgres',
		"SELECT idem_publish('healthy.x', jsonb_build_object('n', $n), 'h-$n')");
	$published{$id} = $t0;
}
my %local;
for my $n (1 .. 5)
{
	my $t0 = time();
	my $id = $node->safe_psql('postgres', "SELECT idem_publish('local.x', jsonb_build_object('n', $n))");
	$local{$id} = $t0;
}

# Wait for the 20 healthy webhooks and the local deliveries (but never as
# long as the slow answer).
my $local_sql = q{
	SELECT count(*) FILTER (WHERE t.kind = 'function') || ' ' || count(*) FILTER (WHERE t.kind = 'notify')
	  FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
	 WHERE t.kind IN ('function', 'notify') AND d.state = 'delivered'};
my $local_done;
while (1)
{
	$local_done = $node->safe_psql('postgres', $local_sql);
	last if scalar(grep { $published{$_} } $healthy->accepted) >= 20 && $local_done eq '5 5';
	last if time() > $slow_started + 19;
	sleep 0.05;
}
my $checked_at = time();
my %received;
for my $e ($healthy->entries)
{
	$received{ $e->{id} } //= $e->{time} if $e->{what} eq 'received';
}
my @late = grep { !defined $received{$_} } keys %published;
is(scalar(@late), 0, 'all 20 healthy webhooks were received');
my $slow_answers = scalar(grep { $_->{what} eq 'answered' } $slow->entries);
is($slow_answers, 0, 'before the slow endpoint answered any of its requests');
cmp_ok($checked_at, '<', $slow_started + 20,
	'so within the slow endpoint\'s 20 s: nothing waited for it');
my @lat = sort { $a <=> $b } map { $received{$_} - $published{$_} } grep { defined $received{$_} } keys %published;
diag(sprintf('healthy latency publish -> receipt: median %.3f s, max %.3f s (contract: 2 s)',
		$lat[int(@lat / 2)] // -1, $lat[-1] // -1));

# The claims did not walk the backlogs: in each claim statement's plan (the
# relay's statements that lock with SKIP LOCKED), the rows that its scans of
# the deliveries' indexes returned or filtered out.
my $log = slurp_file($node->logfile, $log_offset);
my ($claims, $most_rows) = (0, 0);
for my $plan (split /\n(?=\S.*duration: )/, $log)
{
	next unless $plan =~ /Query Text:.*SKIP LOCKED/s;
	my ($touched, $in_scan) = (0, 0);
	for my $line (split /\n/, $plan)
	{
		if ($line =~ /Index (?:Only )?Scan (?:Backward )?using deliver\S+ on deliveries .*actual rows=(\d+) loops=(\d+)/)
		{
			$touched += $1 * $2;
			$in_scan = 1;
		}
		elsif ($in_scan && $line =~ /Rows Removed by Filter: (\d+)/)
		{
			$touched += $1;
		}
		elsif ($line =~ /->/)
		{
			$in_scan = 0;
		}
	}
	$claims++;
	$most_rows = $touched if $touched > $most_rows;
}
cmp_ok($claims, '>', 0, "auto_explain logged the claims ($claims)");
cmp_ok($most_rows, '<', 1000,
	"no claim walked the 6,000 rows of backlog of destinations that may take nothing (at most $most_rows rows)");

# Function and notify deliveries were not held up either.
is($local_done, '5 5', 'the function and notify deliveries were made meanwhile');
my $local_lat = $node->safe_psql('postgres', q{
	SELECT round(extract(epoch FROM max(d.delivered_at - o.published_at))::numeric, 3)
	  FROM idempotency.deliveries d JOIN idempotency.outbox o USING (event_id)
	  JOIN idempotency.destinations t ON t.id = d.destination_id
	 WHERE t.kind IN ('function', 'notify')});
diag("function/notify latency publish -> delivered: max $local_lat s");
is($node->safe_psql('postgres', 'SELECT count(*) FROM received'), '5', 'the function ran once per event');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
		 WHERE t.name = 'slow' AND d.state = 'pending' AND d.attempts = 1}),
	'16', 'the slow deliveries are still in flight, claimed once, max_in_flight (16) of them');

# ---- max_in_flight: at most 3 requests under way to one endpoint.
my $limited = start_sink();
$limited->set_mode('sleep 1 204');
$node->safe_psql('postgres', sprintf(q{
	SELECT idem_destination_create('limited', 'http', '%s', '{limited.*}',
		jsonb_build_object('secret', '%s', 'timeout', '60s', 'max_in_flight', 3));
	SELECT idem_publish('limited.x', jsonb_build_object('n', n)) FROM generate_series(1, 12) n;},
	$limited->url, $SECRET));
$node->poll_query_until('postgres', q{
	SELECT count(*) = 12 FROM idempotency.deliveries d JOIN idempotency.destinations t ON t.id = d.destination_id
	 WHERE t.name = 'limited' AND d.state = 'delivered'}) or die 'the limited deliveries were not made';
my ($open, $most) = (0, 0);
for my $e ($limited->entries)
{
	$open += $e->{what} eq 'received' ? 1 : -1;
	$most = $open if $open > $most;
}
cmp_ok($most, '<=', 3, "at most max_in_flight (3) requests were under way at once ($most)");
cmp_ok($most, '>=', 2, 'and more than one');

$healthy->stop;
$slow->stop;
$limited->stop;
close $blackhole;
$node->stop;
done_testing();
