package linkcheck

import (
	"slices"
	"testing"
)

// The check sees a driver where there is one, and none where there is none.
func TestDrivers(t *testing.T) {
	bad, err := Drivers("../../inbox")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(bad, "github.com/jackc/pgx/v5") || !slices.Contains(bad, "github.com/justonce/justonce/inbox") {
		t.Fatalf("inbox's drivers not seen: %v", bad)
	}
	if bad, err := Drivers("../../backoff"); err != nil || len(bad) > 0 {
		t.Fatalf("backoff: %v, %v", bad, err)
	}
	if _, err := Drivers("../../no-such-package"); err == nil {
		t.Fatal("a missing package is not an error")
	}
}
