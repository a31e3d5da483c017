package bridgereq

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/fingerprint"
)

func ledger(t *testing.T) *inbox.Ledger {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never dialled
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	l, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestValidate(t *testing.T) {
	if err := (Spec{Scope: "orders"}).Validate(); err != nil {
		t.Fatal(err)
	}
	for want, s := range map[string]Spec{
		"empty Scope":               {},
		"invalid Scope: ":           {Scope: "a\x00b"},
		"unknown PrincipalPolicy 2": {Scope: "s", Principal: 2},
		"TTL is negative":           {Scope: "s", TTL: -1},
		"LockWait is negative":      {Scope: "s", LockWait: -1},
		"longer than 255 bytes":     {Scope: strings.Repeat("s", 256)},
	} {
		if err := s.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: %v, want %q", s, err, want)
		}
	}
}

func TestMaxKeyLen(t *testing.T) {
	for _, c := range []struct {
		s          Spec
		limit      int
		principals bool
		want       int
	}{
		{Spec{}, 255, false, 255},
		{Spec{}, 255, true, 231},                                 // isolated by default, once principals are known
		{Spec{Principal: inbox.PrincipalShared}, 255, true, 255}, // shared: the plain key
		{Spec{NewRequest: true}, 255, false, 238},                // the fingerprint suffix
		{Spec{NewRequest: true}, 255, true, 214},                 // both
		{Spec{}, 36, true, 36},                                   // the front's own limit is lower
		{Spec{}, 240, true, 231},
	} {
		if got := c.s.MaxKeyLen(c.limit, c.principals); got != c.want {
			t.Errorf("%+v.MaxKeyLen(%d, %v) = %d, want %d", c.s, c.limit, c.principals, got, c.want)
		}
	}
}

func TestRequest(t *testing.T) {
	l := ledger(t)
	fp := []byte("0123456789abcdef")
	s := Spec{Scope: "orders", Source: "http", TTL: 7, LockWait: 9}
	r, err := s.Request(l, "k", fp, "acme", "alice")
	if err != nil {
		t.Fatal(err)
	}
	want := inbox.Request{Key: inbox.Key{Scope: "orders", Tenant: "acme", ID: inbox.PrincipalKeyID("k", "alice")},
		Principal: "alice", Fingerprint: fp, Source: "http", TTL: 7, LockWait: 9}
	if r.Key != want.Key || r.Principal != want.Principal || string(r.Fingerprint) != string(fp) || r.Source != want.Source || r.TTL != 7 || r.LockWait != 9 {
		t.Fatalf("Request = %+v, want %+v", r, want)
	}
	if r, _ := s.Request(l, "k", fp, "", ""); r.ID != "k" {
		t.Fatalf("without a principal the ID is the plain key, got %q", r.ID)
	}
	shared := Spec{Scope: "orders", Principal: inbox.PrincipalShared, NewRequest: true}
	if r, _ := shared.Request(l, "k", fp, "", "alice"); r.ID != "k~MTIzNDU2Nzg5YWJj" || r.Principal != "alice" {
		t.Fatalf("shared, new request: ID %q, principal %q", r.ID, r.Principal)
	}

	// A key the ledger refuses is the client's; a tenant it refuses is not.
	_, err = s.Request(l, "k\x00", fp, "", "")
	var ke *KeyError
	if !errors.As(err, &ke) || !strings.HasPrefix(ke.Error(), "the key is rejected by the ledger: ") {
		t.Fatalf("refused key: %v", err)
	}
	_, err = s.Request(l, "k", fp, strings.Repeat("t", 256), "")
	if err == nil || errors.As(err, &ke) {
		t.Fatalf("refused tenant: %v", err)
	}
}

func TestCall(t *testing.T) {
	if got := Call[string](nil, "r"); got != "" {
		t.Fatal(got)
	}
	if got := Call(strings.ToUpper, "r"); got != "R" {
		t.Fatal(got)
	}
}

func TestIsUUID(t *testing.T) {
	for s, want := range map[string][2]bool{ // any, v4
		"8e03978e-40d5-43e8-bc93-6894a57f9324": {true, true},
		"8E03978E-40D5-43E8-BC93-6894A57F9324": {true, true},
		"8e03978e-40d5-13e8-bc93-6894a57f9324": {true, false}, // version 1
		"8e03978e-40d5-43e8-7c93-6894a57f9324": {true, false}, // another variant
		"8e03978e40d543e8bc936894a57f9324":     {false, false},
		"8e03978e-40d5-43e8-bc93-6894a57f932g": {false, false},
		"":                                     {false, false},
	} {
		if IsUUID(s, false) != want[0] || IsUUID(s, true) != want[1] {
			t.Errorf("IsUUID(%q) = %v, %v; want %v", s, IsUUID(s, false), IsUUID(s, true), want)
		}
	}
}

type fakeTx struct{ pgx.Tx }

