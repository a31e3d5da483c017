// Package overload proves what the fronts do when offered about twice what
// the ledger's Postgres can take. Each test makes the database the
// bottleneck it can measure: a pool of few connections, and a handler that
// holds its connection for a fixed time, so that the capacity is the pool
// size divided by that time. Then it offers twice that, open loop (each
// request at its time, whether or not the earlier ones were answered):
//
//   - the HTTP and gRPC bridges shed what waits longer than their
//     AcquireWait for a connection (503 overloaded with Retry-After,
//     Unavailable OVERLOADED with RetryInfo); the clients (httpretry,
//     grpcretry) send those again with the same key. The test counts the
//     shed attempts (more than none), checks that every request got its
//     answer in the end and that every key has exactly one effect, and
//     logs the p99 latency of the attempts admitted against an unloaded
//     baseline, as a ratio (a report, not an assertion: it depends on the
//     machine and on AcquireWait);
//   - the consumers (kafkainbox, franzinbox, natsinbox) fall behind with
//     bounded memory: their fetches pause while MaxBuffered messages wait,
//     the backlog stays in the broker, and their live heap measured at two
//     points of the run grows by less than what their buffers hold: the
//     MaxBuffered messages waiting and a batch running (BatchSize), times
//     the message size, plus the broker client's own buffer; then they
//     drain the backlog, every event once;
//   - the same consumers offered half what they take, then a burst of ten
//     times that: their live heap during the burst stays within that bound
//     plus a stated slack above the heap of the steady load, the backlog
//     grows in the broker, and every event runs once afterwards.
//
// It uses the shared services (.services.env): Postgres, and Kafka for the
// Kafka consumers. The NATS cases run a nats-server of their own in a child
// process (testsvc.StartNATSProcess), so that the heap measured is the
// consumer's alone. The package holds tests only.
package overload
