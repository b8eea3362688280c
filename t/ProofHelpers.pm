# Helpers shared by the TAP tests that prove the guarantees under failover
# and crashes (t/030_failover.pl, t/031_crash_windows.pl):
#
#  - node_conf(): the settings every node of these tests needs, in one place;
#  - app_sql(): the application under test, in SQL: a payment endpoint that
#    claims, writes, publishes its event and stores its response in one
#    transaction (app_pay), a three-phase checkout (app_phase), a message
#    consumer (app_consume), and a function destination (fdest);
#  - pay(), checkout(), run_phases(): the clients of those endpoints, as the
#    README tells a client to behave (retry with the same key; on
#    in_progress wait retry_after seconds);
#  - ProofHelpers::Sink: t/WebhookSink.pm with one more mode, "hold
#    <status>": a request is received (and logged) at once, but answered
#    only when the test calls release();
#  - report_figures(): the figures of a run as TAP diag lines.
package ProofHelpers;

use strict;
use warnings;

use Exporter 'import';
use Test::More;
use Time::HiRes qw(sleep);

our @EXPORT = qw(node_conf app_sql pay checkout run_phases report_figures
  $PAY_SCOPE $ORDER_SCOPE $SECRET);

our $PAY_SCOPE = 'shop:POST /payments';
our $ORDER_SCOPE = 'shop:POST /checkout';
our $SECRET = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';

# The settings every node of these tests gets, before its own.  A setting
# that all of them need -- e.g. one that lets webhooks go to 127.0.0.1, where
# the sink listens -- is added here, and only here.
sub node_conf
{
	return <<'EOF';
shared_preload_libraries = 'idempotency'
restart_after_crash = on
idempotency.relay_allowed_networks = '127.0.0.1'
EOF
}

