// Package linkcheck tells what a package links, so that a client package
// (httpretry, grpcretry, backoff) has a test that fails the day it links a
// database driver or the ledger, which a client program must not carry,
// and the conformance suite one that fails the day it links this module's
// test machinery.
package linkcheck

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
)

// forbidden are import path fragments a client package must not link: the
// Postgres and Redis drivers, and the ledger that brings them.
var forbidden = []string{"pgx", "pgconn", "lib/pq", "redis", "github.com/justonce/justonce/inbox"}

// Deps returns the import paths of the packages that the package in dir
// links: its non-test dependencies, itself included, as `go list -deps`
// reports them.
func Deps(dir string) ([]string, error) {
	goCmd, err := exec.LookPath("go") // go test puts its own go first in PATH
	if err != nil {
		return nil, fmt.Errorf("linkcheck: no go command: %w", err)
	}
	cmd := exec.Command(goCmd, "list", "-deps", "-f", "{{.ImportPath}}", ".")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		return nil, fmt.Errorf("linkcheck: go list -deps in %s: %w: %s", dir, err, stderr)
	}
	return strings.Fields(string(out)), nil
}

// Drivers returns the packages that the package in dir links (Deps) and
// that are database drivers or the ledger.
func Drivers(dir string) ([]string, error) {
	deps, err := Deps(dir)
	if err != nil {
		return nil, err
	}
	var bad []string
	for _, p := range deps {
		for _, f := range forbidden {
			if strings.Contains(p, f) {
				bad = append(bad, p)
				break
			}
		}
	}
	return bad, nil
}

// NoDrivers fails t if the package under test (the test's working
// directory) links a database driver or the ledger.
func NoDrivers(t testing.TB) {
	t.Helper()
	bad, err := Drivers(".")
	if err != nil {
		t.Fatal(err)
	}
	if len(bad) > 0 {
		t.Fatalf("this package links %s; a client package must link no database driver", strings.Join(bad, ", "))
	}
}
