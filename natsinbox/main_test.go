package natsinbox

import (
	"os"
	"testing"
)

// TestMain runs the tests, or, in a child process started by a test, the
// child's part: a consumer to be killed (crashChild) or a NATS server to be
// killed and restarted (serverChild).
func TestMain(m *testing.M) {
	switch {
	case os.Getenv(envCrashChild) != "":
		crashChild()
	case os.Getenv(envServerChild) != "":
		serverChild()
	}
	os.Exit(m.Run())
}
