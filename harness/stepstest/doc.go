// Package stepstest proves the ledger's recovery points (inbox.Ledger.DoSteps)
// against crashes: a payment service, a child process of the test, runs
// payments of three steps (an order row, a charge at a payment provider, a
// receipt row) with duplicate deliveries racing each other, and is
// SIGKILLed at every point between and inside the steps; then it is run
// again until every payment is done. The provider, in the test process,
// deduplicates on the idempotency key as a real one does and counts what
// it sees. The package holds tests only.
package stepstest
