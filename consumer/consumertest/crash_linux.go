package consumertest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest/testproc"
	"github.com/justonce/justonce/inbox"
)

// envChild holds, in the child process of a Crash case, its childSpec as
// JSON.
const envChild = "JUSTONCE_CONSUMERTEST_CHILD"

// childSpec is what a Crash case's child process runs: a consumer of Group
// on Topic, in the case's schema, whose handler writes the effect and can
// be held at the case's two gates (advisory locks the parent takes).
type childSpec struct {
	Test        string // the test that called Run
	DB, Schema  string
	Topic       string
	Group       string
	Scope       string
	BatchSize   int
	Concurrency int
	Round       int
	// InTx: the handler takes this lock (shared) in its transaction, after
	// writing its effect: held there while the parent holds it.
	InTx int64
	// AfterCommit: an executed message waits for this lock (shared) after
	// its commit, before the front acknowledges it, while the parent holds
	// it; it is first recorded in crash_held.
	AfterCommit int64
}

// The child's process: the time it may run at most, so that it never
// outlives its test.
const childLimit = 3 * time.Minute

// runAsChild plays the child's part when this process is a Crash case's
// child: it runs the consumer of its childSpec until SIGTERM and ends the
// process, with status 0 when the consumer's Run returned nil. It returns
// at once in any other process.
func runAsChild(t *testing.T, h Harness) {
	v := os.Getenv(envChild)
	if v == "" {
		return
	}
	var spec childSpec
	if err := json.Unmarshal([]byte(v), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "consumertest child: %s: %v\n", envChild, err)
		os.Exit(2)
	}
	if spec.Test != t.Name() {
		t.Skipf("consumertest: a child process of %s", spec.Test)
	}
	if err := runChild(h, spec); err != nil {
		fmt.Fprintln(os.Stderr, "consumertest child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runChild(h Harness, spec childSpec) error {
	ch, ok := h.(CrashHarness)
	if !ok {
		return fmt.Errorf("the Harness is no CrashHarness")
	}
	ctx, cancel := testproc.Context(childLimit)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(spec.DB)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = spec.Schema
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ledger, err := inbox.New(pool, inbox.Config{Schema: spec.Schema, Logger: log})
	if err != nil {
		return err
	}
	// The hooks' writes are the test's record, not the consumer's: they
	// must not end with its context.
	record := func(sql string, args ...any) {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(c, sql, args...); err != nil {
			log.Error("consumertest child: "+sql, "err", err)
		}
	}
	opts := Options{
		Config: consumer.Config{Ledger: ledger, Scope: spec.Scope, Hooks: consumer.Hooks{
			OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
				switch out.Disposition {
				case inbox.Duplicate:
					record(`INSERT INTO crash_duplicates (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
				case inbox.Executed:
					var open bool
					err := pool.QueryRow(ctx, `SELECT CASE WHEN pg_try_advisory_lock_shared($1) THEN pg_advisory_unlock_shared($1) ELSE false END`,
						spec.AfterCommit).Scan(&open)
					if err != nil || open {
						return
					}
					// Committed, not acknowledged: wait here for the kill.
					record(`INSERT INTO crash_held (event_id, round) VALUES ($1, $2)`, m.ID, spec.Round)
					record(`SELECT pg_advisory_unlock_shared($1) FROM (SELECT pg_advisory_lock_shared($1)) AS held`, spec.AfterCommit)
				}
			},
		}},
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			time.Sleep(time.Millisecond) // a handler that takes a little while
			if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock_shared($1)`, spec.InTx)
			return err
		},
		BatchSize:   spec.BatchSize,
		Concurrency: spec.Concurrency,
	}
	return ch.RunChild(ctx, spec.Topic, spec.Group, opts)
}

// gates are a Crash case's two advisory locks, held by the parent on a
// connection of its own to hold the child's messages where they are.
type gates struct {
	conn              *pgx.Conn
	inTx, afterCommit int64
}

func newGates(t *testing.T, fx *fixture) *gates {
	conn, err := pgx.ConnectConfig(context.Background(), fx.pool.Config().ConnConfig.Copy())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	// Keys of this case's own.
	key := 1 + rand.Int64N(1<<31-2)
	return &gates{conn: conn, inTx: key, afterCommit: key + 1}
}

func (g *gates) close(t *testing.T, key int64) {
	_, err := g.conn.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, key)
	require.NoError(t, err)
}

func (g *gates) open(t *testing.T, key int64) {
	_, err := g.conn.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, key)
	require.NoError(t, err)
}

// waiters counts the transactions waiting for the lock key.
func waiters(t *testing.T, fx *fixture, key int64) int {
	return fx.count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
		AND classid = 0 AND objid = $1 AND objsubid = 1`, key)
}

// testCrash: a consumer process SIGKILLed mid-stream, several times over,
// and restarted: 0 lost, 0 doubled. The kills land with work in flight:
// in even rounds handlers wait inside their transactions (effects written,
// not committed: rolled back by the kill), in odd rounds executed messages
// wait between their commit and their acknowledgement (offset commit, ack),
// and must come again after the restart, to be answered from the ledger
// without running. Between two kills more events are published, some with
// IDs seen before. Each restart must consume again within
// Features.CrashRestart of its start.
func testCrash(t *testing.T, s *suite, batch int) {
	h := s.h.(CrashHarness)
	fx := newFixture(t, h)
	fx.exec(t, `CREATE TABLE crash_held (event_id text NOT NULL, round int NOT NULL)`)
	fx.exec(t, `CREATE TABLE crash_duplicates (event_id text NOT NULL, value bytea)`)
	topic := h.NewTopic(t)
	group, scope := "g-"+topic, "crash-"+topic
	const n, more, repeated, kills = 4000, 1000, 500, 4
	h.Publish(t, topic, events("k", 0, n, 40))
	g := newGates(t, fx)

	start := func(round int) *testproc.Proc {
		spec, err := json.Marshal(childSpec{
			Test: s.test, DB: fx.dsn, Schema: fx.schema, Topic: topic, Group: group, Scope: scope,
			BatchSize: batch, Concurrency: 2, Round: round, InTx: g.inTx, AfterCommit: g.afterCommit,
		})
		require.NoError(t, err)
		return testproc.Start(t, "consumer process "+strconv.Itoa(round), append(h.ChildEnv(), envChild+"="+string(spec)),
			testproc.RunOnly(s.test))
	}
	// restarted checks that the process started at started, right after a
	// kill, consumes again in time.
	var restarts []time.Duration
	restarted := func(round int, before int, started time.Time) {
		eventually(t, 90*time.Second, func() bool { return fx.effects(t) > before }, "round %d: first effect", round)
		if round == 0 {
			return
		}
		took := time.Since(started)
		restarts = append(restarts, took)
		if s.f.CrashRestart > 0 {
			require.Less(t, took, s.f.CrashRestart, "round %d: consuming again after a SIGKILL took %s", round, took)
		}
	}
	for round := range kills {
		before, started := fx.effects(t), time.Now()
		p := start(round)
		restarted(round, before, started)
		// A random point in the stream, early enough that work remains.
		target := before + 150 + rand.IntN(300)
		eventually(t, 90*time.Second, func() bool { return fx.effects(t) >= target }, "round %d: progress", round)
		if round%2 == 0 {
			g.close(t, g.inTx)
			eventually(t, 30*time.Second, func() bool { return waiters(t, fx, g.inTx) >= 1 },
				"round %d: a handler waits in its transaction", round)
			inFlight := waiters(t, fx, g.inTx)
			p.Kill(t)
			g.open(t, g.inTx)
			t.Logf("round %d: killed with %d handlers in their transactions and %d effects committed", round, inFlight, fx.effects(t))
		} else {
			g.close(t, g.afterCommit)
			eventually(t, 30*time.Second, func() bool {
				return fx.count(t, `SELECT count(*) FROM crash_held WHERE round = $1`, round) >= 1
			}, "round %d: a message waits between its commit and its acknowledgement", round)
			p.Kill(t)
			g.open(t, g.afterCommit)
			require.Zero(t, fx.count(t, `SELECT count(*) FROM crash_held h WHERE round = $1
				AND (SELECT count(*) FROM effects e WHERE e.event_id = h.event_id) <> 1`, round),
				"round %d: the messages held after their commit have their effect, once", round)
			t.Logf("round %d: killed with %d messages committed and not acknowledged, %d effects committed",
				round, fx.count(t, `SELECT count(*) FROM crash_held WHERE round = $1`, round), fx.effects(t))
		}
		if round == 1 {
			// More events while nobody consumes, and IDs seen before
			// again (their values tell the copies apart).
			h.Publish(t, topic, events("k", n, n+more, 40))
			again := events("k", 0, repeated, 40)
			for i := range again {
				again[i].Value = []byte(again[i].ID + " again")
			}
			h.Publish(t, topic, again)
		}
	}
	require.Less(t, fx.effects(t), n+more, "the kills must land mid-stream")

	// The last process runs to the end and stops gracefully.
	before, started := fx.effects(t), time.Now()
	p := start(kills)
	restarted(kills, before, started)
	distinct := func() int { return fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`) }
	eventually(t, 120*time.Second, func() bool { return distinct() >= n+more },
		"everything processed after the kills: %d of %d events have their effect", distinct(), n+more)
	waitAcked(t, h, topic, group)
	require.NoError(t, p.Stop(time.Minute), "graceful exit")

	fx.assertExactlyOnce(t, n+more)
	require.Zero(t, fx.count(t, `SELECT count(*) FROM crash_held h WHERE NOT EXISTS (SELECT 1 FROM crash_duplicates d
		WHERE d.event_id = h.event_id AND d.value = convert_to(h.event_id, 'UTF8'))`),
		"every message held between its commit and its acknowledgement came again and was answered from the ledger")
	t.Logf("restart after SIGKILL to first effect: %v", restarts)
}
