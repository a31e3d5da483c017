package inbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Defaults.
const (
	DefaultTTL           = 24 * time.Hour
	DefaultLeaseDuration = 30 * time.Second
)

// Config configures a Ledger. The zero value works: the table in the
// connection's search_path, 24 h retention, no Redis.
type Config struct {
	// Schema holding processed_events (as given to migrations.Config).
	// Empty: unqualified names, resolved through the connection's search_path.
	Schema string
	// DefaultTTL is how long a row is kept when a Request sets no TTL. After
	// it the key is new again. Default 24 h.
	DefaultTTL time.Duration
	// ResultTTL is how long a row's result (the stored response) is kept
	// when a Request sets no ResultTTL: past it the key is still
	// remembered, for its TTL, but its result is no longer answered and the
	// janitor clears it (see Request.ResultTTL). Zero, or a value not
	// shorter than the row's TTL: the result lives as long as the row.
	ResultTTL time.Duration
	// MaxKeyLen limits each key part, in bytes. Default 255.
	MaxKeyLen int
	// LeaseDuration is the default lease for lease mode. Default 30 s.
	LeaseDuration time.Duration
	// Owner names this process in lease rows. Default host:pid:random.
	Owner string
	// Redis, when set, puts a lock and a replay cache in front of Postgres.
	// Postgres stays the arbiter. See RedisConfig.
	Redis *RedisConfig
	// RecordDuration stores every handler's run time and completion time
	// (duration_us, completed_at). Do and DoBatch write them always, with
	// the row, at no cost; for DoTx, and for a row taken over (expired, or
	// a lapsed lease), they cost one more row update per event without a
	// result, and are written only when this is set. Default false.
	RecordDuration bool
	// Logger receives warnings (Redis episodes, janitor failures), and so
	// do the consumer runtime and the fronts built on this ledger. Keys are
	// masked. Nil: silent.
	Logger *slog.Logger
}

func (c *Config) setDefaults() error {
	if c.DefaultTTL == 0 {
		c.DefaultTTL = DefaultTTL
	}
	if c.DefaultTTL < 0 {
		return fmt.Errorf("%w: DefaultTTL is negative", ErrConfig)
	}
	if c.ResultTTL < 0 {
		return fmt.Errorf("%w: ResultTTL is negative", ErrConfig)
	}
	if c.MaxKeyLen == 0 {
		c.MaxKeyLen = MaxPartLen
	}
	if c.MaxKeyLen < 0 {
		return fmt.Errorf("%w: MaxKeyLen is negative", ErrConfig)
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.LeaseDuration < 0 {
		return fmt.Errorf("%w: LeaseDuration is negative", ErrConfig)
	}
	if c.Owner == "" {
		host, _ := os.Hostname()
		var b [4]byte
		_, _ = rand.Read(b[:])
		c.Owner = fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:]))
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Redis != nil {
		rc := *c.Redis // the caller's may serve several ledgers
		if rc.Prefix == "" && c.Schema != "" {
			// Ledgers in different schemas may share a Redis: their keys
			// must not meet.
			rc.Prefix = "justonce:" + c.Schema + ":"
		}
		if err := rc.setDefaults(); err != nil {
			return err
		}
		c.Redis = &rc
	}
	return nil
}

// Ledger is the dedupe ledger: each key's effect happens once, recorded in
// processed_events in the same transaction as the effect. Safe for
// concurrent use.
type Ledger struct {
	pool  *pgxpool.Pool
	cfg   Config
	store *storeSlot
	fast  *redisFront // nil without Redis
	stats counters
	// savepointsOnly makes every DoEach run on savepoints (no optimistic
	// path), for benchmarks comparing the two.
	savepointsOnly bool
	// resultsCleared is the database's time (Unix µs) of the janitor's
	// last complete pass over results past their clock; 0: none yet.
	resultsCleared atomic.Int64
}

// measureSavepointsOnly, when set at link time, makes every ledger run
// DoEach on savepoints only (no optimistic path), to measure a front with
// and without it:
//
//	go test -ldflags '-X github.com/justonce/justonce/inbox.measureSavepointsOnly=1' ...
var measureSavepointsOnly string

