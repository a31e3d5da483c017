package grpcbridge

import (
	"strings"
	"testing"
	"time"

	"github.com/justonce/justonce/internal/bridgereq"
)

func TestParseKey(t *testing.T) {
	for _, c := range []struct {
		in   string
		f    KeyFormat
		max  int
		want string
		ok   bool
	}{
		{"abc", KeyAny, 255, "abc", true},
		{"", KeyAny, 255, "", false},
		{"a\x00b", KeyAny, 255, "", false},
		{"é", KeyAny, 255, "", false},
		{strings.Repeat("a", 255), KeyAny, 255, strings.Repeat("a", 255), true},
		{strings.Repeat("a", 256), KeyAny, 255, "", false},
		{strings.Repeat("a", 37), KeyAEP, 36, "", false},
		{"8E03978E-40D5-43E8-BC93-6894A57F9324", KeyUUID, 255, "8e03978e-40d5-43e8-bc93-6894a57f9324", true},
		{"8e03978e40d543e8bc936894a57f9324", KeyUUID, 255, "", false},
	} {
		got, err := parseKey(c.in, c.f, c.max)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseKey(%q, %d, %d) = %q, %v; want %q, ok %v", c.in, c.f, c.max, got, err, c.want, c.ok)
		}
	}
}

func TestCheckFirstSent(t *testing.T) {
	now := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)
	ttl, skew := time.Hour, time.Minute
	for _, c := range []struct {
		fs     time.Time
		reason string
	}{
		{now, ""},
		{now.Add(skew), ""},
		{now.Add(skew + time.Nanosecond), reasonFuture},
		{now.Add(-(ttl - skew)), ""},
		{now.Add(-(ttl - skew) - time.Nanosecond), reasonExpired},
	} {
		p := checkFirstSent(c.fs, now, ttl, skew, "f")
		got := ""
		if p != nil {
			got = p.reason
		}
		if got != c.reason {
			t.Errorf("checkFirstSent(%s) = %q, want %q", c.fs, got, c.reason)
		}
	}
}

// FuzzParseKey: an accepted key is printable ASCII within the limit, UUID
// keys are lower-case UUIDs, and parsing is idempotent.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", "", "8E03978E-40D5-43E8-BC93-6894A57F9324", "a\x00", strings.Repeat("x", 300), "\"k\""} {
		f.Add(s, uint8(0))
	}
	f.Fuzz(func(t *testing.T, s string, fb uint8) {
		fm := KeyFormat(fb % 3)
		limit := 255
		if fm == KeyAEP {
			limit = 36
		}
		k, err := parseKey(s, fm, limit)
		if err != nil {
			return
		}
		if k == "" || len(k) > limit {
			t.Fatalf("accepted %q of length %d", k, len(k))
		}
		for i := 0; i < len(k); i++ {
			if k[i] < 0x20 || k[i] > 0x7e {
				t.Fatalf("accepted a non-printable byte in %q", k)
			}
		}
		if fm == KeyUUID && (k != strings.ToLower(k) || !bridgereq.IsUUID(k, false)) {
			t.Fatalf("UUID key %q not normalised", k)
		}
		if again, err := parseKey(k, fm, limit); err != nil || again != k {
			t.Fatalf("parseKey not idempotent: %q -> %q, %v", k, again, err)
		}
	})
}

// FuzzParseFirstSent: an accepted first_sent round-trips through its RFC
// 3339 form, and the AEP-155 rules never panic and agree with the window.
func FuzzParseFirstSent(f *testing.F) {
	for _, s := range []string{"2026-06-01T12:00:00Z", "2026-06-01T12:00:00.123456789+02:00", "yesterday", "", "9999-12-31T23:59:59Z", "0000-01-01T00:00:00Z"} {
		f.Add(s, int64(0), int32(0))
	}
	f.Fuzz(func(t *testing.T, s string, secs int64, nanos int32) {
		now := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)
		ttl, skew := 24*time.Hour, time.Minute
		check := func(fs time.Time) {
			p := checkFirstSent(fs, now, ttl, skew, "f")
			in := !fs.After(now.Add(skew)) && !fs.Before(now.Add(-(ttl - skew)))
			if (p == nil) != in {
				t.Fatalf("checkFirstSent(%s) = %v, window says %v", fs, p, in)
			}
		}
		if fs, err := parseFirstSent(s); err == nil {
			back, err := parseFirstSent(fs.Format(time.RFC3339Nano))
			if err != nil || !back.Equal(fs) {
				t.Fatalf("%q -> %s does not round-trip: %v", s, fs, err)
			}
			check(fs)
		}
		if fs, err := timestampTime(secs, int64(nanos)); err == nil {
			if fs.Unix() != secs || fs.Nanosecond() != int(nanos) {
				t.Fatalf("timestamp %d.%d -> %s", secs, nanos, fs)
			}
			check(fs)
		}
	})
}
