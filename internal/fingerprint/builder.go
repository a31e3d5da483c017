package fingerprint

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
)

// Lengths says how a Builder writes the length before each field and the
// count before each list of values. Both frame the fields unambiguously;
// they give different bytes, so a caller picks one for good: fingerprints
// are stored, and a stored one must be computed the same way again.
type Lengths int

const (
	// Uvarint writes lengths as unsigned varints (binary.AppendUvarint).
	// Request uses it.
	Uvarint Lengths = iota
	// Uint64 writes lengths as 8-byte big-endian integers.
	Uint64
)

// A Builder computes a fingerprint: a version byte, then SHA-256 over a
// sequence of fields, each written behind its length, so that two
// different sequences never hash the same bytes ("ab","c" differs from
// "a","bc"). Make one with NewBuilder; it is not safe for concurrent use.
type Builder struct {
	h       hash.Hash
	lengths Lengths
	buf     [binary.MaxVarintLen64]byte
}

// NewBuilder starts a fingerprint whose first field is domain, a constant
// naming the kind of thing fingerprinted, which keeps fingerprints of
// different kinds apart.
func NewBuilder(lengths Lengths, domain string) *Builder {
	b := &Builder{h: sha256.New(), lengths: lengths}
	b.String(domain)
	return b
}

// String adds s as one field.
func (b *Builder) String(s string) {
	b.writeLen(len(s))
	b.h.Write([]byte(s))
}

// Bytes adds p as one field.
func (b *Builder) Bytes(p []byte) {
	b.writeLen(len(p))
	b.h.Write(p)
}

// Values adds a named list of values, such as a header or a metadata key:
// name as a field, the number of values, then each value as a field. A
// name without values is hashed with a count of 0.
func (b *Builder) Values(name string, vals []string) {
	b.String(name)
	b.writeLen(len(vals))
	for _, v := range vals {
		b.String(v)
	}
}

// Sum returns the fingerprint: version, then the SHA-256 of the fields
// added so far; 33 bytes. Change version together with the fields a caller
// adds, so that a fingerprint stored under another layout answers as a
// mismatch rather than as a false match.
func (b *Builder) Sum(version byte) []byte {
	return b.h.Sum([]byte{version})
}

func (b *Builder) writeLen(n int) {
	var p []byte
	if b.lengths == Uint64 {
		p = binary.BigEndian.AppendUint64(b.buf[:0], uint64(n))
	} else {
		p = binary.AppendUvarint(b.buf[:0], uint64(n))
	}
	b.h.Write(p)
}
