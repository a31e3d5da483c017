package fingerprint

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"strings"
	"testing"
)

// TestBuilderLayout rebuilds fingerprints by hand from the layout Builder
// documents, for both length encodings, with lengths that take one and
// several varint bytes.
func TestBuilderLayout(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 300)
	for _, c := range []struct {
		lengths Lengths
		put     func([]byte, int) []byte
	}{
		{Uvarint, func(p []byte, n int) []byte { return binary.AppendUvarint(p, uint64(n)) }},
		{Uint64, func(p []byte, n int) []byte { return binary.BigEndian.AppendUint64(p, uint64(n)) }},
	} {
		b := NewBuilder(c.lengths, "domain")
		b.String(long)
		b.Bytes([]byte("body"))
		b.Bytes(nil)
		b.Values("name", []string{"v1", ""})
		b.Values("absent", nil)
		got := b.Sum(7)

		var in []byte
		f := func(s string) { in = append(c.put(in, len(s)), s...) }
		f("domain")
		f(long)
		f("body")
		f("")
		f("name")
		in = c.put(in, 2)
		f("v1")
		f("")
		f("absent")
		in = c.put(in, 0)
		sum := sha256.Sum256(in)
		if want := append([]byte{7}, sum[:]...); !bytes.Equal(got, want) {
			t.Errorf("lengths %d: Sum = %x\nwant %x", c.lengths, got, want)
		}
	}
}

// TestBuilderFraming: moving bytes from one field to the next, or from the
// domain into a field, changes the fingerprint.
func TestBuilderFraming(t *testing.T) {
	t.Parallel()
	for _, lengths := range []Lengths{Uvarint, Uint64} {
		sum := func(domain string, fields ...string) string {
			b := NewBuilder(lengths, domain)
			for _, f := range fields {
				b.String(f)
			}
			return string(b.Sum(1))
		}
		seen := map[string]string{}
		for name, s := range map[string]string{
			"ab,c":    sum("d", "ab", "c"),
			"a,bc":    sum("d", "a", "bc"),
			"abc":     sum("d", "abc"),
			"abc,":    sum("d", "abc", ""),
			"domain":  sum("da", "b", "c"),
			"values":  string(func() []byte { b := NewBuilder(lengths, "d"); b.Values("ab", []string{"c"}); return b.Sum(1) }()),
			"version": string(func() []byte { b := NewBuilder(lengths, "d"); b.String("ab"); b.String("c"); return b.Sum(2) }()),
		} {
			if other, ok := seen[s]; ok {
				t.Errorf("lengths %d: %s and %s give the same fingerprint", lengths, name, other)
			}
			seen[s] = name
		}
	}
}