// New returns a Ledger on pool. The schema must be migrated
// (migrations.Migrator); New does not touch the database.
func New(pool *pgxpool.Pool, cfg Config) (*Ledger, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: nil pool", ErrConfig)
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	l := &Ledger{pool: pool, cfg: cfg, store: newStoreSlot(cfg.Schema), savepointsOnly: measureSavepointsOnly != ""}
	if cfg.Redis != nil {
		l.fast = newRedisFront(*cfg.Redis, cfg.Logger, &l.stats)
	}
	return l, nil
}

// Pool returns the pool the ledger runs on.
func (l *Ledger) Pool() *pgxpool.Pool { return l.pool }

// Logger returns the ledger's logger (Config.Logger; a silent one when
// unset). The runtime and the fronts built on a ledger log through it, so
// one logger is set in one place.
func (l *Ledger) Logger() *slog.Logger { return l.cfg.Logger }

// TxFunc is a handler run inside the ledger's transaction. Its writes
// through tx commit together with the ledger row, or not at all. It must not
// commit or roll back tx; return an error to roll back.
type TxFunc func(ctx context.Context, tx pgx.Tx) (Result, error)

func (l *Ledger) ttl(r Request) time.Duration {
	if r.TTL > 0 {
		return r.TTL
	}
	return l.cfg.DefaultTTL
}

// resultTTL is how long r's result is kept: 0 when it lives as long as
// its row.
func (l *Ledger) resultTTL(r Request) time.Duration {
	d := l.cfg.ResultTTL
	if r.ResultTTL > 0 {
		d = r.ResultTTL
	}
	if d >= l.ttl(r) {
		return 0
	}
	return d
}

func (l *Ledger) lockWait(r Request) time.Duration {
	return max(r.LockWait, 0)
}

// Validate checks a request's key and TTL without touching the database.
func (l *Ledger) Validate(r Request) error {
	if err := r.Key.Validate(l.cfg.MaxKeyLen); err != nil {
		return err
	}
	if r.TTL < 0 {
		return &KeyError{Field: "ttl", Reason: "negative"}
	}
	if r.ResultTTL < 0 {
		return &KeyError{Field: "result_ttl", Reason: "negative"}
	}
	return nil
}

// Do runs fn once for req.Key, inside a transaction that also records the
// key in processed_events:
//
//	BEGIN; claim; fn(ctx, tx); write the row; COMMIT
//
// The claim takes the key's lock and looks the key up; the row is written
// once, complete with fn's result, with COMMIT. BEGIN travels with the
// claim and the row with COMMIT, so the ledger adds no round trip to the
// handler's own. Both layouts work this way (the time-bucket layout writes
// the row into the bucket of the transaction's time, and refuses
// transactions stricter than READ COMMITTED).
//
// The Outcome says what happened: Executed (fn ran and committed), Duplicate
// (done before; Outcome.Result is the stored result), InFlight (another
// caller holds the key now), Mismatch (known with another fingerprint).
// When fn returns an error or panics, the transaction rolls back, nothing is
// recorded, and the error is returned as is (a panic is re-raised after the
// rollback; an error while the connection died is wrapped in a *StoreError
// with Op "handler"): a retry runs fn again. When fn returns nil but a
// statement in its transaction failed (an ignored SQL error), nothing is
// recorded either and Do returns ErrRolledBack: Executed always means
// committed. A handler that ends the transaction itself (COMMIT or
// ROLLBACK through Exec) fails with ErrTxOwned. Database failures are
// *StoreError (errors.Is ErrStore);
// ErrCommitUnknown means the commit's fate is unknown and a retry is safe;
// IsTransient says which errors a retry can cure. With req.AcquireWait, no
// connection of the pool within it is ErrOverloaded: fn did not run. The
// commit of a finished handler is not cut short by ctx's cancellation; a
// cancelled wait for a key in flight returns ctx's error.
func (l *Ledger) Do(ctx context.Context, req Request, fn TxFunc) (Outcome, error) {
	if err := l.Validate(req); err != nil {
		return Outcome{}, err
	}
	return l.withWait(ctx, req, func() (Outcome, error) {
		if l.fast != nil {
			return l.fast.do(ctx, l, req, func() (Outcome, error) { return l.doOnce(ctx, req, fn) })
		}
		return l.doOnce(ctx, req, fn)
	})
}

