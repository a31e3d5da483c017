//go:build containers

package httpbridge_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// TestContainers runs the HTTP bridge tests against Postgres and
// Redis started through testcontainers-go for this test alone (`go test
// -tags containers -run '^TestContainers$' ./httpbridge`; scripts/containers.sh
// prepares an engine and the image). JUSTONCE_CONTAINERS_RUN overrides the
// tests it runs.
func TestContainers(t *testing.T) {
	run := os.Getenv("JUSTONCE_CONTAINERS_RUN")
	if run == "" {
		run = "^Test"
	}
	testsvc.RunInContainers(t, run, "^TestContainers$|^TestRedisCluster|^TestReadme")
}
