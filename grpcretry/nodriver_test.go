package grpcretry_test

import (
	"testing"

	"github.com/justonce/justonce/harness/linkcheck"
)

// A client program that uses grpcretry links no database driver.
func TestLinksNoDatabaseDriver(t *testing.T) { linkcheck.NoDrivers(t) }
