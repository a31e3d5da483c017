// Command justonce operates a justonce ledger: it migrates the schema,
// inspects the processed_events table, frees stuck keys, purges expired
// rows, inspects the transactional outbox (retrying or purging the
// messages a broker refused) and dry-runs replays of a Kafka topic or a
// JetStream stream.
//
//	go install github.com/justonce/justonce/cmd/justonce@latest
//
// # Commands
//
//	justonce migrate up [--to N] [--json]     apply pending migrations
//	justonce migrate down --yes [--to N] [--json]
//	                                          revert migrations (version 1 drops the ledger, 2 the
//	                                          outbox, 4 the recorded steps)
//	justonce migrate status [--json]          schema version and pending migrations
//	justonce ledger stats [--json]            live rows by scope and status, oldest in-flight lease
//	justonce ledger show <scope> <id> [--tenant T] [--reveal] [--json]
//	                                          one key: status, source, attempts, fencing
//	                                          token, lease, timestamps, result code and size, error,
//	                                          its recorded steps and where it stopped
//	justonce ledger release <scope> <id> [--tenant T] [--force] [--redis-url URL]
//	        [--redis-prefix P] [--redis-cluster] [--json]
//	                                          free a stuck (processing) or failed key
//	justonce ledger purge --expired [--batch N] [--pause D] [--json]
//	                                          delete expired rows in batches
//	justonce outbox stats [--json]            pending and failed outbox messages, oldest pending age
//	justonce outbox failed [--limit N] [--json]
//	                                          the failed messages with their errors, oldest first
//	justonce outbox retry (<id>... | --all) [--json]
//	                                          put failed messages back in the queue
//	justonce outbox purge --failed (<id>... | --all) [--older-than D] [--json]
//	                                          delete failed messages (never pending ones)
//	justonce replay kafka --brokers B --topic T --scope S [--from-offset N]
//	        [--since D | --from-time T] [--tenant T] [--id-header H,...] [--json]
//	                                          dry-run a replay of a Kafka topic
//	justonce replay nats --nats-url U --stream S --scope S [--subject S] [--from-seq N]
//	        [--since D | --from-time T] [--tenant T] [--id-header H,...] [--json]
//	                                          dry-run a replay of a JetStream stream
//	justonce help <command>                   the same as justonce <command> -h
//
// Every database command also takes --database-url and --schema. "justonce
// -h" lists the commands; every command prints all its flags, with their
// defaults, with -h or --help (to stdout, exit code 0). Flags may come
// before or after the positional arguments; after "--" everything is
// positional (for an ID that begins with a dash). Duration flags take Go
// durations (10ms, 24h), time flags RFC 3339 (2026-11-20T00:00:00Z).
//
// Event IDs are masked in the output (550e****0000) unless ledger show is
// given --reveal. A stored response body is never printed, only its size.
// ledger release refuses a key that is done unless --force is given:
// releasing it lets its effect happen a second time.
//
// replay cannot run your handler (it is Go code): it reads the topic or
// stream up to where it stood when it began and counts, per partition, the
// events the ledger has done (skipped), those that would run, those
// recorded failed and those without an ID. Nothing is recorded and no
// consumer group or durable is touched. Run the missing events from Go with
// kafkainbox.Consumer.Replay or natsinbox.Replay.
//
// # Configuration
//
// Flags win over environment variables:
//
//	--database-url   DATABASE_URL           Postgres URL or key=value DSN (required)
//	--schema         JUSTONCE_SCHEMA        schema of processed_events and outbox (default: search_path)
//	--redis-url      REDIS_URL              ledger release: the application's Redis replay cache
//	--redis-prefix   JUSTONCE_REDIS_PREFIX  ledger release: its key prefix (default "justonce:")
//	--brokers        KAFKA_BROKERS          replay kafka: comma-separated brokers
//	--nats-url       NATS_URL               replay nats: the NATS server
//
// Connecting gives up after 10 s unless the URL sets connect_timeout.
//
// # Exit codes
//
// The same for every command; scripts can rely on them ("justonce -h"
// prints this list):
//
//	0  success; also: help was asked for, ledger purge found another instance purging
//	1  operational error: database, Redis, Kafka or NATS unreachable, schema not migrated, SQL error
//	2  usage error: unknown command or flag, bad or missing argument or flag, missing confirmation
//	3  not found: ledger show or ledger release of a key with no row
//	4  ledger release changed Postgres but could not invalidate the Redis replay cache; run it again
//
// A usage error is, for example, a missing --database-url or key part, a
// negative --to, or a missing --yes, --force or --expired. Exit code 4
// means the row was deleted in Postgres (or there was none), but a cached
// result may be replayed from Redis until it expires there.
//
// # JSON output
//
// Every command that prints a result takes --json and then prints one JSON
// object on stdout; messages and progress go to stderr. The rules are the
// same for every command:
//
//   - keys are snake_case and always present;
//   - a value that is not set is null (tenant is "" for a key without one);
//   - times are RFC 3339 strings in UTC;
//   - durations are seconds, as numbers, in keys ending in _seconds;
//   - counts and versions are numbers;
//   - event IDs are masked unless ledger show is given --reveal (id_masked).
//
// On exit codes 1 and 2 stdout is empty, as it is when ledger show exits 3.
// ledger release prints its object also when it exits 3 or 4: the row or
// the cache may have changed, and error says why it failed (null on
// success). The objects, with example values:
//
//	migrate up, migrate down:
//	  {"schema": "public", "from": 0, "to": 3, "applied": [1, 2, 3]}
//	migrate status:
//	  {"schema": "public", "version": 0, "latest": 3, "pending": [1, 2, 3]}
//	ledger stats:
//	  {"rows": [{"scope": "billing", "status": "processing", "rows": 2,
//	             "oldest_lease_until": "2026-01-02T15:04:05Z"}],
//	   "total_rows": 2,
//	   "oldest_in_flight_lease": {"scope": "billing", "lease_until": "2026-01-02T15:04:05Z",
//	                              "overdue_seconds": 12.5}}
//	ledger show:
//	  {"scope": "billing", "tenant": "acme", "id": "550e****0000", "id_masked": true,
//	   "status": "done", "source": "kafka", "principal": null, "attempts": 1,
//	   "fencing_token": 0, "lease_owner": null, "lease_until": null,
//	   "created_at": "2026-01-02T15:04:05Z", "completed_at": "2026-01-02T15:04:05Z",
//	   "expires_at": "2026-01-03T15:04:05Z", "duration_seconds": 0.004,
//	   "result_code": 201, "result_headers": 1, "result_body_bytes": 5,
//	   "fingerprint": "010203", "error": null,
//	   "steps": [{"seq": 1, "name": "charge", "kind": "call",
//	              "completed_at": "2026-01-02T15:04:05Z", "output_bytes": 27, "fencing_token": 41}],
//	   "last_step": "charge"}
//	ledger release:
//	  {"scope": "billing", "tenant": "", "id": "550e****0000", "id_masked": true,
//	   "released": true, "was": "processing", "cache": "not_checked", "error": null}
//	ledger purge:
//	  {"deleted": 3, "busy": false}
//	outbox stats:
//	  {"pending": 120, "failed": 1, "lanes_pending": 3,
//	   "oldest_pending_at": "2026-01-02T15:04:05Z", "oldest_pending_age_seconds": 0.8,
//	   "oldest_failed_at": "2026-01-02T15:04:05Z"}
//	outbox failed:
//	  {"messages": [{"id": "0190c2a4-7b1e-8f00-9a3c-5d2e1f0a4b6c", "broker": "kafka",
//	                 "topic": "orders", "attempts": 1,
//	                 "error": "[10] Message Size Too Large: ...",
//	                 "created_at": "2026-01-02T15:04:05Z", "failed_at": "2026-01-02T15:04:06Z"}]}
//	outbox retry:
//	  {"retried": 1}
//	outbox purge:
//	  {"deleted": 1}
//	replay kafka, replay nats:
//	  {"transport": "kafka", "scope": "billing", "dry_run": true,
//	   "partitions": [{"partition": 0, "first": 0, "last": 9, "seen": 10,
//	                   "skipped": 6, "would_run": 4, "failed": 0, "no_id": 0}],
//	   "total": {"seen": 10, "skipped": 6, "would_run": 4, "failed": 0, "no_id": 0},
//	   "took_seconds": 0.12}
//
// ledger stats: oldest_lease_until is set for processing rows only;
// overdue_seconds is negative while the lease still runs. ledger show:
// result_code and duration_seconds are null until the key has a result;
// fingerprint is hex; steps lists the recorded steps of a key run in
// steps (inbox.Ledger.DoSteps), in order (empty otherwise), kind being tx,
// call, compensate or failed, and last_step names the last of them (null
// when none): a key still processing resumes after it. ledger release: was is the row's state before
// (done, failed, processing, expired, absent); cache is invalidated,
// not_checked (no --redis-url), stale (not invalidated: exit 4) or
// unavailable (Redis did not answer; nothing released). ledger purge: busy
// is true when another instance holds the janitor lock (deleted counts the
// rows deleted before). outbox stats: the oldest_pending fields are null
// when nothing is pending; oldest_failed_at is when the earliest failure
// happened, null when nothing failed. outbox
// failed: message IDs are not masked (they are not secrets, unlike an
// Idempotency-Key); error is the broker's. replay: first and last are
// offsets (Kafka) or stream sequences (NATS, one partition 0); would_run
// counts events the ledger has not done.
package main
