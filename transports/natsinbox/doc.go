// Package natsinbox runs NATS consumers with exactly-once effects: each
// event's handler runs once per event ID, inside the Postgres transaction
// that records the ID in the justonce ledger, and the message is acked only
// after that transaction commits.
//
// Its name does not clash with nats.go's nats and jetstream packages, so
// they import side by side without an alias:
//
//	import (
//		"github.com/nats-io/nats.go"
//		"github.com/justonce/justonce/transports/natsinbox"
//	)
//
// # JetStream
//
// Set Config.Stream and Config.Durable. The consumer is a durable pull
// consumer with explicit acks and no MaxDeliver limit (the runtime counts
// attempts), created or updated by Run; Config.Bind runs a durable managed
// elsewhere. Messages are pulled with Consume, and each goes through
// consumer.Processor. When messages are waiting, up to Config.BatchSize
// (default 50) run in one transaction, each as if in a savepoint of its own,
// so that a failing handler is rolled back alone and retried in place before the
// messages behind it; a message that finds none waiting runs at once on
// its own. BatchSize 1 turns batching off:
//
//   - a new event runs in the ledger's transaction and is acked after the
//     commit (DoubleAck with Config.DoubleAck); a duplicate (a republish
//     after the stream's duplicate window, a redelivery after a lost ack,
//     the same event through Kafka or HTTP in the scope) is acked without
//     running the handler;
//   - a handler failure (an error, a swallowed SQL error that made COMMIT
//     roll back, a deferred constraint failing at COMMIT) counts an
//     attempt; the database unavailable, or the event held by another
//     consumer, does not. Both are retried in place by the runtime's retry
//     loop (consumer.Processor.Retry), the message kept InProgress every
//     third of AckWait; a failing message occupies one worker, the others
//     (Config.Concurrency) go on;
//   - after Processor.MaxAttempts handler failures (or a consumer.Permanent
//     error, or no event ID) the message is published to the dead-letter
//     subject, recorded failed in the ledger and Term'ed.
//
// The workers are the lane scheduler every consumer front shares, with one
// lane that Config.Concurrency goroutines drain: each takes the next
// pulled message with what waits behind it (up to BatchSize, after
// Config.BatchLinger if set). JetStream has no partitions or keys to keep
// lanes apart, so Config.Ordering must stay consumer.ByPartition:
// Concurrency 1 keeps the stream's order, and above it the workers run
// side by side in no order, so that a message retried in place holds up
// one worker, not the messages behind it (waiting in a lane they would not
// be kept InProgress, and their AckWait would run out).
//
// Run stops as every front does (see the consumer package, "Fronts"): it
// stops pulling, lets the attempts in flight finish and acks them, ends the
// waits between retries, Naks the rest so that another member of the
// durable gets it at once, and returns nil.
//
// The event ID defaults to the Nats-Msg-Id header (DefaultID), the ledger
// scope to the durable name. The ledger closes JetStream's two gaps: a
// republish after the duplicate window (2 minutes by default) and a
// redelivery after a lost ack.
//
// The ledger keeps an ID for its TTL (Processor.TTL, or the ledger's
// default): keep it longer than the stream's MaxAge, since a redelivery or
// a replay can reach any message the stream still holds. Run checks it
// once the durable is in place (consumer.Config.Horizon): it warns when
// MaxAge is above the TTL or 0 (kept forever), reports the durable's
// backlog, notes a dead-letter stream that keeps dead letters longer than
// the TTL, and with consumer.HorizonRefuse returns a
// *consumer.HorizonError instead of pulling. Core NATS does not redeliver:
// it is not checked.
//
// # Attempts
//
// consumer.Message.Attempt counts handler failures, not JetStream
// deliveries: drains, restarts, an expired AckWait or a lost ack deliver
// again without counting, so they cannot dead-letter a healthy event.
// Retries happen in place; a message handed back before it is done (the
// consumer stopped between two attempts) keeps its counts for its next
// delivery in this process (at most MaxTrackedMessages are remembered).
// Another process starts again at 1: a poison message handed from process
// to process may run up to MaxAttempts times in each, never fewer. A
// handler cancelled by Config.ShutdownTimeout does not count.
//
// Up to Config.MaxBuffered pulled messages wait in the consumer's lane and
// as many in the NATS client while the lane is full, so its memory is
// bounded by twice MaxBuffered messages (and the batches running),
// whatever the stream's backlog. Keep twice MaxBuffered times the
// handler's duration, divided by Config.Concurrency, well under AckWait:
// pulled messages waiting for a worker are not kept InProgress (a
// redelivered copy is answered by the ledger rather than run twice).
//
// # Server restarts
//
// With a file store, a nats-server process that restarts or is killed
// loses no message it acknowledged to the publisher, with the server's
// default sync_interval (a single-replica stream writes each message
// before the PubAck; only the fsync is periodic); acks the consumer state
// lost come back as redeliveries, answered Duplicate by the ledger. This is
// tested with the server SIGKILLed mid-run. A machine crash or power loss
// may drop the last sync_interval (default 2 minutes) of messages: set
// sync_interval: always, or use Replicas: 3. A memory store loses
// everything at a restart. Give the connection nats.MaxReconnects(-1).
//
// # Core NATS
//
// Users without JetStream set Config.Subject (and Config.Queue for a queue
// group). Core NATS does not redeliver: a failed handler is retried in
// place with backoff (consumer.Processor.Retry), and after MaxAttempts the
// message goes to the dead-letter subject. Since a message handed back
// would be lost, a shutdown does not end these retries: they go on until
// Config.ShutdownTimeout. A message that is in flight when the process
// crashes, or that the server drops for a slow consumer, is lost: core
// NATS has no record of it to send again.
// The ledger still makes sure that an event published twice (a publisher
// retry) runs once. Use JetStream where losing a message matters.
//
// Core NATS does not use the lane scheduler: its subscription hands each
// message to a free worker (Config.Concurrency of them) and blocks while
// none is free, one message per transaction. The scheduler's stop (no
// attempt starts after it, and what waits is handed back) fits a broker
// that delivers again; core NATS cannot take a message back, so its
// shutdown drains the subscription and runs what the server already sent,
// and the retries of a message go on until ShutdownTimeout.
//
// # Dead letters
//
// The dead-letter subject is the message's subject with ".dlq" appended,
// or Config.DeadLetterSubject, published with the
// consumer.DeadLetterHeadersContext. With JetStream a stream must capture it: until
// the publish succeeds the message is retried, never acked without its
// dead letter. Its Nats-Msg-Id is "justonce-dlq:<stream>:<sequence>:<scope>",
// so a repeated dead-lettering is dropped by the stream's duplicate window,
// while consumers of the stream with other scopes keep their own. Run
// refuses a configuration that would consume its own dead letters, and a
// replay (Replay, Consumer.Replay) reads past them: they are not events. Set
// Processor.DeadLetter to send them elsewhere; the message is still
// Term'ed.
package natsinbox
