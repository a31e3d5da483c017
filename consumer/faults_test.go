package consumer_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Hostile handlers, each a failure of the handler that must be counted,
// retried with backoff, and dead-lettered and recorded failed after
// MaxAttempts: never acked without its effect, never retried forever.
var hostile = []struct {
	name  string
	check func(t *testing.T, err error)
	run   func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error
}{
	{
		name:  "swallowed unique violation",
		check: func(t *testing.T, err error) { require.ErrorIs(t, err, inbox.ErrRolledBack) },
		run: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, _ = tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
			_, _ = tx.Exec(ctx, `INSERT INTO uniq VALUES (1)`) // exists: 23505, ignored
			return nil
		},
	},
	{
		name:  "deferred constraint failing at COMMIT",
		check: func(t *testing.T, err error) { requireCode(t, err, "23503") },
		run: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO child VALUES ('no such parent')`)
			return err
		},
	},
	{
		name:  "data error returned (22012)",
		check: func(t *testing.T, err error) { requireCode(t, err, "22012") },
		run: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `SELECT 1/0`)
			return err
		},
	},
	{
		name:  "aborted transaction error returned (25P02)",
		check: func(t *testing.T, err error) { requireCode(t, err, "25P02") },
		run: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, _ = tx.Exec(ctx, `INSERT INTO uniq VALUES (1)`)
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
			return err
		},
	},
}

func requireCode(t *testing.T, err error, code string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, code, pgErr.Code)
}

func setupHostile(t *testing.T) *fx {
	f := setup(t)
	f.pg.Exec(t, `CREATE TABLE uniq (n int PRIMARY KEY)`)
	f.pg.Exec(t, `INSERT INTO uniq VALUES (1)`)
	f.pg.Exec(t, `CREATE TABLE parent (id text PRIMARY KEY)`)
	f.pg.Exec(t, `CREATE TABLE child (parent text REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)`)
	return f
}

func TestHandlerFailuresAreCountedAndDeadLettered(t *testing.T) {
	t.Parallel()
	for _, h := range hostile {
		t.Run(h.name, func(t *testing.T) {
			t.Parallel()
			f := setupHostile(t)
			var calls atomic.Int64
			p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				calls.Add(1)
				return h.run(ctx, tx, m)
			})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			// One attempt: a counted retry, with the handler's cause.
			m := msg("h1")
			d := p.Process(ctx, m)
			require.Equal(t, consumer.Retry, d.Action)
			require.True(t, d.Counted, "a handler failure counts")
			require.True(t, d.HandlerRan)
			require.False(t, inbox.IsTransient(d.Err))
			h.check(t, d.Err)

			// To the end: dead-lettered after MaxAttempts and recorded failed.
			m = msg("h2")
			d = p.ProcessWithRetry(ctx, m, nil)
			require.Equal(t, consumer.Ack, d.Action, "ended, not stopped by the test's deadline: %v", d.Err)
			require.True(t, d.DeadLettered)
			h.check(t, d.Err)
			require.Equal(t, 3, m.Attempt)
			require.Equal(t, 0, m.Uncounted)
			require.EqualValues(t, 1+3, calls.Load())
			require.Len(t, f.dead, 1)
			require.Equal(t, 0, f.pg.Count(t, `SELECT count(*) FROM effects`), "no effect was committed")
			rec, err := f.ledger.Lookup(ctx, inbox.Key{Scope: "test", ID: "h2"})
			require.NoError(t, err)
			require.Equal(t, inbox.StatusFailed, rec.Status)
			require.Equal(t, 3, rec.Attempts)
		})
	}
}

// A handler whose attempts always fail transiently (here it loses a
// serialization race every time, or kills its own connection) must not be
// retried forever: past MaxUncounted such retries each one counts.
func TestTransientAfterHandlerIsBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		stmt string
		code string
	}{
		{"serialization failure", `DO $$ BEGIN RAISE EXCEPTION 'lost' USING ERRCODE = '40001'; END $$`, "40001"},
		{"connection killed mid-handler", `SELECT pg_terminate_backend(pg_backend_pid())`, "57P01"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := setup(t)
			cfg := f.cfg()
			cfg.MaxAttempts = 2
			cfg.MaxUncounted = 3
			cfg.StoreBackoff = backoff.Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond}
			var calls atomic.Int64
			var first consumer.Decision
			p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				calls.Add(1)
				_, err := tx.Exec(ctx, tc.stmt)
				return err
			})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			first = p.Process(ctx, msg("t0"))
			require.Equal(t, consumer.Retry, first.Action)
			require.False(t, first.Counted, "a transient failure does not count at first")
			require.True(t, first.HandlerRan)
			require.True(t, inbox.IsTransient(first.Err))
			requireCode(t, first.Err, tc.code)

			m := msg("t1")
			d := p.ProcessWithRetry(ctx, m, nil)
			require.Equal(t, consumer.Ack, d.Action, "ended, not stopped by the test's deadline: %v", d.Err)
			require.True(t, d.DeadLettered)
			requireCode(t, d.Err, tc.code)
			// 3 uncounted retries, then 2 counted attempts.
			require.EqualValues(t, 1+3+2, calls.Load())
			require.Equal(t, 2, m.Attempt)
			require.Equal(t, 5, m.Uncounted)
			rec, err := f.ledger.Lookup(ctx, inbox.Key{Scope: "test", ID: "t1"})
			require.NoError(t, err)
			require.Equal(t, inbox.StatusFailed, rec.Status)
		})
	}
}

// flakyProxy is a loopback TCP proxy to Postgres that can refuse service:
// down closes every connection and answers new ones with an immediate
// close, as a database that went away looks to the client.
type flakyProxy struct {
	ln       net.Listener
	upstream string
	mu       sync.Mutex
	down     bool
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

func newFlakyProxy(t *testing.T, upstream string) *flakyProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &flakyProxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.serve)
	t.Cleanup(func() {
		_ = ln.Close()
		p.setDown(true)
		p.wg.Wait()
	})
	return p
}

func (p *flakyProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.down {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.upstream)
		if err != nil {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
		}
		p.wg.Go(func() { pipe(up, c) })
		p.wg.Go(func() { pipe(c, up) })
	}
}

func (p *flakyProxy) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		for c := range p.conns {
			_ = c.Close()
		}
		clear(p.conns)
	}
}

// recorder is a slog handler that keeps every record.
type recorder struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec.Clone())
	return nil
}
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recorder) WithGroup(string) slog.Handler      { return r }

func (r *recorder) at(level slog.Level) []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []slog.Record
	for _, rec := range r.recs {
		if rec.Level == level {
			out = append(out, rec)
		}
	}
	return out
}

func attr(rec slog.Record, key string) slog.Value {
	var v slog.Value
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value
			return false
		}
		return true
	})
	return v
}

// While the database is unreachable, retries back off more and more (up
// to StoreBackoff.Max) and the outage is logged once when it starts and
// once when it ends, not once per retry. Nothing counts as an attempt.
func TestOutageBacksOffAndLogsOncePerEpisode(t *testing.T) {
	t.Parallel()
	f := setup(t)
	u, err := url.Parse(f.pg.URL)
	require.NoError(t, err)
	proxy := newFlakyProxy(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	pcfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	pcfg.MaxConns = 2
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	logs := &recorder{}
	l, err := inbox.New(pool, inbox.Config{Logger: slog.New(logs)})
	require.NoError(t, err)

	cfg := f.cfg()
	cfg.Ledger = l
	sb := backoff.Backoff{Initial: 10 * time.Millisecond, Max: 80 * time.Millisecond, Multiplier: 2}
	cfg.StoreBackoff = sb
	var calls atomic.Int64
	p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.Equal(t, consumer.Ack, p.Process(ctx, msg("before")).Action)

	for episode := 1; episode <= 2; episode++ {
		proxy.setDown(true)
		const n = 8
		// Messages from several partitions fail together: the delay grows
		// with the outage, not with any one message's attempts.
		var ms []*consumer.Message
		for i := 0; i < n; i++ {
			m := msg(fmt.Sprintf("e%d-%d", episode, i%3))
			ms = append(ms, m)
			d := p.Process(ctx, m)
			require.Equal(t, consumer.Retry, d.Action, "retry %d", i+1)
			require.False(t, d.Counted)
			require.False(t, d.HandlerRan)
			require.True(t, inbox.IsTransient(d.Err), "%v", d.Err)
			require.ErrorIs(t, d.Err, inbox.ErrStore)
			ceil := min(sb.Initial<<i, sb.Max)
			require.GreaterOrEqual(t, d.Delay, ceil/2, "retry %d", i+1)
			require.LessOrEqual(t, d.Delay, ceil, "retry %d", i+1)
		}
		require.GreaterOrEqual(t, min(sb.Initial<<(n-1), sb.Max), sb.Max, "the test reaches StoreBackoff.Max")
		for _, m := range ms {
			require.Equal(t, 1, m.Attempt)
			require.Equal(t, 0, m.Uncounted)
		}
		require.Len(t, logs.at(slog.LevelWarn), episode, "one warning per outage")
		require.Len(t, logs.at(slog.LevelInfo), episode-1)

		proxy.setDown(false)
		d := p.Process(ctx, msg(fmt.Sprintf("e%d-0", episode)))
		require.Equal(t, consumer.Ack, d.Action, "%v", d.Err)
		infos := logs.at(slog.LevelInfo)
		require.Len(t, infos, episode, "one info line when the outage ends")
		require.EqualValues(t, n, attr(infos[episode-1], "failed_attempts").Int64())
		require.Positive(t, attr(infos[episode-1], "down_for").Duration())
		// Back to normal: the next outage starts from StoreBackoff.Initial.
	}
	require.Len(t, logs.at(slog.LevelWarn), 2)
	require.EqualValues(t, 3, calls.Load(), "the handler ran only while the database answered")
}

// ctxCanceller is a pgx tracer that cancels the query's context (a
// context.CancelFunc under cancelAfterKey) after the given number of
// batches on it: the caller's context ends while the ledger is working.
type ctxCanceller struct{}

type cancelAfterKey struct{}

type cancelAfter struct {
	n      atomic.Int64
	after  int64
	cancel context.CancelFunc
}

func (ctxCanceller) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (ctxCanceller) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (ctxCanceller) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (ctxCanceller) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (ctxCanceller) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if c, ok := ctx.Value(cancelAfterKey{}).(*cancelAfter); ok && c.n.Add(1) == c.after {
		c.cancel()
	}
}

// A cancelled context is a Stop carrying the context's error: never a
// retry of an event "in flight", never a counted failure.
func TestCancelledContextStops(t *testing.T) {
	t.Parallel()
	f := setup(t)
	pcfg, err := pgxpool.ParseConfig(f.pg.URL)
	require.NoError(t, err)
	pcfg.MaxConns = 4
	pcfg.ConnConfig.Tracer = ctxCanceller{}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	cfg := f.cfg()
	cfg.Ledger = l

	holding := make(chan struct{})
	release := make(chan struct{})
	var calls atomic.Int64
	p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		if m.ID == "held" {
			close(holding)
			<-release
		}
		if m.ID == "self-cancel" {
			ctx.Value(cancelAfterKey{}).(*cancelAfter).cancel()
			return ctx.Err()
		}
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	bg := context.Background()

	// Already cancelled: nothing runs.
	cctx, cancel := context.WithCancel(bg)
	cancel()
	d := p.Process(cctx, msg("a"))
	require.Equal(t, consumer.Stop, d.Action)
	require.ErrorIs(t, d.Err, context.Canceled)
	require.Zero(t, calls.Load())
	for _, d := range p.ProcessBatch(cctx, []*consumer.Message{msg("a"), msg("b")}) {
		require.Equal(t, consumer.Stop, d.Action)
		require.ErrorIs(t, d.Err, context.Canceled)
	}
	require.Zero(t, calls.Load())

	// Cancelled while the key is in flight elsewhere: the ledger answers
	// InFlight (claim, then lookup), and the context ends right after.
	var wg sync.WaitGroup
	wg.Go(func() {
		if d := p.Process(bg, msg("held")); d.Action != consumer.Ack {
			t.Errorf("holder: %v %v", d.Action, d.Err)
		}
	})
	<-holding
	cctx, cancel = context.WithCancel(bg)
	defer cancel()
	cctx = context.WithValue(cctx, cancelAfterKey{}, &cancelAfter{after: 2, cancel: cancel})
	d = p.Process(cctx, msg("held"))
	close(release)
	wg.Wait()
	require.Equal(t, consumer.Stop, d.Action, "not a retry of an event in flight")
	require.ErrorIs(t, d.Err, context.Canceled)
	require.EqualValues(t, 1, calls.Load(), "the holder ran; the cancelled caller did not")

	// The handler's context ends while it runs: Stop, not a counted failure.
	cctx, cancel = context.WithCancel(bg)
	defer cancel()
	cctx = context.WithValue(cctx, cancelAfterKey{}, &cancelAfter{after: -1, cancel: cancel})
	m := msg("self-cancel")
	d = p.Process(cctx, m)
	require.Equal(t, consumer.Stop, d.Action)
	require.ErrorIs(t, d.Err, context.Canceled)
	require.False(t, d.Counted)
	require.True(t, d.HandlerRan)
	require.Equal(t, 1, m.Attempt)
}

// Hostile handlers mixed into a busy batch: a handler that fails (an
// error, a panic, nil returned on an aborted transaction) is rolled back
// alone: the batch's optimistic transaction goes with it, the messages
// before it run again, each in its own savepoint of one shared transaction,
// and commit, and the hostile handler is not run again for the failure
// reported. A deferred constraint failing at COMMIT cannot be pinned on
// one message, so that batch is split and each message runs alone. Only
// the hostile message is retried, counted.
func TestBatchIsolatesHostileHandlers(t *testing.T) {
	t.Parallel()
	cases := append([]struct {
		name  string
		check func(t *testing.T, err error)
		run   func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error
	}{}, hostile...)
	cases = append(cases, struct {
		name  string
		check func(t *testing.T, err error)
		run   func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error
	}{
		name:  "panic after a write",
		check: func(t *testing.T, err error) { require.ErrorAs(t, err, new(*consumer.PanicError)) },
		run: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID); err != nil {
				return err
			}
			panic("handler bug")
		},
	})
	for _, h := range cases {
		t.Run(h.name, func(t *testing.T) {
			t.Parallel()
			f := setupHostile(t)
			var calls atomic.Int64
			var mu sync.Mutex
			txOf := map[string][]int64{} // message -> the transactions it ran in
			p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				calls.Add(1)
				var xid int64
				if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
					return err
				}
				mu.Lock()
				txOf[m.ID] = append(txOf[m.ID], xid)
				mu.Unlock()
				if m.ID == "bad" {
					return h.run(ctx, tx, m)
				}
				return f.insert(ctx, tx, m)
			})
			require.NoError(t, err)
			var msgs []*consumer.Message
			for i := 0; i < 5; i++ {
				msgs = append(msgs, msg(fmt.Sprintf("ok%d", i)))
			}
			msgs = append(msgs, msg("bad"))
			for i := 5; i < 10; i++ {
				msgs = append(msgs, msg(fmt.Sprintf("ok%d", i)))
			}
			ds := p.ProcessBatch(context.Background(), msgs)
			atCommit := strings.Contains(h.name, "COMMIT")
			if atCommit {
				// The first transaction ran all eleven and failed at
				// COMMIT; then each ran alone up to the hostile one, and
				// the rest in a new shared transaction.
				require.EqualValues(t, 11+6+5, calls.Load())
			} else {
				// The five before the hostile one ran twice: in the
				// optimistic transaction, rolled back with the failure,
				// then on savepoints; every other handler ran once.
				require.EqualValues(t, 11+5, calls.Load())
			}
			for i, d := range ds {
				if msgs[i].ID == "bad" {
					require.Equal(t, consumer.Retry, d.Action)
					require.True(t, d.Counted)
					require.True(t, d.HandlerRan)
					h.check(t, d.Err)
					continue
				}
				require.Equal(t, consumer.Ack, d.Action, i)
				require.Equal(t, inbox.Executed, d.Outcome.Disposition, i)
				require.False(t, d.Counted)
			}
			require.Equal(t, 10, f.pg.Count(t, `SELECT count(*) FROM effects`))
			require.Equal(t, 0, f.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'bad'`))
			require.Equal(t, 10, f.pg.Count(t, `SELECT count(*) FROM processed_events`), "the hostile message's claim rolled back with it")
			for _, m := range msgs {
				require.Equal(t, 1, m.Attempt, "the batch's failure counted against nobody")
			}
			// The batch was real: the messages before the hostile one ran in
			// its transaction; the run ended there (the messages behind a
			// failed one wait for its retry), and the ones after it shared
			// a second transaction.
			mu.Lock()
			defer mu.Unlock()
			shared := txOf["bad"][0]
			for i := 0; i < 5; i++ {
				require.Equal(t, shared, txOf[fmt.Sprintf("ok%d", i)][0], "ok%d ran in the batch's transaction", i)
			}
			if !atCommit {
				require.Len(t, txOf["bad"], 1, "one failure, one run of the hostile handler")
				again := txOf["ok0"][1]
				require.NotEqual(t, shared, again)
				for i := 0; i < 5; i++ {
					ids := txOf[fmt.Sprintf("ok%d", i)]
					require.Equal(t, []int64{shared, again}, ids, "ok%d ran again, in the savepoints' shared transaction", i)
				}
			}
			second := txOf["ok5"][len(txOf["ok5"])-1]
			require.NotEqual(t, shared, second)
			for i := 6; i < 10; i++ {
				ids := txOf[fmt.Sprintf("ok%d", i)]
				require.Equal(t, second, ids[len(ids)-1], "ok%d ran in the second shared transaction", i)
			}
		})
	}
}
