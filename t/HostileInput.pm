# Hostile argument values for every SQL function of the extension, as SQL
# expressions: fixed adversarial values (limits, control bytes, odd Unicode,
# deep and huge JSON, extreme numbers, intervals and timestamps) and random
# ones drawn from a seeded generator, so that a run can be repeated exactly.
#
#   my $corpus = HostileInput->new($seed);
#   my @sql = $corpus->hostile('text', 'scope');   # all candidate values
#   my $sql = $corpus->pick('jsonb', 'body');      # one of them, at random
#   my $sql = $corpus->valid('text', 'key', $id);  # a value the function accepts
#
# Every value is an SQL expression of exactly the argument's type (a literal
# with a cast, or an expression), so overload resolution never changes.  An
# expression may itself fail before the function runs (an invalid UTF-8
# byte string, a lone surrogate escape in JSON, 'infinity' as an interval in
# PostgreSQL 15): that failure is part of the corpus too, since applications
# pass such input through the same calls.
package HostileInput;

use strict;
use warnings;

# Quote a Perl string (characters) as an SQL literal; no NUL.
sub lit
{
	my ($s) = @_;
	$s =~ s/'/''/g;
	return "'$s'";
}

# An SQL text expression for arbitrary bytes (no NUL): decoded from hex, so
# the script stays ASCII; invalid UTF-8 fails in convert_from (22021).
sub bytes_text
{
	my ($bytes) = @_;
	return "convert_from('\\x" . unpack('H*', $bytes) . "'::bytea, 'UTF8')";
}

sub new
{
	my ($class, $seed) = @_;
	my $self = bless { seed => $seed }, $class;
	srand($seed);
	$self->_build;
	return $self;
}

# A random integer in [0, n).
sub rnd { my ($n) = @_; return int(rand($n)); }

# One element of a list, at random.
sub one { return $_[ rnd(scalar @_) ]; }

# A random string of code points, some of each kind that trips up code:
# ASCII, controls, Latin-1, combining marks, RTL, BMP edges, astral.
sub random_string
{
	my ($maxlen) = @_;
	my @ranges = ([ 0x20, 0x7e ], [ 0x01, 0x1f ], [ 0x7f, 0x7f ], [ 0x80, 0xff ],
		[ 0x300, 0x36f ], [ 0x590, 0x6ff ], [ 0x200b, 0x202e ], [ 0xe000, 0xe0ff ],
		[ 0xfff0, 0xffff ], [ 0x10000, 0x1f9ff ], [ 0x10fff0, 0x10ffff ]);
	my $len = rnd($maxlen + 1);
	my $s = '';
	for (1 .. $len)
	{
		my $r = one(@ranges);
		$s .= chr($r->[0] + rnd($r->[1] - $r->[0] + 1));
	}
	return $s;
}

# Random bytes 0x01..0xff: mostly invalid UTF-8.
sub random_bytes
{
	my ($maxlen) = @_;
	return join('', map { chr(1 + rnd(255)) } 1 .. (1 + rnd($maxlen)));
}

