package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/internal/ledgerkey"
)

// The ledger's SQL lives in three files, and nowhere else in the package
// (but its tests):
//
//   - store.go (this file): the store interface the ledger's logic calls,
//     the statements both layouts run alike (rowStore), transaction
//     control, and how a row is read;
//   - store_plain.go: the plain layout's own statements (plainStore);
//   - store_buckets.go: the time-bucket layout's own statements, its view
//     of the buckets and its janitor (bucketStore).
//
// The ledger's logic (Do, DoBatch, DoEach, DoTx, leases, release, the
// janitor) holds no SQL and does not ask which layout it runs on: it calls
// the store's verbs, which queue their statements on the batch the logic
// sends, so that a claim's round trips stay the logic's to arrange.

// ledgerStore is every statement group the ledger runs, one verb each. The
// plain layout (plainStore) and the time-bucket layout (bucketStore)
// implement it; both share rowStore's statements for the verbs of rowVerbs.
type ledgerStore interface {
	rowVerbs

	// checkTTL refuses, before anything runs, a TTL the layout cannot
	// keep (the time-bucket layout's MaxTTL).
	checkTTL(ttl time.Duration) error

	// planDo returns Do's statements for k (on the time-bucket layout,
	// those of k's shard, from the ledger's view of the buckets).
	planDo(ctx context.Context, q querier, k Key) (doPlan, error)
	// queueClaim queues on b Do's claim of k: the key's advisory lock,
	// then, in a statement of its own, its look-up; c holds their answers
	// once b has run.
	queueClaim(b *pgx.Batch, p doPlan, k Key, c *doClaim)
	// queueInsertDone queues on b the claimed key's row, written once,
	// complete (sent with COMMIT).
	queueInsertDone(b *pgx.Batch, p doPlan, r doneRow)
	// planStale reports whether err says Do's plan was stale (a bucket
	// opened or went since it was made); the plans are then made afresh.
	planStale(err error) bool
	// forgetPlans makes the next planDo make its plan afresh.
	forgetPlans()
	// takeOver claims, in a transaction that holds the key's lock, a row
	// that may be taken over (expired, or a lapsed lease): pgx.ErrNoRows
	// when it changed since it was looked up.
	takeOver(ctx context.Context, q querier, p claimParams) (claimedScan, error)

	// queueLockMany queues on b DoBatch's claim of reqs: every key's lock,
	// then their look-up; a holds the answers once b has run.
	queueLockMany(b *pgx.Batch, reqs []Request, a *lockManyAnswer)
	// takeOverMany is takeOver for every request of a batch, in one
	// statement: one claimRow per request, in order.
	takeOverMany(ctx context.Context, conn *pgx.Conn, reqs []Request, ttl func(Request) time.Duration) ([]claimRow, error)
	// insertMany returns the statement that writes the new keys' rows of
	// a batch, complete, with the commit.
	insertMany(p insertManyParams) (queuedStmt, error)

	// claimInRun claims one request of a DoEach run inside the savepoint
	// justonce_each that b (not yet sent) opens. A key claimed leaves its
	// columns in c; a key not claimed comes back with its row, its
	// savepoint rolled back and released (which frees the key's lock).
	// Errors are *StoreError; the run's transaction is then to be rolled
	// back.
	claimInRun(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, p claimParams, c *claimedScan) (claimRow, error)

	// claimsRunUpFront reports whether DoEach may claim a run's keys up
	// front, with queueLockMany, and write their rows with insertMany at
	// the commit (the optimistic path, see optimistic_batch.go); false:
	// every run claims each request in its savepoint (claimInRun).
	claimsRunUpFront() bool

	// claimInSavepoint claims one key inside a savepoint of the caller's
	// transaction (DoTx). When the key is not claimed the savepoint is
	// rolled back, which also releases the key's lock, and the row is
	// looked up.
	claimInSavepoint(ctx context.Context, tx pgx.Tx, p claimParams) (claimRow, error)

	// claimLease claims one key outside any transaction of the caller's
	// (lease mode with p.lease > 0): the claimed row, or the row found.
	claimLease(ctx context.Context, q querier, p claimParams) (claimRow, error)
	// claimLeaseSteps is claimLease for DoSteps: in the claim's round
	// trip it also asks whether the key has recorded steps (hasSteps,
	// for a key claimed), which loadSteps then reads.
	claimLeaseSteps(ctx context.Context, q querier, p claimParams) (cr claimRow, hasSteps bool, err error)

	// recordFailure records a dead-lettered key as failed, unless it is
	// done: false when it left the row as it was.
	recordFailure(ctx context.Context, q querier, p failParams) (bool, error)

	// purge is one step of the janitor: n rows gone, more when another
	// step may find more, locked false when another janitor holds the
	// lock.
	purge(ctx context.Context, pool *pgxpool.Pool, limit int) (n int64, more, locked bool, err error)
}

// rowVerbs are the statements on one key's row, or on the whole table,
// that both layouts run alike (rowStore's): the ledger may call them
// before it knows the layout.
type rowVerbs interface {
	// lookup returns the row of k whatever its expiry (nil when absent),
	// and whether it is live.
	lookup(ctx context.Context, q querier, k Key) (*Record, bool, error)
	// complete stores a transactional-mode result in the claimed row;
	// queueComplete queues that statement on b.
	complete(ctx context.Context, q querier, c completion) error
	queueComplete(b *pgx.Batch, c completion)
	// renew, leaseComplete, leaseFail and leaseAbandon act on a lease's
	// row while it is still processing under the lease's token: false
	// when it is not.
	renew(ctx context.Context, q querier, p leaseParams) (bool, error)
	leaseComplete(ctx context.Context, q querier, p leaseParams) (bool, error)
	leaseFail(ctx context.Context, q querier, p leaseParams) (bool, error)
	leaseAbandon(ctx context.Context, q querier, p leaseParams) (bool, error)
	// release deletes k's row, whatever its state.
	release(ctx context.Context, q querier, k Key) (bool, error)
	// releaseStuck deletes k's row if it is stuck; live reports a row that
	// was not (done, or under a lease that still runs).
	releaseStuck(ctx context.Context, q querier, k Key) (deleted, live bool, err error)
	// known: for each key, the status of its live row, or "".
	known(ctx context.Context, q querier, keys []Key) ([]Status, error)
	// live counts the live rows of one scope and tenant.
	live(ctx context.Context, q querier, scope, tenant string) (int64, error)
	// stats: live rows by scope and status.
	stats(ctx context.Context, q querier) ([]ScopeStats, error)
	// replication reads how the server replicates the session's commits
	// (CheckReplication): the settings, and its walsenders.
	replication(ctx context.Context, q querier) (Replication, error)

	// The recorded steps of keys run with DoSteps (processed_steps); the
	// table is the same on both layouts.
	//
	// loadSteps returns the live steps of a key just claimed under
	// token, in order, after deleting its expired ones and giving the
	// others the key's expiry, so that they go with it.
	loadSteps(ctx context.Context, q querier, k Key, token int64) ([]Step, error)
	// recordStep records a step while the key's row is processing under
	// p.token (see isStepFenced for the refusal); queueRecordStep queues
	// that statement on b (a Postgres step's, sent with its COMMIT).
	recordStep(ctx context.Context, q querier, p stepParams) error
	queueRecordStep(b *pgx.Batch, p stepParams)
	// steps returns the live steps of k, in order.
	steps(ctx context.Context, q querier, k Key) ([]Step, error)
	// leaseLapse ends a lease now, keeping its row (and steps): false
	// when the row is not processing under the lease's token.
	leaseLapse(ctx context.Context, q querier, p leaseParams) (bool, error)
	// purgeSteps deletes up to limit expired steps under the janitor
	// lock, as purge does rows: more when the batch was full, locked false
	// when another janitor holds the lock.
	purgeSteps(ctx context.Context, q querier, limit int) (n int64, more, locked bool, err error)

	// clearResults clears, under the janitor lock, the stored results
	// (code, headers, body) of up to limit rows whose result passed its
	// own clock after since (migration 6): more when the batch was full,
	// at the database's time of the statement.
	clearResults(ctx context.Context, q querier, limit int, since time.Time) (n int64, more, locked bool, at time.Time, err error)
}