func TestContext(t *testing.T) {
	ctx := context.Background()
	if Tx(ctx) != nil {
		t.Fatal("Tx of a bare context")
	}
	if _, ok := Key(ctx); ok {
		t.Fatal("Key of a bare context")
	}
	if _, ok := FencingToken(ctx); ok {
		t.Fatal("FencingToken of a bare context")
	}
	tx := fakeTx{}
	ctx = WithFencingToken(WithKey(WithTx(ctx, tx), "k"), 7)
	if Tx(ctx) != pgx.Tx(tx) {
		t.Fatal("Tx lost")
	}
	if k, ok := Key(ctx); !ok || k != "k" {
		t.Fatal("Key lost")
	}
	if tok, ok := FencingToken(ctx); !ok || tok != 7 {
		t.Fatal("FencingToken lost")
	}
}

func TestExpiry(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	at := now.Add(3 * time.Hour)
	for name, c := range map[string]struct {
		out  inbox.Outcome
		want time.Time
		ok   bool
	}{
		"with its row":        {inbox.Outcome{Disposition: inbox.Duplicate, Record: &inbox.Record{ExpiresAt: at}}, at, true},
		"in flight, no row":   {inbox.Outcome{Disposition: inbox.InFlight}, now.Add(24*time.Hour - time.Minute), true},
		"in flight, its row":  {inbox.Outcome{Disposition: inbox.InFlight, Record: &inbox.Record{ExpiresAt: at}}, at, true},
		"nothing about a key": {inbox.Outcome{}, time.Time{}, false},
	} {
		got, ok := Expiry(c.out, now, 24*time.Hour, time.Minute)
		if ok != c.ok || !got.Equal(c.want) {
			t.Errorf("%s: Expiry = %s, %v; want %s, %v", name, got, ok, c.want, c.ok)
		}
	}
}

func TestPlainRetry(t *testing.T) {
	var m fingerprint.Members
	m.Add("method", []byte("POST"))
	plain := append([]byte{fingerprint.PlainVersion}, make([]byte, 32)...)
	plain[5] = 7
	detailed := fingerprint.Detailed(plain, &m)
	other := bytes.Clone(plain)
	other[6] = 1
	mismatch := func(stored []byte) inbox.Outcome {
		return inbox.Outcome{Disposition: inbox.Mismatch, Record: &inbox.Record{Fingerprint: stored}}
	}
	req := inbox.Request{Fingerprint: detailed}
	if !PlainRetry(mismatch(plain), &req) || !bytes.Equal(req.Fingerprint, plain) {
		t.Fatal("a stored plain fingerprint of the same request: ask again with the plain form")
	}
	for name, c := range map[string]inbox.Outcome{
		"another request":       mismatch(other),
		"a detailed one":        mismatch(fingerprint.Detailed(other, &m)),
		"not a mismatch":        {Disposition: inbox.Duplicate, Record: &inbox.Record{Fingerprint: plain}},
		"no row":                {Disposition: inbox.Mismatch},
		"no stored fingerprint": mismatch(nil),
	} {
		req := inbox.Request{Fingerprint: detailed}
		if PlainRetry(c, &req) || !bytes.Equal(req.Fingerprint, detailed) {
			t.Errorf("%s: asked again", name)
		}
	}
}

func TestWould(t *testing.T) {
	rec := func(src inbox.Source, st inbox.Status) *inbox.Record { return &inbox.Record{Source: src, Status: st} }
	for want, out := range map[string]inbox.Outcome{
		WouldConflict: {Disposition: inbox.InFlight},
		WouldMismatch: {Disposition: inbox.Mismatch, Record: rec("http", inbox.StatusDone)},
		WouldReplay:   {Disposition: inbox.Duplicate, Record: rec("http", inbox.StatusFailed)},
		"other front": {Disposition: inbox.Mismatch, Record: rec("kafka", inbox.StatusDone)},
		"other, busy": {Disposition: inbox.Mismatch, Record: rec("kafka", inbox.StatusProcessing)},
	} {
		got := Would(out, "http")
		switch want {
		case "other front":
			want = WouldReplay
		case "other, busy":
			want = WouldConflict
		}
		if got != want {
			t.Errorf("Would(%+v) = %s, want %s", out, got, want)
		}
	}
}

func TestClient(t *testing.T) {
	if got := Client("10.0.0.1:5", "curl/8"); len(got) != 4 || got[1] != "10.0.0.1:5" || got[3] != "curl/8" {
		t.Fatal(got)
	}
	if got := Client("", ""); len(got) != 0 {
		t.Fatal(got)
	}
}

func TestObserveScope(t *testing.T) {
	l := ledger(t)
	s := Spec{Scope: "orders", Observe: true}
	r, err := s.Request(l, "k", []byte("0123456789abcdef"), "", "")
	if err != nil || r.Scope != "orders"+ObserveSuffix {
		t.Fatalf("observe scope %q, %v", r.Scope, err)
	}
	if err := (Spec{Scope: strings.Repeat("s", 250), Observe: true}).Validate(); err == nil {
		t.Fatal("a scope too long for its observe suffix")
	}
	if err := (Spec{Scope: "s", KeyRate: &inbox.KeyRate{}}).Validate(); !errors.Is(err, inbox.ErrConfig) {
		t.Fatalf("a KeyRate without Limit: %v", err)
	}
}
