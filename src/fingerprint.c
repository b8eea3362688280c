/*-------------------------------------------------------------------------
 *
 * fingerprint.c
 *	  Canonical JSON text and SHA-256 fingerprint of a jsonb request.
 *
 * A request is fingerprinted as SHA-256 over the UTF-8 bytes of its
 * canonical JSON text, so that key order, whitespace and the spelling of
 * numbers do not change the fingerprint, but any change of value does.
 * Where every number is exactly representable as an IEEE double, the
 * canonical text equals RFC 8785 (JSON Canonicalization Scheme, JCS)
 * output, so a client can compute the same fingerprint with a standard JCS
 * library.
 *
 * The canonical form:
 *
 * - No whitespace anywhere.
 *
 * - Objects: members sorted by key, comparing keys as sequences of UTF-16
 *   code units (RFC 8785 section 3.2.3; this differs from UTF-8 byte order
 *   only in that characters above U+FFFF sort before U+E000..U+FFFF).
 *   jsonb has already removed duplicate keys (the last one wins).  In a
 *   database whose encoding is not UTF8, keys are compared in their UTF-8
 *   form.  Arrays keep their order.
 *
 * - Strings (keys and values): '"', the content, '"', escaping only \" \\
 *   \b \f \n \r \t, and other code points below U+0020 as \u00xx with
 *   lower-case hex digits; every other character (including U+007F,
 *   non-ASCII characters and U+2028) is written literally.
 *
 * - true, false and null as such.
 *
 * - Numbers: jsonb stores numbers as numeric, so 1, 1.0, 1e0 and 1.000 are
 *   the same value, differing only in display scale.  The exact decimal
 *   value is normalised to significant digits d1..dk (no leading or
 *   trailing zeros) and an exponent n such that value = 0.d1...dk * 10^n,
 *   then written by the ECMAScript Number::toString rules that RFC 8785
 *   uses:
 *     zero: 0 (and -0 is 0);
 *     negative: a minus sign, then the magnitude as below;
 *     k <= n <= 21: the digits followed by n-k zeros;
 *     0 < n <= 21: the digits with a decimal point after the n-th digit;
 *     -6 < n <= 0: "0.", then -n zeros, then the digits;
 *     otherwise: d1, then "." and d2..dk if k > 1, then "e", then "+" or
 *     "-", then abs(n-1).
 *   So 1e21 is 1e+21, 1e20 is 100000000000000000000, 1e-7 is 1e-7, and
 *   12345678901234567890 stays exact (it differs from
 *   12345678901234567891).
 *
 *   JCS libraries parse numbers to doubles and print them as ECMAScript
 *   does: the fewest digits that convert back to the same double (by round
 *   to nearest, ties to even), the nearer to it of two such candidates.  To
 *   agree with them, a number whose value is EXACTLY that of a finite IEEE
 *   double d is written with those digits of d instead of its own.  Thus
 *   0.1000000000000000055511151231257827021181583404541015625, which is
 *   exactly the double 0.1, is written 0.1, and 36028797018963968, which is
 *   exactly 2^55, is written 36028797018963970.  A number that is not
 *   exactly a double keeps its own digits, e.g. 9007199254740993 or
 *   333333333.33333329 (where JCS prints 333333333.3333333).  A double of
 *   at most DBL_DIG (15) significant digits is already written with the
 *   fewest digits, and no double has more than 767 significant digits, so
 *   only numbers in between are checked: d is the nearest double (strtod),
 *   and its exact decimal expansion is computed and compared with the
 *   number.
 *
 * idem_canonical returns the canonical text in the server encoding; the
 * fingerprint is taken over its UTF-8 form.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <float.h>
#include <math.h>

#include <openssl/evp.h>

#include "fmgr.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/builtins.h"

#include "fingerprint.h"

/* most significant digits in the exact decimal expansion of any double */
#define DBL_EXACT_MAX_DIGITS 767

/* significant digits that always suffice to identify a double */
#define DBL_ROUND_TRIP_DIGITS 17

/*
 * Long loops over a request check for interrupts (statement_timeout, a
 * cancel) every this many bytes of a string or of the text being hashed: a
 * few hundred microseconds of work, so a cancel is never kept waiting and
 * small requests pay nothing.  The loops over array elements and object
 * members check once per element, which costs one load and branch next to
 * the iterator's hundreds of instructions.
 */
#define INTERRUPT_CHECK_BYTES (1024 * 1024)

