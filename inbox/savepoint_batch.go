package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
)

// EachFunc runs the handler of reqs[i] of a DoEach run on the run's
// transaction. Its writes through tx commit with the run, or, when it
// fails, are rolled back without those of the requests before it. It must
// not commit or roll back tx. Within one DoEach call it may be called
// again for the same i: a request's first run goes with the run's
// optimistic transaction when a later request's handler fails (see
// DoEach).
type EachFunc func(ctx context.Context, tx pgx.Tx, i int) (Result, error)

// EachOptions bound a DoEach run.
type EachOptions struct {
	// MaxTime: once the run has been going this long, it starts no further
	// request and commits what ran (the requests left are not decided).
	// Zero: no bound.
	MaxTime time.Duration
	// Stop, once closed, ends the run the same way: no further request
	// starts (a consumer that is shutting down closes it). Nil: never.
	Stop <-chan struct{}
}

// EachRun is what a DoEach run decided.
type EachRun struct {
	// Outcomes of reqs[:len(Outcomes)], in order: the requests the run
	// decided. When Failed is set, the last one is the request whose
	// handler failed, and its Outcome is the zero Outcome.
	Outcomes []Outcome
	// Failed is the error of the last decided request's handler (returned,
	// or ErrRolledBack when it returned nil on a failed statement): neither
	// its claim nor its writes are recorded, and the requests before it
	// committed.
	Failed error
}

