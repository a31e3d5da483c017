package consumertest_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/justonce/justonce/harness/linkcheck"
)

// The suite is for fronts outside this module too: it links none of the
// module's test machinery (harness/), no container library, and no private
// package (internal/) but those the ledger and the runtime link anyway.
func TestLinksNoTestMachinery(t *testing.T) {
	allowed := map[string]bool{}
	for _, dir := range []string{"../../inbox", ".."} {
		deps, err := linkcheck.Deps(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range deps {
			allowed[p] = true
		}
	}
	for _, dir := range []string{".", "testproc"} {
		deps, err := linkcheck.Deps(dir)
		if err != nil {
			t.Fatal(err)
		}
		if dir == "." && !slices.Contains(deps, "github.com/justonce/justonce/inbox") {
			t.Fatalf("go list -deps lists no ledger: %v", deps)
		}
		for _, p := range deps {
			if machinery(p) && !allowed[p] {
				t.Errorf("%s links %s: the suite must need nothing of the module's test machinery or private packages", dir, p)
			}
		}
	}
}

func machinery(path string) bool {
	return strings.HasPrefix(path, "github.com/justonce/justonce/harness/") ||
		strings.HasPrefix(path, "github.com/justonce/justonce/") && strings.Contains(path, "/internal/") ||
		strings.Contains(path, "testcontainers")
}
