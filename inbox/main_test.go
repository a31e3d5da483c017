package inbox_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// TestMain points DATABASE_URL, which the examples read as a user's
// program would, at the test Postgres.
func TestMain(m *testing.M) {
	if os.Getenv("DATABASE_URL") == "" {
		if u := testsvc.Getenv("JUSTONCE_TEST_POSTGRES_URL"); u != "" {
			_ = os.Setenv("DATABASE_URL", u)
		}
	}
	os.Exit(m.Run())
}