# The application, run once per database after CREATE EXTENSION.
sub app_sql
{
	return <<'EOF';
-- Domain tables.  No unique constraint on op_key or message_id: a second
-- execution of an operation, or a second processing of a message, would
-- show as a second row.
CREATE TABLE payments (id serial PRIMARY KEY, op_key text NOT NULL, amount int NOT NULL);
CREATE TABLE phase_writes (op_key text NOT NULL, phase int NOT NULL, token bigint NOT NULL);
CREATE TABLE shipments (message_id text NOT NULL);
-- What the function destination received, one row per call that committed.
CREATE TABLE fsink (event_id uuid NOT NULL, op_key text, n int);
-- fdest sleeps on the call for the event whose payload has n = stall.on_n.
CREATE TABLE stall (on_n int);
INSERT INTO stall VALUES (NULL);

-- Every domain write passes this gate.  It is open unless the test holds
-- advisory lock 4242 exclusively; then the writer waits in the middle of
-- its transaction, where the test can kill it.
CREATE FUNCTION domain_gate() RETURNS void LANGUAGE sql AS
$$ SELECT pg_advisory_xact_lock_shared(4242) $$;

-- POST /payments: claim, write the payment, publish its event, store the
-- response, all in the caller's transaction.  Returns what the client gets.
CREATE FUNCTION app_pay(p_key text, p_amount int,
						OUT outcome text, OUT status int, OUT headers text, OUT body text)
LANGUAGE plpgsql AS $$
DECLARE
	c		record;
	pay_id	int;
	b		jsonb;
	h		jsonb;
BEGIN
	SELECT * INTO c FROM idem_claim('shop:POST /payments', p_key,
									jsonb_build_object('amount', p_amount));
	outcome := c.outcome;
	IF c.outcome <> 'claimed' THEN
		status := c.status;
		headers := c.headers::text;
		body := c.body::text;
		RETURN;
	END IF;
	INSERT INTO payments (op_key, amount) VALUES (p_key, p_amount) RETURNING id INTO pay_id;
	PERFORM idem_publish('payment.created',
						 jsonb_build_object('op_key', p_key, 'payment_id', pay_id),
						 key => p_key,
						 headers => jsonb_build_object('x-event-key', p_key,
													   'x-event-topic', 'payment.created'));
	PERFORM domain_gate();
	-- A response no second execution could reproduce: the row id, a nonce
	-- and the time.
	b := jsonb_build_object('payment_id', pay_id, 'amount', p_amount,
							'nonce', md5(random()::text), 'at', clock_timestamp());
	h := jsonb_build_object('Location', '/payments/' || pay_id);
	PERFORM idem_succeed('shop:POST /payments', p_key, 201, b, h);
	status := 201;
	headers := h::text;
	body := b::text;
END $$;

-- One phase of POST /checkout, in the caller's transaction: renew the lease
-- (which takes the key's lock, so a fenced owner stops here), write the
-- phase's row, then checkpoint 'phase<n>' (phases 1 and 2) or store the
-- response (phase 3).  Returns the recovery point, or the response as
-- 'status|headers|body'.
CREATE FUNCTION app_phase(p_key text, p_token bigint, p_phase int, p_lease interval)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	b		jsonb;
	h		jsonb;
BEGIN
	PERFORM idem_extend('shop:POST /checkout', p_key, p_token, p_lease);
	INSERT INTO phase_writes VALUES (p_key, p_phase, p_token);
	IF p_phase < 3 THEN
		PERFORM idem_checkpoint('shop:POST /checkout', p_key, p_token, 'phase' || p_phase);
		PERFORM domain_gate();
		RETURN 'phase' || p_phase;
	END IF;
	b := jsonb_build_object('order', p_key, 'nonce', md5(random()::text), 'at', clock_timestamp());
	h := jsonb_build_object('Location', '/orders/' || p_key);
	PERFORM idem_succeed('shop:POST /checkout', p_key, 201, b, h, token => p_token);
	PERFORM domain_gate();
	RETURN '201|' || h::text || '|' || b::text;
END $$;

-- A message consumer: apply the message unless the inbox has seen it.
CREATE FUNCTION app_consume(p_message_id text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
	IF NOT idem_inbox_accept('orders-topic', p_message_id) THEN
		RETURN false;
	END IF;
	INSERT INTO shipments VALUES (p_message_id);
	PERFORM domain_gate();
	RETURN true;
END $$;

-- The function destination.
CREATE FUNCTION fdest(event jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO fsink VALUES ((event->>'id')::uuid, event->'payload'->>'op_key',
							  (event->'payload'->>'n')::int);
	IF (event->'payload'->>'n')::int = (SELECT on_n FROM stall) THEN
		PERFORM pg_sleep(300);
	END IF;
END $$;
EOF
}

# One request to POST /payments with key $key: the client's view,
# { outcome, response => 'status|headers|body' }.
sub pay
{
	my ($node, $key, $amount) = @_;
	my ($outcome, $response) = split /\|/,
	  $node->safe_psql('postgres',
		"SELECT outcome, concat_ws('|', status, headers, body) FROM app_pay('$key', $amount)"),
	  2;
	return { outcome => $outcome, response => $response };
}

# Run the phases of POST /checkout from $from to $to (each its own
# transaction) as the owner of token $token.  Returns the last phase's
# result: a recovery point, or the response 'status|headers|body'.
sub run_phases
{
	my ($node, $key, $token, $from, $to, $lease) = @_;
	my $out;
	for my $phase ($from .. $to)
	{
		$out = $node->safe_psql('postgres', "SELECT app_phase('$key', $token, $phase, '$lease')");
	}
	return $out;
}

# The client of POST /checkout: claim with a lease; replay: done; in_progress:
# wait retry_after seconds and retry; claimed: run the phases after the
# recovery point, one transaction each, unless claim_only.  Returns
# { attempts => [ { outcome, token, recovery_point, lease_expires_at } ... ],
#   token => the token claimed, next_phase => the first phase it has to run,
#   response => 'status|headers|body' (undef if claim_only) }.
sub checkout
{
	my ($node, $key, %opt) = @_;
	my $lease = $opt{lease} // '2 seconds';
	my %r = (attempts => []);

	for (1 .. 60)
	{
		my ($outcome, $token, $rp, $retry_after, $response) = split /\|/,
		  $node->safe_psql('postgres', qq{
			SELECT outcome, token, recovery_point, retry_after, concat_ws('|', status, headers, body)
			  FROM idem_claim('$ORDER_SCOPE', '$key', '{"cart": 1}', lease => '$lease')}), 5;
		my $attempt = { outcome => $outcome, token => $token, recovery_point => $rp };
		push @{ $r{attempts} }, $attempt;
		if ($outcome eq 'replay')
		{
			$r{response} = $response;
			return \%r;
		}
		if ($outcome eq 'in_progress')
		{
			die "retry_after must be at least 1, got '$retry_after'" unless $retry_after >= 1;
			sleep $retry_after;
			next;
		}
		die "unexpected outcome '$outcome'" unless $outcome eq 'claimed';
		# When the lease this claim took ends: the claim's own time plus the
		# lease, so that the caller can tell when the takeover happened.
		$attempt->{lease_expires_at} = $node->safe_psql('postgres', qq{
			SELECT lease_expires_at FROM idempotency.records
			 WHERE scope = '$ORDER_SCOPE' AND key = '$key'});
		$r{token} = $token;
		$r{next_phase} = $rp eq '' ? 1 : substr($rp, length('phase')) + 1;
		return \%r if $opt{claim_only};
		$r{response} = run_phases($node, $key, $token, $r{next_phase}, 3, $lease);
		return \%r;
	}
	die "checkout $key: no response after 60 attempts";
}

# The figures of a run, as diag lines a README can quote.
sub report_figures
{
	my ($name, @figures) = @_;
	while (my ($label, $value) = splice(@figures, 0, 2))
	{
		diag(sprintf('%s: %-28s %s', $name, $label, $value));
	}
}

# t/WebhookSink.pm with a mode "hold <status>": each request is logged as
# received at once, then answered with <status> only after release().  A
# test kills the relay while the request is held, then releases it: the
# consumer has processed the request, the relay never learned it.
package ProofHelpers::Sink;

use strict;
use warnings;

use parent -norequire, 'WebhookSink';
use WebhookSink;
use Time::HiRes qw(time sleep);

sub release_file { return $_[0]->{dir} . '/sink.release'; }

# From now on, hold every request until release().
sub hold
{
	my ($self, $status) = @_;
	unlink $self->release_file;
	$self->set_mode('hold ' . ($status // 204));
}

# Answer the held requests, and every later one at once.
sub release
{
	my ($self) = @_;
	open(my $fh, '>', $self->release_file) or die "cannot write sink release: $!";
	close $fh;
}

# Called by WebhookSink's connection handler for every request, after it
# has logged "received" and before it answers.
sub _mode
{
	my ($self) = @_;
	my $mode = $self->SUPER::_mode();
	return $mode unless $mode =~ /^hold (\d+)$/;
	my $status = $1;
	my $deadline = time() + 600;
	sleep 0.02 until -e $self->release_file || time() > $deadline;
	return $status;
}

# webhook-ids of the requests received so far.
sub received
{
	my ($self) = @_;
	return map { $_->{id} } grep { $_->{what} eq 'received' } $self->entries;
}

1;