// withWait repeats op while it answers InFlight, until the lock wait runs
// out, with jittered backoff and no connection held.
func (l *Ledger) withWait(ctx context.Context, req Request, op func() (Outcome, error)) (Outcome, error) {
	wait := l.lockWait(req)
	deadline := time.Now().Add(wait)
	backoff := 2 * time.Millisecond
	for {
		out, err := op()
		if err != nil || out.Disposition != InFlight || wait <= 0 || time.Now().After(deadline) {
			l.observe(req, out, err)
			return out, err
		}
		sleep := backoff/2 + mrand.N(backoff)
		if rem := time.Until(deadline); sleep > rem {
			sleep = rem
		}
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			err := fmt.Errorf("justonce/inbox: gave up waiting for a key in flight: %w", ctx.Err())
			l.observe(req, Outcome{}, err)
			return Outcome{}, err
		case <-t.C:
		}
		if backoff < 100*time.Millisecond {
			backoff *= 2
		}
	}
}

func (l *Ledger) doOnce(ctx context.Context, req Request, fn TxFunc) (out Outcome, err error) {
	pc, err := l.acquire(ctx, req)
	if err != nil {
		return Outcome{}, err
	}
	// A connection left inside a transaction is destroyed, not reused;
	// one on a server that refused a write as read-only is closed.
	defer func() { releaseConn(pc, err) }()
	conn := pc.Conn()
	s, err := l.store.get(ctx, conn) // the layout, at first use
	if err != nil {
		return Outcome{}, storeErr("claim", err)
	}
	// A row written by someone who did not hold the key's lock can refuse
	// the commit's write: the transaction rolls back, and the claim is
	// made again, which then finds that row.
	for attempt := 1; ; attempt++ {
		out, conflict, err := l.doWriteOnce(ctx, conn, s, req, fn)
		if !conflict || attempt == maxConflictRetries {
			return out, err
		}
	}
}

// maxConflictRetries bounds the claims of a key whose row appeared,
// written without the key's lock, while its handler ran.
const maxConflictRetries = 3

// doWriteOnce is Do, writing the key's row once, complete, with the
// commit:
//
//	BEGIN; lock the key; look it up  -- one round trip
//	fn(ctx, tx)                      -- the handler's
//	write the row; COMMIT            -- one round trip
//
// The key's advisory lock (a transaction lock) keeps every other claimer
// out until the commit, and they answer InFlight, as they would for a row
// not yet committed; the lock is released only after the commit is
// visible. The look-up runs as a statement of its own after the lock is
// taken, so its snapshot sees every row an earlier holder committed.
// conflict reports that the row's write met a row written without the
// lock (the transaction rolled back): claim again.
func (l *Ledger) doWriteOnce(ctx context.Context, conn *pgx.Conn, s ledgerStore, req Request, fn TxFunc) (out Outcome, conflict bool, err error) {
	plan, err := s.planDo(ctx, conn, req.Key)
	if err != nil {
		return Outcome{}, false, storeErr("claim", err)
	}
	ttl := l.ttl(req)
	if err := s.checkTTL(ttl); err != nil {
		return Outcome{}, false, storeErr("claim", err)
	}
	var c doClaim
	b := &pgx.Batch{}
	b.Queue(sqlBegin)
	s.queueClaim(b, plan, req.Key, &c)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		rollback(conn)
		return Outcome{}, false, storeErr("claim", err)
	}
	if !c.readCommitted {
		// The look-up's snapshot would predate the key's lock.
		rollback(conn)
		return Outcome{}, false, storeErr("claim", errNotReadCommitted)
	}
	if !c.fresh {
		// The key's shard has a bucket newer than the plan's: the look-up
		// did not look there. Claim again with a fresh plan.
		endTx(ctx, conn)
		s.forgetPlans()
		return Outcome{}, true, storeErr("claim", errStaleView)
	}
	now := c.now
	var rec *Record
	var live, leased bool
	if c.found {
		rec, live, leased = c.row.recordAt(req.Key, now)
	}
	switch {
	case !c.locked:
		// Another caller holds the key (or one sharing its lock).
		endTx(ctx, conn)
		return classify(req, claimRow{rec: rec, live: live}), false, nil
	case rec != nil && takeover(rec, live, leased, req.Fingerprint):
		// Take over an expired row or a lapsed lease: rare, so through the
		// claim statement (the lock is ours already) and a completion.
		return l.takeOver(ctx, conn, s, req, fn)
	case rec != nil:
		endTx(ctx, conn)
		return classify(req, claimRow{rec: rec, live: live}), false, nil
	}

	start := time.Now()
	hctx, run := withEventAtCommit(ctx, req.Key)
	res, err := runHandler(hctx, conn, fn)
	if err != nil {
		return Outcome{}, false, err
	}
	took := time.Since(start)
	if err := l.commit(ctx, conn, func(b *pgx.Batch) {
		run.flush(b)
		s.queueInsertDone(b, plan, doneRow{req: req, ttl: ttl, resultTTL: l.resultTTL(req), res: res, took: took})
	}); err != nil {
		if s.planStale(err) { // the shard's bucket changed while fn ran
			return Outcome{}, true, err
		}
		return Outcome{}, isKeyConflict(err), err
	}
	created := now
	rec = &Record{
		Key: req.Key, Status: StatusDone, Fingerprint: req.Fingerprint, Source: req.Source,
		Principal: req.Principal, Attempts: 1, Result: res, Duration: took.Truncate(time.Microsecond),
		CreatedAt: created, CompletedAt: created, ExpiresAt: created.Add(ttl.Truncate(time.Microsecond)),
	}
	return Outcome{Disposition: Executed, Result: res, Record: rec}, false, nil
}

