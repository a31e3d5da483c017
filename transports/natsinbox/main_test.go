package natsinbox

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// TestMain runs the tests, or, in a child process started by a test, the
// child's part: a NATS server to be killed and restarted (testsvc.NATSProcessChild).
// (The conformance suite's crash case re-runs TestConformance instead.)
// The examples read the service addresses from the environment, as a
// program would: TestMain exports those of .services.env that the
// environment does not set.
func TestMain(m *testing.M) {
	testsvc.NATSProcessChild()
	if v := testsvc.Getenv(testsvc.EnvPostgres); v != "" {
		_ = os.Setenv(testsvc.EnvPostgres, v)
	}
	os.Exit(m.Run())
}
