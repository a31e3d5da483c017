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
//		"github.com/justonce/justonce/natsinbox"
//	)
//
// # JetStream
//
// Set Config.Stream and Config.Durable. The consumer is a durable pull
// consumer with explicit acks and no MaxDeliver limit (the runtime counts
// attempts), created or updated by Run; use Config.Bind to run a durable
// managed elsewhere with other settings (DeliverPolicy, BackOff, ...).
// Messages are pulled with Consume, or with Fetch in batch mode
// (Config.BatchSize), and each goes through consumer.Processor:
//
//   - new event: the handler runs in the ledger's transaction; after the
//     commit the message is acked (Ack, or DoubleAck with Config.DoubleAck);
//   - duplicate (the ID is in the ledger already: a republish after the
//     stream's duplicate window, a redelivery after a lost ack, the same
//     event arriving through Kafka or HTTP in the same scope): acked
//     without running the handler;
//   - handler error (including a handler that swallowed a SQL error, so
//     that COMMIT answered ROLLBACK, and a deferred constraint failing at
//     COMMIT): a counted attempt, retried in place by the runtime's retry
//     loop (consumer.Processor.Retry) while the message is kept
//     InProgress;
//   - the database unavailable, or the event held by another consumer of
//     the scope right now: retried in place the same way, without
//     counting an attempt (the runtime bounds such retries after the
//     handler ran, consumer.Config.MaxUncounted);
//   - after Config.Processor.MaxAttempts handler failures (or a
//     consumer.Permanent error, or no event ID): published to the
//     dead-letter subject with the consumer.DeadLetterHeaders (error,
//     attempts, origin subject, stream sequence, ...), recorded failed in
//     the ledger, then Term'ed.
//
// While a handler runs or waits to be retried, the consumer sends
// InProgress every third of the consumer's AckWait, so the message is not
// redelivered meanwhile. A failing message occupies one worker for its
// retry budget (the sum of the backoff delays); the other workers
// (Config.Concurrency) go on. Run stops as every front does (see the
// consumer package, "Fronts"): it stops pulling, lets the attempts in
// flight finish and acks them, ends the waits between retries, Naks what
// was pulled but not started or is waiting to be retried (so another
// member of the durable gets it at once), and returns nil.
//
// # Attempts
//
// consumer.Message.Attempt is the handler attempt: one more than the
// handler's failures counted so far. It is not JetStream's delivery count
// (NumDelivered), which also grows when nothing failed: a draining consumer
// Naks what it pulled, a consumer or server restarts, a prefetched message
// waits past AckWait, an ack is lost. Those redeliveries never count, so a
// few restarts cannot dead-letter a healthy event on its first real
// failure.
//
// Retries happen in place, so an attempt count normally lives and ends with
// one delivery. When a message is handed back to JetStream before it is
// done (the consumer stopped between two attempts), the process remembers
// its Attempt and Uncounted, by stream, durable, scope and stream sequence,
// and a later delivery of it to any Consumer of the same process goes on
// from there; the entry is dropped when the message is acked or
// dead-lettered. The table holds at most MaxTrackedMessages entries and
// forgets the oldest first. A delivery to another process (another member
// of the durable, or this one after a restart) starts again at 1: the
// counts are per process lifetime, not stored anywhere. That is the safe
// side: a message is never dead-lettered before MaxAttempts handler
// failures in one process, at the cost that a poison message handed from
// process to process may run up to MaxAttempts times in each. A handler
// failure while the consumer stops counts; a handler cancelled by
// Config.ShutdownTimeout does not.
//
// Keep Config.Prefetch times the handler's duration, divided by
// Config.Concurrency, well under AckWait: pulled messages waiting for a
// worker are not heartbeated, and a redelivered copy of one is answered
// by the ledger (in flight, then duplicate) rather than run twice.
//
// The event ID defaults to the Nats-Msg-Id header (DefaultID),
// the ledger scope to the durable name and the recorded source to
// Source.
//
// Why the ledger is needed with JetStream: JetStream drops a republished
// Nats-Msg-Id only inside the stream's duplicate window (2 minutes by
// default), and it redelivers a message whose ack was lost (a crash between
// the database commit and the ack, an ack dropped by the network, a server
// restart that lost the consumer's latest acks) after AckWait. Each would
// run the handler twice; the ledger answers Duplicate instead.
//
// # Server restarts and the file store
//
// What the no-loss claim needs from JetStream is that a message it
// acknowledged to the publisher (the PubAck) is still in the stream after
// the server comes back. With a file store (Storage: FileStorage):
//
//   - the nats-server process restarts or is killed (SIGKILL), with the
//     server's default sync setting (sync_interval: 2 minutes): nothing is
//     lost. A single-replica stream writes each message to its file before
//     the PubAck, and the operating system keeps written data when the
//     process dies; only the fsync is periodic. The consumer's state (its
//     acks) may lose its latest updates: those messages are delivered
//     again and the ledger answers Duplicate. The consumer reconnects by
//     itself (give the connection nats.MaxReconnects(-1)). This is tested:
//     the server process is SIGKILLed with handlers in flight and
//     restarted on the same store, and every event has its effect exactly
//     once.
//   - the machine crashes or loses power: with the default sync_interval,
//     messages acknowledged in the last interval (up to 2 minutes) may be
//     gone from the stream, and no consumer can run what the broker lost.
//     For this case set sync_interval: always in the server's jetstream
//     block (every write fsynced before the PubAck; slower), or run a
//     clustered stream with Replicas: 3, where a message is acknowledged
//     once a majority of servers have it.
//
// A memory store loses everything at a server restart.
//
// # Core NATS
//
// Users without JetStream set Config.Subject (and Config.Queue for a queue
// group). Core NATS does not redeliver: a failed handler is retried in
// place with backoff (consumer.Processor.Retry), and after MaxAttempts the
// message goes to the dead-letter subject. Since a message handed back
// would be lost, a shutdown does not end these retries: they go on until
// Config.ShutdownTimeout. A message that
// is in flight when the process crashes, or that the server drops for a
// slow consumer, is lost: core NATS has no record of it to send again.
// The ledger still makes sure that an event published twice (a publisher
// retry) runs once. Use JetStream where losing a message matters.
//
// # Dead letters
//
// The dead-letter subject is the message's subject with ".dlq" appended,
// or Config.DeadLetterSubject. With JetStream it is published with a
// JetStream publish, so a stream must capture it: when none does, the
// publish fails and the message is retried (it is never acked without its
// dead letter). The dead letter carries the original headers except the
// server's own Nats-* headers; its Nats-Msg-Id is
// "justonce-dlq:<stream>:<sequence>" so a repeated dead-lettering is
// dropped by the dead-letter stream's duplicate window, and the original
// event ID is in the Justonce-Event-Id header. Run refuses a configuration
// where the consumer would receive its own dead letters. Set
// Config.Processor.DeadLetter to send them elsewhere (a table, another
// system); the message is still Term'ed.
package natsinbox
