package httpbridge

import (
	"strconv"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/sealbox"
)

// encHeader is the stored (never replayed) header naming the key that
// encrypted a stored body. Its presence is what marks a body encrypted.
const encHeader = "Justonce-Body-Key"

func (e *Encryption) ring() sealbox.Ring {
	if e == nil {
		return sealbox.Ring{}
	}
	return sealbox.Ring{Keys: e.Keys, Current: e.Current}
}

// aad binds a ciphertext to its row and status, so that it cannot be moved
// to another key or served under another status.
func aad(k inbox.Key, code int) []byte {
	b := []byte("justonce-httpbridge/v1")
	for _, p := range []string{k.Scope, k.Tenant, k.ID, strconv.Itoa(code)} {
		b = append(b, 0)
		b = append(b, p...)
	}
	return b
}

// seal encrypts body with the current key and records the key's ID in h.
func (e *Encryption) seal(k inbox.Key, code int, h map[string][]string, body []byte) ([]byte, error) {
	kid, sealed, err := e.ring().Seal(aad(k, code), body)
	if err != nil {
		return nil, err
	}
	h[encHeader] = []string{kid}
	return sealed, nil
}

// open decrypts a stored body sealed under key ID kid.
func (e *Encryption) open(k inbox.Key, code int, kid string, sealed []byte) ([]byte, error) {
	return e.ring().Open(kid, aad(k, code), sealed)
}