// takeOver claims, with the claim statement, a key whose row the lock
// holder may take over (on the time-bucket layout the claim moves the row
// to its shard's newest bucket), then runs fn and records its result with an
// update.
func (l *Ledger) takeOver(ctx context.Context, conn *pgx.Conn, s ledgerStore, req Request, fn TxFunc) (Outcome, bool, error) {
	c, err := s.takeOver(ctx, conn, claimParams{req: req, ttl: l.ttl(req)})
	if errors.Is(err, pgx.ErrNoRows) {
		// The row changed since the look-up (written without the lock):
		// claim again.
		rollback(conn)
		return Outcome{}, true, storeErr("claim", err)
	}
	if err != nil {
		rollback(conn)
		return Outcome{}, false, storeErr("claim", err)
	}
	out, err := l.runClaimed(ctx, conn, s, req, c.record(req, 0, ""), fn)
	return out, false, err
}

// runClaimed runs fn for a key whose row the open transaction has
// written, and records fn's result (if any) with the commit.
func (l *Ledger) runClaimed(ctx context.Context, conn *pgx.Conn, s ledgerStore, req Request, rec *Record, fn TxFunc) (Outcome, error) {
	start := time.Now()
	hctx, run := withEventAtCommit(ctx, req.Key)
	res, err := runHandler(hctx, conn, fn)
	if err != nil {
		return Outcome{}, err
	}
	took := time.Since(start)
	if err := l.commit(ctx, conn, func(b *pgx.Batch) {
		run.flush(b)
		// An empty result needs no second write: the claimed row is
		// already done, stamped at claim time.
		if !res.IsZero() || l.cfg.RecordDuration {
			s.queueComplete(b, completion{key: req.Key, res: res, took: took, resultTTL: l.resultTTL(req)})
		}
	}); err != nil {
		return Outcome{}, err
	}
	rec.Result = res
	return Outcome{Disposition: Executed, Result: res, Record: rec}, nil
}

// runHandler runs fn in the owned transaction; on error or panic it rolls
// back (and re-panics). A handler that returns nil on an aborted
// transaction (it ignored a failed statement) fails with a RolledBackError:
// COMMIT could only roll back. A handler error while the connection died is
// wrapped as a StoreError (Op "handler"), so that it reads as the
// unavailability it is.
func runHandler(ctx context.Context, conn *pgx.Conn, fn TxFunc) (res Result, err error) {
	return runHandlerTx(ctx, conn, &ownedTx{conn: conn}, fn)
}

// runHandlerTx is runHandler with tx, the transaction fn gets; one that
// has not begun yet (a Postgres step's, whose first statement begins it)
// may be idle when fn returns.
func runHandlerTx(ctx context.Context, conn *pgx.Conn, tx pgx.Tx, fn TxFunc) (res Result, err error) {
	ok := false
	defer func() {
		if !ok {
			rollback(conn)
		}
	}()
	if r := runOf(ctx); r != nil && r.deferring {
		r.mu.Lock()
		r.tx = tx
		r.mu.Unlock()
	}
	res, err = fn(ctx, tx)
	err = handlerErr(conn.PgConn(), err)
	lazy, isLazy := tx.(interface{ begun() bool })
	if pc := conn.PgConn(); err == nil && !pc.IsClosed() && pc.TxStatus() == 'I' && (!isLazy || lazy.begun()) {
		// COMMIT or ROLLBACK sent through Exec: the key's lock went with
		// the transaction, and what the handler wrote is no longer tied to
		// the ledger's row.
		err = fmt.Errorf("%w: the handler ended the transaction itself", ErrTxOwned)
	}
	ok = err == nil
	return res, err
}