// The verbs' parameters.
type (
	// claimParams: a claim of req's key whose row expires after ttl; in
	// lease mode (lease > 0) held by owner.
	claimParams struct {
		req        Request
		ttl, lease time.Duration
		owner      string
	}
	// completion: a transactional-mode result for key's row.
	completion struct {
		key       Key
		res       Result
		took      time.Duration
		resultTTL time.Duration // the result's own clock; 0: the row's
	}
	// doneRow: a claimed key's row, written complete.
	doneRow struct {
		req            Request
		ttl, resultTTL time.Duration
		res            Result
		took           time.Duration
	}
	// leaseParams: the lease of key under token; what renew (lease),
	// leaseComplete (res, took) and leaseFail (errText, took) write.
	leaseParams struct {
		key       Key
		token     int64
		lease     time.Duration
		res       Result
		errText   string
		took      time.Duration
		resultTTL time.Duration
	}
	// failParams: a dead-lettered request after attempts, failed with
	// errText, kept for ttl.
	failParams struct {
		req      Request
		attempts int
		errText  string
		ttl      time.Duration
	}
	// stepParams: step name of key, recorded under the lease token as the
	// seq-th step of the key, of kind, with its output.
	stepParams struct {
		key    Key
		name   string
		kind   StepKind
		seq    int
		output []byte
		token  int64
	}
	// insertManyParams: the rows of reqs[i] for i in idx, with their
	// results (nil: none) and their run time: took for each, or, when
	// tooks is set, tooks[j] for reqs[idx[j]].
	insertManyParams struct {
		reqs           []Request
		idx            []int
		results        []Result
		ttl, resultTTL func(Request) time.Duration
		took           time.Duration
		tooks          []time.Duration
	}
)

// Transaction control: the ledger's logic opens and ends the transactions
// its verbs run in, and DoEach's savepoints, with these.
const (
	sqlBegin    = "BEGIN"
	sqlCommit   = "COMMIT"
	sqlRollback = "ROLLBACK"

	// Each request of a DoEach run claims and runs in this savepoint.
	sqlEachSavepoint = "SAVEPOINT justonce_each"
	sqlEachRelease   = "RELEASE SAVEPOINT justonce_each"
	sqlEachRollback  = "ROLLBACK TO SAVEPOINT justonce_each"
	// sqlEachUndo is the two in one simple-protocol message: a batch would
	// prepare RELEASE before the ROLLBACK TO ran, which an aborted
	// savepoint refuses.
	sqlEachUndo = sqlEachRollback + "; " + sqlEachRelease
)

// The statements of a nested transaction a handler opens (ownedTx.Begin).
func sqlSavepoint(name string) string           { return "SAVEPOINT " + name }
func sqlReleaseSavepoint(name string) string    { return "RELEASE SAVEPOINT " + name }
func sqlRollbackToSavepoint(name string) string { return "ROLLBACK TO SAVEPOINT " + name }

// querier is what pgx.Tx, *pgx.Conn and *pgxpool.Pool have in common.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// storeSlot holds a ledger's store, chosen at its first use: the layout is
// found out from the database.
//
// No caller waits on another's finding out: each caller that arrives
// before the store is known finds it out on its own querier, and the
// first answer is kept. A caller holding a connection of the pool (a
// claim with AcquireWait, Do's connection) that waited on a lock held by
// one finding out through the pool would hold that connection while the
// other waited for one: with more first calls at once than the pool has
// connections, neither would move again.
type storeSlot struct {
	rows *rowStore // valid on both layouts, at once
	// plain is built with the ledger, so that its first claim on the
	// plain layout builds no statement (only the time-bucket layout's
	// are built then, on that layout).
	plain *plainStore
	ready atomic.Bool
	mu    sync.Mutex  // guards setting s
	s     ledgerStore // set once ready
	// onOpen, when set (by tests), is called as a caller starts finding
	// out the layout.
	onOpen func()
}

func newStoreSlot(schema string) *storeSlot {
	rows := newRowStore(schema)
	return &storeSlot{rows: rows, plain: newPlainStore(rows)}
}

