package fingerprint

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// benchBodies are request bodies of the sizes and shapes the bridge sees:
// a small JSON order, a nested one of about 2 KiB, a JSON array of 64 KiB,
// and a form.
func benchBodies() []struct{ name, ctype, body string } {
	var items []string
	for i := 0; i < 20; i++ {
		items = append(items, fmt.Sprintf(`{"sku":"SKU-%04d","qty":%d,"price":"%d.99","tags":["a","b"]}`, i, i%7+1, i*3))
	}
	nested := `{"customer":{"id":"c-42","email":"a@example.com","address":{"city":"Lyon","zip":"69001"}},` +
		`"items":[` + strings.Join(items, ",") + `],"currency":"EUR","note":"` + strings.Repeat("n", 200) + `"}`
	var big []string
	for i := 0; i < 2000; i++ {
		big = append(big, fmt.Sprintf(`{"i":%d,"v":"%08d"}`, i, i))
	}
	return []struct{ name, ctype, body string }{
		{"json-small", "application/json", `{"amount":"12.50","currency":"EUR","customer":"c-42","note":"book"}`},
		{"json-2KiB", "application/json", nested},
		{"json-64KiB", "application/json", "[" + strings.Join(big, ",") + "]"},
		{"form", "application/x-www-form-urlencoded", "amount=12.50&currency=EUR&customer=c-42&note=book"},
	}
}

// BenchmarkFingerprint measures the fingerprints of a request: plain
// (Request, what the HTTP bridge stored before detailed fingerprints) and
// detailed (RequestDetailed, what it stores now), and reports their size
// in bytes (what the ledger row's fingerprint column holds).
func BenchmarkFingerprint(b *testing.B) {
	for _, c := range benchBodies() {
		for _, f := range []struct {
			name string
			fn   func(*http.Request, []byte, []string) []byte
		}{{"plain", Request}, {"detailed", RequestDetailed}} {
			b.Run(c.name+"/"+f.name, func(b *testing.B) {
				r := httptest.NewRequest("POST", "/orders?page=1&sort=asc", strings.NewReader(c.body))
				r.Header.Set("Content-Type", c.ctype)
				r.Header.Set("X-Tenant", "acme")
				body := []byte(c.body)
				headers := []string{"X-Tenant"}
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				var fp []byte
				for b.Loop() {
					fp = f.fn(r, body, headers)
				}
				b.ReportMetric(float64(len(fp)), "fp-bytes")
			})
		}
	}
}