// handlerErr checks what a handler left behind: nil when the transaction
// may commit.
func handlerErr(pc *pgconn.PgConn, err error) error {
	switch {
	case err == nil && pc.TxStatus() == 'E':
		return &RolledBackError{Op: "handler"}
	case err == nil:
		return nil
	case pc.IsClosed() && !errors.As(err, new(*StoreError)):
		return &StoreError{Op: "handler", Err: err}
	}
	return err
}

// commitTimeout bounds the commit of a handler that has finished. The
// commit does not follow the caller's cancellation: work that is done is
// recorded rather than thrown away, and the caller still learns the
// outcome.
const commitTimeout = 30 * time.Second

// commit sends the queued completion statements and COMMIT in one round
// trip, and checks COMMIT's answer: a transaction that rolled back is
// never reported as committed.
func (l *Ledger) commit(ctx context.Context, conn *pgx.Conn, queue func(*pgx.Batch)) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	b := &pgx.Batch{}
	queue(b)
	n := b.Len()
	b.Queue(sqlCommit)
	br := conn.SendBatch(ctx, b)
	var err error
	for i := 0; i < n && err == nil; i++ {
		_, err = br.Exec()
	}
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		if tag.String() != "COMMIT" {
			return &RolledBackError{Op: "commit"}
		}
		return nil
	}
	return commitErr(conn, err)
}

// commitErr classifies a failed commit: refused by the server (a deferred
// constraint, say), never sent, or in flight when the connection failed.
func commitErr(conn *pgx.Conn, err error) error {
	if !conn.IsClosed() && conn.PgConn().TxStatus() != 'I' {
		rollback(conn)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) || pgconn.SafeToRetry(err) {
		return storeErr("commit", err)
	}
	return &StoreError{Op: "commit", Err: &commitUnknownError{err}}
}

// rollback ends the connection's transaction; when that fails the
// connection is closed, which also ends it (the pool drops closed
// connections and ones left inside a transaction).
func rollback(conn *pgx.Conn) {
	if conn.IsClosed() || conn.PgConn().TxStatus() == 'I' {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, sqlRollback); err != nil {
		_ = conn.Close(ctx)
	}
}

// endTx rolls back a transaction that claimed nothing, in one round trip
// sent as a batch like the claim's, with ctx's values (tracers see it as the
// call's own) but not its cancellation.
func endTx(ctx context.Context, conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	b := &pgx.Batch{}
	b.Queue(sqlRollback)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		rollback(conn)
	}
}

// classify turns an unclaimed claim row into an Outcome.
func classify(req Request, cr claimRow) Outcome {
	rec := cr.rec
	switch {
	case rec == nil || !cr.live:
		// Another caller holds the key's lock (or is taking over an expired
		// row): its row is not visible yet.
		return Outcome{Disposition: InFlight, Record: rec}
	case fingerprintDiffers(req.Fingerprint, rec.Fingerprint):
		return Outcome{Disposition: Mismatch, Record: rec}
	case rec.Status == StatusProcessing:
		return Outcome{Disposition: InFlight, Record: rec}
	default:
		return Outcome{Disposition: Duplicate, Record: rec, Result: rec.Result}
	}
}

// copyOutcome answers a later copy of a key within one batch (DoEach,
// DoBatch), whose first copy, with fingerprint firstFP, got o: a copy with
// another fingerprint is a Mismatch, as Do would answer it once the first
// had run.
func copyOutcome(req Request, firstFP []byte, o Outcome) Outcome {
	switch {
	case o.Disposition == Executed && fingerprintDiffers(req.Fingerprint, firstFP):
		return Outcome{Disposition: Mismatch, Record: o.Record}
	case o.Disposition == Executed:
		return Outcome{Disposition: Duplicate, Result: o.Result, Record: o.Record}
	case (o.Disposition == Duplicate || o.Disposition == Mismatch) && o.Record != nil:
		// The key's row was there already: answer against it.
		return classify(req, claimRow{rec: o.Record, live: true})
	}
	return o
}