// DoEach runs requests that must be decided in order in one transaction,
// with one COMMIT for all, as if each ran in a savepoint of its own: a
// request whose handler fails is rolled back alone, and the requests
// before it commit.
//
// It goes the optimistic way first (on the plain layout):
//
//	BEGIN; lock every key; look every key up   -- one round trip
//	fn(ctx, tx, i) for each new key, in order  -- the handlers' own
//	INSERT the new keys' rows; COMMIT          -- one round trip
//
// A request whose key is not new is answered (Duplicate, Mismatch) from
// its row, without a handler. A key repeated within reqs is claimed once;
// its later copies answer like a duplicate of the first. When the
// optimistic way cannot decide the run as savepoints would (a key held
// elsewhere, a row to take over, a row written without its key's lock),
// it rolls back before anything is recorded and the run is made on
// savepoints:
//
//	SAVEPOINT; claim; fn(ctx, tx, i); RELEASE SAVEPOINT
//
// for each request, the SAVEPOINT and the claim in one round trip (with
// the previous request's RELEASE, and the first with BEGIN). The
// time-bucket layout makes every run this way.
//
// The run stops, and commits what ran before, at the first request that
// is not done: one whose handler failed (returned an error, or nil on an
// aborted transaction; EachRun.Failed says why) or one held InFlight
// elsewhere. A handler that fails on the optimistic way takes the run's
// transaction with it: the requests before it are run again on savepoints
// and commit, so their handlers are called twice (their first run rolled
// back), and the failed request is reported with the error of its one
// run. The run also starts no request after opts.MaxTime or once opts.Stop
// is closed. The caller decides what comes next for the request that
// stopped the run and for the ones after it: nothing about them is
// recorded.
//
// The error return means the transaction failed as a whole and nothing of
// the run is recorded (or, with ErrCommitUnknown, maybe all of it): the
// database was unavailable (IsTransient), a deferred constraint failed at
// COMMIT, or a handler ended the transaction or broke its connection
// (which savepoints cannot contain). Run the requests one by one with Do
// then, so that a hostile handler is isolated. A handler's panic rolls
// the run back and is re-raised.
//
// With Config.Redis, the run first asks Redis about every key in one
// pipelined call: cached keys are answered from the cache (their
// Outcome.Cached set) without a Postgres claim, keys locked elsewhere are
// InFlight, and the others are locked in Redis until the run ends; after
// the commit, the outcomes are cached under the same rule as Do's: by the
// caller that still holds the key's lock, in the same Redis operation that
// checks it.
func (l *Ledger) DoEach(ctx context.Context, reqs []Request, opts EachOptions, fn EachFunc) (EachRun, error) {
	if len(reqs) == 0 {
		return EachRun{}, nil
	}
	for i, r := range reqs {
		if err := l.Validate(r); err != nil {
			return EachRun{}, fmt.Errorf("request %d: %w", i, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return EachRun{}, fmt.Errorf("justonce/inbox: %w", err)
	}
	// A TTL the layout cannot keep (past the time-bucket layout's
	// MaxTTL) fails the run before any handler runs, as it fails Do and
	// DoBatch.
	s, err := l.store.get(ctx, l.pool)
	if err != nil {
		return EachRun{}, storeErr("claim", err)
	}
	for _, q := range reqs {
		if err := s.checkTTL(l.ttl(q)); err != nil {
			return EachRun{}, storeErr("claim", err)
		}
	}
	r := &eachRun{l: l, s: s, reqs: reqs, limit: len(reqs), opts: opts, fn: fn, start: time.Now()}
	// Copies of a key: a scan rather than a map, for batches of tens.
	r.first = make([]int, len(reqs))
	for i, q := range reqs {
		r.first[i] = i
		for j := 0; j < i; j++ {
			if r.first[j] == j && reqs[j].Key == q.Key {
				r.first[i] = j
				break
			}
		}
	}
	if l.fast != nil {
		if err := r.acquire(ctx); err != nil {
			return EachRun{}, err
		}
		defer r.finish(ctx)
	}
	run, err := r.decide(ctx)
	if err != nil {
		for _, q := range reqs {
			l.observe(q, Outcome{}, err)
		}
		return EachRun{}, err
	}
	for i, out := range run.Outcomes {
		if run.Failed != nil && i == len(run.Outcomes)-1 {
			l.observe(reqs[i], Outcome{}, run.Failed)
			continue
		}
		l.observe(reqs[i], out, nil)
	}
	return run, nil
}

// eachRun is one DoEach call.
type eachRun struct {
	l     *Ledger
	s     ledgerStore
	reqs  []Request
	limit int // the savepoint path decides reqs[:limit] at most
	opts  EachOptions
	fn    EachFunc
	start time.Time
	first []int // index of each request's first copy in reqs

	// Redis, when configured: per request (first copies only).
	states    []acquireState
	cached    []string
	tokens    []string
	stopLocks func()
	outs      []Outcome // what was decided, for the cache
	committed bool
}

// decide runs the requests: on the optimistic path first where the
// layout allows it (optimistic_batch.go), and on savepoints (run) for
// what that path leaves undecided.
func (r *eachRun) decide(ctx context.Context) (EachRun, error) {
	if !r.s.claimsRunUpFront() || r.l.savepointsOnly {
		return r.run(ctx)
	}
	run, o, err := r.optimistic(ctx)
	switch {
	case err != nil || o.end == optimisticDone:
		return run, err
	case o.end == optimisticRetry:
		return r.run(ctx)
	}
	// The handler of reqs[o.failedAt] failed, and the transaction went
	// with it: decide the requests before it on savepoints, then report
	// its failure, unless the savepoint path ended the run before it.
	if o.failedAt > 0 {
		r.limit = o.failedAt
		if run, err = r.run(ctx); err != nil || run.Failed != nil || len(run.Outcomes) < o.failedAt ||
			(len(run.Outcomes) > 0 && run.Outcomes[len(run.Outcomes)-1].Disposition == InFlight) {
			return run, err
		}
	}
	run.Outcomes = append(run.Outcomes, Outcome{})
	run.Failed = o.failed
	return run, nil
}

// over reports whether the run may start no further request.
func (r *eachRun) over() bool {
	if r.opts.MaxTime > 0 && time.Since(r.start) >= r.opts.MaxTime {
		return true
	}
	select {
	case <-r.opts.Stop:
		return true
	default:
		return false
	}
}

// run claims and runs the requests on one connection.
func (r *eachRun) run(ctx context.Context) (run EachRun, err error) {
	l := r.l
	outs := make([]Outcome, 0, len(r.reqs))
	results := make([]Result, len(r.reqs))
	took := make([]time.Duration, len(r.reqs))
	executed := make([]bool, len(r.reqs))
	// The claimed rows' columns; their Records are built after the
	// commit, so that a run holds little per message while it runs.
	claims := make([]claimedScan, len(r.reqs))
	var failed error

	// Answers that need no Postgres claim (copies, Redis) are decided as
	// they come; the connection is taken at the first claim.
	var conn *pgx.Conn
	var tx *ownedTx // one for the run: its nested savepoints are numbered across handlers
	var release func(...error)
	defer func() {
		if release != nil {
			release(err, run.Failed)
		}
	}()
	inTx := false
	panicked := true
	defer func() {
		if panicked && conn != nil {
			rollback(conn) // a handler panicked: re-raised after the rollback
		}
	}()
	var pending []string // statements to send with the next round trip
	stop := false
	for i := 0; i < r.limit && !stop; i++ {
		if i > 0 && (r.over() || ctx.Err() != nil) {
			break
		}
		req := r.reqs[i]
		if f := r.first[i]; f != i {
			outs = append(outs, copyOutcome(req, r.reqs[f].Fingerprint, outs[f]))
			continue
		}
		if r.states != nil {
			switch r.states[i] {
			case redisHit:
				if out, ok := decodeCached(req, r.cached[i]); ok {
					outs = append(outs, out)
					continue
				}
			case redisBusy:
				outs = append(outs, Outcome{Disposition: InFlight})
				stop = true
				continue
			}
		}
		if conn == nil {
			pc, err := l.pool.Acquire(ctx)
			if err != nil {
				return EachRun{}, storeErr("acquire", err)
			}
			// A connection left inside a transaction is destroyed, not
			// reused; one on a server that refused a write as read-only
			// is closed.
			release = func(errs ...error) { releaseConn(pc, errs...) }
			conn = pc.Conn()
			tx = &ownedTx{conn: conn}
		}

		// [BEGIN | RELEASE previous] SAVEPOINT; claim: one round trip.
		start := time.Now()
		b := &pgx.Batch{}
		if !inTx {
			b.Queue(sqlBegin)
		}
		for _, s := range pending {
			b.Queue(s)
		}
		pending = pending[:0]
		b.Queue(sqlEachSavepoint)
		cr, err := r.s.claimInRun(ctx, conn, b, claimParams{req: req, ttl: l.ttl(req)}, &claims[i])
		inTx = true
		if err != nil {
			rollback(conn)
			panicked = false
			return EachRun{}, err
		}
		if !cr.claimed {
			out := classify(req, cr)
			outs = append(outs, out)
			if out.Disposition == InFlight {
				stop = true
			}
			continue
		}

		res, err := r.fn(WithEvent(ctx, req.Key), tx, i)
		pgc := conn.PgConn()
		if werr := runGone(pgc, err); werr != nil {
			panicked = false
			return EachRun{}, werr
		}
		if err = handlerErr(pgc, err); err != nil {
			// Roll this request back alone, and stop: the ones before it
			// commit.
			b := &pgx.Batch{}
			b.Queue(sqlEachRollback)
			b.Queue(sqlEachRelease)
			if rerr := conn.SendBatch(context.WithoutCancel(ctx), b).Close(); rerr != nil {
				rollback(conn)
				panicked = false
				return EachRun{}, storeErr("handler", rerr)
			}
			outs = append(outs, Outcome{})
			failed = err
			break
		}
		results[i] = res
		took[i] = time.Since(start)
		executed[i] = true
		outs = append(outs, Outcome{Disposition: Executed, Result: res})
		pending = append(pending, sqlEachRelease)
	}
	panicked = false

	if inTx {
		commitStart := time.Now()
		err := l.commit(ctx, conn, func(b *pgx.Batch) {
			for i := range outs {
				if !executed[i] {
					continue
				}
				if !results[i].IsZero() || l.cfg.RecordDuration {
					r.s.queueComplete(b, completion{key: r.reqs[i].Key, res: results[i], took: took[i], resultTTL: r.l.resultTTL(r.reqs[i])})
				}
			}
		})
		if err != nil {
			return EachRun{}, err
		}
		// Each executed request's duration includes its share of the
		// commit.
		if n := countTrue(executed); n > 0 {
			share := time.Since(commitStart) / time.Duration(n)
			for i := range outs {
				if executed[i] {
					rec := claims[i].record(r.reqs[i], 0, "")
					rec.Result, rec.Duration = results[i], took[i]+share
					outs[i].Record = rec
				}
			}
		}
	}
	// Copies of an executed key answer with its record too.
	for i := range outs {
		if f := r.first[i]; f != i && outs[i].Record == nil && outs[f].Disposition == Executed {
			outs[i].Record = outs[f].Record
		}
	}
	r.outs = outs
	r.committed = true
	return EachRun{Outcomes: outs, Failed: failed}, nil
}

// runGone returns the run's error when a handler (which returned err)
// took the run's transaction with it: it broke the connection, or it ended
// the transaction (a raw COMMIT or ROLLBACK: what ran before it is not
// known to be either). Nil: the transaction is still there.
func runGone(pgc *pgconn.PgConn, err error) error {
	switch {
	case pgc.IsClosed():
		if err == nil {
			err = errors.New("connection closed")
		}
		if !errors.As(err, new(*StoreError)) {
			err = &StoreError{Op: "handler", Err: err}
		}
		return err
	case pgc.TxStatus() == 'I':
		return &RolledBackError{Op: "handler"}
	}
	return nil
}

func countTrue(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

// acquire asks Redis about every first copy of a key in one pipelined
// call: cached, locked by us now, or held elsewhere.
func (r *eachRun) acquire(ctx context.Context) error {
	f := r.l.fast
	n := len(r.reqs)
	r.states = make([]acquireState, n)
	r.cached = make([]string, n)
	r.tokens = make([]string, n)
	var idx []int
	var keys [][]string
	var args [][]any
	for i, q := range r.reqs {
		if r.first[i] != i {
			continue
		}
		r.tokens[i] = newToken()
		res, lock := f.keys(q.Key)
		idx = append(idx, i)
		keys = append(keys, []string{res, lock})
		args = append(args, []any{r.tokens[i], f.cfg.LockTTL.Milliseconds()})
	}
	cctx, cancel := f.call(ctx)
	defer cancel()
	cmds := f.evalMany(cctx, acquireScript, keys, args)
	if ctx.Err() != nil {
		// Locks may have been taken: they lapse after LockTTL, and are
		// released below where we know we hold them.
		r.releaseAll(ctx, idx, cmds)
		return fmt.Errorf("justonce/inbox: %w", ctx.Err())
	}
	var locked []int
	down := false
	for j, cmd := range cmds {
		i := idx[j]
		v, err := cmd.Slice()
		if err != nil || len(v) == 0 {
			if err == nil {
				err = errors.New("empty script reply")
			}
			f.failed("acquire", err)
			down = true
			r.states[i] = redisDown
			continue
		}
		switch n, _ := v[0].(int64); n {
		case 1:
			s, _ := v[1].(string)
			r.states[i], r.cached[i] = redisHit, s
		case 2:
			r.states[i] = redisLocked
			locked = append(locked, i)
		default:
			r.states[i] = redisBusy
		}
	}
	if !down {
		f.ok()
	}
	r.stopLocks = r.keepLocks(ctx, locked)
	return nil
}

// releaseAll releases the locks an interrupted acquire took.
func (r *eachRun) releaseAll(ctx context.Context, idx []int, cmds []*redis.Cmd) {
	var mine []int
	for j, cmd := range cmds {
		if v, err := cmd.Slice(); err == nil && len(v) > 0 {
			if n, _ := v[0].(int64); n == 2 {
				mine = append(mine, idx[j])
			}
		}
	}
	r.finishKeys(ctx, mine, nil)
}

// keepLocks extends the locks held in one pipelined call every third of
// LockTTL, until the returned stop is called.
func (r *eachRun) keepLocks(ctx context.Context, locked []int) (stop func()) {
	if len(locked) == 0 {
		return func() {}
	}
	f := r.l.fast
	var mu sync.Mutex
	stopped := false
	var t *time.Timer
	every := f.cfg.LockTTL / 3
	tick := func() {
		var keys [][]string
		var args [][]any
		for _, i := range locked {
			_, lock := f.keys(r.reqs[i].Key)
			keys = append(keys, []string{lock})
			args = append(args, []any{r.tokens[i], f.cfg.LockTTL.Milliseconds()})
		}
		cctx, cancel := f.call(context.WithoutCancel(ctx))
		for _, cmd := range f.evalMany(cctx, extendScript, keys, args) {
			if err := cmd.Err(); err != nil {
				f.failed("extend", err)
				break
			}
		}
		cancel()
		mu.Lock()
		if !stopped {
			t.Reset(every)
		}
		mu.Unlock()
	}
	mu.Lock()
	t = time.AfterFunc(every, tick)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		t.Stop()
		mu.Unlock()
	}
}

// finish releases the locks the run holds, caching, for the requests that
// committed, what Postgres answered (the same values Do caches).
func (r *eachRun) finish(ctx context.Context) {
	if r.stopLocks != nil {
		r.stopLocks()
	}
	f := r.l.fast
	var locked []int
	values := map[int]string{}
	ttls := map[int]time.Duration{}
	for i := range r.reqs {
		if r.states == nil || r.states[i] != redisLocked {
			continue
		}
		locked = append(locked, i)
		if r.committed && i < len(r.outs) {
			out := r.outs[i]
			if out.Record != nil && (out.Disposition == Executed || out.Disposition == Duplicate) {
				values[i], ttls[i] = f.encode(out, r.l.resultTTL(r.reqs[i]))
			}
		}
	}
	if f.beforeFinish != nil {
		for _, i := range locked {
			f.beforeFinish(r.reqs[i].Key)
		}
	}
	r.finishKeys(ctx, locked, func(i int) (string, time.Duration) { return values[i], ttls[i] })
}

// finishKeys runs finishScript for each of idx in one pipelined call,
// trying the failed ones once more (a stale pooled connection right after
// a Redis restart).
func (r *eachRun) finishKeys(ctx context.Context, idx []int, value func(int) (string, time.Duration)) {
	f := r.l.fast
	for try := 0; try < 2 && len(idx) > 0; try++ {
		var keys [][]string
		var args [][]any
		for _, i := range idx {
			res, lock := f.keys(r.reqs[i].Key)
			var v string
			var ttl time.Duration
			if value != nil {
				v, ttl = value(i)
			}
			keys = append(keys, []string{res, lock})
			args = append(args, []any{r.tokens[i], v, ttl.Milliseconds()})
		}
		cctx, cancel := f.call(context.WithoutCancel(ctx))
		cmds := f.evalMany(cctx, finishScript, keys, args)
		cancel()
		var again []int
		for j, cmd := range cmds {
			if err := cmd.Err(); err != nil && !errors.Is(err, redis.Nil) {
				f.failed("finish", err)
				again = append(again, idx[j])
			}
		}
		if len(again) == 0 {
			f.ok()
		}
		idx = again
	}
}

// evalMany runs script once per keys[j], args[j] in one pipeline (EVALSHA,
// then EVAL for the calls that found the script not loaded), and returns
// one command per call, each with its own error.
func (f *redisFront) evalMany(ctx context.Context, script *redis.Script, keys [][]string, args [][]any) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(keys))
	pipe := f.cfg.Client.Pipeline()
	for j := range keys {
		cmds[j] = script.EvalSha(ctx, pipe, keys[j], args[j]...)
	}
	_, _ = pipe.Exec(ctx)
	var missing []int
	for j, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			missing = append(missing, j)
		}
	}
	if len(missing) > 0 {
		pipe := f.cfg.Client.Pipeline()
		for _, j := range missing {
			cmds[j] = script.Eval(ctx, pipe, keys[j], args[j]...)
		}
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}