# A JSON string literal for a Perl string, non-ASCII as \u escapes (astral
# characters as surrogate pairs), so that the JSON text is ASCII.
sub json_string
{
	my ($s) = @_;
	my $out = '"';
	for my $c (split //, $s)
	{
		my $o = ord($c);
		if ($c eq '"' || $c eq '\\') { $out .= "\\$c"; }
		elsif ($o < 0x20 || $o >= 0x7f)
		{
			if ($o > 0xffff)
			{
				my $v = $o - 0x10000;
				$out .= sprintf('\\u%04x\\u%04x', 0xd800 + ($v >> 10), 0xdc00 + ($v & 0x3ff));
			}
			else { $out .= sprintf('\\u%04x', $o); }
		}
		else { $out .= $c; }
	}
	return "$out\"";
}

# A random JSON number: huge and tiny exponents, long mantissas, -0.
sub random_number
{
	my @forms = (
		sub { (rnd(2) ? '-' : '') . rnd(1000) },
		sub { (rnd(2) ? '-' : '') . join('', map { rnd(10) } 1 .. 1 + rnd(120)) },
		sub { rnd(10) . '.' . join('', map { rnd(10) } 1 .. 1 + rnd(40)) . 'e' . (rnd(2) ? '-' : '') . rnd(1000) },
		sub { '-0' . (rnd(2) ? '.0' : '') },
		sub { '1e' . (rnd(2) ? '-' : '') . (300 + rnd(200)) },
	);
	return one(@forms)->();
}

# A random JSON text: nesting up to depth, random widths.
sub random_json
{
	my ($depth) = @_;
	my $r = rnd(10);
	if ($depth > 0 && $r < 2)
	{
		return '[' . join(',', map { random_json($depth - 1) } 1 .. rnd(6)) . ']';
	}
	if ($depth > 0 && $r < 4)
	{
		return '{' . join(',', map { json_string(random_string(8)) . ':' . random_json($depth - 1) } 1 .. rnd(6)) . '}';
	}
	return random_number() if $r < 6;
	return json_string(random_string(20)) if $r < 8;
	return one('true', 'false', 'null');
}

# The fixed adversarial values of each type, plus random ones.
sub _build
{
	my ($self) = @_;
	my %v;

	$v{text} = [
		q{''}, q{'a'}, q{' '}, q{'  padded  '},
		q{repeat('k', 255)}, q{repeat('k', 256)}, q{repeat('k', 100000)},
		q{repeat('é', 127)}, q{repeat('é', 128)}, q{repeat('😀', 63)}, q{repeat('😀', 64)},
		q{E'\x01'}, q{E'a\tb'}, q{E'line\nbreak'}, q{E'\r\n'}, q{E'\x7f'}, q{E'\x1b[31mred'},
		q{chr(127) || 'x'}, q{E'k\x08\x08'},
		q{'ключ'}, q{'日本語'}, q{'e' || chr(769)}, q{chr(8238) || 'cba'}, q{'שלום'},
		q{chr(65535)}, q{chr(65534)}, q{chr(1114111)}, q{chr(65279) || 'bom'},
		q{chr(8203)}, q{chr(173)}, q{chr(65533)}, q{chr(57344)}, q{chr(65536)},
		q{'\xc0\xaf'}, q{'%C0%AF'}, q{'\u0000'}, q{'\ud800'}, q{'\x00'},
		q{'%s%s%n%x'}, q{'''); DROP TABLE idempotency.records; --'}, q{'"'}, q{'\\'},
		q{'*'}, q{'.'}, q{'order.*'}, q{'*.*'}, q{'**'}, q{'NULL'}, q{'null'}, q{'-0'},
		q{'NaN'}, q{'1e308'},
		q{(SELECT string_agg(chr(i), '') FROM generate_series(1, 127) i)},
		q{(SELECT string_agg(chr(i), '') FROM generate_series(128, 400) i)},
	];
	push @{ $v{text} }, lit(random_string(40)) for 1 .. 24;
	push @{ $v{text} }, bytes_text(random_bytes(24)) for 1 .. 12;

	my @deep = map {
		(   "(repeat('[', $_) || repeat(']', $_))::jsonb",
			"(repeat('{\"a\":', $_) || '1' || repeat('}', $_))::jsonb")
	} (1000, 5000, 14000);
	$v{jsonb} = [
		q{'{}'::jsonb}, q{'[]'::jsonb}, q{'null'::jsonb}, q{'true'::jsonb}, q{'0'::jsonb},
		q{'""'::jsonb}, q{'"s"'::jsonb}, q{'{"a": 1}'::jsonb}, q{'[1, 2, 3]'::jsonb},
		q{'1e308'::jsonb}, q{'-0'::jsonb}, q{'-0.0'::jsonb}, q{'1e-400'::jsonb},
		q{'-1e-400'::jsonb}, q{'1e1000'::jsonb},
		q{(repeat('9', 100))::jsonb}, q{('-' || repeat('1', 100) || '.' || repeat('0', 50))::jsonb},
		q{'0.1000000000000000055511151231257827021181583404541015625'::jsonb},
		q{'[9007199254740993, 36028797018963968, 5e-324, 2.2250738585072014e-308]'::jsonb},
		q{'"NaN"'::jsonb}, q{'"Infinity"'::jsonb}, q{'"-Infinity"'::jsonb}, q{'"-0"'::jsonb},
		q{'"\ud83d\ude00"'::jsonb}, q{'"\ud800"'::jsonb}, q{'"\udc00\ud800"'::jsonb},
		q{'"\u0000"'::jsonb}, q{'"\uffff"'::jsonb}, q{'"e\u0301"'::jsonb},
		q{'"\u202eabc"'::jsonb}, q{'"\u2028\u2029"'::jsonb},
		q{'{"\uffff": 1, "\ud800\udc00": 2, "\ue000": 3, "": 4}'::jsonb},
		@deep,
		q{(SELECT jsonb_object_agg('k' || i, i) FROM generate_series(1, 20000) i)},
		q{(SELECT jsonb_agg(i) FROM generate_series(1, 100000) i)},
		q{to_jsonb(repeat('x', 2000000))}, q{to_jsonb(repeat(E'"\\\n\x01', 100000))},
		q{jsonb_build_object('s', repeat('y', 1048000))},
		q{'{"Content-Type": "text/plain"}'::jsonb}, q{'{"X": "a\r\nInjected: 1"}'::jsonb},
		q{'{"X\r\nY": "v"}'::jsonb}, q{'{"Bad Name:": "v"}'::jsonb},
		q{'{"webhook-id": "x"}'::jsonb}, q{'{"Host": "evil.example"}'::jsonb},
		q{'{"content-type": "x"}'::jsonb}, q{'{"": ""}'::jsonb}, q{'{"X": 1}'::jsonb},
		q{'{"X": null}'::jsonb}, q{'{"X": ["a"]}'::jsonb},
		q{(SELECT jsonb_object_agg('X-H' || i, 'v') FROM generate_series(1, 10000) i)},
		q{'{"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}'::jsonb},
		q{'{"secret": "whsec_"}'::jsonb}, q{'{"secret": "whsec_!!!!"}'::jsonb},
		q{'{"secret": "whsec_AA=="}'::jsonb}, q{jsonb_build_object('secret', 'whsec_' || repeat('QUFB', 3000))},
		q{'{"secrets": []}'::jsonb}, q{'{"secrets": [null]}'::jsonb}, q{'{"secrets": "x"}'::jsonb},
		q{'{"max_attempts": -1}'::jsonb}, q{'{"max_attempts": 0}'::jsonb},
		q{'{"max_attempts": 1e308}'::jsonb}, q{'{"max_attempts": 2147483648}'::jsonb},
		q{'{"max_attempts": 1.5}'::jsonb}, q{'{"max_attempts": "10"}'::jsonb},
		q{'{"backoff_base": "-1 s"}'::jsonb}, q{'{"backoff_base": "178000000 years"}'::jsonb},
		q{'{"backoff_base": 1e308}'::jsonb}, q{'{"backoff_cap": "0"}'::jsonb},
		q{'{"backoff_base": "2h", "backoff_cap": "1s"}'::jsonb},
		q{'{"timeout": "0"}'::jsonb}, q{'{"timeout": 1e-400}'::jsonb}, q{'{"timeout": -1}'::jsonb},
		q{'{"timeout": "infinity"}'::jsonb}, q{'{"timeout": "9223372036854775807 us"}'::jsonb},
		q{'{"headers": {"A": "b\r\nc"}}'::jsonb}, q{'{"headers": "x"}'::jsonb},
		q{'{"unknown": 1}'::jsonb}, q{'{"timeout": null}'::jsonb},
		q{'{"a": 1, "a": 2}'::jsonb},
	];
	push @{ $v{jsonb} }, lit(random_json(4)) . '::jsonb' for 1 .. 30;
	push @{ $v{jsonb} }, 'to_jsonb(' . bytes_text(random_bytes(16)) . ')' for 1 .. 4;

	# idem_claim's text overload: JSON text, and text that is not JSON.
	$v{request_text} = [
		q{'{"a": 1}'}, q{'{"a": 1, "a": 2}'}, q{''}, "'{'", q{'nul'}, q{'1e1000'},
		q{'[' || repeat('[', 20000) || repeat(']', 20000) || ']'}, q{'"\ud800"'},
		q{'{"a": 1} trailing'}, q{repeat(' ', 100000) || '1'}, q{E'\x01'},
	];
	push @{ $v{request_text} }, lit(random_json(4)) for 1 .. 10;

	$v{bytea} = [
		q{'\x'::bytea}, q{'\x00'::bytea}, q{decode(repeat('ab', 32), 'hex')},
		q{decode(repeat('ab', 64), 'hex')}, q{decode(repeat('ab', 65), 'hex')},
		q{decode(repeat('00', 1048576), 'hex')}, q{'\x00ff00'::bytea},
	];

	$v{interval} = [
		q{'-1 us'::interval}, q{'0'::interval}, q{'1 us'::interval}, q{'1 second'::interval},
		q{'1 hour'::interval}, q{'infinity'::interval}, q{'178000000 years'::interval},
		q{'-178000000 years'::interval}, q{'2147483647 days'::interval},
		q{'-2147483648 days'::interval}, q{'2147483647 months'::interval},
		q{'9223372036854775807 us'::interval}, q{'1 mon -30 days'::interval},
		q{'1 mon -31 days'::interval}, q{'-1 mon 31 days'::interval},
		q{'1 day -86400 s'::interval}, q{'-1 day 86401 s'::interval},
		q{'290000 years'::interval}, q{'294276 years'::interval},
		q{('294276-12-31 23:59:59+00'::timestamptz - now())},
	];

	$v{integer} = [
		'-1', '0', '1', '99', '100', '200', '599', '600', '1000', '2147483647',
		'(-2147483648)::integer',
	];
	$v{bigint} = [
		'0::bigint', '(-1)::bigint', '1::bigint', '2::bigint', '2147483648::bigint',
		'9223372036854775807::bigint', '(-9223372036854775808)::bigint',
	];
	$v{'text[]'} = [
		q{'{}'::text[]}, q{'{*}'::text[]}, q{'{""}'::text[]}, q{ARRAY[NULL]::text[]},
		q{'{order.*}'::text[]}, q{'{{a,b},{c,d}}'::text[]}, q{'[0:1]={a,b}'::text[]},
		q{array_fill('t'::text, ARRAY[10000])}, q{ARRAY[repeat('t', 256)]},
		q{'{*.*,**,a*b}'::text[]}, q{ARRAY[E'\x01']}, q{ARRAY['a', NULL]},
		q{ARRAY[chr(65535), 'e' || chr(769)]},
	];
	$v{'timestamp with time zone'} = [
		q{'infinity'::timestamptz}, q{'-infinity'::timestamptz},
		q{'4713-01-01 00:00:00+00 BC'::timestamptz}, q{'294276-12-31 23:59:59.999999+00'::timestamptz},
		q{'epoch'::timestamptz}, q{now()}, q{now() + '1 hour'},
	];
	$v{uuid} = [
		q{'00000000-0000-0000-0000-000000000000'::uuid}, q{'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid},
		q{gen_random_uuid()},
	];
	$v{regprocedure} = [
		q{'hx_handler(jsonb)'::regprocedure}, q{'hx_handler_null(jsonb)'::regprocedure},
		q{'hx_handler_nullrow(jsonb)'::regprocedure}, q{'hx_handler_status(jsonb)'::regprocedure},
		q{'hx_handler_raise(jsonb)'::regprocedure}, q{'hx_handler_int(jsonb)'::regprocedure},
		q{'hx_handler_setof(jsonb)'::regprocedure}, q{'hx_handler_two(jsonb,jsonb)'::regprocedure},
		q{'hx_handler_claims(jsonb)'::regprocedure}, q{'hx_handler_release(jsonb)'::regprocedure},
		q{'hx_proc(jsonb)'::regprocedure}, q{'hx_agg(jsonb)'::regprocedure},
		q{'lower(text)'::regprocedure}, q{'now()'::regprocedure},
		q{'idem_canonical(jsonb)'::regprocedure}, q{0::oid::regprocedure},
		q{4294967295::oid::regprocedure}, q{'nonexistent(jsonb)'::regprocedure},
	];

	$v{boolean} = [ 'true', 'false' ];
	# idem_citus_distribute's tenant table: none is a Citus table here.
	$v{regclass} = [
		q{'pg_class'::regclass}, q{'idempotency.records'::regclass}, q{0::oid::regclass},
		q{4294967295::oid::regclass},
	];

	# Values that only make sense for some arguments, by argument name.
	$v{'text:kind'} = [ q{'http'}, q{'notify'}, q{'function'}, q{'HTTP'}, q{'webhook'} ];
	$v{'text:target'} = [
		q{'http://127.0.0.1:9/hook'}, q{'https://127.0.0.1:9/'}, q{'file:///etc/passwd'},
		q{'gopher://127.0.0.1:9/'}, q{'http://'}, q{'http://[::1'}, q{'http://a b/'},
		q{E'http://127.0.0.1:9/\r\nHost: evil'}, q{'http://user:pw@127.0.0.1:9/'},
		q{'http://127.0.0.1:99999/'}, q{'HTTP://127.0.0.1:9/'},
		q{'hx_sink(jsonb)'}, q{'hx_handler_int(jsonb)'}, q{'pg_catalog.pg_sleep(float8)'},
		q{'nonexistent(jsonb)'}, q{'hx_sink(jsonb); DROP TABLE hx_events'}, q{'hx_sink'},
		q{'hx_chan'}, q{repeat('c', 63)}, q{repeat('c', 64)}, q{'Chan With Space'},
		q{'"quoted"'},
	];
	$v{'text:topic'} = [ q{'order.created'}, q{'*'}, q{'order.*'} ];

	$self->{values} = \%v;
	return;
}

# The corpus key for an argument: by name where the name has its own values.
sub _key
{
	my ($self, $type, $name) = @_;
	return 'request_text' if $type eq 'text' && $name eq 'request';
	return $type;
}

# Every candidate value for an argument (fixed and random), as SQL.
sub hostile
{
	my ($self, $type, $name) = @_;
	my $v = $self->{values};
	my $list = $v->{ $self->_key($type, $name) }
	  or die "HostileInput: no values for type $type";
	my @extra = @{ $v->{"$type:$name"} // [] };
	return (@$list, @extra);
}

# One candidate value at random; argument-specific ones come up more often.
sub pick
{
	my ($self, $type, $name) = @_;
	my $extra = $self->{values}{"$type:$name"};
	return one(@$extra) if $extra && rnd(2);
	return one($self->hostile($type, $name));
}

# A value the function accepts for this argument, so that the call gets past
# it to the argument under test.  $id makes keys fresh.
sub valid
{
	my ($self, $type, $name, $id, $fn) = @_;
	my %by_name = (
		scope => q{'hx'}, key => "'k$id'", source => q{'hx-src'}, message_id => "'m$id'",
		label => q{'charge'}, recovery_point => q{'step1'}, note => q{'hostile test'},
		topic => q{'order.created'}, name => q{'d_fn'}, kind => q{'notify'},
		target => q{'hx_chan'}, destination => q{'d_fn'},
	);
	if ($type eq 'text')
	{
		return q{'{"a": 1}'} if $name eq 'request';
		# idem_publish's key is an ordering key, not an idempotency key
		return q{'order-1'} if $name eq 'key' && $fn =~ /^idem_publish/;
		return $by_name{$name} // q{'v'};
	}
	my %by_type = (
		jsonb => q{'{"a": 1}'::jsonb}, bytea => q{decode(repeat('ab', 32), 'hex')},
		interval => q{'1 hour'::interval}, integer => '200', bigint => '1::bigint',
		'text[]' => q{'{*}'::text[]}, 'timestamp with time zone' => q{now() - '1 hour'::interval},
		uuid => q{'00000000-0000-0000-0000-000000000000'::uuid},
		regprocedure => q{'hx_handler(jsonb)'::regprocedure},
		boolean => 'false', regclass => q{'pg_class'::regclass},
	);
	return q{'{}'::jsonb} if $type eq 'jsonb' && $name eq 'options';
	return q{'{"Content-Type": "application/json"}'::jsonb} if $type eq 'jsonb' && $name eq 'headers';
	return '10' if $type eq 'integer' && $name ne 'status';
	return $by_type{$type} // die "HostileInput: no valid value for type $type";
}

# How many candidate values there are in all.
sub size
{
	my ($self) = @_;
	my $n = 0;
	$n += scalar @$_ for values %{ $self->{values} };
	return $n;
}

1;