// takeover reports whether a claim may take over the existing row rec:
// its retention expired, or (lease mode) its lease lapsed and the
// fingerprints agree. The claim statements test the same in SQL.
func takeover(rec *Record, live, leased bool, fp []byte) bool {
	if !live {
		return true
	}
	return rec.Status == StatusProcessing && !rec.LeaseUntil.IsZero() && !leased &&
		(fp == nil || rec.Fingerprint == nil || string(fp) == string(rec.Fingerprint))
}

func fingerprintDiffers(a, b []byte) bool {
	return a != nil && b != nil && string(a) != string(b)
}

// DoTx is Do inside a transaction the caller already has open: it claims
// the key in tx, runs fn with tx, and records the result in tx. It neither
// commits nor rolls back: the caller does. If DoTx returns an error, roll tx
// back (the claim is part of it). A Duplicate, InFlight or Mismatch leaves
// tx usable and unchanged, and holds no lock on the key.
//
// The ledger cannot see the caller's COMMIT: an Executed answer means the
// claim, fn's writes and the result are in tx, and they happen exactly when
// tx commits. Use pgx's Commit, which reports a transaction that rolled
// back; fn returning nil on an aborted transaction is ErrRolledBack here
// already.
func (l *Ledger) DoTx(ctx context.Context, tx pgx.Tx, req Request, fn TxFunc) (Outcome, error) {
	if err := l.Validate(req); err != nil {
		return Outcome{}, err
	}
	// The claim runs in a savepoint: when the key is not new, rolling the
	// savepoint back releases the key's advisory lock at once, so the
	// caller's transaction does not hold other callers of that key off
	// until it ends.
	s, err := l.store.get(ctx, tx)
	var cr claimRow
	if err == nil {
		cr, err = s.claimInSavepoint(ctx, tx, claimParams{req: req, ttl: l.ttl(req)})
	}
	if err != nil {
		err = storeErr("claim", err)
		l.observe(req, Outcome{}, err)
		return Outcome{}, err
	}
	if !cr.claimed {
		out := classify(req, cr)
		l.observe(req, out, nil)
		return out, nil
	}
	start := time.Now()
	res, err := fn(WithEvent(ctx, req.Key), tx)
	if err = handlerErr(tx.Conn().PgConn(), err); err != nil {
		l.observe(req, Outcome{}, err)
		return Outcome{}, err
	}
	// An empty result needs no second write: the claimed row is already
	// done, stamped at claim time.
	if !res.IsZero() || l.cfg.RecordDuration {
		if err := s.complete(ctx, tx, completion{key: req.Key, res: res, took: time.Since(start), resultTTL: l.resultTTL(req)}); err != nil {
			err = storeErr("complete", err)
			l.observe(req, Outcome{}, err)
			return Outcome{}, err
		}
	}
	out := Outcome{Disposition: Executed, Result: res}
	l.observe(req, out, nil)
	return out, nil
}

// BatchFunc runs the new requests of a batch in one transaction. fresh
// holds the indexes (into the requests given to DoBatch) of the keys claimed
// now; it is never empty. It returns one Result per fresh index, in the same
// order, or nil when there is nothing to record.
type BatchFunc func(ctx context.Context, tx pgx.Tx, fresh []int) ([]Result, error)

