package fingerprint

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// detailed fingerprints a request built from method, target, content type,
// body and header pairs, with X-Tenant fingerprinted.
func detailed(method, target, ctype, body string, hdr ...string) []byte {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	if ctype != "" {
		r.Header.Set("Content-Type", ctype)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return RequestDetailed(r, []byte(body), []string{"X-Tenant"})
}

func TestDetailedKeepsThePlainFingerprint(t *testing.T) {
	t.Parallel()
	for _, body := range []string{`{"b":[1,{"d":2}],"a":"x"}`, `"scalar"`, `[]`, "a=1&b=2", "raw"} {
		ctype := "application/json"
		if !strings.HasPrefix(body, "{") && !strings.HasPrefix(body, "[") && !strings.HasPrefix(body, `"`) {
			ctype = "application/x-www-form-urlencoded"
		}
		r := httptest.NewRequest("POST", "/o?q=1", strings.NewReader(body))
		r.Header.Set("Content-Type", ctype)
		fp := RequestDetailed(r, []byte(body), nil)
		require.EqualValues(t, DetailVersion, fp[0])
		require.Equal(t, Request(r, []byte(body), nil), Plain(fp), body)
		require.Greater(t, len(fp), 33, "members follow the plain part")
	}
	old := detailed("POST", "/", "application/json", `{}`)[:33]
	old[0] = PlainVersion
	require.Equal(t, old, Plain(old), "a plain fingerprint is its own plain form")
}

// TestDetailedGolden pins the bytes of a detailed fingerprint: they are
// stored in the ledger, so a change makes every stored key a mismatch.
// Change them only together with DetailVersion.
func TestDetailedGolden(t *testing.T) {
	t.Parallel()
	fp := detailed("POST", "/orders?page=2", "application/json", `{"b":[1,{"d":2}],"a":"x"}`, "X-Tenant", "acme")
	const want = "02437dedb3425b611866bc925f5e7859c2b6d195fc852d28853ab6ab7a76e8e3d9" + // version, plain SHA-256
		"07626f64793a2f61" + "41f795af482a" + // "body:/a"
		"09626f64793a2f622f30" + "5e2f314a609d" + // "body:/b/0"
		"0b626f64793a2f622f312f64" + "cca7a27a0a2a" + // "body:/b/1/d"
		"0c636f6e74656e742d74797065" + "8c0e66f17d57" + // "content-type"
		"0f6865616465723a582d54656e616e74" + "242b991ecaa1" + // "header:X-Tenant"
		"066d6574686f64" + "2aab19abe667" + // "method"
		"0470617468" + "1354234bb1a9" + // "path"
		"0a71756572793a70616765" + "b65941f106d1" // "query:page"
	require.Equal(t, want, hex.EncodeToString(fp))
}

func TestDifferences(t *testing.T) {
	t.Parallel()
	const base = `{"amount":"12.50","currency":"EUR","customer":{"id":"c-1","email":"a@example.com"},"items":[{"sku":"A","qty":1},{"sku":"B","qty":2}]}`
	first := detailed("POST", "/orders?page=1&sort=asc", "application/json", base, "X-Tenant", "acme")
	for name, c := range map[string]struct {
		fp   []byte
		want []string
	}{
		"same, other order": {detailed("POST", "/orders?sort=asc&page=1", "application/json; charset=utf-8",
			`{"currency":"EUR","amount":"12.50","items":[{"qty":1,"sku":"A"},{"sku":"B","qty":2}],"customer":{"email":"a@example.com","id":"c-1"}}`,
			"X-Tenant", "acme"), nil},
		"member": {detailed("POST", "/orders?page=1&sort=asc", "application/json",
			strings.Replace(base, "12.50", "13.50", 1), "X-Tenant", "acme"), []string{"body:/amount"}},
		"nested and array": {detailed("POST", "/orders?page=1&sort=asc", "application/json",
			strings.Replace(strings.Replace(base, `"qty":2`, `"qty":3`, 1), "a@example", "b@example", 1), "X-Tenant", "acme"),
			[]string{"body:/customer/email", "body:/items/1/qty"}},
		"added and removed": {detailed("POST", "/orders?page=1&sort=asc", "application/json",
			strings.Replace(base, `"currency":"EUR"`, `"note":"x"`, 1), "X-Tenant", "acme"),
			[]string{"body:/currency", "body:/note"}},
		"header": {detailed("POST", "/orders?page=1&sort=asc", "application/json", base, "X-Tenant", "other"),
			[]string{"header:X-Tenant"}},
		"query": {detailed("POST", "/orders?page=2&sort=asc", "application/json", base, "X-Tenant", "acme"),
			[]string{"query:page"}},
		"query added": {detailed("POST", "/orders?page=1&sort=asc&x=1", "application/json", base, "X-Tenant", "acme"),
			[]string{"query:x"}},
		"path and method": {detailed("PATCH", "/orders/7?page=1&sort=asc", "application/json", base, "X-Tenant", "acme"),
			[]string{"method", "path"}},
		"media type": {detailed("POST", "/orders?page=1&sort=asc", "text/plain", base, "X-Tenant", "acme"),
			[]string{"body", "content-type"}},
		"object became scalar": {detailed("POST", "/orders?page=1&sort=asc", "application/json", `{"amount":"12.50","currency":"EUR","customer":"c-1","items":[{"sku":"A","qty":1},{"sku":"B","qty":2}]}`, "X-Tenant", "acme"),
			[]string{"body:/customer"}},
	} {
		got, err := Differences(first, c.fp)
		require.NoError(t, err, name)
		require.Equal(t, c.want, nilIfEmpty(got), name)
	}

	form := func(body string) []byte {
		return detailed("POST", "/f", "application/x-www-form-urlencoded", body)
	}
	got, err := Differences(form("amount=1&to=bob&to=eve"), form("to=bob&to=mallory&amount=1"))
	require.NoError(t, err)
	require.Equal(t, []string{"form:to"}, got)
	got, err = Differences(detailed("POST", "/u", "text/plain", "hello"), detailed("POST", "/u", "text/plain", "hullo"))
	require.NoError(t, err)
	require.Equal(t, []string{"body"}, got)
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// TestDifferencesNeverHoldValues: the stored fingerprint holds names and
// short digests, never the request's values.
func TestDifferencesNeverHoldValues(t *testing.T) {
	t.Parallel()
	fp := detailed("POST", "/orders?token=qs-secret-value", "application/json",
		`{"card":"4111-1111-1111-1111","nested":{"pin":"9876-secret"}}`, "X-Tenant", "tenant-secret-name")
	for _, v := range []string{"qs-secret-value", "4111", "9876-secret", "tenant-secret-name"} {
		require.False(t, bytes.Contains(fp, []byte(v)), v)
	}
	require.True(t, bytes.Contains(fp, []byte("body:/nested/pin")), "names are kept")
}

func TestDifferencesOfPlainFingerprints(t *testing.T) {
	t.Parallel()
	cur := detailed("POST", "/", "application/json", `{"a":1}`)
	old := Plain(cur)
	_, err := Differences(old, cur)
	require.ErrorIs(t, err, ErrNotDetailed)
	_, err = Differences(cur, old)
	require.ErrorIs(t, err, ErrNotDetailed)
	_, err = Differences(append(bytes.Clone(cur), 0x7f), cur)
	require.Error(t, err)
	require.False(t, errors.Is(err, ErrNotDetailed), "malformed is not merely plain")
}

// TestDetailedBounds: a request with many parts is described more
// coarsely, within MaxMembers and MaxSectionBytes, and two such requests
// still name where they differ.
func TestDetailedBounds(t *testing.T) {
	t.Parallel()
	obj := func(n int, changed int) string {
		var parts []string
		for i := 0; i < n; i++ {
			v := i
			if i == changed {
				v = -1
			}
			parts = append(parts, fmt.Sprintf(`"k%03d":{"v":%d,"w":[1,2]}`, i, v))
		}
		return "{" + strings.Join(parts, ",") + "}"
	}
	check := func(fp []byte) []entry {
		es, err := members(fp)
		require.NoError(t, err)
		require.LessOrEqual(t, len(es), MaxMembers)
		require.LessOrEqual(t, len(fp)-33, MaxSectionBytes)
		return es
	}
	// 8 top-level members of 2 leaves and an array each: depth 2 fits.
	a, b := detailed("POST", "/", "application/json", obj(8, -1)), detailed("POST", "/", "application/json", obj(8, 5))
	check(a)
	got, err := Differences(a, b)
	require.NoError(t, err)
	require.Equal(t, []string{"body:/k005/v"}, got)
	// 20: only the top level fits.
	a, b = detailed("POST", "/", "application/json", obj(20, -1)), detailed("POST", "/", "application/json", obj(20, 5))
	check(a)
	got, err = Differences(a, b)
	require.NoError(t, err)
	require.Equal(t, []string{"body:/k005"}, got)
	// 40: the body as a whole.
	a, b = detailed("POST", "/", "application/json", obj(40, -1)), detailed("POST", "/", "application/json", obj(40, 5))
	check(a)
	got, err = Differences(a, b)
	require.NoError(t, err)
	require.Equal(t, []string{"body"}, got)
	// A fine description against a coarse one names the coarse member.
	got, err = Differences(detailed("POST", "/", "application/json", obj(8, -1)), detailed("POST", "/", "application/json", obj(40, -1)))
	require.NoError(t, err)
	require.Equal(t, []string{"body"}, got)

	// A wide array under an object: described down to the array.
	wide := func(note string) []byte {
		var items []string
		for i := 0; i < 2000; i++ {
			items = append(items, fmt.Sprintf(`{"i":%d}`, i))
		}
		return detailed("POST", "/", "application/json", `{"note":"`+note+`","items":[`+strings.Join(items, ",")+`]}`)
	}
	require.Equal(t, []string{"body:/items", "body:/note"}, names(check(wide("a")))[:2])
	got, err = Differences(wide("a"), wide("b"))
	require.NoError(t, err)
	require.Equal(t, []string{"body:/note"}, got)

	// Many query parameters collapse into "query".
	var q []string
	for i := 0; i < 40; i++ {
		q = append(q, fmt.Sprintf("p%d=%d", i, i))
	}
	a = detailed("POST", "/?"+strings.Join(q, "&"), "application/json", `{"a":1}`)
	es := check(a)
	require.Contains(t, es, new(Members).entry("query", []byte(strings.Join(sortedQuery(q), "&"))))
	require.Contains(t, names(es), "body:/a", "the body keeps its detail")

	// Long names are cut, JSON pointer tokens escaped.
	long := strings.Repeat("é", 50)
	fp := detailed("POST", "/", "application/json", `{"a/b~c":1,"`+long+`":2}`)
	ns := names(check(fp))
	require.Contains(t, ns, "body:/a~1b~0c")
	require.Contains(t, ns, cut("body:/"+long))
	require.LessOrEqual(t, len(cut("body:/"+long)), MaxNameLen)
}

func names(es []entry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.name)
	}
	return out
}

func sortedQuery(q []string) []string {
	r := httptest.NewRequest("GET", "/?"+strings.Join(q, "&"), nil)
	return strings.Split(r.URL.Query().Encode(), "&")
}
