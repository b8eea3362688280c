#!/usr/bin/perl
# neighbour.pl: a misbehaving webhook endpoint for bench/relay.sh.
#
#   perl neighbour.pl PORT slow SECONDS PIDFILE
#       answers every request 204 No Content, SECONDS after it arrived;
#       each connection is served by a process of its own, so that many
#       requests wait at once, and kept-alive connections are honoured
#   perl neighbour.pl PORT blackhole PIDFILE
#       accepts every connection and never reads or answers anything
#
# It listens on 127.0.0.1:PORT, writes its pid to PIDFILE once it listens,
# and leads a process group of its own: bench/relay.sh stops it, with its
# children, by killing that group.
use strict;
use warnings;

use IO::Socket::INET;
use POSIX qw(setsid _exit);

my ($port, $mode) = @ARGV;
my ($seconds, $pidfile);
if (@ARGV == 4 && $mode eq 'slow' && $ARGV[2] =~ /^\d+(\.\d+)?$/)
{
	($seconds, $pidfile) = @ARGV[2, 3];
}
elsif (@ARGV == 3 && $mode eq 'blackhole')
{
	$pidfile = $ARGV[2];
}
else
{
	die "usage: $0 PORT slow SECONDS PIDFILE | PORT blackhole PIDFILE\n";
}

setsid();
my $listener = IO::Socket::INET->new(
	LocalAddr => '127.0.0.1',
	LocalPort => $port,
	Proto => 'tcp',
	Listen => 1024,
	ReuseAddr => 1) or die "cannot listen on 127.0.0.1:$port: $!\n";
open(my $fh, '>', $pidfile) or die "cannot write $pidfile: $!\n";
print $fh "$$\n";
close $fh;

$SIG{CHLD} = 'IGNORE';		# no zombies of finished connections
my @held;					# blackhole: the connections it never answers

while (1)
{
	my $conn = $listener->accept or next;

	if ($mode eq 'blackhole')
	{
		push @held, $conn;
		next;
	}
	my $pid = fork;
	if (!defined $pid)
	{
		close $conn;
		next;
	}
	if ($pid)
	{
		close $conn;
		next;
	}

	# The connection's own process: one request after the other.
	close $listener;
	$conn->autoflush(1);
	local $/ = "\r\n\r\n";
	while (defined(my $head = <$conn>))
	{
		my ($length) = $head =~ /^content-length:\s*(\d+)/im;
		my $body = '';
		if ($length)
		{
			local $/ = \$length;
			$body = <$conn>;
			last unless defined $body;
		}
		select(undef, undef, undef, $seconds);
		print $conn "HTTP/1.1 204 No Content\r\n\r\n" or last;
	}
	_exit(0);
}