/*
 * An object member, with its key in UTF-8 for sorting.  Kept small: qsort
 * moves whole members.
 */
typedef struct CanonicalMember
{
	const char *sortkey;
	int			sortkeylen;
	int			keylen;
	const char *key;			/* server encoding */
	JsonbValue	value;
} CanonicalMember;

static void append_container(StringInfo out, JsonbContainer *container);

PG_FUNCTION_INFO_V1(idem_canonical);
PG_FUNCTION_INFO_V1(idem_fingerprint);

/*
 * Append a JSON string literal, escaping only what RFC 8785 escapes.  Bytes
 * below 0x20, '"' and '\\' are those ASCII characters in every server
 * encoding, so working byte by byte is safe; the bytes between two escapes
 * are copied as one run.
 */
static void
append_string(StringInfo out, const char *s, int len)
{
	int			run = 0;		/* start of the bytes not yet appended */

	appendStringInfoChar(out, '"');
	for (int i = 0; i < len; i++)
	{
		unsigned char c = (unsigned char) s[i];

		if (i % INTERRUPT_CHECK_BYTES == INTERRUPT_CHECK_BYTES - 1)
			CHECK_FOR_INTERRUPTS();
		if (c >= 0x20 && c != '"' && c != '\\')
			continue;

		appendBinaryStringInfo(out, s + run, i - run);
		run = i + 1;
		switch (c)
		{
			case '"':
				appendStringInfoString(out, "\\\"");
				break;
			case '\\':
				appendStringInfoString(out, "\\\\");
				break;
			case '\b':
				appendStringInfoString(out, "\\b");
				break;
			case '\f':
				appendStringInfoString(out, "\\f");
				break;
			case '\n':
				appendStringInfoString(out, "\\n");
				break;
			case '\r':
				appendStringInfoString(out, "\\r");
				break;
			case '\t':
				appendStringInfoString(out, "\\t");
				break;
			default:
				appendStringInfo(out, "\\u%04x", c);
				break;
		}
	}
	appendBinaryStringInfo(out, s + run, len - run);
	appendStringInfoChar(out, '"');
}

/*
 * Normalise numeric_out's text "[-]digits[.digits]" in place: on return
 * str[0 .. *ndigits - 1] holds its significant digits, without leading or
 * trailing zeros (none for zero), and its magnitude is 0.DIGITS *
 * 10^*exponent.
 */
static void
normalize_decimal(char *str, bool *negative, int *ndigits, int *exponent)
{
	const char *p = str;
	bool		in_fraction = false;
	int			k = 0;
	int			n = 0;

	*negative = (*p == '-');
	if (*negative)
		p++;
	for (; *p != '\0'; p++)
	{
		if (*p == '.')
			in_fraction = true;
		else
		{
			if (!in_fraction)
				n++;
			if (k == 0 && *p == '0')
				n--;
			else
				str[k++] = *p;
		}
	}
	while (k > 0 && str[k - 1] == '0')
		k--;
	*ndigits = k;
	*exponent = n;
}

/* The double nearest to 0.DIGITS * 10^n (k <= DBL_EXACT_MAX_DIGITS). */
static double
decimal_to_double(const char *digits, int k, int n)
{
	char		buf[DBL_EXACT_MAX_DIGITS + 16];

	snprintf(buf, sizeof(buf), "0.%.*se%d", k, digits, n);
	return strtod(buf, NULL);
}

/*
 * Whether 0.DIGITS * 10^n (k <= DBL_EXACT_MAX_DIGITS digits, normalised) is
 * exactly the finite nonzero double d.  With d = m * 2^e for an odd m, the
 * exact decimal value of d is the integer m * 2^e, or m * 5^-e * 10^e when
 * e < 0; these products have at most DBL_EXACT_MAX_DIGITS digits.
 */
