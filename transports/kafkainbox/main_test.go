package kafkainbox_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// TestMain runs the tests, or a child process's part of
// BenchmarkScaleProcesses when the environment says so. The examples read the service addresses from
// the environment, as a program would: TestMain exports those of
// .services.env that the environment does not set.
func TestMain(m *testing.M) {
	runScaleChild()
	for _, name := range []string{testsvc.EnvPostgres, testsvc.EnvKafka} {
		if v := testsvc.Getenv(name); v != "" {
			_ = os.Setenv(name, v)
		}
	}
	os.Exit(m.Run())
}