// get returns the layout's store, finding out the layout on q while it
// is not known yet.
func (o *storeSlot) get(ctx context.Context, q querier) (ledgerStore, error) {
	if o.ready.Load() {
		return o.s, nil
	}
	if o.onOpen != nil {
		o.onOpen()
	}
	s, err := o.open(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("ledger layout: %w", err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.ready.Load() {
		o.s = s
		o.ready.Store(true)
	}
	return o.s, nil
}

// open finds out the table's layout and returns its store.
func (o *storeSlot) open(ctx context.Context, q querier) (ledgerStore, error) {
	var kind string
	if err := q.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = $1::regclass`, o.rows.table).Scan(&kind); err != nil {
		return nil, err
	}
	if kind == "p" {
		return openBucketStore(ctx, q, o.rows)
	}
	return o.plain, nil
}

// rowStore holds the statements both layouts run alike: those on one
// key's row by its key, which Postgres routes to the row's bucket on the
// time-bucket layout, and those on the whole table.
type rowStore struct {
	schema string
	table  string // quoted, schema-qualified when a schema is configured
	// oid mixes the table's identity into advisory lock keys, so that
	// ledgers in different schemas of one database never contend.
	oid string
	// names replaces {T} (the table), {SEQ} (the fencing sequence) and
	// {OID} (oid) in statement texts.
	names *strings.Replacer

	lookupSQL, lookupAtSQL, completeSQL                   string
	renewSQL, leaseCompleteSQL, leaseFailSQL, leaseDelSQL string
	releaseSQL, releaseStuckSQL                           string
	knownSQL, liveSQL, statsSQL                           string
	clearResultsSQL                                       string

	stepsSQL // processed_steps' statements
}

var _, _ ledgerStore = (*plainStore)(nil), (*bucketStore)(nil)

func newRowStore(schema string) *rowStore {
	s := &rowStore{schema: schema}
	s.table = s.ident("processed_events")
	s.oid = "(('" + strings.ReplaceAll(s.table, "'", "''") + "'::regclass)::oid::bigint << 32)"
	s.names = strings.NewReplacer("{T}", s.table, "{SEQ}", s.ident("processed_events_fencing_seq"), "{OID}", s.oid,
		"{S}", s.ident("processed_steps"))
	r := s.names

	s.lookupSQL = r.Replace(`SELECT ` + s.cols("e") + ` FROM {T} e WHERE e.scope = $1 AND e.tenant = $2 AND e.event_id = $3`)
	// lookupAtSQL is Do's look-up: rowCols only, read with recordScan's
	// destAt and recordAt, which tell liveness from the transaction's
	// now() that Do's lock statement returned. Sixteen columns are what
	// pgx describes in a buffer of the connection's own: a wider result
	// allocates its description anew, and it stays on the heap while the
	// handler runs.
	s.lookupAtSQL = r.Replace(`SELECT ` + strings.ReplaceAll(rowCols, "x.", "e.") +
		` FROM {T} e WHERE e.scope = $1 AND e.tenant = $2 AND e.event_id = $3`)

	s.completeSQL = r.Replace(`UPDATE {T} SET response_code = $4, response_headers = $5, response_body = $6,
		completed_at = clock_timestamp(), duration_us = $7, result_expires_at = ` + resultClock(8) + `
		WHERE scope = $1 AND tenant = $2 AND event_id = $3`)

	s.renewSQL = r.Replace(`UPDATE {T} SET lease_until = now() + $5::bigint * interval '1 microsecond'
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseCompleteSQL = r.Replace(`UPDATE {T} SET status = 'done', response_code = $5, response_headers = $6,
		response_body = $7, duration_us = $8, completed_at = now(), lease_until = NULL,
		result_expires_at = ` + resultClock(9) + `
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseFailSQL = r.Replace(`UPDATE {T} SET status = 'failed', error = $5, duration_us = $6,
		completed_at = now(), lease_until = NULL
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseDelSQL = r.Replace(`DELETE FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.releaseSQL = r.Replace(`DELETE FROM {T} WHERE scope = $1 AND tenant = $2 AND event_id = $3`)

	// releaseStuckSQL deletes the row unless it is done and unexpired, or
	// processing under a lease that still runs (whatever its expiry, as
	// the janitor keeps it), and says whether a row was there (the outer
	// query sees the table as before the DELETE).
	s.releaseStuckSQL = r.Replace(`WITH d AS (DELETE FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3
			AND (status <> 'done' OR expires_at <= now())
			AND NOT (status = 'processing' AND lease_until > now())
		RETURNING 1)
	SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3)`)

	// knownSQL: which of a list of keys have a live row, and in what state.
	s.knownSQL = r.Replace(`SELECT u.ord, e.status FROM unnest($1::text[], $2::text[], $3::text[])
		WITH ORDINALITY AS u(scope, tenant, event_id, ord)
		JOIN {T} e ON e.scope = u.scope AND e.tenant = u.tenant AND e.event_id = u.event_id
		WHERE e.expires_at > now()`)

	s.liveSQL = r.Replace(`SELECT count(*) FROM {T} WHERE scope = $1 AND tenant = $2 AND expires_at > now()`)

	s.statsSQL = r.Replace(`SELECT scope, status, count(*), min(lease_until) FILTER (WHERE status = 'processing')
		FROM {T} WHERE expires_at > now() GROUP BY scope, status ORDER BY scope, status`)
	// clearResultsSQL is the janitor's batch on results past their own
	// clock: an UPDATE that nulls them, found through the BRIN index on
	// result_expires_at from since ($3) on, under the janitor lock. It
	// changes no indexed column, so it may stay a HOT update. The outer
	// condition repeats the inner one: on the time-bucket layout a ctid
	// names a row in each bucket, and only due rows may be cleared. The
	// clock stays, so that reads keep saying the result is gone.
	const due = `result_expires_at <= now() AND result_expires_at > $3
		AND (response_code IS NOT NULL OR response_headers IS NOT NULL OR response_body IS NOT NULL)`
	s.clearResultsSQL = r.Replace(`
WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1::bigint # {OID}) AS ok),
c AS (
	UPDATE {T} SET response_code = NULL, response_headers = NULL, response_body = NULL
	WHERE ctid = ANY(ARRAY(
		SELECT ctid FROM {T}
		WHERE (SELECT ok FROM l) AND ` + due + `
		LIMIT $2
		FOR UPDATE SKIP LOCKED)) AND ` + due + `
	RETURNING 1
)
SELECT (SELECT ok FROM l), count(*), now() FROM c`)
	s.stepsSQL = newStepsSQL(r)
	return s
}

func (s *rowStore) clearResults(ctx context.Context, q querier, limit int, since time.Time) (n int64, more, locked bool, at time.Time, err error) {
	err = q.QueryRow(ctx, s.clearResultsSQL, s.janitorLockKey(), limit, since).Scan(&locked, &n, &at)
	return n, n >= int64(limit), locked, at, err
}

// ident quotes name, qualified with the ledger's schema when it has one.
func (s *rowStore) ident(name string) string {
	if s.schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{s.schema, name}.Sanitize()
}

// cols lists a row's columns under the alias a, in recordScan's dest
// order (lookupCols).
func (s *rowStore) cols(a string) string { return strings.ReplaceAll(lookupCols, "x.", a+".") }

// rawRowCols are the columns of a row named x that recordScan reads: every
// column of processed_events but the key's and the result's clock, in the
// table's order, as they are stored.
const rawRowCols = `x.status, x.fingerprint, x.source, x.principal, x.lease_owner, x.lease_until,
		x.fencing_token, x.attempts, x.response_code, x.response_headers, x.response_body, x.error,
		x.duration_us, x.created_at, x.completed_at, x.expires_at`

// rowCols are rawRowCols as a read answers them: a result past its own
// clock (result_expires_at, migration 6) is not answered; its code reads
// resultGoneCode (recordScan then sets Record.ResultGone), its headers and
// body NULL. The mask keeps Do's look-up at sixteen columns.
var rowCols = strings.NewReplacer(
	"x.response_code,", "CASE WHEN x.result_expires_at <= now() THEN "+strconv.Itoa(resultGoneCode)+" ELSE x.response_code END,",
	"x.response_headers,", "CASE WHEN x.result_expires_at <= now() THEN NULL ELSE x.response_headers END,",
	"x.response_body,", "CASE WHEN x.result_expires_at <= now() THEN NULL ELSE x.response_body END,",
).Replace(rawRowCols)

// resultGoneCode is the response code a read answers for a result past its
// clock: no stored code is negative.
const resultGoneCode = -1

// lookupCols are the columns a look-up returns for recordScan: rowCols,
// and whether the row and its lease are live at now().
var lookupCols = rowCols + `, x.expires_at > now(), x.lease_until > now()`

// rawLookupCols is lookupCols with rawRowCols, for rows a statement has
// just claimed (they hold no result), named by the statement's own alias.
const rawLookupCols = rawRowCols + `, x.expires_at > now(), x.lease_until > now()`

// rawCols is cols with rawLookupCols.
func (s *rowStore) rawCols(a string) string { return strings.ReplaceAll(rawLookupCols, "x.", a+".") }

// resultClock is the SQL of a result's expiry from its TTL in microseconds,
// parameter n: NULL (the row's own) when the TTL is 0.
func resultClock(n int) string {
	p := "$" + strconv.Itoa(n) + "::bigint"
	return "CASE WHEN " + p + " > 0 THEN clock_timestamp() + " + p + " * interval '1 microsecond' END"
}

// lockKey is the advisory lock a claim takes for a key.
func lockKey(k Key) int64 { return ledgerkey.Hash(k.Scope, k.Tenant, k.ID) }

// janitorLockKey is the advisory lock (mixed with the table's OID in SQL)
// that lets one janitor run at a time per table.
func (s *rowStore) janitorLockKey() int64 {
	h := fnv.New64a()
	h.Write([]byte("justonce.janitor:" + s.table))
	return int64(h.Sum64())
}

// claimRow is a claim's answer for one key.
type claimRow struct {
	ord     int64
	claimed bool
	rec     *Record // nil when no row is visible
	live    bool    // retention not expired
	leased  bool    // lease still running
}

// claimOne claims one key on q with sql, the layout's one-key claim
// statement: the claimed row, or (not claimed) the existing row found by
// a second statement.
func (s *rowStore) claimOne(ctx context.Context, q querier, sql string, p claimParams) (claimRow, error) {
	var c claimedScan
	err := q.QueryRow(ctx, sql, claimOneArgs(p)...).Scan(c.dest()...)
	if err == nil {
		return claimRow{claimed: true, rec: c.record(p.req, p.lease, p.owner), live: true, leased: p.lease > 0}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return claimRow{}, err
	}
	rec, live, err := s.lookup(ctx, q, p.req.Key)
	return claimRow{rec: rec, live: live}, err
}

// takeOverWith is takeOver with sql, the layout's one-key claim statement.
func takeOverWith(ctx context.Context, q querier, sql string, p claimParams) (claimedScan, error) {
	var c claimedScan
	err := q.QueryRow(ctx, sql, claimOneArgs(p)...).Scan(c.dest()...)
	return c, err
}

// queueClaimOne queues on b sql, the layout's one-key claim statement;
// once b has run, claimed says whether the key was claimed, its columns in
// c.
func queueClaimOne(b *pgx.Batch, sql string, p claimParams, c *claimedScan, claimed *bool) {
	b.Queue(sql, claimOneArgs(p)...).QueryRow(func(row pgx.Row) error {
		err := row.Scan(c.dest()...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		*claimed = err == nil
		return err
	})
}

func claimOneArgs(p claimParams) []any {
	r := p.req
	return []any{r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
		p.ttl.Microseconds(), lockKey(r.Key), p.lease.Microseconds(), p.owner}
}

// claimManyArgs are the batch claim statement's arguments: per request,
// its key, fingerprint, source, principal, TTL and lock; then the lease and
// owner of them all.
func claimManyArgs(reqs []Request, ttl func(Request) time.Duration, lease time.Duration, owner string) []any {
	n := len(reqs)
	scopes, tenants, ids := make([]string, n), make([]string, n), make([]string, n)
	fps := make([][]byte, n)
	sources, principals := make([]string, n), make([]string, n)
	ttls, locks := make([]int64, n), make([]int64, n)
	for i, r := range reqs {
		scopes[i], tenants[i], ids[i] = r.Scope, r.Tenant, r.ID
		fps[i] = r.Fingerprint
		sources[i], principals[i] = string(r.Source), r.Principal
		ttls[i] = ttl(r).Microseconds()
		locks[i] = lockKey(r.Key)
	}
	return []any{scopes, tenants, ids, fps, sources, principals, ttls, locks, lease.Microseconds(), owner}
}

// takeOverManyWith is takeOverMany with sql, the layout's batch claim
// statement, which returns per input ordinal whether it claimed, and the
// claimed or existing row.
func takeOverManyWith(ctx context.Context, conn *pgx.Conn, sql string, reqs []Request, ttl func(Request) time.Duration) ([]claimRow, error) {
	b := &pgx.Batch{}
	b.Queue(sql, claimManyArgs(reqs, ttl, 0, "")...)
	br := conn.SendBatch(ctx, b)
	var rows []claimRow
	qr, err := br.Query()
	if err == nil {
		rows, err = collectClaimRows(qr, reqs, true)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return rows, err
}

// collectClaimRows reads the rows of a batch claim (claimed: each row
// says whether it claimed) or of a batch look-up (the existing row of each
// request that has one; claimed is left false): one claimRow per request.
func collectClaimRows(rows pgx.Rows, reqs []Request, claimed bool) ([]claimRow, error) {
	defer rows.Close()
	what := "look-up"
	if claimed {
		what = "claim"
	}
	out := make([]claimRow, len(reqs))
	for rows.Next() {
		var cr claimRow
		var sc recordScan
		dest := append(make([]any, 0, 20), &cr.ord)
		if claimed {
			dest = append(dest, &cr.claimed)
		}
		if err := rows.Scan(append(dest, sc.dest()...)...); err != nil {
			return nil, err
		}
		i := int(cr.ord) - 1
		if i < 0 || i >= len(reqs) {
			return nil, fmt.Errorf("%s returned ordinal %d of %d", what, cr.ord, len(reqs))
		}
		cr.rec, cr.live, cr.leased = sc.record(reqs[i].Key)
		out[i] = cr
	}
	return out, rows.Err()
}

// lockManyAnswer is what queueLockMany's statements answer.
type lockManyAnswer struct {
	locked []bool
	now    time.Time // the transaction's
	rows   []claimRow
}

// queueLockManyWith is queueLockMany with the layout's lock and look-up
// statements; extra are the look-up's arguments after the keys'.
func queueLockManyWith(b *pgx.Batch, lockSQL, lookupSQL string, reqs []Request, a *lockManyAnswer, extra ...any) {
	n := len(reqs)
	locks := make([]int64, n)
	scopes, tenants, ids := make([]string, n), make([]string, n), make([]string, n)
	for i, r := range reqs {
		locks[i] = lockKey(r.Key)
		scopes[i], tenants[i], ids[i] = r.Scope, r.Tenant, r.ID
	}
	b.Queue(lockSQL, locks).QueryRow(func(row pgx.Row) error { return row.Scan(&a.locked, &a.now) })
	a.rows = make([]claimRow, n)
	b.Queue(lookupSQL, append([]any{scopes, tenants, ids}, extra...)...).Query(func(qr pgx.Rows) error {
		got, err := collectClaimRows(qr, reqs, false)
		copy(a.rows, got)
		return err
	})
}

// result is one claimRow per key: claimed says its lock was taken; rec is
// its row, if any.
func (a *lockManyAnswer) result() ([]claimRow, error) {
	if len(a.locked) != len(a.rows) {
		return nil, fmt.Errorf("lock returned %d answers for %d keys", len(a.locked), len(a.rows))
	}
	for i := range a.rows {
		a.rows[i].claimed = a.locked[i]
	}
	return a.rows, nil
}

// doPlan is Do's statements for one key (planDo): opaque to the ledger's
// logic.
type doPlan struct {
	// lock takes the key's lock ($1) and returns now() (on the time-bucket
	// layout also whether the transaction is READ COMMITTED, and whether
	// the plan's newest bucket of the shard is still its newest). On the
	// time-bucket layout, lockEarly is lock for the time before the
	// janitor may open the shard's next bucket (nextOpen, on the
	// database's clock): it skips that check, which the row's INSERT
	// makes anyway.
	lock, lockEarly string
	nextOpen        time.Time
	// lookup looks the key ($1, $2, $3) up (rowCols: read it with
	// recordScan's destAt and recordAt).
	lookup string
	// insert writes the row (on the time-bucket layout into the shard's
	// newest bucket, refusing, JO001, if it is no longer the newest).
	insert string
	// The time-bucket layout's DoEach claim in one round trip: markLock
	// (markLockEarly) is lock that also records in a transaction-local
	// setting, under the token $2, that the lock is held; claimNew then
	// writes the key's claim row (done, without a result) into the newest
	// bucket only if that setting holds the token ($8) and no bucket has
	// the key. claimNew's snapshot is taken after markLock ran, so it sees
	// every row an earlier holder of the lock committed.
	markLock, markLockEarly, claimNew string
}

// doClaim is what queueClaim's statements answer.
type doClaim struct {
	locked bool
	now    time.Time // the transaction's
	// readCommitted is false when the time-bucket layout refused a
	// transaction stricter than READ COMMITTED; fresh is false when the
	// plan's newest bucket was no longer its shard's newest (the look-up
	// missed a bucket). Both true on the plain layout.
	readCommitted, fresh bool
	found                bool // the key has a row, in row
	row                  recordScan
}

// errNotReadCommitted is Do's refusal of a transaction stricter than READ
// COMMITTED on the time-bucket layout (doClaim.readCommitted false), with
// the SQLSTATE the layout's SQL functions raise for it.
var errNotReadCommitted = &pgconn.PgError{Severity: "ERROR", Code: "0A000",
	Message: "justonce: the time-bucket ledger claims only in READ COMMITTED transactions"}

// errStaleView is the claim's error when the bucket view was stale
// (doClaim.fresh false) and the retries ran out.
var errStaleView = errors.New("the ledger's bucket list changed during the claim")

// queueInsertDone queues the claimed key's row, with p.insert, the
// layout's statement: the same arguments on both layouts.
func (s *rowStore) queueInsertDone(b *pgx.Batch, p doPlan, r doneRow) {
	q := r.req
	b.Queue(p.insert, q.Scope, q.Tenant, q.ID, q.Fingerprint, string(q.Source), q.Principal,
		nullCode(r.res.Code), nullHeader(r.res.Header), r.res.Body, r.took.Microseconds(), r.ttl.Microseconds(),
		r.resultTTL.Microseconds())
}

// queueLookup queues on b sql, a look-up of k by its scope, tenant and ID;
// once the batch has run, found says whether k has a row, scanned into
// dest.
func queueLookup(b *pgx.Batch, sql string, k Key, dest []any, found *bool) {
	b.Queue(sql, k.Scope, k.Tenant, k.ID).QueryRow(func(row pgx.Row) error {
		err := row.Scan(dest...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		*found = err == nil
		return err
	})
}

// claimInSavepointWith is claimInSavepoint with sql, the layout's one-key
// claim statement, in one round trip. refresh, when set, brings the
// transaction's list of partitions up to date after the claim found none
// for its row (on the time-bucket layout: a bucket opened since the
// transaction took the ledger's locks), and the claim is made again, once.
func (s *rowStore) claimInSavepointWith(ctx context.Context, tx pgx.Tx, sql string, p claimParams,
	refresh func(context.Context, querier, Key) error) (claimRow, error) {
	var c claimedScan
	claimed := false
	b := &pgx.Batch{}
	b.Queue("SAVEPOINT justonce_claim")
	queueClaimOne(b, sql, p, &c, &claimed)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		if refresh == nil || !isNoPartition(err) {
			return claimRow{}, err
		}
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT justonce_claim; RELEASE SAVEPOINT justonce_claim"); err != nil {
			return claimRow{}, err
		}
		if err := refresh(ctx, tx, p.req.Key); err != nil {
			return claimRow{}, err
		}
		return s.claimInSavepointWith(ctx, tx, sql, p, nil)
	}
	if claimed {
		if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT justonce_claim"); err != nil {
			return claimRow{}, err
		}
		return claimRow{claimed: true, rec: c.record(p.req, 0, ""), live: true}, nil
	}
	var ls recordScan
	found := false
	b = &pgx.Batch{}
	b.Queue("ROLLBACK TO SAVEPOINT justonce_claim")
	b.Queue("RELEASE SAVEPOINT justonce_claim")
	queueLookup(b, s.lookupSQL, p.req.Key, ls.dest(), &found)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return claimRow{}, err
	}
	if !found {
		return claimRow{}, nil
	}
	rec, live, _ := ls.record(p.req.Key)
	return claimRow{rec: rec, live: live}, nil
}

// claimedScan receives the columns a claim returns.
type claimedScan struct {
	token            int64
	attempts         int32
	created, expires time.Time
	leaseUntil       *time.Time
}

func (c *claimedScan) dest() []any {
	return []any{&c.token, &c.attempts, &c.created, &c.expires, &c.leaseUntil}
}

// record builds the claimed row from the request and the returned columns.
func (c *claimedScan) record(req Request, lease time.Duration, owner string) *Record {
	rec := &Record{
		Key: req.Key, Status: StatusDone, Fingerprint: req.Fingerprint, Source: req.Source,
		Principal: req.Principal, FencingToken: c.token, Attempts: int(c.attempts),
		CreatedAt: c.created, CompletedAt: c.created, ExpiresAt: c.expires,
	}
	if lease > 0 {
		rec.Status, rec.CompletedAt, rec.LeaseOwner, rec.LeaseUntil = StatusProcessing, time.Time{}, owner, derefTime(c.leaseUntil)
	}
	return rec
}

// recordScan receives a row's columns, every one nullable.
type recordScan struct {
	status, source, principal, leaseOwner, errText *string
	fingerprint, body                              []byte
	leaseUntil, createdAt, completedAt, expiresAt  *time.Time
	token, durationUS                              *int64
	attempts, code                                 *int32
	header                                         map[string][]string
	live, leaseLive                                *bool
}

func (r *recordScan) dest() []any {
	return []any{&r.status, &r.fingerprint, &r.source, &r.principal, &r.leaseOwner, &r.leaseUntil,
		&r.token, &r.attempts, &r.code, &r.header, &r.body, &r.errText,
		&r.durationUS, &r.createdAt, &r.completedAt, &r.expiresAt, &r.live, &r.leaseLive}
}

// destAt is dest for a look-up of rowCols only (see recordAt).
func (r *recordScan) destAt() []any { return r.dest()[:16] }

// recordAt is record for a row read with destAt in a transaction whose
// now() is now: the row is live while it expires after now, and its lease
// while that ends after now, as lookupCols' comparisons tell.
func (r *recordScan) recordAt(k Key, now time.Time) (rec *Record, live, leased bool) {
	rec, _, _ = r.record(k)
	if rec == nil {
		return nil, false, false
	}
	return rec, r.expiresAt != nil && r.expiresAt.After(now), r.leaseUntil != nil && r.leaseUntil.After(now)
}

// record builds the Record, or nil when the row was absent.
func (r *recordScan) record(k Key) (rec *Record, live, leased bool) {
	if r.status == nil {
		return nil, false, false
	}
	rec = &Record{
		Key:          k,
		Status:       Status(*r.status),
		Fingerprint:  r.fingerprint,
		Source:       Source(deref(r.source)),
		Principal:    deref(r.principal),
		LeaseOwner:   deref(r.leaseOwner),
		LeaseUntil:   derefTime(r.leaseUntil),
		FencingToken: deref(r.token),
		Attempts:     int(deref(r.attempts)),
		Result:       Result{Code: int(deref(r.code)), Header: r.header, Body: r.body},
		ResultGone:   r.code != nil && *r.code == resultGoneCode,
		Error:        deref(r.errText),
		Duration:     time.Duration(deref(r.durationUS)) * time.Microsecond,
		CreatedAt:    derefTime(r.createdAt),
		CompletedAt:  derefTime(r.completedAt),
		ExpiresAt:    derefTime(r.expiresAt),
	}
	if rec.ResultGone {
		rec.Result = Result{}
	}
	return rec, deref(r.live), deref(r.leaseLive)
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func derefTime(p *time.Time) time.Time { return deref(p) }

func (s *rowStore) lookup(ctx context.Context, q querier, k Key) (*Record, bool, error) {
	var sc recordScan
	err := q.QueryRow(ctx, s.lookupSQL, k.Scope, k.Tenant, k.ID).Scan(sc.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	rec, live, _ := sc.record(k)
	return rec, live, nil
}

func (c completion) args() []any {
	return []any{c.key.Scope, c.key.Tenant, c.key.ID, nullCode(c.res.Code), nullHeader(c.res.Header), c.res.Body,
		c.took.Microseconds(), c.resultTTL.Microseconds()}
}

func (s *rowStore) queueComplete(b *pgx.Batch, c completion) {
	b.Queue(s.completeSQL, c.args()...)
}

func (s *rowStore) complete(ctx context.Context, q querier, c completion) error {
	_, err := q.Exec(ctx, s.completeSQL, c.args()...)
	return err
}

func (s *rowStore) renew(ctx context.Context, q querier, p leaseParams) (bool, error) {
	tag, err := q.Exec(ctx, s.renewSQL, p.key.Scope, p.key.Tenant, p.key.ID, p.token, p.lease.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *rowStore) leaseComplete(ctx context.Context, q querier, p leaseParams) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseCompleteSQL, p.key.Scope, p.key.Tenant, p.key.ID, p.token,
		nullCode(p.res.Code), nullHeader(p.res.Header), p.res.Body, p.took.Microseconds(), p.resultTTL.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *rowStore) leaseFail(ctx context.Context, q querier, p leaseParams) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseFailSQL, p.key.Scope, p.key.Tenant, p.key.ID, p.token, p.errText, p.took.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *rowStore) leaseAbandon(ctx context.Context, q querier, p leaseParams) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseDelSQL, p.key.Scope, p.key.Tenant, p.key.ID, p.token)
	return tag.RowsAffected() == 1, err
}

func (s *rowStore) release(ctx context.Context, q querier, k Key) (ok bool, err error) {
	err = retryMoved(func() error {
		return s.withStepsReleased(ctx, q, k, func(b *pgx.Batch) {
			b.Queue(s.releaseSQL, k.Scope, k.Tenant, k.ID).Exec(func(tag pgconn.CommandTag) error {
				ok = tag.RowsAffected() == 1
				return nil
			})
		})
	})
	return ok, err
}

func (s *rowStore) releaseStuck(ctx context.Context, q querier, k Key) (deleted, live bool, err error) {
	err = retryMoved(func() error {
		return s.withStepsReleased(ctx, q, k, func(b *pgx.Batch) {
			b.Queue(s.releaseStuckSQL, k.Scope, k.Tenant, k.ID).QueryRow(func(row pgx.Row) error {
				return row.Scan(&deleted, &live)
			})
		})
	})
	return deleted, live && !deleted, err
}

// retryMoved runs a statement outside a transaction again when Postgres
// refused it because the row it waited for was moved to another partition
// (SQLSTATE 40001: on the time-bucket layout, a takeover moves a row to a
// newer bucket). Run again, it finds the row where it went.
func retryMoved(f func() error) error {
	var err error
	for range 3 {
		var pgErr *pgconn.PgError
		if err = f(); !errors.As(err, &pgErr) || pgErr.Code != "40001" {
			return err
		}
	}
	return err
}

func (s *rowStore) stats(ctx context.Context, q querier) ([]ScopeStats, error) {
	rows, err := q.Query(ctx, s.statsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (ScopeStats, error) {
		var st ScopeStats
		var status string
		var oldest *time.Time
		err := row.Scan(&st.Scope, &status, &st.Rows, &oldest)
		st.Status = Status(status)
		st.OldestLease = derefTime(oldest)
		return st, err
	})
}

// replicationSQL reads the settings of the ledger's session and the
// server's walsenders: pg_basebackup's are not standbys. The last column
// counts the walsenders whose state the role may not read.
const replicationSQL = `SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
	pg_is_in_recovery(),
	count(*) FILTER (WHERE state IS NULL OR state <> 'backup'),
	count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')),
	count(*) FILTER (WHERE state IS NULL)
FROM pg_stat_replication`

func (s *rowStore) replication(ctx context.Context, q querier) (Replication, error) {
	var r Replication
	var standbys, sync, hidden int64
	err := q.QueryRow(ctx, replicationSQL).Scan(&r.SynchronousCommit, &r.SynchronousStandbyNames,
		&r.InRecovery, &standbys, &sync, &hidden)
	if err != nil {
		return Replication{}, err
	}
	r.Standbys, r.SyncStandbys = int(standbys), int(sync)
	if hidden > 0 {
		r.SyncStandbys = -1 // the role may not read pg_stat_replication's sync_state
	}
	return r, nil
}

func (s *rowStore) live(ctx context.Context, q querier, scope, tenant string) (n int64, err error) {
	err = q.QueryRow(ctx, s.liveSQL, scope, tenant).Scan(&n)
	return n, err
}

func (s *rowStore) known(ctx context.Context, q querier, keys []Key) ([]Status, error) {
	scopes, tenants, ids := make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		scopes[i], tenants[i], ids[i] = k.Scope, k.Tenant, k.ID
	}
	rows, err := q.Query(ctx, s.knownSQL, scopes, tenants, ids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := make([]Status, len(keys))
	for rows.Next() {
		var ord int64
		var st string
		if err := rows.Scan(&ord, &st); err != nil {
			return nil, err
		}
		if ord >= 1 && int(ord) <= len(keys) {
			out[ord-1] = Status(st)
		}
	}
	return out, rows.Err()
}

func nullCode(c int) *int32 {
	if c == 0 {
		return nil
	}
	v := int32(c)
	return &v
}

func nullHeader(h map[string][]string) any {
	if len(h) == 0 {
		return nil
	}
	return h
}

// insertManyWith is insertMany with sql, the layout's batch INSERT, whose
// arguments are the same on both layouts, and extra after them.
func insertManyWith(sql string, p insertManyParams, extra ...any) (queuedStmt, error) {
	args, err := insertManyArgs(p)
	if err != nil {
		return queuedStmt{}, err
	}
	return queuedStmt{sql: sql, args: append(args, extra...)}, nil
}

func insertManyArgs(p insertManyParams) ([]any, error) {
	n := len(p.idx)
	scopes, tenants, ids := make([]string, n), make([]string, n), make([]string, n)
	fps, bodies := make([][]byte, n), make([][]byte, n)
	sources, principals := make([]string, n), make([]string, n)
	codes, headers := make([]*int32, n), make([]*string, n)
	durs, ttls, resultTTLs := make([]int64, n), make([]int64, n), make([]int64, n)
	for j, i := range p.idx {
		r := p.reqs[i]
		scopes[j], tenants[j], ids[j] = r.Scope, r.Tenant, r.ID
		fps[j], sources[j], principals[j] = r.Fingerprint, string(r.Source), r.Principal
		durs[j], ttls[j] = p.took.Microseconds(), p.ttl(r).Microseconds()
		if p.tooks != nil {
			durs[j] = p.tooks[j].Microseconds()
		}
		if p.resultTTL != nil {
			resultTTLs[j] = p.resultTTL(r).Microseconds()
		}
		if p.results == nil {
			continue
		}
		res := p.results[j]
		codes[j], bodies[j] = nullCode(res.Code), res.Body
		if len(res.Header) > 0 {
			h, err := json.Marshal(res.Header)
			if err != nil {
				return nil, err
			}
			hs := string(h)
			headers[j] = &hs
		}
	}
	return []any{scopes, tenants, ids, fps, sources, principals, codes, headers, bodies, durs, ttls, resultTTLs}, nil
}

// isKeyConflict reports whether err is the ledger's primary key refusing a
// row: a row for the key was written by someone who did not hold the key's
// lock (or is not visible to a REPEATABLE READ snapshot).
func isKeyConflict(err error) bool {
	// processed_events_pkey; processed_events_bucket_pkey on the
	// time-bucket layout, reported with its bucket's own index name.
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" &&
		strings.HasPrefix(pgErr.ConstraintName, "processed_events") && strings.HasSuffix(pgErr.ConstraintName, "pkey")
}

// isNoPartition reports whether err is Postgres finding no partition for a
// row written through the partitioned table: on the time-bucket layout, a
// row meant for a bucket opened after the session last brought its cached
// list of partitions up to date (see bucketStore.refreshPartitions).
func isNoPartition(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514" && strings.HasPrefix(pgErr.Message, "no partition of relation")
}

// stepsSQL are the statements on processed_steps, the recorded steps of
// keys run with DoSteps (migration 4). They are the same on both layouts:
// the steps table is not partitioned, and they find a key's ledger row
// through processed_events, wherever its bucket (a takeover may move it).
type stepsSQL struct {
	hasStepsSQL                               string
	loadStepsSQL, recordStepSQL, listStepsSQL string
	leaseLapseSQL, releaseStepsSQL            string
	purgeStepsSQL                             string
}

func newStepsSQL(r *strings.Replacer) stepsSQL {
	var q stepsSQL
	// hasStepsSQL: whether a key has steps, live or expired (then
	// loadStepsSQL reads them); sent with the claim.
	q.hasStepsSQL = r.Replace(`SELECT EXISTS (SELECT 1 FROM {S} WHERE scope = $1 AND tenant = $2 AND event_id = $3)`)
	// loadStepsSQL runs after a claim ($4: its token). Steps that expired
	// belong to an earlier life of the key (its row expired, or was
	// released while they stayed): they are deleted, so that the key's
	// steps are recorded anew. The live ones take the row's expiry, so
	// that they expire with the key however often it is taken over. The
	// outer SELECT sees the table as the statement began, without the
	// effects of its parts: the live steps, whether or not the lease still
	// holds (a step's record is fenced anyway).
	q.loadStepsSQL = r.Replace(`WITH gone AS (
	DELETE FROM {S} WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND expires_at <= now()
), kept AS (
	UPDATE {S} s SET expires_at = e.expires_at FROM {T} e
	WHERE s.scope = $1 AND s.tenant = $2 AND s.event_id = $3 AND s.expires_at > now()
		AND e.scope = $1 AND e.tenant = $2 AND e.event_id = $3 AND e.fencing_token = $4
		AND e.status = 'processing' AND s.expires_at <> e.expires_at
)
SELECT step, kind, seq, output, token, completed_at FROM {S}
WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND expires_at > now() ORDER BY seq`)

	// recordStepSQL is the fenced record of a step: its expiry is the
	// key's row's, read only while the row is processing under the
	// holder's token ($8), and locked (FOR SHARE) until the record
	// commits. Otherwise the expiry is NULL and the INSERT fails on
	// expires_at's NOT NULL (isStepFenced): a Postgres step's writes,
	// sent in the same transaction, roll back with it. A takeover
	// (another token) that committed first is seen; one that is under
	// way waits for the lock and then finds this step recorded; one that
	// holds the row first makes this statement wait, then read the new
	// token. The row's status and token are the lease's: a lease that ran
	// out but was not taken over still records, as nobody else can run.
	q.recordStepSQL = r.Replace(`INSERT INTO {S} (scope, tenant, event_id, step, seq, kind, output, token,
		completed_at, expires_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp(),
		(SELECT e.expires_at FROM {T} e WHERE e.scope = $1 AND e.tenant = $2 AND e.event_id = $3
			AND e.fencing_token = $8 AND e.status = 'processing' FOR SHARE))`)

	q.listStepsSQL = r.Replace(`SELECT step, kind, seq, output, token, completed_at FROM {S}
	WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND expires_at > now() ORDER BY seq`)

	// leaseLapseSQL ends a lease now, leaving the row (with its
	// fingerprint) and its steps for the next caller to take over.
	q.leaseLapseSQL = r.Replace(`UPDATE {T} SET lease_until = now()
	WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	// releaseStepsSQL deletes a key's steps once it has no row, in the
	// transaction that deleted the row (Release, ReleaseStuck): a step
	// recorded before the row's DELETE took the row (it waited for the
	// record's lock) is seen by this later statement; one recorded after
	// is fenced out, as the row is gone.
	q.releaseStepsSQL = r.Replace(`DELETE FROM {S} WHERE scope = $1 AND tenant = $2 AND event_id = $3
	AND NOT EXISTS (SELECT 1 FROM {T} WHERE scope = $1 AND tenant = $2 AND event_id = $3)`)

	// purgeStepsSQL: the janitor's batch on the steps, as plainStore's
	// purgeSQL on rows, under the same lock.
	q.purgeStepsSQL = r.Replace(`
WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1::bigint # {OID}) AS ok),
d AS (
	DELETE FROM {S} WHERE ctid = ANY(ARRAY(
		SELECT ctid FROM {S}
		WHERE (SELECT ok FROM l) AND expires_at <= now()
		LIMIT $2
		FOR UPDATE SKIP LOCKED))
	RETURNING 1
)
SELECT (SELECT ok FROM l), count(*) FROM d`)
	return q
}

// isStepFenced reports whether err is a step's record refused by its
// fence (recordStepSQL): the key's row was not processing under the
// recording lease's token: taken over, completed, failed or released. On
// the time-bucket layout a takeover that moved the row to another bucket
// while the record waited for it refuses the record too (40001).
func isStepFenced(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return pgErr.Code == "23502" && pgErr.TableName == "processed_steps" && pgErr.ColumnName == "expires_at" ||
		pgErr.Code == "40001" && strings.Contains(pgErr.Message, "moved to another partition")
}

// isStepConflict reports whether err is the steps' primary key refusing a
// record: the step is recorded already (an earlier try whose answer was
// lost).
func isStepConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "processed_steps_pkey"
}

func stepArgs(p stepParams) []any {
	return []any{p.key.Scope, p.key.Tenant, p.key.ID, p.name, p.seq, string(p.kind), p.output, p.token}
}

func (s *rowStore) recordStep(ctx context.Context, q querier, p stepParams) error {
	_, err := q.Exec(ctx, s.recordStepSQL, stepArgs(p)...)
	return err
}

func (s *rowStore) queueRecordStep(b *pgx.Batch, p stepParams) {
	b.Queue(s.recordStepSQL, stepArgs(p)...)
}

// claimOneSteps is claimOne, with the question whether the key has
// recorded steps in the claim's round trip.
func (s *rowStore) claimOneSteps(ctx context.Context, q querier, sql string, p claimParams) (claimRow, bool, error) {
	var c claimedScan
	claimed, has := false, false
	k := p.req.Key
	b := &pgx.Batch{}
	queueClaimOne(b, sql, p, &c, &claimed)
	b.Queue(s.hasStepsSQL, k.Scope, k.Tenant, k.ID).QueryRow(func(row pgx.Row) error { return row.Scan(&has) })
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		return claimRow{}, false, err
	}
	if claimed {
		return claimRow{claimed: true, rec: c.record(p.req, p.lease, p.owner), live: true, leased: p.lease > 0}, has, nil
	}
	rec, live, err := s.lookup(ctx, q, k)
	return claimRow{rec: rec, live: live}, false, err
}

func (s *rowStore) loadSteps(ctx context.Context, q querier, k Key, token int64) ([]Step, error) {
	rows, err := q.Query(ctx, s.loadStepsSQL, k.Scope, k.Tenant, k.ID, token)
	return collectSteps(rows, err)
}

func (s *rowStore) steps(ctx context.Context, q querier, k Key) ([]Step, error) {
	rows, err := q.Query(ctx, s.listStepsSQL, k.Scope, k.Tenant, k.ID)
	return collectSteps(rows, err)
}

func collectSteps(rows pgx.Rows, err error) ([]Step, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Step, error) {
		var st Step
		var kind string
		var seq int32
		err := row.Scan(&st.Name, &kind, &seq, &st.Output, &st.Token, &st.CompletedAt)
		st.Kind, st.Seq = StepKind(kind), int(seq)
		return st, err
	})
}

