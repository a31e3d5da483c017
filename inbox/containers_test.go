//go:build containers

package inbox_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/internal/testsvc"
)

// TestContainers runs the ledger tests of this package against Postgres and
// Redis started through testcontainers-go for this test alone (`go test
// -tags containers -run '^TestContainers$' ./inbox`; scripts/containers.sh
// prepares an engine and the image). JUSTONCE_CONTAINERS_RUN overrides the
// tests it runs.
func TestContainers(t *testing.T) {
	run := os.Getenv("JUSTONCE_CONTAINERS_RUN")
	if run == "" {
		run = "^Test"
	}
	testsvc.RunInContainers(t, run, "^TestContainers$|^TestRedisCluster|^TestReadme")
}
