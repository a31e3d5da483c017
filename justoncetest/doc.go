// Package justoncetest helps you test code built on justonce against a real
// Postgres, in the style of River's rivertest.
//
// Ledger gives a test a ledger in a schema of its own, migrated, and
// dropped when the test ends. It connects to DATABASE_URL, which must name
// a Postgres the test may create schemas in; when it is unset the test
// fails and says so (it is never skipped). The ledger's pool has its
// search_path set to that schema, so tables a test creates without a schema
// name are dropped with it.
//
// Deliver pushes a synthetic message through a consumer.Processor with the
// real runtime: the same retry loop, backoff, dead-lettering and ledger
// transaction a Kafka or NATS front uses.
//
// RequireProcessed, RequireFailed, RequireNotProcessed and RequireDuplicate
// assert what the ledger holds for a key. When they fail, they say what they
// found: the row's status, attempts and error.
//
//	func TestBilling(t *testing.T) {
//		ledger := justoncetest.Ledger(t)
//		p, _ := consumer.New(consumer.Config{Ledger: ledger, Scope: "billing"}, handler)
//		m := &consumer.Message{ID: "evt-1", Value: []byte(`{"cents":1250}`)}
//		justoncetest.Deliver(t, p, m)
//		justoncetest.Deliver(t, p, m) // a redelivery
//		justoncetest.RequireProcessed(t, ledger, inbox.Key{Scope: "billing", ID: "evt-1"})
//	}
//
// A front for another broker (RabbitMQ, SQS, a queue table) proves its
// delivery guarantees with the conformance suite that kafkainbox and
// natsinbox pass: implement consumertest.Harness and call consumertest.Run
// (package github.com/justonce/justonce/consumer/consumertest) from a test.
package justoncetest