func (s *rowStore) leaseLapse(ctx context.Context, q querier, p leaseParams) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseLapseSQL, p.key.Scope, p.key.Tenant, p.key.ID, p.token)
	return tag.RowsAffected() == 1, err
}

// withStepsReleased runs, in one transaction and one round trip, the
// statement queue queues (a release of k's row) and the delete of k's
// steps when no row is left.
func (s *rowStore) withStepsReleased(ctx context.Context, q querier, k Key, queue func(*pgx.Batch)) error {
	b := &pgx.Batch{}
	b.Queue(sqlBegin)
	queue(b)
	b.Queue(s.releaseStepsSQL, k.Scope, k.Tenant, k.ID)
	b.Queue(sqlCommit)
	return q.SendBatch(ctx, b).Close()
}

func (s *rowStore) purgeSteps(ctx context.Context, q querier, limit int) (n int64, more, locked bool, err error) {
	err = q.QueryRow(ctx, s.purgeStepsSQL, s.janitorLockKey(), limit).Scan(&locked, &n)
	return n, n >= int64(limit), locked, err
}

// The new-key rate limit's counts (table key_rate, migration 3), which
// inbox/keyrate.go keeps when the ledger has no Redis.

// keyRateCountSQL adds a key to its tenant's count, starting the count
// afresh in a later window; the table's CHECK refuses a count over
// max_keys.
const keyRateCountSQL = `INSERT INTO {T} AS k (name, tenant, window_start, keys, max_keys)
VALUES ($1, $2, $3, 1, $4)
ON CONFLICT (name, tenant) DO UPDATE SET
	keys = CASE WHEN EXCLUDED.window_start > k.window_start THEN 1 ELSE k.keys + 1 END,
	window_start = GREATEST(k.window_start, EXCLUDED.window_start),
	max_keys = EXCLUDED.max_keys`

const keyRatePeekSQL = `SELECT window_start, keys FROM {T} WHERE name = $1 AND tenant = $2`

const keyRateUndoSQL = `UPDATE {T} SET keys = keys - 1
WHERE name = $1 AND tenant = $2 AND window_start = $3 AND keys > 0`
