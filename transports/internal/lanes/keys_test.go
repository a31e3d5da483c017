package lanes

import (
	"hash/fnv"
	"testing"

	"github.com/justonce/justonce/consumer/consumertest"
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

// consumertest.LaneKeys, which the fronts' memory benchmarks use to run
// every message at once, gives keys of as many different lanes.
func TestLaneKeysFallInDifferentLanes(t *testing.T) {
	for _, n := range []int{2, 7, 40} {
		seen := map[int]bool{}
		for _, k := range consumertest.LaneKeys(n) {
			seen[keyBucket([]byte(k), n)] = true
		}
		if len(seen) != n {
			t.Fatalf("LaneKeys(%d): %d lanes", n, len(seen))
		}
	}
}
