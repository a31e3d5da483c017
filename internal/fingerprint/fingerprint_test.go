package fingerprint

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestCanonicalJSON(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		`{"b":1,"a":2}`:                       `{"a":2,"b":1}`,
		` { "z" : [ 3 , {"y":1,"x":2} ] } `:   `{"z":[3,{"x":2,"y":1}]}`,
		`12345678901234567890123`:             `12345678901234567890123`,
		`{"n":1.0,"m":1e2,"l":-0}`:            `{"l":-0,"m":1e2,"n":1.0}`,
		`"\u0041\u00e9\n\/"`:                  `"Aé\n/"`,
		`"<&>"`:                               `"<&>"`,
		`{"a":1,"a":2}`:                       `{"a":1,"a":2}`,           // duplicates keep their order
		`{"amount":2,"Amount":1}`:             `{"amount":2,"Amount":1}`, // so do keys equal but for case
		`{"Amount":1,"amount":2}`:             `{"Amount":1,"amount":2}`,
		`{"b":1,"aB":2,"B":3,"Ab":4}`:         `{"aB":2,"b":1,"Ab":4,"B":3}`,
		`{"B":1,"a":2}`:                       `{"B":1,"a":2}`,
		`{"b":{"d":null,"c":true},"a":false}`: `{"a":false,"b":{"c":true,"d":null}}`,
		`"\ud83d\ude00"`:                      `"😀"`, // a valid surrogate pair
		`"\ufffd"`:                            "\"\uFFFD\"",
		`[]`:                                  `[]`,
		`{}`:                                  `{}`,
		"\"\x7f\"":                            "\"\x7f\"",
		`"\u001f"`:                            `"\u001f"`,
	}
	for in, want := range cases {
		got, ok := canonicalJSON([]byte(in))
		require.True(t, ok, in)
		require.Equal(t, want, string(got), in)
	}
	for _, in := range []string{
		``, `{`, `{"a":1}{"b":2}`, `{"a":1} x`, `[1,]`, `{"a" 1}`, "\"\xff\"",
		`"\ud800"`, `{"\udc00":1}`, `"\ud800\u0041"`, `"\udc00\ud800"`, // lone surrogates would collide with U+FFFD
		`01`, `1.`, `.5`, `-`, `1e`, `+1`, `tru`, `nul`, `"\x"`, `"\u12"`, "\"a\tb\"", `{"a":1,}`, `{1:2}`,
		strings.Repeat("[", maxJSONDepth+2) + strings.Repeat("]", maxJSONDepth+2),
	} {
		_, ok := canonicalJSON([]byte(in))
		require.False(t, ok, in)
	}
}