static bool
is_exact_double(const char *digits, int k, int n, double d)
{
	uint8		x[DBL_EXACT_MAX_DIGITS];	/* least significant first */
	int			len = 0;
	int			zeros = 0;
	int			e;
	uint64		m = (uint64) ldexp(frexp(fabs(d), &e), 53);

	e -= 53;
	while ((m & 1) == 0)
	{
		m >>= 1;
		e++;
	}

	/*
	 * Cheap necessary conditions: if e < 0, d has exactly -e decimal places;
	 * otherwise d is an integer, and each of its n - k trailing zeros needs a
	 * factor 5 in m < 2^53, so there are at most 22 of them.
	 */
	if (e < 0 ? k - n != -e : (n < k || n - k > 22))
		return false;

	for (; m > 0; m /= 10)
		x[len++] = m % 10;
	/* multiply by 2^e or 5^-e, by up to 13 factors at a time */
	for (int left = abs(e); left > 0; left -= 13)
	{
		uint64		factor = 1;
		uint64		carry = 0;

		for (int i = 0; i < Min(left, 13); i++)
			factor *= (e > 0) ? 2 : 5;
		for (int i = 0; i < len; i++)
		{
			carry += x[i] * factor;
			x[i] = carry % 10;
			carry /= 10;
		}
		for (; carry > 0; carry /= 10)
			x[len++] = carry % 10;
	}

	while (x[zeros] == 0)
		zeros++;
	if (len - zeros != k || len + Min(e, 0) != n)
		return false;
	for (int i = 0; i < k; i++)
	{
		if (digits[i] - '0' != x[len - 1 - i])
			return false;
	}
	return true;
}

/*
 * If 0.DIGITS * 10^n is exactly a finite double d, replace the digits and
 * exponent by the ones ECMAScript's Number::toString prints for d: the
 * fewest digits that convert back to d (by round to nearest, ties to even,
 * as strtod does), and of two such the one nearer to d, or the even one on a
 * tie.  With j digits the only candidates are DIGITS truncated to j digits
 * and that plus one unit in the last place; 17 digits always suffice.  (The
 * shortest_dec.h functions are no substitute: they never print a midpoint
 * between two doubles, so they print 69830165215099616 (a double) as
 * 6.9830165215099616e+16 where ECMAScript prints 69830165215099620.)
 */
static void
use_double_digits(char *digits, int *ndigits, int *exponent)
{
	int			k = *ndigits;
	int			n = *exponent;
	double		d = decimal_to_double(digits, k, n);

	if (!isfinite(d) || d == 0 || !is_exact_double(digits, k, n, d))
		return;

	for (int j = 1; j < k && j <= DBL_ROUND_TRIP_DIGITS; j++)
	{
		char		up[DBL_ROUND_TRIP_DIGITS];
		int			upk = j;
		int			upn = n;
		bool		down_ok;
		bool		up_ok;
		bool		nearer_up;

		memcpy(up, digits, j);
		while (upk > 0 && up[upk - 1] == '9')
			upk--;
		if (upk > 0)
			up[upk - 1]++;
		else
		{
			up[0] = '1';
			upk = 1;
			upn++;
		}

		down_ok = decimal_to_double(digits, j, n) == d;
		up_ok = decimal_to_double(up, upk, upn) == d;
		/* is the exact value nearer to up, or halfway and down is odd? */
		nearer_up = digits[j] > '5' ||
			(digits[j] == '5' &&
			 (j + 1 < k || (digits[j - 1] - '0') % 2 != 0));
		if (up_ok && (!down_ok || nearer_up))
		{
			memcpy(digits, up, upk);
			*ndigits = upk;
			*exponent = upn;
			return;
		}
		if (down_ok)
		{
			*ndigits = j;
			while (digits[*ndigits - 1] == '0')
				(*ndigits)--;
			return;
		}
	}
}

/* Append a number as ECMAScript Number::toString writes it (RFC 8785). */
static void
append_number(StringInfo out, Numeric num)
{
	char	   *digits;
	bool		negative;
	int			k;
	int			n;

	digits = DatumGetCString(DirectFunctionCall1(numeric_out,
												 NumericGetDatum(num)));
	normalize_decimal(digits, &negative, &k, &n);
	if (k > DBL_DIG && k <= DBL_EXACT_MAX_DIGITS)
		use_double_digits(digits, &k, &n);

	if (negative && k > 0)
		appendStringInfoChar(out, '-');
	if (k == 0)
		appendStringInfoChar(out, '0');
	else if (k <= n && n <= 21)
	{
		appendBinaryStringInfo(out, digits, k);
		for (int i = k; i < n; i++)
			appendStringInfoChar(out, '0');
	}
	else if (0 < n && n <= 21)
	{
		appendBinaryStringInfo(out, digits, n);
		appendStringInfoChar(out, '.');
		appendBinaryStringInfo(out, digits + n, k - n);
	}
	else if (-6 < n && n <= 0)
	{
		appendStringInfoString(out, "0.");
		for (int i = n; i < 0; i++)
			appendStringInfoChar(out, '0');
		appendBinaryStringInfo(out, digits, k);
	}
	else
	{
		appendStringInfoChar(out, digits[0]);
		if (k > 1)
		{
			appendStringInfoChar(out, '.');
			appendBinaryStringInfo(out, digits + 1, k - 1);
		}
		appendStringInfo(out, "e%c%d", n > 0 ? '+' : '-', abs(n - 1));
	}
	pfree(digits);
}

