// Package natsinbox runs NATS consumers with exactly-once effects: each
// event's handler runs once per event ID, inside the Postgres transaction
// that records the ID in the justonce ledger, and the message is acked only
// after that transaction commits.
//
// The package lives in transports/nats but is named natsinbox, so that it
// can be imported next to nats.go's nats and jetstream packages without an
// alias:
//
//	import (
//		"github.com/nats-io/nats.go"
//		natsinbox "github.com/justonce/justonce/transports/nats"
//	)
//
// # JetStream
//
// Set Config.Stream and Config.Durable. The consumer is a durable pull
// consumer with explicit acks and no MaxDeliver limit (the runtime counts
// attempts), created or updated by Run; use Config.Bind to run a durable
// managed elsewhere with other settings (DeliverPolicy, BackOff, ...). Messages are pulled with Consume, or with Fetch in
// batch mode (Config.Batch), and each goes through consumer.Processor:
//
//   - new event: the handler runs in the ledger's transaction; after the
//     commit the message is acked (Ack, or DoubleAck with Config.DoubleAck);
//   - duplicate (the ID is in the ledger already: a republish after the
//     stream's duplicate window, a redelivery after a lost ack, the same
//     event arriving through Kafka or HTTP in the same scope): acked
//     without running the handler;
//   - handler error: NakWithDelay with the runtime's backoff, so JetStream
//     delivers it again; the JetStream delivery count (NumDelivered) is the
//     attempt number (consumer.Message.Attempt);
//   - after Config.Processor.MaxAttempts deliveries (or a
//     consumer.Permanent error, or no event ID): published to the
//     dead-letter subject with the consumer.DeadLetterHeaders (error,
//     attempts, origin subject, stream sequence, ...), recorded failed in
//     the ledger, then Term'ed.
//
// While a handler runs, the consumer sends InProgress every third of the
// consumer's AckWait, so a handler slower than AckWait is not redelivered
// meanwhile. Run drains on shutdown: it stops pulling, lets in-flight
// handlers finish and acks them, Naks what was pulled but not started (so
// another member of the durable gets it at once), and returns.
//
// The event ID defaults to the Nats-Msg-Id header (consumer.DefaultNATSID),
// the ledger scope to the durable name and the recorded source to
// inbox.SourceNATS.
//
// Why the ledger is needed with JetStream: JetStream drops a republished
// Nats-Msg-Id only inside the stream's duplicate window (2 minutes by
// default), and it redelivers a message whose ack was lost (a crash between
// the database commit and the ack, an ack dropped by the network) after
// AckWait. Both would run the handler twice; the ledger answers Duplicate
// instead.
//
// Retries that are not the handler's fault (the database is unreachable,
// or another consumer of the scope holds the event in its transaction right
// now) are repeated in place, the message kept InProgress, rather than
// Nak'ed: a redelivery would raise NumDelivered, the attempt number, and
// could dead-letter a healthy event early. Note that NumDelivered still
// counts redeliveries that no handler failure caused (a message that waited
// in the client past AckWait, a lost ack): they count toward MaxAttempts if
// the handler later fails. Keep Config.Prefetch times the handler's
// duration, divided by Config.Concurrency, well under AckWait: pulled
// messages waiting for a worker are not heartbeated.
//
// # Core NATS
//
// Users without JetStream set Config.Subject (and Config.Queue for a queue
// group). Core NATS does not redeliver: a failed handler is retried in
// place with backoff (consumer.Processor.ProcessWithRetry), and after
// MaxAttempts the message goes to the dead-letter subject. A message that
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
