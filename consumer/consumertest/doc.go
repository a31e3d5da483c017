// Package consumertest is the delivery-guarantee suite every consumer
// front must pass (like Watermill's pubsub/tests). It runs against the
// front's real broker and a real Postgres, and proves, each case from the
// business table the handler writes and from the ledger:
//
//   - DuplicatesRunOnce: a message delivered again (the same ID at a later
//     offset) runs once;
//   - PoisonDeadLettered, NoIDDeadLettered: a message that always fails, or
//     has no ID, is dead-lettered with its cause and attempts while the
//     rest flows;
//   - SwallowedSQLError, DeferredConstraintAtCommit: a hostile handler (one
//     that ignores a SQL error, one whose deferred constraint fails at
//     COMMIT) never gets its message acknowledged without its effect;
//   - RestartLosesNothing: a consumer stopped mid-stream, with handlers
//     running, and restarted loses and doubles nothing;
//   - with Features.Batch, the same in batch mode; with
//     Features.SharedGroup, two consumers of one group lose and double
//     nothing across the rebalance;
//   - with Features.Crash (Linux), Crash and, with Batch, BatchCrash: a
//     consumer in a child process SIGKILLed four times mid-stream and
//     restarted: twice with handlers held inside their transactions
//     (effects written, not committed), twice with messages held between
//     their commit and their acknowledgement, which must come again and be
//     answered from the ledger without running; then 0 lost, 0 doubled;
//   - with Features.Stall, RetryingMessageHoldsOnlyItsLane: a message that
//     fails at COMMIT retries in place, holding up only its own lane (the
//     other lane's messages all run within its retry budget, with a
//     Concurrency of 1), then is dead-lettered, and the messages behind it
//     run after it, in order;
//   - with Features.Replay, ReplayRunsOnlyTheMissing: the front's replay,
//     from the start of the topic, through the same handler, after a
//     restore lost the last effects: a dry run counts without running, the
//     ledger skips what ran and only the missing events run, the replay
//     ends where the topic stood when it began, a replay from a time reads
//     only what came after it, and no replay acknowledges anything for the
//     live group.
//
// # Using it
//
// A front implements Harness and calls Run from a test:
//
//	func TestConformance(t *testing.T) {
//		consumertest.Run(t, &harness{brokers: brokersFromEnv(t)},
//			consumertest.Features{Batch: true, SharedGroup: true, Crash: true, Stall: true, Replay: true})
//	}
//
// Harness's methods, each a few lines over the front's own API:
//
//   - NewTopic(t): a fresh topic (or subject with its stream) with a
//     dead-letter destination, with at least two lanes when Stall is on;
//   - Publish(t, topic, msgs): send in order, each ID in the front's
//     default ID header;
//   - Start(t, topic, group, opts): run a consumer of group (a consumer
//     group, a durable) on topic with opts (the Processor's Config,
//     the handler, BatchSize, Concurrency) until the returned stop, which
//     shuts it down gracefully; Start (the function) runs a front's
//     Consumer in a test and checks the shutdown contract;
//   - DeadLetters(t, topic): what reached the dead-letter destination;
//   - Pending(t, topic, group): how many messages of topic the group has
//     not acknowledged (Kafka: the lag of its committed offsets; JetStream:
//     the durable's pending and unacknowledged messages);
//   - PostgresURL(t): a Postgres on which the suite may create schemas.
//     Each case makes one of its own (migrated, dropped at its end;
//     justoncetest.Ledger with WithDatabase) and builds its ledger there.
//
// And for the cases Features switches on:
//
//   - Crash, CrashHarness: ChildEnv() is the environment a child process
//     needs to build the same Harness on the same broker (its address,
//     when the test found it elsewhere than in the environment);
//     RunChild(ctx, topic, group, opts) runs, in the child, a consumer as
//     a program would run it (no test tuning, such as shorter group
//     timeouts, that would hide what a restart costs and that
//     Features.CrashRestart bounds) until ctx ends, and returns its Run's
//     error. The suite re-executes the test
//     binary, running only the test that called Run, with an environment
//     variable that makes Run play the child's part: so build the Harness
//     the same way in that test whether it runs as parent or child, and
//     call Run once in it. Features.CrashRestart bounds how soon a
//     consumer restarted right after a SIGKILL must have its first effect.
//   - Stall, StallHarness: PublishLane(t, topic, lane, msgs) sends msgs in
//     order to lane 0 or 1 of topic (a Kafka partition): messages that run
//     one after the other, apart from the other lane's.
//   - Replay, ReplayHarness: Replay(t, topic, group, opts, since, ro) runs
//     the Replay method of a consumer of group on topic made from opts
//     (its handler, scope and ID), from the first message stored at or
//     after since (zero: from the start), through the front's own replay
//     configuration.
//
// The suite links nothing of this module's test machinery and no
// container library: a front outside the module uses it as it is, with
// services of its own.
package consumertest
