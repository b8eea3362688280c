--
-- Canonical JSON text (RFC 8785 / JCS) and SHA-256 fingerprint of requests
--

-- key order and whitespace do not matter
SELECT idem_canonical('{"b": 1, "a": 2}');
SELECT idem_canonical('{"b": 1, "a": 2}') = idem_canonical(E'{\n\t"a" :2 ,  "b":1\n}') AS same_text,
       idem_fingerprint('{"b": 1, "a": 2}') = idem_fingerprint(E'{\n\t"a" :2 ,  "b":1\n}') AS same_fingerprint;
-- but any change of value does
SELECT idem_fingerprint('{"a": 2, "b": 1}') = idem_fingerprint('{"a": 1, "b": 2}') AS swapped_values,
       idem_fingerprint('{"a": 1}') = idem_fingerprint('{"a": "1"}') AS number_vs_string,
       idem_fingerprint('[1, 2]') = idem_fingerprint('[2, 1]') AS array_order;
SELECT octet_length(idem_fingerprint('{}'));

-- nested objects and arrays; arrays keep their order
SELECT idem_canonical('{"z": [3, 1, {"y": null, "x": [true, false]}], "a": {"c": {"e": 1, "d": 2}, "b": []}}');

-- empty containers
SELECT idem_canonical('{}') AS empty_object, idem_canonical('[]') AS empty_array,
       idem_canonical('[{}, [], [[]], {"a": {}}]') AS nested_empty;

-- top-level scalars are written alone
SELECT input, idem_canonical(input::jsonb)
FROM unnest(ARRAY['5', '-0.0', '"x"', '"a\"b"', 'true', 'false', 'null'])
     WITH ORDINALITY AS t(input, i) ORDER BY i;

-- the spelling of a number does not matter, its value does
SELECT count(DISTINCT idem_fingerprint(input::jsonb)) AS fingerprints,
       min(idem_canonical(input::jsonb)) AS canonical
FROM unnest(ARRAY['1', '1.0', '1e0', '1.000', '10e-1', '0.01E2']) AS t(input);
SELECT idem_canonical('[0.1, 0.10, 1e-1]');
SELECT idem_fingerprint('0.1') = idem_fingerprint('0.10') AS same;
SELECT idem_canonical('[12345678901234567890, 12345678901234567891]');
SELECT idem_fingerprint('12345678901234567890') = idem_fingerprint('12345678901234567891') AS same;

-- numbers, by the ECMAScript Number::toString branches
SELECT input, idem_canonical(input::jsonb)
FROM unnest(ARRAY[
    -- zero
    '0', '-0', '0.000', '-0e10',
    -- digits followed by zeros (k <= n <= 21)
    '1', '-1', '123.456e5', '1e20', '-1e20', '123456789012345678901',
    -- decimal point inside the digits (0 < n <= 21)
    '-0.5e1', '1.5', '-123.456', '100000000000000000000.5',
    -- leading zeros (-6 < n <= 0)
    '0.5', '-0.5', '1e-6', '0.0000012345', '-0.000001',
    -- exponent form
    '1e21', '-1e21', '1.5e21', '123456789012345678901234', '1E30',
    '1e-7', '-1.5e-7', '0.000000000000000000000000001',
    '5e-324', '-5e-324', '1.7976931348623157e308',
    -- beyond the range of doubles: kept exact
    '1e400', '-1.2345e-400', '1234567890123456789e400'
    ]) WITH ORDINALITY AS t(input, i) ORDER BY i;

-- A number whose value is exactly an IEEE double is written with the
-- fewest digits that convert back to that double (as JCS libraries do);
-- any other number keeps its exact digits.
SELECT input, idem_canonical(input::jsonb)
FROM unnest(ARRAY[
    -- exactly the double 0.1, so written 0.1
    '0.1000000000000000055511151231257827021181583404541015625',
    -- one unit more or less in the last place: not doubles, kept
    '0.1000000000000000055511151231257827021181583404541015626',
    '0.1000000000000000055511151231257827021181583404541015624',
    -- nearest to 0.1 but not exactly a double: kept
    '0.10000000000000001',
    -- 2^53 + 1 is not a double: kept; 2^53 is
    '9007199254740993', '9007199254740992',
    -- 2^55 = 36028797018963968 has 17 digits, but 3602879701896397e1
    -- converts back to it
    '36028797018963968',
    -- a double whose shortest digits lie exactly halfway to the next
    -- double (convert back by ties-to-even)
    '69830165215099616',
    -- 2^64 and the exact value of the largest double
    '18446744073709551616',
    '179769313486231570814527423731704356798070567525844996598917476803157260780028538760589558632766878171540458953514382464234321326889464182768467546703537516986049910576551282076245490090389328944075868508455133942304583236903222948165808559332123348274797826204144723168738177180919299881250404026184124858368',
    -- 333333333.33333329 has 17 digits and is not a double: kept, although
    -- JCS (which parses it to a double) writes 333333333.3333333
    '333333333.33333329',
    -- 333333333.3333333 is kept as is, and so is the exact value of the
    -- double nearest to it written in full
    '333333333.3333333',
    '333333333.333333313465118408203125'
    ]) WITH ORDINALITY AS t(input, i) ORDER BY i;

