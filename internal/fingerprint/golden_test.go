package fingerprint

import (
	"encoding/hex"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestRequestGolden pins the fingerprint bytes. They are stored in the
// ledger: if any of these change, a retry of a key recorded before the
// upgrade answers as a mismatch. Change them only together with Version.
func TestRequestGolden(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é-long value ", 40) // lengths above 127 and 255
	for _, c := range []struct {
		name, method, target, ctype, body string
		hdr                               []string // name, value pairs
		want                              string
	}{
		{"empty", "POST", "/", "", "", nil, "01e64017c30bb3f6fb76bf8b0e032c1cb047aef7e0d74ff42e02f35ce54ec002f7"},
		{"json", "POST", "/orders?b=1&a=2", "application/json; charset=utf-8", `{"b":[1,{"d":2,"c":1.0}],"a":"x"}`, nil, "01fd868c237a692998aa39ca5e548bdc798da6b39101e30741141f276441f8243f"},
		{"form", "PUT", "/orders/7", "application/x-www-form-urlencoded", "b=2&a=x+y&a=%21", nil, "0166788cf012a1b6eb879d7431791cd641cc51a26aebe3f2d7b4fc6662a13cffb5"},
		{"raw", "POST", "/upload", "text/plain", "hello\n", nil, "0112f2c275ccf2b364e593fbb3877a0be0d5043369746b1517c21db62a1a45463c"},
		{"invalid json", "POST", "/orders", "application/json", `{"a":1,}`, nil, "012ea5b35be3592722dbc4656cf6bb0875a5765776dd9abb565255192d50a1fa29"},
		{"long", "POST", "/" + strings.Repeat("p", 200), "application/vnd.x+json", `{"v":"` + long + `"}`, nil, "01d91ccd6bb56640c8686c46c6e025c40c2b069e16578f12803bf2da35c8020918"},
		{"headers", "PATCH", "/orders?x", "application/json", `{}`, []string{"Api-Version", "2", "Api-Version", long, "X-Other", "y"}, "01141b8188655ed8102a6ebe4c8e6ee377c1d37f633bb447178a23c9aa9a3cb3ea"},
	} {
		r := httptest.NewRequest(c.method, c.target, strings.NewReader(c.body))
		if c.ctype != "" {
			r.Header.Set("Content-Type", c.ctype)
		}
		for i := 0; i+1 < len(c.hdr); i += 2 {
			r.Header.Add(c.hdr[i], c.hdr[i+1])
		}
		got := Request(r, []byte(c.body), []string{"api-version", "Absent"})
		if h := hex.EncodeToString(got); h != c.want {
			t.Errorf("%s: Request = %s\nwant %s", c.name, h, c.want)
		}
	}
}
