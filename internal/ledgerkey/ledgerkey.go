// Package ledgerkey names a ledger key outside Postgres: its 64-bit hash
// (the claim's advisory lock, and the Redis hash tag) and its Redis keys.
// The inbox and the command-line tool must agree on both.
package ledgerkey

import (
	"fmt"
	"net/url"
)

// Hash is FNV-1a 64 over the key's length-prefixed parts, so that
// ("a:b", "c") and ("a", "b:c") differ.
func Hash(scope, tenant, id string) int64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, p := range [3]string{scope, tenant, id} {
		for n := len(p); ; n /= 10 { // the length, in decimal digits
			h = (h ^ uint64('0'+n%10)) * prime
			if n < 10 {
				break
			}
		}
		h = (h ^ ':') * prime
		for i := 0; i < len(p); i++ {
			h = (h ^ uint64(p[i])) * prime
		}
	}
	return int64(h)
}

// RedisKeys are the Redis keys of the key's cached result and lock under
// prefix: <prefix>{<hash>}:<scope>:<tenant>:<id>:res|lock, the hash tag
// keeping both on one Cluster slot.
func RedisKeys(prefix, scope, tenant, id string) (res, lock string) {
	base := fmt.Sprintf("%s{%016x}:%s:%s:%s", prefix, uint64(Hash(scope, tenant, id)),
		url.QueryEscape(scope), url.QueryEscape(tenant), url.QueryEscape(id))
	return base + ":res", base + ":lock"
}
