package httpbridge

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	ok := map[string]string{
		`abc`:                                    "abc",
		`"abc"`:                                  "abc",
		`  "abc"  `:                              "abc",
		"\t550e8400-e29b-41d4-a716-446655440000": "550e8400-e29b-41d4-a716-446655440000",
		`"a \"quoted\" \\ key"`:                  `a "quoted" \ key`,
		`"has spaces"`:                           "has spaces",
		`usr_abc123:booking.create:res_xyz:1`:    "usr_abc123:booking.create:res_xyz:1",
		`dGVzdA==`:                               "dGVzdA==",
		`*tok/en`:                                "*tok/en",
		`"a,b"`:                                  "a,b", // a comma inside the string is part of it
	}
	for in, want := range ok {
		got, err := parseKey(in, 255)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	bad := map[string]*keyError{
		``:                errKeyEmpty,
		`  `:              errKeyEmpty,
		`""`:              errKeyEmpty,
		`"a", "b"`:        errKeyList,
		`a,b`:             errKeyList,
		`a, b`:            errKeyList,
		`"a";p=1`:         errKeyParams,
		`a;p=1`:           errKeyParams,
		`"abc`:            errKeyBadString,
		`"a\b"`:           errKeyBadString,
		`"a"b`:            errKeyBadString,
		`a b`:             errKeyUnquoted,
		`a"b`:             errKeyUnquoted,
		`a\b`:             errKeyUnquoted,
		"a\x00b":          errKeyUnprintable,
		"a\x7fb":          errKeyUnprintable,
		"\"a\x01\"":       errKeyUnprintable,
		"caf\xc3\xa9":     errKeyUnprintable,
		"\"caf\xc3\xa9\"": errKeyUnprintable,
	}
	for in, want := range bad {
		_, err := parseKey(in, 255)
		require.Equal(t, want, err, "%q", in)
	}
	_, err := parseKey(strings.Repeat("k", 256), 255)
	require.ErrorContains(t, err, "longer than 255")
	_, err = parseKey(`"`+strings.Repeat("k", 37)+`"`, 36)
	require.ErrorContains(t, err, "longer than 36")
}

func TestExtractKey(t *testing.T) {
	t.Parallel()
	names := []string{"Idempotency-Key", "X-Idempotency-Key"}
	h := http.Header{}
	_, present, err := extractKey(h, names, 255, KeyAny)
	require.NoError(t, err)
	require.False(t, present)

	h = http.Header{"Idempotency-Key": {"a", "b"}}
	_, _, err = extractKey(h, names, 255, KeyAny)
	require.Equal(t, errKeyRepeated, err)

	h = http.Header{"Idempotency-Key": {"a"}, "X-Idempotency-Key": {`"a"`}}
	k, present, err := extractKey(h, names, 255, KeyAny)
	require.NoError(t, err)
	require.True(t, present)
	require.Equal(t, "a", k)

	h = http.Header{"X-Idempotency-Key": {"550E8400-E29B-41D4-A716-446655440000"}}
	k, _, err = extractKey(h, names, 255, KeyUUIDv4)
	require.NoError(t, err)
	require.Equal(t, "550e8400-e29b-41d4-a716-446655440000", k)
	h = http.Header{"Idempotency-Key": {"550e8400-e29b-41d4-c716-446655440000"}} // variant bits wrong
	_, _, err = extractKey(h, names, 255, KeyUUIDv4)
	require.Equal(t, errKeyNotUUIDv4, err)
	_, _, err = extractKey(h, names, 255, KeyUUID)
	require.NoError(t, err)
	h = http.Header{"Idempotency-Key": {"550e8400e29b41d4a716446655440000"}}
	_, _, err = extractKey(h, names, 255, KeyUUID)
	require.Equal(t, errKeyNotUUID, err)
}

func TestFormatKeyRoundTrips(t *testing.T) {
	t.Parallel()
	for _, k := range []string{"a", `a"b`, `a\b`, "with space", `\"`} {
		got, err := parseKey(formatKey(k), 255)
		require.NoError(t, err)
		require.Equal(t, k, got)
	}
}

// FuzzParseKey: parseKey never panics, and what it accepts is consistent:
// a non-empty key of printable ASCII within the limit, which its sf-string
// form parses back to; a header value with a comma outside quotes is never
// accepted as one key.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{
		"abc", `"abc"`, `"a\"b"`, `"a\\b"`, `"a", "b"`, "a,b", `"a";p`, "", `""`, " ",
		"550e8400-e29b-41d4-a716-446655440000", "\x00", "caf\xc3\xa9", `"unterminated`,
		`"a"  `, "\t\"x\"\t", `"\`, strings.Repeat("k", 300), "a b", `*/:`,
	} {
		f.Add(s, 255)
	}
	f.Add("abcdef", 3)
	f.Fuzz(func(t *testing.T, v string, maxLen int) {
		if maxLen < 1 || maxLen > 1024 {
			maxLen = 255
		}
		k, err := parseKey(v, maxLen)
		if err != nil {
			if _, ok := err.(*keyError); !ok {
				t.Fatalf("error of type %T", err)
			}
			return
		}
		if k == "" || len(k) > maxLen || !printableASCII(k) {
			t.Fatalf("accepted %q from %q", k, v)
		}
		// The sf-string form of an accepted key parses back to it.
		k2, err := parseKey(formatKey(k), maxLen)
		if err != nil || k2 != k {
			t.Fatalf("round trip of %q: %q, %v", k, k2, err)
		}
		// A bare value is accepted as itself.
		tv := strings.Trim(v, " \t")
		if tv != "" && tv[0] != '"' && k != tv {
			t.Fatalf("bare %q parsed as %q", tv, k)
		}
		// A comma outside the quotes means a list: never accepted.
		if outsideQuotesHasComma(tv) {
			t.Fatalf("list %q accepted as %q", v, k)
		}
	})
}

// outsideQuotesHasComma scans an sf-string-ish value for a comma that is
// not inside a (properly escaped) quoted string.
func outsideQuotesHasComma(s string) bool {
	in := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case in && c == '\\':
			i++
		case c == '"':
			in = !in
		case !in && c == ',':
			return true
		}
	}
	return false
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
