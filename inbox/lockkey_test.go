package inbox

import (
	"strings"
	"testing"
)

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

// Do's look-up reads rowCols into destAt's targets, one for one, and stays
// within the sixteen columns pgx describes without allocating (see
// lookupAtSQL).
func TestDoLookupColumns(t *testing.T) {
	var r recordScan
	cols := strings.Split(rowCols, ",")
	if len(cols) != len(r.destAt()) || len(cols) > 16 {
		t.Fatalf("rowCols has %d columns, destAt %d targets (at most 16)", len(cols), len(r.destAt()))
	}
	if n := len(strings.Split(lookupCols, ",")); n != len(r.dest()) {
		t.Fatalf("lookupCols has %d columns, dest %d targets", n, len(r.dest()))
	}
}
