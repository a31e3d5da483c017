package failover_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// migrate creates the ledger's tables and effects, a business table with
// no unique constraint, so that a doubled effect shows as a second row
// rather than hiding behind a unique violation.
func migrate(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := migrations.New(pool, migrations.Config{}).Up(ctx)
	require.NoError(t, err)
	createEffects(t, pool)
}

// createEffects creates the business table, with no unique constraint.
func createEffects(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `CREATE TABLE effects (id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
}

// effect is the business handler: one row in effects per run, and the
// runs counted in memory (runs that rolled back count there too). A key
// held (hold) waits, after its write, until it is let go.
func (w *workload) effect(id string) inbox.TxFunc {
	return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		w.runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, id)
		w.mu.Lock()
		h := w.held[id]
		w.mu.Unlock()
		if h != nil {
			h.running <- struct{}{}
			select {
			case <-h.release:
			case <-time.After(time.Minute):
			}
		}
		return inbox.Result{Code: 200}, err
	}
}

// hold makes the next run of id's handler signal running and wait, after
// its write, until release is closed.
type hold struct {
	running chan struct{}
	release chan struct{}
}

func (w *workload) hold(id string) *hold {
	h := &hold{running: make(chan struct{}, 1), release: make(chan struct{})}
	w.mu.Lock()
	w.held[id] = h
	w.mu.Unlock()
	return h
}

// workload calls Ledger.Do from several workers, each key delivered by two
// workers at once (concurrent duplicates), as consumers do: an InFlight
// answer or a transient error is tried again until the key is answered
// Executed or Duplicate, which acknowledges it.
type workload struct {
	ledger *inbox.Ledger
	scope  string

	next                              atomic.Int64
	runs, inFlight, transient, commit atomic.Int64

	mu        sync.Mutex
	kinds     map[string]int // transient errors by SQLSTATE, or "connection"
	held      map[string]*hold
	acked     map[string]inbox.Disposition // the answer that acknowledged each key
	successes []span                       // each Do call answered Executed or Duplicate
	errs      []error
}

type span struct {
	start, end time.Time
	executed   bool
}

func newWorkload(l *inbox.Ledger, scope string) *workload {
	return &workload{ledger: l, scope: scope, acked: map[string]inbox.Disposition{}, kinds: map[string]int{}, held: map[string]*hold{}}
}

// start runs n workers until stop is called (or the test ends); stop
// waits for them (each finishes the key it holds) and returns the first
// unexpected error.
func (w *workload) start(t *testing.T, n int) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				// Two consecutive jobs are one key: two workers deliver it
				// at the same moment.
				id := fmt.Sprintf("k-%d", (w.next.Add(1)-1)/2)
				if err := w.deliver(id); err != nil {
					w.mu.Lock()
					w.errs = append(w.errs, err)
					w.mu.Unlock()
					return
				}
			}
		})
	}
	stop = sync.OnceValue(func() error {
		cancel()
		wg.Wait()
		w.mu.Lock()
		defer w.mu.Unlock()
		return errors.Join(w.errs...)
	})
	t.Cleanup(func() { _ = stop() })
	return stop
}

// deliver calls Do for id until it is acknowledged, for at most a minute.
func (w *workload) deliver(id string) error {
	req := inbox.Request{Key: inbox.Key{Scope: w.scope, ID: id}}
	end := time.Now().Add(time.Minute)
	for time.Now().Before(end) {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := w.ledger.Do(ctx, req, w.effect(id))
		cancel()
		switch {
		case err == nil && (out.Disposition == inbox.Executed || out.Disposition == inbox.Duplicate):
			w.mu.Lock()
			if _, ok := w.acked[id]; !ok {
				w.acked[id] = out.Disposition
			}
			w.successes = append(w.successes, span{start, time.Now(), out.Disposition == inbox.Executed})
			w.mu.Unlock()
			return nil
		case err == nil && out.Disposition == inbox.InFlight:
			w.inFlight.Add(1)
			time.Sleep(2 * time.Millisecond)
		case err == nil:
			return fmt.Errorf("key %s: unexpected answer %v", id, out.Disposition)
		case inbox.IsTransient(err):
			w.transient.Add(1)
			kind := "connection"
			var pgErr *pgconn.PgError
			switch {
			case errors.Is(err, inbox.ErrCommitUnknown):
				w.commit.Add(1)
				kind = "commit unknown"
			case errors.As(err, &pgErr):
				kind = pgErr.Code
			}
			w.mu.Lock()
			w.kinds[kind]++
			w.mu.Unlock()
			time.Sleep(10 * time.Millisecond)
		default:
			return fmt.Errorf("key %s: %w", id, err)
		}
	}
	return fmt.Errorf("key %s not acknowledged within a minute", id)
}

// errorKinds returns the transient errors met, by kind.
func (w *workload) errorKinds() map[string]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string]int, len(w.kinds))
	for k, v := range w.kinds {
		out[k] = v
	}
	return out
}

// done returns the number of Do calls answered Executed or Duplicate.
func (w *workload) done() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.successes)
}

// resumedAfter returns when the first Do call started at or after t0
// returned Executed: a commit (a Duplicate needs only a read).
func (w *workload) resumedAfter(t0 time.Time) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var first time.Time
	for _, s := range w.successes {
		if s.executed && !s.start.Before(t0) && (first.IsZero() || s.end.Before(first)) {
			first = s.end
		}
	}
	return first, !first.IsZero()
}

// waitResumed waits (up to within) until a Do call started after t0
// committed, and returns how long after t0 that was.
func (w *workload) waitResumed(t *testing.T, t0 time.Time, within time.Duration) time.Duration {
	t.Helper()
	end := time.Now().Add(within)
	for {
		if at, ok := w.resumedAfter(t0); ok {
			return at.Sub(t0)
		}
		if time.Now().After(end) {
			t.Fatalf("no Do call committed within %s of the fault", within)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitDone waits until n more Do calls have been acknowledged.
func (w *workload) waitDone(t *testing.T, n int, within time.Duration) {
	t.Helper()
	target := w.done() + n
	end := time.Now().Add(within)
	for w.done() < target {
		if time.Now().After(end) {
			t.Fatalf("%d Do calls acknowledged, %d expected within %s", w.done(), target, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// requireOnce checks, on the database pool now reaches: every key
// acknowledged has exactly one effect and a done ledger row (0 lost), no
// key has two effects (0 doubled), and every ledger row has its effect and
// every effect its row (the two committed together).
func (w *workload) requireOnce(t *testing.T, pool *pgxpool.Pool) (keys int) {
	t.Helper()
	ctx := context.Background()
	effects := map[string]int{}
	rows, err := pool.Query(ctx, `SELECT id, count(*) FROM effects GROUP BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		effects[id] = n
	}
	require.NoError(t, rows.Err())
	var doubled []string
	for id, n := range effects {
		if n > 1 {
			doubled = append(doubled, fmt.Sprintf("%s x%d", id, n))
		}
	}
	sort.Strings(doubled)
	require.Empty(t, doubled, "0 doubled")

	w.mu.Lock()
	acked := make(map[string]inbox.Disposition, len(w.acked))
	for k, v := range w.acked {
		acked[k] = v
	}
	w.mu.Unlock()
	var lost []string
	for id, d := range acked {
		if effects[id] != 1 {
			lost = append(lost, fmt.Sprintf("%s (answered %v)", id, d))
		}
	}
	sort.Strings(lost)
	require.Empty(t, lost, "0 lost: every acknowledged key has its effect")

	var unpaired, done int
	require.NoError(t, pool.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE p.event_id IS NULL OR e.id IS NULL), count(*) FILTER (WHERE p.status = 'done')
		FROM (SELECT event_id, status FROM processed_events WHERE scope = $1) p
		FULL JOIN (SELECT DISTINCT id FROM effects) e ON e.id = p.event_id`, w.scope).Scan(&unpaired, &done))
	require.Zero(t, unpaired, "every ledger row has its effect and every effect its ledger row")
	require.GreaterOrEqual(t, done, len(acked))
	return len(acked)
}

// lookup is Ledger.Lookup retried while it fails for the time being (a
// pooled connection to a server that died).
func lookup(t *testing.T, l *inbox.Ledger, k inbox.Key) (*inbox.Record, error) {
	t.Helper()
	end := time.Now().Add(10 * time.Second)
	for {
		rec, err := l.Lookup(context.Background(), k)
		if !inbox.IsTransient(err) || time.Now().After(end) {
			return rec, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}
