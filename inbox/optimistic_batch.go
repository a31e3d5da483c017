package inbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// A DoEach run first tries the optimistic path: every key of the run is
// claimed up front, in one round trip with BEGIN (their advisory locks in
// one statement, then their look-up in a second, as DoBatch claims), the
// handlers run one after another on the run's transaction without a
// savepoint each, and the new keys' rows are written, complete, by one
// INSERT sent with COMMIT. A run of n new keys costs the handlers' own
// round trips and two more, where the savepoint path costs n more (a
// savepoint and a claim statement before each handler), and a duplicate
// costs nothing beyond the look-up, where the savepoint path costs two.
//
// The optimistic path decides nothing the savepoint path would decide
// otherwise. Whatever it cannot decide alike sends the run to the
// savepoint path before anything commits:
//
//   - a key it could not lock (held elsewhere), a row to take over
//     (expired, or a lapsed lease), a row in flight: the transaction is
//     rolled back before any handler runs, and the run starts again on
//     savepoints;
//   - a handler that fails (returns an error, or nil on an aborted
//     transaction): the transaction is rolled back, which undoes the
//     handlers before it too; those run again on savepoints, and the
//     failed request is reported failed with the error it returned, so
//     that one failure of a handler is one failure of its request (it is
//     not called a second time for one decision);
//   - a row the commit's INSERT meets (written by someone who did not hold
//     the key's lock): the commit rolls back, and the run starts again on
//     savepoints, whose claims answer such keys Duplicate.
//
// What savepoints could not contain either fails the run as a whole, as
// on the savepoint path: a deferred constraint failing at COMMIT, a
// handler that breaks its connection or ends the transaction (the
// handlers' transaction refuses COMMIT and ROLLBACK statements: see
// guardedTx), the database unavailable; a panic rolls the run back and is
// re-raised.
//
// Handlers that ran before a failing one in the same run are rolled back
// and called again: their writes through tx happen once, as on every
// retry; what they do outside the transaction may happen again.

// optimisticEnd says how an optimistic try ended.
type optimisticEnd uint8

const (
	// optimisticDone: the run is decided (committed, or failed as a whole).
	optimisticDone optimisticEnd = iota
	// optimisticRetry: nothing is decided; run it on savepoints.
	optimisticRetry
	// optimisticFailedAt: the handler of request failedAt failed; decide
	// the requests before it on savepoints, then report it failed.
	optimisticFailedAt
)

// optimisticResult is how an optimistic try ended.
type optimisticResult struct {
	end      optimisticEnd
	failedAt int
	failed   error
}

