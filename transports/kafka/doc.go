// Package kafkainbox runs a segmentio/kafka-go consumer group through the
// justonce ledger, so that each event ID has its effect exactly once inside
// the handler's Postgres transaction, whatever Kafka redelivers (rebalances,
// a crash between the database commit and the offset commit, producer
// retries, replays).
//
// The package lives in transports/kafka but is named kafkainbox, so that it
// can be imported next to kafka-go (package kafka) without an alias:
//
//	import (
//		"github.com/segmentio/kafka-go"
//		kafkainbox "github.com/justonce/justonce/transports/kafka"
//	)
//
// A Consumer reads one topic as a member of a consumer group. For each
// message it extracts the event ID (consumer.DefaultKafkaID: the CloudEvents
// ce_id header, then event-id, then Idempotency-Key), claims it in the ledger
// and runs the handler in the same transaction (consumer.Processor). A
// duplicate is acknowledged without running the handler. The handler's
// consumer.Message has Raw set to the kafka.Message.
//
// Keep the ledger's retention (Processor.TTL, or the ledger's default)
// longer than anything Kafka may redeliver: the topic's retention when you
// may rewind the group or replay the topic.
//
// Guarantees:
//   - An offset is committed only after the ledger transaction of its message
//     (and of every earlier message of its partition) committed: the commit
//     never passes an unprocessed offset. Offsets are committed every
//     Config.CommitInterval and once more at shutdown, so a crash or a
//     rebalance redelivers at most that much, and the ledger skips it.
//   - Order is kept within a partition: a partition's messages run one after
//     the other and a failing message is retried in place, with backoff,
//     before the next one runs. Config.Concurrency and Config.Ordering allow
//     parallelism across partitions or across keys; the commit watermark of
//     each partition then waits for the slowest message below it.
//   - After Processor.MaxAttempts failed attempts (or at once for a
//     consumer.Permanent error, or a message without an ID) the message is
//     published to the dead-letter topic (default "<topic>.dlq") with the
//     consumer.DeadLetterHeaders (error, attempts, origin topic, partition,
//     offset, event ID, scope, time), recorded as failed in the ledger, and
//     its offset committed: the messages behind it go on.
//   - Batch mode (Config.BatchSize) claims up to BatchSize fetched messages
//     in one statement and runs the new ones in one transaction; a failing
//     message is isolated and retried on its own, the others are kept. A
//     message that needs a retry is retried after the rest of its batch
//     ran, so in batch mode order holds for the messages that succeed at
//     the first attempt.
//   - Run stops fetching when its context ends, lets in-flight work finish
//     (up to Config.ShutdownTimeout), commits, and leaves the group.
//
// Replay: Consumer.Replay (or Replay with any consumer.Processor) re-reads
// a topic from an offset or a time, up to where it stood when the replay
// began, through the same handler: the ledger skips what already ran and
// only the missing events run; a dry run only counts. A replay joins no
// group and commits nothing.
//
// Transactional producers: kafka-go v0.4.51 hands out transaction markers
// as messages and does not filter aborted records, whatever the
// IsolationLevel (segmentio/kafka-go#1332). Markers (no headers, the
// marker's 4-byte key and 6-byte value, no event ID) are skipped and their
// offsets committed; records of aborted transactions are delivered and run
// like any other, so do not consume topics whose producers abort
// transactions unless running those records is acceptable.
//
// Rebalances: kafka-go gives no revocation callback, so a member may still
// finish messages of a partition that has just moved to another member, and
// its offset commit for that partition may fail or land late. Neither loses
// nor doubles anything: the new owner starts from the last committed offset,
// and the ledger answers Duplicate (or InFlight, retried) for what the old
// owner ran. During that short overlap two members may run neighbouring
// messages of one partition at the same time: order within a partition is
// kept per member, not across a rebalance.
package kafkainbox
