package httpbridge

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"strconv"

	"github.com/justonce/justonce/inbox"
)

// encHeader is the stored (never replayed) header naming the key that
// encrypted a stored body. Its presence is what marks a body encrypted.
const encHeader = "Justonce-Body-Key"

var errNoKey = errors.New("httpbridge: stored body's encryption key is not configured")

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

func gcmFor(key []byte) (cipher.AEAD, error) {
	blk, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(blk)
}

// seal encrypts body with the current key: nonce || ciphertext || tag. It
// records the key ID in h.
func (e *Encryption) seal(k inbox.Key, code int, h map[string][]string, body []byte) ([]byte, error) {
	g, err := gcmFor(e.Keys[e.Current])
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, g.NonceSize(), g.NonceSize()+len(body)+g.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	h[encHeader] = []string{e.Current}
	return g.Seal(nonce, nonce, body, aad(k, code)), nil
}

// open decrypts a stored body sealed under key ID kid.
func (e *Encryption) open(k inbox.Key, code int, kid string, sealed []byte) ([]byte, error) {
	if e == nil {
		return nil, errNoKey
	}
	key, ok := e.Keys[kid]
	if !ok {
		return nil, errNoKey
	}
	g, err := gcmFor(key)
	if err != nil {
		return nil, err
	}
	if len(sealed) < g.NonceSize() {
		return nil, errors.New("httpbridge: stored body too short to decrypt")
	}
	return g.Open(nil, sealed[:g.NonceSize()], sealed[g.NonceSize():], aad(k, code))
}