// optimistic tries the run on the optimistic path (see above).
func (r *eachRun) optimistic(ctx context.Context) (run EachRun, res optimisticResult, err error) {
	l := r.l
	n := len(r.reqs)
	// What needs no claim is decided as the savepoint path decides it:
	// later copies of a key, keys answered from the Redis cache; a key
	// locked in Redis by another caller ends the run there.
	end := n      // requests [0, end) are considered
	busy := false // reqs[end] is locked elsewhere in Redis
	cached := make(map[int]Outcome)
	var claimIdx []int // requests to claim in Postgres
	for i, req := range r.reqs {
		if r.first[i] != i {
			continue
		}
		if r.states != nil {
			switch r.states[i] {
			case redisHit:
				if out, ok := decodeCached(req, r.cached[i]); ok {
					cached[i] = out
					continue
				}
			case redisBusy:
				end, busy = i, true
			}
		}
		if busy {
			break
		}
		claimIdx = append(claimIdx, i)
	}
	if len(claimIdx) == 0 {
		// Nothing to claim: the savepoint path decides it without a
		// connection.
		return EachRun{}, optimisticResult{end: optimisticRetry}, nil
	}

	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return EachRun{}, optimisticResult{}, storeErr("acquire", err)
	}
	var failed error
	defer func() { releaseConn(pc, err, failed) }()
	conn := pc.Conn()

	// BEGIN; lock every key; look every key up: one round trip.
	claimReqs := make([]Request, len(claimIdx))
	for j, i := range claimIdx {
		claimReqs[j] = r.reqs[i]
	}
	rows, now, err := l.lockMany(ctx, conn, r.s, claimReqs)
	if err != nil {
		rollback(conn)
		return EachRun{}, optimisticResult{}, storeErr("claim", err)
	}
	// fresh marks the requests whose key is new and locked: their
	// handlers run. The others are answered from their rows.
	fresh := make([]bool, n)
	var answered map[int]Outcome // made for the first key not new: rare
	for j, i := range claimIdx {
		cr := rows[j]
		switch {
		case cr.claimed && cr.rec == nil:
			fresh[i] = true
			continue
		case cr.claimed && takeover(cr.rec, cr.live, cr.leased, r.reqs[i].Fingerprint):
			// Rare: the savepoint path's claim takes the row over.
			endTx(ctx, conn)
			return EachRun{}, optimisticResult{end: optimisticRetry}, nil
		}
		out := classify(r.reqs[i], cr)
		if out.Disposition == InFlight {
			// Held elsewhere: on savepoints the run ends there, without
			// holding the locks of the keys after it.
			endTx(ctx, conn)
			return EachRun{}, optimisticResult{end: optimisticRetry}, nil
		}
		if answered == nil {
			answered = make(map[int]Outcome)
		}
		answered[i] = out
	}

	// outs[i] is reqs[i]'s outcome (an executed one's Result is the
	// row's); took[i] its handler's run time.
	outs := make([]Outcome, 0, n)
	took := make([]time.Duration, n)
	executed := make([]int, 0, len(claimIdx))
	// One for the run (its nested savepoints are numbered across
	// handlers), refusing what would end it: see guardedTx.
	tx := guardedTx{&ownedTx{conn: conn}}
	panicked := true
	defer func() {
		if panicked {
			rollback(conn) // a handler panicked: re-raised after the rollback
		}
	}()
	for i := 0; i < n; i++ {
		if i > 0 && (r.over() || ctx.Err() != nil) {
			break
		}
		if i == end {
			if busy {
				outs = append(outs, Outcome{Disposition: InFlight})
			}
			break
		}
		req := r.reqs[i]
		if f := r.first[i]; f != i {
			outs = append(outs, copyOutcome(req, r.reqs[f].Fingerprint, outs[f]))
			continue
		}
		if out, ok := cached[i]; ok {
			outs = append(outs, out)
			continue
		}
		if !fresh[i] {
			outs = append(outs, answered[i])
			continue
		}
		start := time.Now()
		res, herr := r.fn(WithEvent(ctx, req.Key), tx, i)
		pgc := conn.PgConn()
		if werr := runGone(pgc, herr); werr != nil {
			panicked = false
			failed = werr
			return EachRun{}, optimisticResult{}, werr
		}
		if herr = handlerErr(pgc, herr); herr != nil {
			// Without a savepoint of its own, the failing handler's
			// writes go only with the whole transaction's.
			panicked = false
			failed = herr // a connection refused as read-only is closed
			rollback(conn)
			return EachRun{}, optimisticResult{end: optimisticFailedAt, failedAt: i, failed: herr}, nil
		}
		took[i] = time.Since(start)
		executed = append(executed, i)
		outs = append(outs, Outcome{Disposition: Executed, Result: res})
	}
	panicked = false

	commitStart := time.Now()
	var insert queuedStmt
	if len(executed) > 0 {
		rs := make([]Result, len(executed))
		tooks := make([]time.Duration, len(executed))
		for j, i := range executed {
			rs[j], tooks[j] = outs[i].Result, took[i]
		}
		if insert, err = r.s.insertMany(insertManyParams{reqs: r.reqs, idx: executed, results: rs, ttl: l.ttl, resultTTL: l.resultTTL, tooks: tooks}); err != nil {
			rollback(conn)
			return EachRun{}, optimisticResult{}, &StoreError{Op: "complete", Err: err}
		}
	}
	if err = l.commit(ctx, conn, func(b *pgx.Batch) {
		if len(executed) > 0 {
			insert.queue(b)
		}
	}); err != nil {
		if isKeyConflict(err) {
			// A row written without its key's lock: the savepoint
			// path's claims answer it.
			return EachRun{}, optimisticResult{end: optimisticRetry}, nil
		}
		failed = err
		return EachRun{}, optimisticResult{}, err
	}
	// Each executed request's duration includes its share of the commit.
	if len(executed) > 0 {
		share := time.Since(commitStart) / time.Duration(len(executed))
		for _, i := range executed {
			req, ttl := r.reqs[i], l.ttl(r.reqs[i])
			outs[i].Record = &Record{
				Key: req.Key, Status: StatusDone, Fingerprint: req.Fingerprint, Source: req.Source,
				Principal: req.Principal, Attempts: 1, Result: outs[i].Result, Duration: (took[i] + share).Truncate(time.Microsecond),
				CreatedAt: now, CompletedAt: now, ExpiresAt: now.Add(ttl.Truncate(time.Microsecond)),
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
	return EachRun{Outcomes: outs}, optimisticResult{end: optimisticDone}, nil
}
