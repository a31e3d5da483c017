// Command justonce operates a justonce ledger: it migrates the schema,
// inspects the processed_events table, frees stuck keys and purges expired
// rows.
//
//	go install github.com/justonce/justonce/cmd/justonce@latest
//
// # Commands
//
//	justonce migrate up [--to N]              apply pending migrations
//	justonce migrate down --yes [--to N]      revert migrations (version 1 drops the table)
//	justonce migrate status [--json]          schema version and pending migrations
//	justonce ledger stats [--json]            live rows by scope and status, oldest in-flight lease
//	justonce ledger show <scope> <id> [--tenant T] [--reveal] [--json]
//	                                          one key: status, source, attempts, fencing
//	                                          token, lease, timestamps, result code and size, error
//	justonce ledger release <scope> <id> [--tenant T] [--force] [--redis-url URL] [--json]
//	                                          free a stuck (processing) or failed key
//	justonce ledger purge --expired [--batch N] [--pause D] [--json]
//	                                          delete expired rows in batches
//
// Every command prints its flags with -h or --help (to stdout, exit code 0),
// as does "justonce help <command>". Flags may come before or after the
// positional arguments; after "--" everything is positional (for an ID that
// begins with a dash).
//
// Event IDs are masked in the output (550e****0000) unless ledger show is
// given --reveal. A stored response body is never printed, only its size.
// ledger release refuses a key that is done unless --force is given:
// releasing it lets its effect happen a second time.
//
// # Configuration
//
// Flags win over environment variables:
//
//	--database-url   DATABASE_URL           Postgres URL or key=value DSN (required)
//	--schema         JUSTONCE_SCHEMA        schema of processed_events (default: search_path)
//	--redis-url      REDIS_URL              ledger release: the application's Redis replay cache
//	--redis-prefix   JUSTONCE_REDIS_PREFIX  ledger release: its key prefix (default "justonce:")
//
// Connecting gives up after 10 s unless the URL sets connect_timeout.
//
// # Exit codes
//
// Scripts can rely on these:
//
//	0  success (also: help was asked for; purge found another instance purging)
//	1  operational error: database or Redis unreachable, schema not migrated, SQL error
//	2  usage error: unknown command or flag, missing or extra argument, invalid key,
//	   missing --database-url, missing confirmation (--yes, --force, --expired)
//	3  not found: ledger show or ledger release of a key with no row
//	4  ledger release deleted the row in Postgres (or found none), but the
//	   Redis replay cache could not be invalidated: a cached result may be
//	   replayed until it expires there; run it again once Redis answers
//
// # JSON output
//
// With --json, ledger stats prints
//
//	{"rows":[{"scope","status","rows","oldest_lease_until"}],"total_rows",
//	 "oldest_in_flight_lease":{"scope","lease_until","overdue_seconds"} or null}
//
// ledger show prints the row with snake_case fields (scope, tenant, id,
// id_masked, status, source, principal, attempts, fencing_token, lease_owner,
// lease_until, created_at, completed_at, expires_at, duration_ms,
// result_code, result_headers, result_body_bytes, fingerprint (hex), error);
// times are RFC 3339 in UTC, null when unset. migrate status prints
// {"schema","version","latest","pending"}, ledger purge
// {"deleted","busy"}, ledger release
// {"scope","tenant","id" (masked),"released","was","cache","error"}, where
// was is the row's state before (done, failed, processing, expired, absent)
// and cache is invalidated, not_checked (no --redis-url), stale (not
// invalidated) or unavailable (Redis did not answer, nothing released); it
// is printed also when the command exits 3 or 4.
//
// # Adding commands
//
// The command tree is built in rootCommand (cli.go). Each leaf gets its
// own flag.FlagSet; a group such as "replay kafka" / "replay nats" is a
// *command with subs, in its own file, appended to rootCommand's list.
package main
