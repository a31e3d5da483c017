// Package sealbox encrypts stored bodies at rest with AES-GCM under keys
// named by ID, so that keys can rotate: new bodies are sealed with the
// current key, and older ones opened with the key whose ID was recorded
// with them.
package sealbox

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"fmt"
)

// ErrUnknownKey: the key ID a body was sealed under is not in the ring.
var ErrUnknownKey = errors.New("sealbox: the body's encryption key is not configured")

// Ring holds the keys by ID and the ID of the one that seals new bodies.
type Ring struct {
	Keys    map[string][]byte
	Current string
}

// Validate checks that the ring has keys, that Current is one of them,
// and that every ID is 1 to 64 printable ASCII characters and every key
// an AES key (16, 24 or 32 bytes).
func (r Ring) Validate() error {
	if len(r.Keys) == 0 {
		return errors.New("no keys")
	}
	if _, ok := r.Keys[r.Current]; !ok {
		return fmt.Errorf("the current key ID %q is not among the keys", r.Current)
	}
	for id, k := range r.Keys {
		if id == "" || len(id) > 64 || !printableASCII(id) {
			return fmt.Errorf("key ID %q must be 1 to 64 printable ASCII characters", id)
		}
		if _, err := aes.NewCipher(k); err != nil {
			return fmt.Errorf("key %q: %v", id, err)
		}
	}
	return nil
}

// Seal encrypts body with the current key, binding it to aad, and returns
// the key's ID and nonce || ciphertext || tag.
func (r Ring) Seal(aad, body []byte) (keyID string, sealed []byte, err error) {
	g, err := gcmFor(r.Keys[r.Current])
	if err != nil {
		return "", nil, err
	}
	nonce := make([]byte, g.NonceSize(), g.NonceSize()+len(body)+g.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return "", nil, err
	}
	return r.Current, g.Seal(nonce, nonce, body, aad), nil
}

// Open decrypts a body sealed under keyID with the same aad.
func (r Ring) Open(keyID string, aad, sealed []byte) ([]byte, error) {
	key, ok := r.Keys[keyID]
	if !ok {
		return nil, ErrUnknownKey
	}
	g, err := gcmFor(key)
	if err != nil {
		return nil, err
	}
	if len(sealed) < g.NonceSize() {
		return nil, errors.New("sealbox: sealed body too short")
	}
	return g.Open(nil, sealed[:g.NonceSize()], sealed[g.NonceSize():], aad)
}

func gcmFor(key []byte) (cipher.AEAD, error) {
	blk, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(blk)
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
