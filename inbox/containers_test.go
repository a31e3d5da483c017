//go:build containers

package inbox_test

import (
	"os"
	"testing"

	"github.com/justonce/justonce/harness/testsvc"
)

// containerTests are the ledger tests TestContainers runs by default: the
// ledger's core (ledger_test.go) and its Redis fast path, less the tests
// that depend most on timing (short leases, racers that must meet), which
// the main run covers.
const containerTests = `^Test(DuplicateReturnsStoredResult|HandlerErrorAndPanicRollBack|` +
	`SavepointsInsideHandler|TenantIsolation|ExpiredRowIsNewAgain|LeaseTakeoverAfterExpiry|` +
	`DoTxJoinsCallerTransaction|DoBatch|JanitorDeletesOnlyExpired|InvalidInputRejectedBeforeSQL|ReleaseAndRecordFailure|` +
	`RedisLockOwnership|RedisCacheFollowsTheLedger)$`

// TestContainers runs the ledger tests of this package against Postgres and
// Redis started through testcontainers-go for this test alone (`go test
// -tags containers -run '^TestContainers$' ./inbox`; scripts/containers.sh
// prepares an engine and the image). JUSTONCE_CONTAINERS_RUN overrides the
// tests it runs ("^Test": all of them).
func TestContainers(t *testing.T) {
	run := os.Getenv("JUSTONCE_CONTAINERS_RUN")
	if run == "" {
		run = containerTests
	}
	testsvc.RunInContainers(t, run, "^TestContainers$|^TestRedisCluster|^TestReadme")
}