-- RFC 8785 Appendix B: the exact values of these doubles give the
-- canonical numbers listed there
SELECT input, idem_canonical(input::jsonb)
FROM unnest(ARRAY[
    '295147905179352825856',                        -- 4430000000000000
    '99999999999999974834176',                      -- 44b52d02c7e14af5
    '99999999999999991611392',                      -- 44b52d02c7e14af6
    '100000000000000008388608',                     -- 44b52d02c7e14af7
    '999999999999999737856',                        -- 444b1ae4d6e2ef4e
    '999999999999999868928',                        -- 444b1ae4d6e2ef4f
    '1000000000000000000000',                       -- 444b1ae4d6e2ef50
    '0.0000009999999999999997429898750123111739185333135537803173065185546875', -- 3eb0c6f7a0b5ed8c
    '0.000000999999999999999954748111825886258685613938723690807819366455078125', -- 3eb0c6f7a0b5ed8d
    '333333333.333333194255828857421875',           -- 41b3de4355555553
    '333333333.3333332538604736328125',             -- 41b3de4355555554
    '333333333.333333313465118408203125',           -- 41b3de4355555555
    '333333333.33333337306976318359375',            -- 41b3de4355555556
    '333333333.333333432674407958984375',           -- 41b3de4355555557
    '-0.0000033333333333333333236658639620042521301002125255763530731201171875', -- becbf647612f3696
    '1424953923781206.25'                           -- 43143ff3c1cb0959
    ]) WITH ORDINALITY AS t(input, i) ORDER BY i;

-- strings: only " \ and control characters are escaped
SELECT idem_canonical('"\u0001\u001f\b\f\n\r\t \" \\ \/ \u0041"');
-- U+007F, U+2028 and non-ASCII characters are written literally (shown in hex)
SELECT encode(convert_to(idem_canonical('["\u007f", "\u2028", "\u00e9", "\u20ac", "\ud83d\ude00"]'), 'UTF8'), 'hex');
SELECT idem_canonical('["\u00e9", "\u20ac", "\ud83d\ude00", "caf\u00e9"]');

-- keys sort by UTF-16 code units: U+1F600 (surrogates D83D DE00) sorts
-- before U+FB33 and U+FF21, though after them in UTF-8 byte order
SELECT idem_canonical('{"\ufb33": 1, "\ud83d\ude00": 2, "\uff21": 3, "\u00e9": 4, "b": 5, "aa": 6, "a": 7, "A": 8, "": 9}');
SELECT idem_canonical('{"\ufb33": 1, "\ud83d\ude00": 2, "\uff21": 3, "\u00e9": 4, "b": 5, "aa": 6, "a": 7, "A": 8, "": 9}')
    = U&'{"":9,"A":8,"a":7,"aa":6,"b":5,"\00E9":4,"\+01F600":2,"\FB33":1,"\FF21":3}' AS utf16_order;

-- RFC 8785 section 3.2.2 example.  333333333.33333329 has 17 digits and is
-- not exactly a double, so it stays 333333333.33333329 here, where the RFC
-- (parsing it to a double) shows 333333333.3333333.
SELECT idem_canonical('{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA''\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}');
-- with 333333333.3333333 in the input the result is exactly the RFC's
SELECT idem_canonical('{"numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA''\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}')
    = U&'{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"!20AC$\u000f\nA''B\"\\\\\"/"}' UESCAPE '!' AS rfc8785;

-- SHA-256 over the UTF-8 bytes of the canonical text; the expected hashes
-- were computed with: printf '%s' '<canonical text>' | sha256sum
SELECT idem_canonical('{"b":1,"a":[1.0,"x"]}'),
       encode(idem_fingerprint('{"b":1,"a":[1.0,"x"]}'), 'hex')
       = 'a88dede55f330dbae7d6c99cb78c43213f114625ed11c8fd0b769d117c06bb50' AS sha256_ok;
SELECT idem_canonical('{"name": "Zo\u00eb", "amount": 12.50, "currency": "\u20ac"}'),
       encode(idem_fingerprint('{"name": "Zo\u00eb", "amount": 12.50, "currency": "\u20ac"}'), 'hex')
       = 'bb639ccf1edad8e15b54de1b3b220ec19e27b2648b459bb0fb050f233f01e44a' AS sha256_ok;
SELECT idem_canonical('"\ud83d\ude00"'),
       encode(idem_fingerprint('"\ud83d\ude00"'), 'hex')
       = '7a0c50b92434b015545fe93ab723db2d4b2cdd14a441405624a9ce8be29f1d5a' AS sha256_ok;
-- the RFC 8785 example output
SELECT encode(idem_fingerprint('{"numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA''\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}'), 'hex')
       = '2d5e01a318d0f0879ab568c4be289c8b1f64ef8921a53c6277d5e069978baacb' AS sha256_ok;
-- and the hash itself for one input
SELECT encode(idem_fingerprint('{"b":1,"a":[1.0,"x"]}'), 'hex');