// DoBatch claims every request in one statement, runs fn once with the new
// ones in the same transaction, and commits once: one round trip to claim,
// the handler's, one to record and commit. It returns one Outcome per
// request. A key repeated within the batch runs once; its later copies are
// Duplicates. If fn fails (or returns nil on an aborted transaction:
// ErrRolledBack) the whole batch rolls back and the error is returned; run the requests one by one with Do to isolate a poison message.
func (l *Ledger) DoBatch(ctx context.Context, reqs []Request, fn BatchFunc) ([]Outcome, error) {
	outs := make([]Outcome, len(reqs))
	if len(reqs) == 0 {
		return outs, nil
	}
	// Unique keys, in first-seen order; copies point at their first.
	first := make(map[Key]int, len(reqs))
	var uniq []Request
	var uniqIdx []int // uniq position -> reqs index
	for i, r := range reqs {
		if err := l.Validate(r); err != nil {
			return nil, fmt.Errorf("request %d: %w", i, err)
		}
		if _, ok := first[r.Key]; !ok {
			first[r.Key] = len(uniq)
			uniq = append(uniq, r)
			uniqIdx = append(uniqIdx, i)
		}
	}

	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, storeErr("acquire", err)
	}
	var failed error
	defer func() { releaseConn(pc, failed) }()
	conn := pc.Conn()
	s, err := l.store.get(ctx, conn) // the layout, at first use
	if err != nil {
		return nil, storeErr("claim", err)
	}
	for _, r := range uniq {
		if err := s.checkTTL(l.ttl(r)); err != nil {
			return nil, storeErr("claim", err)
		}
	}

	for attempt := 1; ; attempt++ {
		conflict, err := l.batchOnce(ctx, conn, s, reqs, uniq, uniqIdx, outs, fn)
		if err == nil {
			break
		}
		if !conflict || attempt == maxConflictRetries {
			failed = err
			return nil, err
		}
	}
	// Copies within the batch answer like a duplicate of their first.
	for i, r := range reqs {
		f := uniqIdx[first[r.Key]]
		if f == i {
			continue
		}
		outs[i] = copyOutcome(r, reqs[f].Fingerprint, outs[f])
	}
	for i, r := range reqs {
		l.observe(r, outs[i], nil)
	}
	return outs, nil
}

// batchOnce claims the unique requests uniq (uniqIdx: their indexes in
// reqs), runs fn with the fresh ones and commits, filling outs at
// uniqIdx. The claim locks every key in one statement and looks them up
// in a second (one round trip with BEGIN), and the new keys' rows are
// written once, complete, by one statement with the commit; conflict
// reports that it met a row written without its key's lock (rolled back:
// claim again). Rows to take over go through the claim statement.
func (l *Ledger) batchOnce(ctx context.Context, conn *pgx.Conn, s ledgerStore, reqs, uniq []Request, uniqIdx []int, outs []Outcome, fn BatchFunc) (conflict bool, err error) {
	// isNew marks the uniq positions claimed by the lock alone (their rows
	// are written with the commit); the others claimed wrote their rows.
	isNew := make([]bool, len(uniq))
	rows, now, err := l.lockMany(ctx, conn, s, uniq) // per uniq
	var over []int                                   // locked, with a row that may be taken over
	for u := range rows {
		cr := &rows[u]
		switch {
		case cr.claimed && cr.rec == nil:
			isNew[u] = true
		case cr.claimed && takeover(cr.rec, cr.live, cr.leased, uniq[u].Fingerprint):
			over = append(over, u)
		default:
			cr.claimed = false
		}
	}
	if err == nil && len(over) > 0 {
		sub := make([]Request, len(over))
		for j, u := range over {
			sub[j] = uniq[u]
		}
		var taken []claimRow
		if taken, err = s.takeOverMany(ctx, conn, sub, l.ttl); err == nil {
			for j, u := range over {
				rows[u] = taken[j]
			}
		}
	}
	if err != nil {
		rollback(conn)
		return false, storeErr("claim", err)
	}

	var fresh []int
	var freshU []int // uniq positions of fresh
	for u, cr := range rows {
		if cr.claimed {
			fresh = append(fresh, uniqIdx[u])
			freshU = append(freshU, u)
		} else {
			outs[uniqIdx[u]] = classify(uniq[u], cr)
		}
	}
	if len(fresh) == 0 {
		rollback(conn)
		return false, nil
	}
	start := time.Now()
	var results []Result
	_, err = runHandler(ctx, conn, func(ctx context.Context, tx pgx.Tx) (Result, error) {
		var err error
		results, err = fn(ctx, tx, fresh)
		return Result{}, err
	})
	if err != nil {
		return false, err
	}
	if results != nil && len(results) != len(fresh) {
		rollback(conn)
		return false, fmt.Errorf("justonce/inbox: batch handler returned %d results for %d requests", len(results), len(fresh))
	}
	d := time.Since(start) / time.Duration(len(fresh))
	// The rows to insert, by their uniq positions: the store is given
	// uniq, not the caller's reqs, which would then escape to the heap.
	newU := make([]int, 0, len(freshU))
	var newRes []Result
	if results != nil {
		newRes = make([]Result, 0, len(freshU))
	}
	for j, u := range freshU {
		if isNew[u] {
			newU = append(newU, u)
			if results != nil {
				newRes = append(newRes, results[j])
			}
		}
	}
	var insert queuedStmt
	if len(newU) > 0 {
		if insert, err = s.insertMany(insertManyParams{reqs: uniq, idx: newU, results: newRes, ttl: l.ttl, resultTTL: l.resultTTL, took: d}); err != nil {
			rollback(conn)
			return false, fmt.Errorf("justonce/inbox: batch result: %w", err)
		}
	}
	err = l.commit(ctx, conn, func(b *pgx.Batch) {
		if len(newU) > 0 {
			insert.queue(b)
		}
		for j, i := range fresh {
			if isNew[freshU[j]] {
				continue
			}
			var res Result
			if results != nil {
				res = results[j]
			}
			if !res.IsZero() {
				s.queueComplete(b, completion{key: reqs[i].Key, res: res, took: d, resultTTL: l.resultTTL(reqs[i])})
			}
		}
	})
	if err != nil {
		return isKeyConflict(err), err
	}
	for j, i := range fresh {
		outs[i] = Outcome{Disposition: Executed}
		if results != nil {
			outs[i].Result = results[j]
		}
		if isNew[freshU[j]] {
			r := reqs[i]
			ttl := l.ttl(r)
			outs[i].Record = &Record{
				Key: r.Key, Status: StatusDone, Fingerprint: r.Fingerprint, Source: r.Source,
				Principal: r.Principal, Attempts: 1, Result: outs[i].Result, Duration: d.Truncate(time.Microsecond),
				CreatedAt: now, CompletedAt: now, ExpiresAt: now.Add(ttl.Truncate(time.Microsecond)),
			}
		}
	}
	return false, nil
}

