# Waiting for crash recovery in the TAP tests.
#
# After a backend or background worker is killed with SIGKILL, the postmaster
# terminates every other process, reinitializes and replays WAL.  Polling with
# poll_query_until() during that window races it: the psql it starts can be
# refused and exit before it has read its query, and IPC::Run then dies of a
# broken pipe.  So the tests note where the server log ends before the kill,
# and wait for the log to say that the server has been through the crash and
# accepts connections again before they run a query.
package CrashRecovery;

use strict;
use warnings;

use Exporter 'import';
our @EXPORT = qw(log_offset wait_for_crash_recovery);

# Where the node's server log ends now: pass it to wait_for_crash_recovery.
sub log_offset
{
	my ($node) = @_;
	return -s $node->logfile;
}

# Wait until the node has been through crash recovery since $offset and
# answers queries again.
sub wait_for_crash_recovery
{
	my ($node, $offset) = @_;
	$node->wait_for_log(qr/all server processes terminated; reinitializing/, $offset);
	$node->wait_for_log(qr/database system is ready to accept connections/, $offset);
	$node->poll_query_until('postgres', 'SELECT true')
	  or die 'the server did not come back';
	return;
}

1;
