package franzinbox_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// child, when set (crash_linux_test.go), runs this test binary as a child
// process a test started, and reports whether it did.
var child func() (code int, ran bool)

// TestMain runs the tests, or a child process's part. The examples read the
// service addresses from the environment, as a program would: TestMain
// exports those of .services.env that the environment does not set.
func TestMain(m *testing.M) {
	if child != nil {
		if code, ran := child(); ran {
			os.Exit(code)
		}
	}
	for _, name := range []string{testsvc.EnvPostgres, testsvc.EnvKafka} {
		if v := testsvc.Getenv(name); v != "" {
			_ = os.Setenv(name, v)
		}
	}
	os.Exit(m.Run())
}