/* Append the canonical text of a scalar or of a nested container. */
static void
append_value(StringInfo out, JsonbValue *v)
{
	switch (v->type)
	{
		case jbvNull:
			appendStringInfoString(out, "null");
			break;
		case jbvBool:
			appendStringInfoString(out, v->val.boolean ? "true" : "false");
			break;
		case jbvString:
			append_string(out, v->val.string.val, v->val.string.len);
			break;
		case jbvNumeric:
			append_number(out, v->val.numeric);
			break;
		case jbvBinary:
			append_container(out, v->val.binary.data);
			break;
		default:
			elog(ERROR, "unexpected jsonb value type: %d", (int) v->type);
	}
}

/*
 * Sort weight of a byte of a UTF-8 string, so that byte order is UTF-16
 * code unit order.  UTF-8 byte order is code point order; UTF-16 differs
 * only in putting U+E000..U+FFFF (lead bytes 0xEE, 0xEF) after the
 * characters above U+FFFF (lead bytes 0xF0..0xF4, surrogates 0xD800..0xDBFF
 * in UTF-16).  Weighing 0xEE and 0xEF as 0xFE and 0xFF, which never occur in
 * UTF-8, fixes that; where the first difference is in a continuation byte,
 * both characters share a lead byte and plain byte order is right.
 */
static inline int
utf16_weight(unsigned char c)
{
	return (c == 0xEE || c == 0xEF) ? c + 0x10 : c;
}

/*
 * qsort comparator: order object members by key in UTF-16 code units.  It
 * checks for interrupts, since sorting an object of millions of members
 * takes a while (pg_qsort holds no resources an error could leak).
 */
static int
member_cmp(const void *a, const void *b)
{
	const CanonicalMember *ma = a;
	const CanonicalMember *mb = b;
	int			len = Min(ma->sortkeylen, mb->sortkeylen);

	CHECK_FOR_INTERRUPTS();

	for (int i = 0; i < len; i++)
	{
		unsigned char ca = (unsigned char) ma->sortkey[i];
		unsigned char cb = (unsigned char) mb->sortkey[i];

		if (ca != cb)
			return utf16_weight(ca) - utf16_weight(cb);
	}
	return ma->sortkeylen - mb->sortkeylen;
}

/*
 * Append the canonical text of a jsonb container: an object with sorted
 * members, an array, or the scalar alone for a top-level raw scalar.  It
 * recurses into nested containers, so it checks the stack depth (jsonb can
 * be nested as deep as its parser's stack allows); and it checks for
 * interrupts at every element and member, so that a large request can be
 * cancelled.
 */
static void
append_container(StringInfo out, JsonbContainer *container)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;

	check_stack_depth();

	it = JsonbIteratorInit(container);
	tok = JsonbIteratorNext(&it, &v, true);
	if (tok == WJB_BEGIN_ARRAY)
	{
		bool		raw = v.val.array.rawScalar;

		if (!raw)
			appendStringInfoChar(out, '[');
		for (int i = 0; JsonbIteratorNext(&it, &v, true) == WJB_ELEM; i++)
		{
			CHECK_FOR_INTERRUPTS();
			if (i > 0)
				appendStringInfoChar(out, ',');
			append_value(out, &v);
		}
		if (!raw)
			appendStringInfoChar(out, ']');
	}
	else if (tok == WJB_BEGIN_OBJECT)
	{
		CanonicalMember *members;
		int			nmembers = 0;

		members = palloc(sizeof(CanonicalMember) * v.val.object.nPairs);
		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_END_OBJECT)
		{
			CanonicalMember *m = &members[nmembers];

			CHECK_FOR_INTERRUPTS();
			if (tok == WJB_KEY)
			{
				m->key = v.val.string.val;
				m->keylen = v.val.string.len;
				m->sortkey = pg_server_to_any(v.val.string.val,
											  v.val.string.len, PG_UTF8);
				m->sortkeylen = (m->sortkey == v.val.string.val) ?
					v.val.string.len : strlen(m->sortkey);
			}
			else
			{
				m->value = v;
				nmembers++;
			}
		}
		qsort(members, nmembers, sizeof(CanonicalMember), member_cmp);

		appendStringInfoChar(out, '{');
		for (int i = 0; i < nmembers; i++)
		{
			CHECK_FOR_INTERRUPTS();
			if (i > 0)
				appendStringInfoChar(out, ',');
			append_string(out, members[i].key, members[i].keylen);
			appendStringInfoChar(out, ':');
			append_value(out, &members[i].value);
		}
		appendStringInfoChar(out, '}');
		pfree(members);
	}
	else
		elog(ERROR, "unexpected jsonb iterator token: %d", (int) tok);
}