func TestCanonicalForm(t *testing.T) {
	t.Parallel()
	c, ok := canonicalForm([]byte("b=2&a=x+y&a=%21"))
	require.True(t, ok)
	require.Equal(t, "a=x+y&a=%21&b=2", string(c))
	_, ok = canonicalForm([]byte("a=1;b=2"))
	require.False(t, ok)
	_, ok = canonicalForm([]byte("a=%zz"))
	require.False(t, ok)
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	fp := func(method, target, ctype, body string, hdr ...string) []byte {
		r := httptest.NewRequest(method, target, strings.NewReader(body))
		if ctype != "" {
			r.Header.Set("Content-Type", ctype)
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			r.Header.Add(hdr[i], hdr[i+1])
		}
		return Request(r, []byte(body), []string{"Api-Version"})
	}
	base := fp("POST", "/o?b=1&a=2", "application/json", `{"a":1,"b":2}`)
	require.Len(t, base, 33)
	require.EqualValues(t, Version, base[0])
	require.Equal(t, base, fp("POST", "/o?a=2&b=1", "application/json; charset=utf-8", `{"b":2, "a":1}`))
	require.Equal(t, base, fp("POST", "/o?a=2&b=1", "Application/JSON", `{"b":2,"a":1}`))
	for name, other := range map[string][]byte{
		"method":     fp("PATCH", "/o?b=1&a=2", "application/json", `{"a":1,"b":2}`),
		"path":       fp("POST", "/p?b=1&a=2", "application/json", `{"a":1,"b":2}`),
		"query":      fp("POST", "/o?b=1", "application/json", `{"a":1,"b":2}`),
		"media":      fp("POST", "/o?b=1&a=2", "application/vnd.x+json", `{"a":1,"b":2}`),
		"raw":        fp("POST", "/o?b=1&a=2", "text/plain", `{"a":1,"b":2}`),
		"body":       fp("POST", "/o?b=1&a=2", "application/json", `{"a":1,"b":3}`),
		"header":     fp("POST", "/o?b=1&a=2", "application/json", `{"a":1,"b":2}`, "Api-Version", "2"),
		"other hdr2": fp("POST", "/o?b=1&a=2", "application/json", `{"a":1,"b":2}`, "Api-Version", "1", "Api-Version", "2"),
	} {
		require.NotEqual(t, base, other, name)
	}
	// A raw body that happens to be the canonical JSON of another body is
	// not confused with it.
	require.NotEqual(t,
		fp("POST", "/o", "application/json", `{"b":1,"a":2}`),
		fp("POST", "/o", "application/json", `{"a":2,"b":1}x`))
}

// FuzzCanonicalJSON: canonicalJSON never panics; it accepts exactly the
// valid JSON that encoding/json accepts (but for lone surrogate escapes and
// invalid UTF-8, which it refuses on purpose); its output is valid JSON,
// canonical already (idempotent), and means the same as the input; its
// members (Members.AddJSON) are within the size limits and do not differ
// from themselves.
func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{
		`{"b":1,"a":2}`, `[1,2,{"z":null,"y":[true,false]}]`, `"\ud83d\ude00"`, `"\ud800"`,
		`12345678901234567890`, `{"a":1,"a":2}`, `{"":{"":""}}`, `-0.0e-10`, `"\u0000"`,
		"\"\xff\"", `{"a":1}{}`, ` [ ] `, `"\\ufffd\ufffd"`, `{"\t":"<>&\u2028"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, ok := canonicalJSON(in)
		valid := json.Valid(in)
		if ok && !valid {
			t.Fatalf("accepted invalid JSON %q", in)
		}
		if !ok {
			refusable := !utf8.Valid(in) || bytes.Contains(bytes.ToLower(in), []byte(`\ud`)) || len(in) > maxJSONDepth
			if valid && !refusable {
				t.Fatalf("refused valid JSON %q", in)
			}
			return
		}
		if !json.Valid(out) {
			t.Fatalf("invalid output %q from %q", out, in)
		}
		again, ok := canonicalJSON(out)
		if !ok || !bytes.Equal(again, out) {
			t.Fatalf("not idempotent: %q -> %q -> %q (%v)", in, out, again, ok)
		}
		if !reflect.DeepEqual(decode(t, in), decode(t, out)) {
			t.Fatalf("meaning changed: %q -> %q", in, out)
		}
		// The canonical form's members (what a mismatch names) stay
		// within bounds, and a document does not differ from itself.
		var m Members
		m.AddJSON("body", "body:", out)
		fp := Detailed(make([]byte, 33), &m)
		if len(fp)-33 > MaxSectionBytes {
			t.Fatalf("member section of %d bytes for %q", len(fp)-33, out)
		}
		if es, err := members(fp); err == nil && len(es) > MaxMembers {
			t.Fatalf("%d members for %q", len(es), out)
		}
		if diff, err := Differences(fp, fp); err == nil && len(diff) > 0 {
			t.Fatalf("%q differs from itself: %v", out, diff)
		}
	})
}

func decode(t *testing.T, b []byte) any {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", b, err)
	}
	return v
}
