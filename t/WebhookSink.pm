# A webhook receiver on loopback for the outbox TAP tests.
#
# It verifies every request as the Standard Webhooks specification tells a
# consumer to: the signed content is "<webhook-id>.<webhook-timestamp>.<body>",
# each "v1,<base64>" entry of webhook-signature is compared with
# base64(HMAC-SHA256(content, key)) for each key the receiver knows (the
# base64-decoded part of a whsec_ secret), and the timestamp must be within
# five minutes of now.  An unverified request gets 401.  A verified one gets
# the answer of the current mode.
#
# Every request is appended to a log (one line per request, written under
# flock, so concurrent connections never interleave):
#   received <time> <webhook-id> <conn>      when the request has arrived, on
#                                             connection <conn> (its server pid)
#   answered <time> <webhook-id> <status> <verified> <key> <topic>
#                                             just before the answer is sent
# "key" and "topic" come from the event headers the test publishes
# (x-event-key, x-event-topic), "-" when absent.
#
# The mode is read from a file for every request, so the test changes it at
# any time: "204", "500", "410", "sleep <seconds> <status>",
# "<status> retry-after <value>" (the answer carries "Retry-After: <value>"),
# or "key <key> <status> retry-after <value> after <seconds> else sleep
# <seconds>" (that answer, after a while, to the requests of one key,
# x-event-key; 204 after a while to the others).
#
# The server runs in a child process of the test (fork); each connection is
# served by a child of the server, so many requests are in flight at once
# and kept-alive connections are honoured.  stop() kills the whole process
# group; start() can listen on the same port again.
package WebhookSink;

use strict;
use warnings;

use Digest::SHA qw(hmac_sha256);
use IO::Socket::INET;
use MIME::Base64 qw(decode_base64 encode_base64);
use POSIX qw(setpgid _exit);
use Fcntl qw(:flock);
use Time::HiRes qw(time sleep);

# new(port => ..., dir => ..., secrets => ['whsec_...', ...])
sub new
{
	my ($class, %args) = @_;
	my $self = bless {%args}, $class;
	$self->{keys} = [ map { decode_base64(substr($_, length('whsec_'))) } @{ $args{secrets} } ];
	$self->set_mode('204');
	open(my $fh, '>', $self->log_file) or die "cannot create sink log: $!";
	close $fh;
	return $self;
}

sub log_file { return $_[0]->{dir} . '/sink.log'; }
sub mode_file { return $_[0]->{dir} . '/sink.mode'; }

