package httpretry_test

import (
	"testing"

	"github.com/justonce/justonce/harness/linkcheck"
)

// A client program that uses httpretry links no database driver.
func TestLinksNoDatabaseDriver(t *testing.T) { linkcheck.NoDrivers(t) }
