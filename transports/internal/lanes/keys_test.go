package lanes

import (
	"hash/fnv"
	"testing"
)

func TestKeyBucketIsFNV1aModuloLanes(t *testing.T) {
	for _, key := range []string{"a", "order-42", "ключ"} {
		h := fnv.New32a()
		h.Write([]byte(key))
		if got, want := keyBucket([]byte(key), 7), int(h.Sum32()%7); got != want {
			t.Fatalf("keyBucket(%q, 7) = %d, want %d", key, got, want)
		}
	}
	if keyBucket(nil, 4) != -1 || keyBucket([]byte("k"), 1) != -1 {
		t.Fatal("an empty key or a single lane must give -1")
	}
}
