// Package franzinbox runs a twmb/franz-go (kgo) consumer group through the
// justonce ledger, so that each event ID has its effect exactly once inside
// the handler's Postgres transaction, whatever Kafka redelivers
// (rebalances, a crash between the database commit and the offset commit,
// producer retries, replays). It has the shape of kafkainbox, the
// segmentio/kafka-go front: the same Config fields, New, Run and
// guarantees; pick it for its read-committed isolation (records of aborted
// transactions never run), for rebalances that redeliver nothing, or
// because your services already use franz-go.
//
// A Consumer reads Config.Topics as a member of a consumer group. For
// each message it extracts the event ID (DefaultID: the CloudEvents ce_id
// header, then event-id, then Idempotency-Key), claims it in the ledger
// and runs the handler in the same transaction (consumer.Processor). A
// duplicate is acknowledged without running the handler. The handler's
// consumer.Message has Raw set to the *kgo.Record.
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
//   - Read committed: the client fetches with read-committed isolation, so
//     records of transactions that were aborted are never delivered, and
//     those of a transaction still open wait for its commit. Transaction
//     markers are never delivered either. (kafka-go, under kafkainbox,
//     delivers the records of aborted transactions.)
//   - An offset is committed only after the ledger transaction of its message
//     (and of every earlier message of its partition) committed: the commit
//     never passes an unprocessed offset. Offsets are committed every
//     Config.CommitInterval, when partitions are revoked and once more at
//     shutdown, so a crash redelivers at most CommitInterval's worth, and
//     the ledger skips it.
//   - Order is kept within a partition: a partition's messages run one after
//     the other and a failing message is retried in place, with backoff, by
//     the runtime's retry loop (consumer.Processor.Retry) before the next
//     one runs. Config.Concurrency (default 4) and Config.Ordering set the parallelism
//     across partitions or across keys; the commit watermark of each
//     partition then waits for the slowest message below it.
//   - One bad message holds up only what must wait for it: the messages
//     behind it in its partition (or its key, with consumer.ByKey). While it waits
//     between attempts it holds no Concurrency slot, so the other
//     partitions go on, even with Concurrency 1, until Config.MaxBuffered
//     polled messages are waiting; polling then pauses until the bad
//     message is done, which takes at most its retry budget
//     (Processor.MaxAttempts counted failures, with backoff).
//   - After Processor.MaxAttempts failed attempts (or at once for a
//     consumer.Permanent error) the message is published to the dead-letter
//     topic (default "<topic>.dlq") with the consumer.DeadLetterHeadersContext,
//     recorded as failed in the ledger, and its offset committed: the
//     messages behind it go on. A record without an event ID is
//     dead-lettered at once, or with Processor.AllowNoID run in a plain
//     transaction, without dedupe. It is never skipped.
//   - Batches form under load: the messages of a partition already
//     waiting, up to Config.BatchSize (default 50), run in one transaction,
//     each message as if in a savepoint of its own
//     (consumer.Processor.ProcessRun); a failing message is rolled back
//     alone and retried in place before the messages behind it run. A lone
//     message runs at once. BatchSize 1 runs one message per transaction.
//   - Rebalances: when partitions are revoked (franz-go's cooperative
//     rebalancing revokes only those that move), their queued messages are
//     dropped, the attempts in flight finish (up to half the rebalance
//     timeout, then they are cancelled and rolled back), and what is done
//     is committed before the group hands the partitions on. The client
//     blocks rebalances from a poll until its records are queued
//     (kgo.BlockRebalanceOnPoll), so no record of a revoked partition
//     runs after the revoke. Two members therefore never run one
//     partition's messages at once, and the next owner starts where this
//     one stopped: a rebalance redelivers nothing (unless that commit
//     fails, or the partitions were lost rather than revoked; the ledger
//     skips what comes again). A handler that ignores its context's
//     cancellation is left running a second after it was cancelled, so
//     that it does not hold the group's rebalance: its message is not
//     committed, and its next run waits for the key's lock and then finds
//     the key done (if the handler returned success, its transaction still
//     commits) or runs it. It holds its Concurrency slot until it returns,
//     and Run returns only after it has.
//     Partitions lost
//     rather than revoked (this member was dropped from the group) are
//     forgotten at once: nothing more of them is committed, and their
//     attempts in flight are cancelled at once and rolled back, to run
//     again at the new owner.
//   - Run stops as every front does (see the consumer package, "Fronts"):
//     it stops polling when its context ends, lets in-flight work finish
//     (up to Config.ShutdownTimeout), commits, leaves the group and returns
//     nil.
//
// Replay: Consumer.Replay (or Replay with any consumer.Processor) re-reads
// a topic from an offset or a time, up to where it stood when the replay
// began, through the same handler: the ledger skips what already ran and
// only the missing events run; a dry run only counts. A replay joins no
// group and commits nothing.
//
// Restarts: the Consumer gives franz-go a session timeout of 10 s
// (DefaultSessionTimeout; franz-go's is 45 s), a 1 s heartbeat and a 10 s
// rebalance timeout, so a killed member's partitions, and a restarted
// process, consume again about 10 s after the kill; a live member silent
// for longer is dropped and the group rebalances. Adjust them with
// Config.ClientOptions.
package franzinbox