// lockMany opens the transaction, takes the keys' advisory locks and then
// looks the keys up, in one round trip. claimed says the lock was taken;
// rec is the key's row, if any.
func (l *Ledger) lockMany(ctx context.Context, conn *pgx.Conn, s ledgerStore, reqs []Request) ([]claimRow, time.Time, error) {
	var a lockManyAnswer
	b := &pgx.Batch{}
	b.Queue(sqlBegin)
	s.queueLockMany(b, reqs, &a)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return nil, a.now, err
	}
	rows, err := a.result()
	return rows, a.now, err
}

// Lookup returns the live row for k, or ErrNotFound (absent or expired).
func (l *Ledger) Lookup(ctx context.Context, k Key) (*Record, error) {
	if err := k.Validate(l.cfg.MaxKeyLen); err != nil {
		return nil, err
	}
	rec, live, err := l.store.rows.lookup(ctx, l.pool, k)
	if err != nil {
		return nil, storeErr("lookup", err)
	}
	if rec == nil || !live {
		return nil, ErrNotFound
	}
	return rec, nil
}

// ScopeStats is one line of Ledger.Stats: live rows of one scope and status.
type ScopeStats struct {
	Scope  string
	Status Status
	Rows   int64
	// OldestLease is the earliest lease_until among processing rows (zero
	// when none): a lease far in the past is a stuck key.
	OldestLease time.Time
}

// Stats returns live rows by scope and status, with the oldest lease of the
// processing ones.
func (l *Ledger) Stats(ctx context.Context) ([]ScopeStats, error) {
	st, err := l.store.rows.stats(ctx, l.pool)
	return st, storeErr("stats", err)
}

// LiveKeys counts the unexpired rows of one scope and tenant (an index range
// scan), for per-tenant quotas.
func (l *Ledger) LiveKeys(ctx context.Context, scope, tenant string) (int64, error) {
	n, err := l.store.rows.live(ctx, l.pool, scope, tenant)
	return n, storeErr("live keys", err)
}

// Known reports, for each key, the status of its live row, or "" when the
// key is new (absent or expired), in one statement. A replay's dry run uses
// it to count what would run without running anything.
func (l *Ledger) Known(ctx context.Context, keys []Key) ([]Status, error) {
	for i, k := range keys {
		if err := k.Validate(l.cfg.MaxKeyLen); err != nil {
			return nil, fmt.Errorf("key %d: %w", i, err)
		}
	}
	if len(keys) == 0 {
		return nil, nil
	}
	st, err := l.store.rows.known(ctx, l.pool, keys)
	return st, storeErr("known", err)
}

// DefaultTTL returns the retention of rows whose request sets no TTL.
func (l *Ledger) DefaultTTL() time.Duration { return l.cfg.DefaultTTL }
