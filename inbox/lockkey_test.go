package inbox

import "testing"

func TestLockKeySeparatesParts(t *testing.T) {
	seen := map[int64]Key{}
	for _, k := range []Key{
		{Scope: "a:b", ID: "c"}, {Scope: "a", Tenant: "b", ID: "c"}, {Scope: "a", ID: "b:c"},
		{Scope: "ab", ID: "c"}, {Scope: "a", ID: "bc"}, {Scope: "1:a", ID: "b"}, {Scope: "s", ID: "1"},
		{Scope: "s", ID: "10"}, {Scope: "s", ID: "01"},
	} {
		h := lockKey(k)
		if prev, ok := seen[h]; ok {
			t.Fatalf("%v and %v share lock key %d", prev, k, h)
		}
		seen[h] = k
	}
	var sink int64
	if testing.AllocsPerRun(100, func() { sink += lockKey(Key{Scope: "orders", ID: "evt-1"}) }) != 0 || sink == 0 {
		t.Fatal("lockKey allocates")
	}
}
