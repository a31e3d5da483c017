// Package kafkainbox runs a segmentio/kafka-go consumer group through the
// justonce ledger, so that each event ID has its effect exactly once inside
// the handler's Postgres transaction, whatever Kafka redelivers (rebalances,
// a crash between the database commit and the offset commit, producer
// retries, replays).
//
// Its name does not clash with kafka-go's package kafka, so both import
// without an alias:
//
//	import (
//		"github.com/segmentio/kafka-go"
//		"github.com/justonce/justonce/transports/kafkainbox"
//	)
//
// A Consumer reads one topic as a member of a consumer group. For each
// message it extracts the event ID (DefaultID: the CloudEvents
// ce_id header, then event-id, then Idempotency-Key), claims it in the ledger
// and runs the handler in the same transaction (consumer.Processor). A
// duplicate is acknowledged without running the handler. The handler's
// consumer.Message has Raw set to the kafka.Message.
//
// Keep the ledger's retention (Processor.TTL, or the ledger's default)
// longer than anything Kafka may redeliver: the topic's retention when you
// may rewind the group or replay the topic. Run checks it at start
// (consumer.Config.Horizon): it reads the topic's retention.ms, segment.ms,
// retention.bytes and cleanup.policy and the group's lag, warns when a
// record may be delivered after the ledger forgot its ID (a record stays
// up to retention.ms + segment.ms; a compacted topic, or retention.ms -1,
// keeps records forever), and with consumer.HorizonRefuse returns a
// *consumer.HorizonError instead of joining the group.
//
// Guarantees:
//   - An offset is committed only after the ledger transaction of its message
//     (and of every earlier message of its partition) committed: the commit
//     never passes an unprocessed offset. Offsets are committed every
//     Config.CommitInterval and once more at shutdown, so a crash or a
//     rebalance redelivers at most that much, and the ledger skips it.
//   - Order is kept within a partition: a partition's messages run one after
//     the other and a failing message is retried in place, with backoff, by
//     the runtime's retry loop (consumer.Processor.Retry) before the next
//     one runs. Config.Concurrency (default 4) and Config.Ordering set the
//     parallelism across partitions or across keys; the commit watermark of
//     each partition then waits for the slowest message below it.
//   - One bad message holds up only what must wait for it: the messages
//     behind it in its partition (or its key, with consumer.ByKey). While it waits
//     between attempts it holds no Concurrency slot, so the other partitions
//     go on, even with Concurrency 1, until Config.MaxBuffered fetched
//     messages are waiting; fetching then pauses until the bad message is
//     done, which takes at most its retry budget (Processor.MaxAttempts
//     counted failures, with backoff). A handler error, a panic, a data or
//     constraint error, a transaction the handler left aborted, or a
//     deferred constraint failing at COMMIT counts as a failed attempt.
//   - After Processor.MaxAttempts failed attempts (or at once for a
//     consumer.Permanent error) the message is published to the dead-letter
//     topic (default "<topic>.dlq") with the consumer.DeadLetterHeadersContext
//     (error, attempts, origin topic, partition, offset, event ID, scope,
//     time), recorded as failed in the ledger, and its offset committed: the
//     messages behind it go on.
//   - A record without an event ID is dead-lettered at once (nothing can
//     dedupe it), or with Processor.AllowNoID run in a plain transaction,
//     without dedupe. It is never skipped.
//   - Batching is adaptive and on by default: when several fetched messages
//     of a partition are waiting, up to Config.BatchSize (default 50) run
//     in one transaction, each message as if in a savepoint of its own,
//     and commit together; a message alone in its partition runs
//     at once in a transaction of its own, so batching adds no latency when
//     the consumer keeps up. A message whose handler fails is rolled back
//     alone: the messages before it commit, and it is
//     retried in place or dead-lettered before the ones behind it run, so
//     partition order holds as in per-message mode. A deferred constraint
//     failing at COMMIT cannot be pinned on one message: that batch runs
//     again message by message. BatchSize 1 turns batching off.
//   - Run stops as every front does (see the consumer package, "Fronts"):
//     it stops fetching when its context ends, lets in-flight work finish
//     (up to Config.ShutdownTimeout), commits, leaves the group and returns
//     nil.
//
// Replay: Consumer.Replay (or Replay with any consumer.Processor) re-reads
// a topic from an offset or a time, up to where it stood when the replay
// began, through the same handler: the ledger skips what already ran and
// only the missing events run; a dry run only counts. A replay joins no
// group and commits nothing.
//
// Transactional producers: kafka-go v0.4.51 hands out transaction markers
// (COMMIT and ABORT control records) as messages. A message with a
// marker's shape (no headers, a 4-byte key of version 0 and type 0 or 1) is
// looked up in the partition leader's record batch and skipped only if
// that batch is a control batch; a plain record of the same shape runs.
// Records of aborted transactions are delivered by kafka-go and run like
// any other: do not consume topics whose producers abort transactions
// unless that is acceptable.
//
// Restarts and rebalances: the Consumer gives kafka-go a session timeout
// of 10 s (DefaultSessionTimeout; kafka-go's is 30 s), a 1 s heartbeat and
// a 1 s join backoff, so a killed member's partitions, and a restarted
// process, consume again about 10 s after the kill; a live member silent
// for longer (a long pause) is dropped and the group rebalances. Adjust
// the timings with Config.Reader.
//
// The Consumer joins the group through kafka-go's generation API and reads
// each assigned partition with a reader of its own. A rebalance ends the
// generation, and with it every partition the member holds (kafka-go
// rebalances eagerly): the member stops fetching, waits for its attempts
// in flight (up to the least of ShutdownTimeout and half the rebalance and
// session timeouts, then cancels them: rolled back, they come again),
// commits what is done under the ending generation, and only then
// rejoins. So a partition's next owner starts after what this member
// finished, and a commit of an ended generation is refused by the
// coordinator: a member never moves an offset back below what the next
// owner committed. Fetched messages not yet started are read again, by
// whichever member gets their partition, and the order the Consumer keeps
// (Ordering) holds across the rebalance. A handler that ignores its
// cancellation is left running a second later, and the member rejoins: if
// it returns success, its transaction still commits, and its effect still
// happens once (the next run of its message waits for the key's lock,
// then finds the key done). Run returns only after such handlers have.
package kafkainbox
