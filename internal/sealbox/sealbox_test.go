package sealbox

import (
	"bytes"
	"errors"
	"testing"
)

func TestSealOpenRotate(t *testing.T) {
	old := Ring{Keys: map[string][]byte{"k1": bytes.Repeat([]byte{1}, 32)}, Current: "k1"}
	if err := old.Validate(); err != nil {
		t.Fatal(err)
	}
	kid, sealed, err := old.Seal([]byte("row"), []byte("secret body"))
	if err != nil || kid != "k1" || bytes.Contains(sealed, []byte("secret")) {
		t.Fatalf("seal: %q %q %v", kid, sealed, err)
	}
	rotated := Ring{Keys: map[string][]byte{"k1": old.Keys["k1"], "k2": bytes.Repeat([]byte{2}, 16)}, Current: "k2"}
	got, err := rotated.Open(kid, []byte("row"), sealed)
	if err != nil || string(got) != "secret body" {
		t.Fatalf("open after rotation: %q %v", got, err)
	}
	if _, err := rotated.Open(kid, []byte("other row"), sealed); err == nil {
		t.Fatal("opened under another aad")
	}
	if _, err := (Ring{Keys: map[string][]byte{"k2": rotated.Keys["k2"]}, Current: "k2"}).Open(kid, []byte("row"), sealed); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("retired key: %v", err)
	}
	if _, err := rotated.Open(kid, []byte("row"), sealed[:3]); err == nil {
		t.Fatal("opened a truncated body")
	}
}

func TestValidate(t *testing.T) {
	key := bytes.Repeat([]byte{1}, 16)
	for name, r := range map[string]Ring{
		"empty":       {},
		"no current":  {Keys: map[string][]byte{"a": key}, Current: "b"},
		"empty id":    {Keys: map[string][]byte{"": key}, Current: ""},
		"bad id":      {Keys: map[string][]byte{"a\n": key}, Current: "a\n"},
		"bad key len": {Keys: map[string][]byte{"a": key[:5]}, Current: "a"},
	} {
		if r.Validate() == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
