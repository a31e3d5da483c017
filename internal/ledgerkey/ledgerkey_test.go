package ledgerkey

import "testing"

// The hash is part of the stored state (advisory lock keys, Redis key
// names, shards): it must not change between releases.
func TestHashIsStableAndLengthPrefixed(t *testing.T) {
	if got, want := Hash("orders", "", "evt-1"), int64(7928064294435458304); got != want {
		t.Fatalf("Hash = %d, want %d", got, want)
	}
	if Hash("a:b", "", "c") == Hash("a", "b:c", "") || Hash("ab", "", "c") == Hash("a", "bc", "") {
		t.Fatal("parts that concatenate alike hash alike")
	}
	res, lock := RedisKeys("justonce:", "http:/orders", "t 1", "k/1")
	if want := "justonce:{" + hex(Hash("http:/orders", "t 1", "k/1")) + "}:http%3A%2Forders:t+1:k%2F1"; res != want+":res" || lock != want+":lock" {
		t.Fatalf("RedisKeys = %q, %q; want %q:res|lock", res, lock, want)
	}
}

func hex(h int64) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		b[i] = digits[uint64(h)>>(4*(15-i))&15]
	}
	return string(b)
}