/* Append the canonical text of a jsonb value, in the server encoding. */
void
idem_canonical_append(StringInfo out, Jsonb *jb)
{
	append_container(out, &jb->root);
}

/*
 * The SHA-256 digest.  OpenSSL 3's EVP_sha256() makes every
 * EVP_DigestInit_ex look the algorithm up again (an implicit fetch, about a
 * third of hashing a small request): fetched once for the backend's life.
 */
static const EVP_MD *
sha256_md(void)
{
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
	static EVP_MD *md = NULL;

	if (md == NULL)
		md = EVP_MD_fetch(NULL, "SHA256", NULL);
	return md;
#else
	return EVP_sha256();
#endif
}

/*
 * Hash len bytes of data into out with ctx, a slice at a time with an
 * interrupt check between slices, so that hashing the canonical text of a
 * large request can be cancelled.  Returns false if OpenSSL fails.
 */
static bool
sha256_slices(EVP_MD_CTX *ctx, const uint8 *data, size_t len, uint8 *out)
{
	const EVP_MD *md = sha256_md();

	if (md == NULL || EVP_DigestInit_ex(ctx, md, NULL) != 1)
		return false;
	while (len > 0)
	{
		size_t		slice = Min(len, INTERRUPT_CHECK_BYTES);

		CHECK_FOR_INTERRUPTS();
		if (EVP_DigestUpdate(ctx, data, slice) != 1)
			return false;
		data += slice;
		len -= slice;
	}
	return EVP_DigestFinal_ex(ctx, out, NULL) == 1;
}

/*
 * Compute SHA-256 with OpenSSL into out (IDEM_SHA256_LEN bytes).  One
 * context serves the backend: a cancel that interrupts the hashing leaves
 * it half used, and the next EVP_DigestInit_ex starts it afresh.
 */
void
idem_sha256(const void *data, size_t len, uint8 *out)
{
	static EVP_MD_CTX *ctx = NULL;

	if (ctx == NULL)
		ctx = EVP_MD_CTX_new();
	if (ctx == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory")));
	if (!sha256_slices(ctx, data, len, out))
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_INVOCATION_EXCEPTION),
				 errmsg("could not compute SHA-256 digest")));
}

/* Fingerprint a request: SHA-256 of the UTF-8 bytes of its canonical text. */
bytea *
idem_fingerprint_jsonb(Jsonb *jb)
{
	StringInfoData buf;
	char	   *utf8;
	bytea	   *result;

	initStringInfo(&buf);
	idem_canonical_append(&buf, jb);
	utf8 = pg_server_to_any(buf.data, buf.len, PG_UTF8);

	result = palloc(VARHDRSZ + IDEM_SHA256_LEN);
	SET_VARSIZE(result, VARHDRSZ + IDEM_SHA256_LEN);
	idem_sha256(utf8, (utf8 == buf.data) ? buf.len : strlen(utf8),
				(uint8 *) VARDATA(result));

	if (utf8 != buf.data)
		pfree(utf8);
	pfree(buf.data);
	return result;
}

/* SQL: idem_canonical(jsonb) returns the canonical text of a request. */
Datum
idem_canonical(PG_FUNCTION_ARGS)
{
	Jsonb	   *jb = PG_GETARG_JSONB_P(0);
	StringInfoData buf;

	initStringInfo(&buf);
	idem_canonical_append(&buf, jb);
	PG_RETURN_TEXT_P(cstring_to_text_with_len(buf.data, buf.len));
}

/* SQL: idem_fingerprint(jsonb) returns the fingerprint of a request. */
Datum
idem_fingerprint(PG_FUNCTION_ARGS)
{
	PG_RETURN_BYTEA_P(idem_fingerprint_jsonb(PG_GETARG_JSONB_P(0)));
}
