package backoff_test

import (
	"testing"

	"github.com/justonce/justonce/harness/linkcheck"
)

// The clients share this package: it links no database driver.
func TestLinksNoDatabaseDriver(t *testing.T) { linkcheck.NoDrivers(t) }