sub url
{
	my ($self, $path) = @_;
	return "http://127.0.0.1:$self->{port}" . ($path // '/hook');
}

# Change the answer to every following request.
sub set_mode
{
	my ($self, $mode) = @_;
	my $tmp = $self->mode_file . '.tmp';
	open(my $fh, '>', $tmp) or die "cannot write sink mode: $!";
	print $fh $mode;
	close $fh;
	rename($tmp, $self->mode_file) or die "cannot rename sink mode: $!";
}

# Start listening; returns once the port accepts connections.
sub start
{
	my ($self) = @_;
	my $listener;
	for (1 .. 50)
	{
		$listener = IO::Socket::INET->new(
			LocalAddr => '127.0.0.1',
			LocalPort => $self->{port},
			Proto => 'tcp',
			Listen => 128,
			ReuseAddr => 1);
		last if $listener;
		sleep 0.1;
	}
	die "sink cannot listen on port $self->{port}: $!" unless $listener;

	my $pid = fork();
	die "fork failed: $!" unless defined $pid;
	if ($pid == 0)
	{
		setpgid(0, 0);
		$SIG{PIPE} = 'IGNORE';
		$SIG{CHLD} = 'IGNORE';    # no zombies from connection children
		while (1)
		{
			my $conn = $listener->accept or next;
			my $child = fork();
			if (defined $child && $child == 0)
			{
				close $listener;
				$self->_serve($conn);
				_exit(0);
			}
			close $conn;
		}
	}
	close $listener;
	$self->{pid} = $pid;
	return $self;
}

# Stop the server and every connection it is serving.
sub stop
{
	my ($self) = @_;
	return unless $self->{pid};
	kill 'KILL', -$self->{pid};
	kill 'KILL', $self->{pid};
	waitpid($self->{pid}, 0);
	delete $self->{pid};
}

sub DESTROY { $_[0]->stop if $_[0]->{pid}; }

sub _log
{
	my ($self, $line) = @_;
	open(my $fh, '>>', $self->log_file) or return;
	flock($fh, LOCK_EX);
	printf $fh "%s\n", $line;
	close $fh;
}

sub _mode
{
	my ($self) = @_;
	open(my $fh, '<', $self->mode_file) or return '204';
	my $mode = <$fh>;
	close $fh;
	return $mode // '204';
}

# Verify a request as Standard Webhooks says; returns 1 or 0.
sub _verify
{
	my ($self, $h, $body) = @_;
	my ($id, $ts, $sigs) = @$h{qw(webhook-id webhook-timestamp webhook-signature)};
	return 0 unless defined $id && defined $ts && defined $sigs;
	return 0 unless $ts =~ /^\d+$/ && abs(time() - $ts) <= 300;
	my $content = "$id.$ts.$body";
	for my $key (@{ $self->{keys} })
	{
		my $expected = encode_base64(hmac_sha256($content, $key), '');
		for my $entry (split / /, $sigs)
		{
			my ($version, $sig) = split /,/, $entry, 2;
			return 1 if $version eq 'v1' && defined $sig && $sig eq $expected;
		}
	}
	return 0;
}

# Serve one connection: HTTP/1.1 requests until the client closes it.
sub _serve
{
	my ($self, $conn) = @_;
	binmode $conn;
	while (1)
	{
		my $line = <$conn>;
		return unless defined $line;
		my %h;
		while (my $hl = <$conn>)
		{
			$hl =~ s/\r?\n$//;
			last if $hl eq '';
			my ($name, $value) = split /:\s*/, $hl, 2;
			$h{ lc $name } = $value;
		}
		my $body = '';
		my $len = $h{'content-length'} // 0;
		while (length($body) < $len)
		{
			my $n = read($conn, $body, $len - length($body), length($body));
			return unless $n;
		}
		my $id = $h{'webhook-id'} // '-';
		$self->_log(sprintf("received %.6f %s %d", time(), $id, $$));

		my $verified = $self->_verify(\%h, $body);
		my $mode = $self->_mode;
		my $status = $mode;
		my $extra = '';
		if ($mode =~ /^sleep (\S+) (\d+)$/)
		{
			sleep $1;
			$status = $2;
		}
		elsif ($mode =~ /^(\d+) retry-after (.+)$/)
		{
			$status = $1;
			$extra = "Retry-After: $2\r\n";
		}
		elsif ($mode =~ /^key (\S+) (\d+) retry-after (\S+) after (\S+) else sleep (\S+)$/)
		{
			if (($h{'x-event-key'} // '') eq $1)
			{
				sleep $4;
				$status = $2;
				$extra = "Retry-After: $3\r\n";
			}
			else
			{
				sleep $5;
				$status = 204;
			}
		}
		$status = 401 unless $verified;
		$self->_log(sprintf("answered %.6f %s %d %d %s %s", time(), $id, $status, $verified,
				$h{'x-event-key'} // '-', $h{'x-event-topic'} // '-'));
		my %reason = (204 => 'No Content', 401 => 'Unauthorized', 410 => 'Gone',
			429 => 'Too Many Requests', 500 => 'Internal Server Error',
			503 => 'Service Unavailable');
		print $conn "HTTP/1.1 $status " . ($reason{$status} // 'Status') .
		  "\r\n${extra}Content-Length: 0\r\n\r\n";
		$conn->flush;
	}
}

# The log as a list of hashes, in order.
sub entries
{
	my ($self) = @_;
	open(my $fh, '<', $self->log_file) or die "cannot read sink log: $!";
	my @e;
	while (my $l = <$fh>)
	{
		chomp $l;
		my @f = split / /, $l;
		if ($f[0] eq 'received')
		{
			push @e, { what => 'received', time => $f[1], id => $f[2], conn => $f[3] };
		}
		else
		{
			push @e, { what => 'answered', time => $f[1], id => $f[2], status => $f[3],
				verified => $f[4], key => $f[5], topic => $f[6] };
		}
	}
	close $fh;
	return @e;
}

# webhook-ids of requests answered with 2xx, in order (repeats included).
sub accepted
{
	my ($self) = @_;
	return map { $_->{id} }
	  grep { $_->{what} eq 'answered' && $_->{status} =~ /^2/ } $self->entries;
}

# Start afresh.
sub clear_log
{
	my ($self) = @_;
	open(my $fh, '>', $self->log_file) or die;
	close $fh;
}

1;
