// Package consumer is the broker-neutral runtime that makes an event
// handler run once per event ID: ID extraction, the ledger transaction,
// retry with backoff, dead-lettering, batching and the decision to ack.
//
// Fronts (kafkainbox, natsinbox) turn their broker's messages into a
// *Message, call Processor.Process (one message) or ProcessRun (the
// messages already waiting, in order, in one transaction, each as if in a
// savepoint of its own), carry on with Processor.Retry (the one retry loop), and ack, retry
// or stop as the Decision says. A front for another broker (RabbitMQ, SQS) is written the
// same way:
//
//	p, _ := consumer.New(consumer.Config{Ledger: ledger, Scope: "billing"},
//		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
//			_, err := tx.Exec(ctx, `INSERT INTO invoices ...`)
//			return err
//		})
//	d := p.ProcessWithRetry(ctx, msg, nil) // attempts until Ack or Stop
//	if d.Action == consumer.Ack { ... ack msg ... }
//
// # Fronts
//
// Every front has the same shape, so that a program written against one
// runs against another by changing its import and its Config:
//
//   - New(cfg Config, h consumer.Handler) (*Consumer, error) validates cfg
//     and applies its defaults; it does not connect.
//   - Config.Processor is this package's Config (Ledger is required; the
//     front sets Scope, ID, Source and DeadLetter unless given).
//   - Config embeds this package's Scheduling, so the same ideas have the
//     same names, defaults and validation in every front's Config:
//     Concurrency (how many messages, or batches, run at once), Ordering
//     (which stay in order), MaxBuffered (how many fetched messages may
//     wait), BatchSize (how many messages at most share one ledger
//     transaction when they are waiting; default 50, 1: one each),
//     BatchMaxTime (how long a batch keeps starting messages), BatchLinger
//     (how long a batch waits to fill up; default 0) and ShutdownTimeout
//     (how long a shutdown waits for work in flight). A front whose
//     default differs says so on its Config.
//   - Run(ctx) error consumes until ctx ends, then shuts down: it stops
//     fetching, lets the attempts in flight finish (handlers keep an
//     uncancelled context for up to ShutdownTimeout, then it is cancelled
//     and their transactions roll back), ends the waits between retries,
//     acknowledges (acks, commits) what finished and leaves the rest to be
//     delivered again, deduplicated by the ledger. It returns nil after
//     such a stop, and an error only when it could not run (a broker
//     refused the setup) or failed for good. Broker and database errors
//     while running are retried and logged, never returned: messages
//     wait, they are not skipped.
//   - Before it consumes, Run measures how long the broker may still
//     deliver a message (Kafka: retention.ms + segment.ms; JetStream:
//     MaxAge) against how long the ledger keeps its ID, reports it to
//     Hooks.OnHorizon, and warns, or with Config.Horizon HorizonRefuse
//     returns a *HorizonError (ErrRedeliveryHorizon). A check that could
//     not be made is logged and never stops Run.
//   - Run may be called once; a second call returns ErrRunOnce.
//   - Everything is logged through the ledger's logger
//     (inbox.Config.Logger).
//
// # Attempts
//
// Message.Attempt counts the handler's failures: an error or panic, a data
// or constraint error (SQLSTATE classes 22 and 23, also a deferred
// constraint failing at COMMIT), a transaction the handler left aborted by
// ignoring a failed statement (inbox.ErrRolledBack). Such a failure is
// retried with Config.Backoff and, after Config.MaxAttempts, dead-lettered,
// recorded failed in the ledger and acked: nothing is acked without its
// effect, and nothing is retried forever.
//
// Transient failures (inbox.IsTransient: the database unreachable, the
// connection lost mid-handler or at COMMIT, a serialization failure or
// deadlock) are retried without counting. When the handler had run in that
// attempt, Message.Uncounted goes up by one, and past
// Config.MaxUncounted each further such failure counts, so that a handler
// that always breaks its own connection is dead-lettered in the end (but
// when that last attempt's COMMIT went through with its answer lost, the
// ledger says so and the message is acked as done). When
// the handler never ran (the database could not be reached at all) the
// retry never counts, however long the outage: an outage dead-letters
// nothing.
//
// The same holds when the ledger could not claim the message for a reason
// that is not the message's, before its handler ran: the ledger's table or
// a privilege is missing (consumers started before the migration), the
// database refuses writes, the ledger refuses the configured TTL. Every
// message would fail the same way, so it is retried as through an outage
// (logged as one) rather than dead-lettered. A data or constraint error at
// the claim (SQLSTATE classes 22 and 23) is the message's, and counts.
//
// # Steps
//
// With Config.Steps a handler whose work spans Postgres and outside
// services runs in steps (inbox.Ledger.DoSteps) rather than in one
// transaction, on every front alike: it gets a nil tx and reaches the
// event's *inbox.Steps with Steps(ctx). A failed attempt keeps the steps
// it recorded, is retried as above, and the next attempt resumes after
// them. A failure that dead-letters (Permanent, refused by
// Config.Retryable, or the last attempt's) first runs the compensations
// the handler declared, in reverse order, and records the key failed. Each
// such event runs alone under its own lease, never batched into a shared
// transaction. A lease lost to another holder is retried without
// counting.
//
// # Outages
//
// While the database is unreachable, retries wait Config.StoreBackoff,
// whose delay grows with each failed attempt of the outage, across all the
// processor's messages, and starts again from its initial value once the
// database answers. The outage is logged once when it starts (a warning)
// and once when it ends (info, with its duration and number of failed
// attempts), not once per retry.
//
// # Cancellation
//
// When the context ends, the Decision is Stop with the context's error:
// the message is neither acked nor retried here and comes again after a
// restart or rebalance. Work that committed before is acked.
package consumer
