# An endpoint that answers a 2xx status line and then closes the connection
# before its header block ends (no empty line) did not answer in full: the
# delivery is not delivered.  libcurl reports such a transfer as complete
# (CURLE_OK, with the status of the line it read), and the relay recorded
# it as delivered: the event was never retried.  Found by an adversarial
# review.
#
# Raw TCP endpoints on loopback (no WebhookSink): each reads the request and
# writes a fixed byte string, then closes.  Driven by the worker's relay;
# every wait polls for a state.
use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IO::Socket::INET;
use POSIX qw(_exit);
use OutboxNode;

# Fork a server on a free port that answers every request with $answer.
my @children;
sub raw_endpoint
{
	my ($answer) = @_;
	my $port = PostgreSQL::Test::Cluster::get_free_port();
	my $l = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => $port,
		Listen => 64, ReuseAddr => 1, Proto => 'tcp') or die "listen: $!";
	my $pid = fork();
	die "fork: $!" unless defined $pid;
	if ($pid == 0)
	{
		$SIG{CHLD} = 'IGNORE';
		while (my $c = $l->accept)
		{
			next if fork();
			my $buf = '';
			while ($buf !~ /\r\n\r\n/) { my $r = sysread($c, $buf, 65536, length $buf); last unless $r; }
			my ($cl) = $buf =~ /content-length:\s*(\d+)/i;
			my ($body) = $buf =~ /\r\n\r\n(.*)$/s;
			$body //= '';
			while (defined $cl && length($body) < $cl) { my $r = sysread($c, $body, 65536, length $body); last unless $r; }
			syswrite($c, $answer);
			close $c;
			_exit(0);
		}
		_exit(0);
	}
	close $l;
	push @children, $pid;
	return "http://127.0.0.1:$port/hook";
}

my $node = start_outbox_node('truncated_answer', worker => 1, conf => q{
idempotency.cleanup_interval = '1h'
});

sub q1 { return $node->safe_psql('postgres', $_[0]); }

my %cases = (
	complete      => "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
	status_line   => "HTTP/1.1 200 OK\r\n",
	mid_headers   => "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n",
	mid_header_ln => "HTTP/1.1 204 No Content\r\nX-Foo: ba",
	# An interim answer ends its own header block; the final one must too.
	interim_complete => "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
	interim_cut      => "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n",
);
for my $name (sort keys %cases)
{
	my $url = raw_endpoint($cases{$name});
	q1(sprintf(q{SELECT idem_destination_create('%s', 'http', '%s', '{%s}',
		jsonb_build_object('secret', '%s', 'max_attempts', 1, 'timeout', '5s'))},
		$name, $url, $name, $SECRET));
	q1("SELECT idem_publish('$name', '{}')");
}
ok($node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM idempotency.deliveries WHERE state = 'pending'}),
	'every delivery was attempted (max_attempts 1)');

is(q1(q{SELECT dl.state || ' ' || coalesce(dl.last_status::text, '-')
	FROM idempotency.deliveries dl JOIN idempotency.destinations d ON d.id = dl.destination_id
	WHERE d.name = 'complete'}), 'delivered 200', 'a complete 200 is delivered');
is(q1(q{SELECT dl.state || ' ' || coalesce(dl.last_status::text, '-')
	FROM idempotency.deliveries dl JOIN idempotency.destinations d ON d.id = dl.destination_id
	WHERE d.name = 'interim_complete'}), 'delivered 200', 'a complete 200 after a 100 is delivered');
for my $name (qw(status_line mid_headers mid_header_ln interim_cut))
{
	my $r = q1(qq{SELECT dl.state || ' ' || coalesce(dl.last_status::text, '-') || ' ' || coalesce(dl.last_error, '-')
		FROM idempotency.deliveries dl JOIN idempotency.destinations d ON d.id = dl.destination_id
		WHERE d.name = '$name'});
	like($r, qr/^dead /, "$name: a response cut off inside its header block is not delivered (got: $r)");
}

kill 'KILL', @children;
$node->stop;
done_testing();
