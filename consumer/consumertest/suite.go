package consumertest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/justoncetest"
)

// Msg is a message to publish. An empty ID publishes it without an ID.
type Msg struct {
	ID    string
	Key   string
	Value []byte
}

// DeadLetter is a message found at a dead-letter destination.
type DeadLetter struct {
	ID      string
	Value   []byte
	Headers map[string]string
}

// Options start a consumer.
type Options struct {
	// Config for the processor: the suite sets Ledger, Scope, MaxAttempts,
	// Backoff and Hooks; the adapter adds its transport's defaults (ID,
	// Source, DeadLetter).
	Config consumer.Config
	// Handler to run.
	Handler consumer.Handler
	// BatchSize > 0 runs batch mode with up to this many messages a batch
	// (the front's Scheduling.BatchSize). 0: as the Harness runs the front
	// by default (one message a transaction, or the front's own batches).
	BatchSize int
	// Concurrency > 0 sets the front's Scheduling.Concurrency; 0: its
	// default.
	Concurrency int
}

// Harness adapts one transport to the suite.
type Harness interface {
	// NewTopic returns a fresh topic (Kafka) or subject with its stream
	// (NATS), with a dead-letter destination, ready to publish to. With
	// Features.Stall it has at least two lanes (Kafka partitions).
	NewTopic(t *testing.T) string
	// Publish sends msgs to topic in order, the ID in the transport's
	// default ID header.
	Publish(t *testing.T, topic string, msgs []Msg)
	// Start runs a consumer of group on topic until stop is called; stop
	// shuts it down gracefully (stop fetching, finish in-flight work,
	// commit or ack, close) and returns when it is down.
	Start(t *testing.T, topic, group string, opts Options) (stop func())
	// DeadLetters returns what reached topic's dead-letter destination.
	DeadLetters(t *testing.T, topic string) []DeadLetter
	// Pending returns how many messages of topic group has not
	// acknowledged: Kafka, the end offsets less the group's committed
	// offsets; JetStream, the durable's pending and unacknowledged
	// messages.
	Pending(t *testing.T, topic, group string) int
	// PostgresURL returns the connection string (a URL or keyword/value)
	// of a Postgres on which the suite may create schemas: each case makes
	// one of its own, migrated, and drops it at its end.
	PostgresURL(t *testing.T) string
}

// CrashHarness is a Harness whose consumer can run in a child process:
// Features.Crash needs one. The suite runs the test that called Run again
// in a child process, where Run plays the child's part: the test builds
// its Harness there as it does in the parent, with ChildEnv's environment.
type CrashHarness interface {
	Harness
	// ChildEnv returns what the child process needs in its environment,
	// beyond the parent's, to build the same Harness on the same broker
	// (such as the broker's address, when the test found it other than in
	// the environment), as "NAME=value" entries.
	ChildEnv() []string
	// RunChild runs, in the child process, a consumer of group on topic
	// with opts, configured as a program would run it (no test tuning
	// that would hide what a restart costs, such as shorter group
	// timeouts), until ctx ends, and returns its Run's error.
	RunChild(ctx context.Context, topic, group string, opts Options) error
}

// StallHarness is a Harness that publishes to one lane of a topic:
// Features.Stall needs one.
type StallHarness interface {
	Harness
	// PublishLane sends msgs in order to lane 0 or 1 of topic: messages
	// of one lane run one after the other, apart from the other lane's
	// (Kafka: a partition).
	PublishLane(t *testing.T, topic string, lane int, msgs []Msg)
}

// ReplayHarness is a Harness whose front replays a topic: Features.Replay
// needs one.
type ReplayHarness interface {
	Harness
	// Replay runs the Replay method of a consumer of group on topic made
	// from opts (its handler, scope and ID extractor), with ro, from the
	// first message stored at or after since (zero: from the start of the
	// topic), and returns its report.
	Replay(t *testing.T, topic, group string, opts Options, since time.Time, ro consumer.ReplayOptions) (consumer.ReplayReport, error)
}

// Features says what an adapter supports.
type Features struct {
	// Batch: batch mode.
	Batch bool
	// SharedGroup: two consumers may share one group (Kafka consumer
	// group, JetStream durable).
	SharedGroup bool
	// Crash: the Crash cases, on Linux: a consumer in a child process
	// SIGKILLed mid-stream and restarted. The Harness must be a
	// CrashHarness.
	Crash bool
	// CrashRestart, with Crash, bounds how soon a consumer started right
	// after another was SIGKILLed has its first effect (Kafka: the group
	// moves a dead member's partitions when its session times out). 0: no
	// bound but the case's deadlines.
	CrashRestart time.Duration
	// Stall: the Stall case, a retrying message that must hold up only its
	// lane. The Harness must be a StallHarness.
	Stall bool
	// Replay: the Replay case. The Harness must be a ReplayHarness.
	Replay bool
}

// Start runs c, a front's Consumer, until the returned stop is called or
// the test ends. stop cancels Run's context and checks the shutdown
// contract every front keeps: Run returns nil, within a minute. exited is
// closed when Run returns, also before stop (a Run that could not start).
func Start(t testing.TB, c interface{ Run(context.Context) error }) (stop func(), exited <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var err error
	go func() {
		defer close(done)
		err = c.Run(ctx)
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(time.Minute):
				t.Errorf("Run did not return within a minute of its context ending")
			}
		})
	}
	t.Cleanup(stop)
	return stop, done
}

// Run runs the suite: the cases Features switches on, each as a subtest.
// In the child process of a Crash case it plays the child's part instead
// and ends the process.
func Run(t *testing.T, h Harness, f Features) {
	runAsChild(t, h)
	s := &suite{h: h, f: f, test: t.Name()}
	needs := func(on, ok bool, feature, iface string) {
		if on && !ok {
			t.Fatalf("consumertest: Features.%s needs a Harness that implements %s", feature, iface)
		}
	}
	_, crash := h.(CrashHarness)
	_, stall := h.(StallHarness)
	_, replay := h.(ReplayHarness)
	needs(f.Crash, crash, "Crash", "CrashHarness")
	needs(f.Stall, stall, "Stall", "StallHarness")
	needs(f.Replay, replay, "Replay", "ReplayHarness")

	t.Run("DuplicatesRunOnce", func(t *testing.T) { testDuplicates(t, h, 0) })
	t.Run("PoisonDeadLettered", func(t *testing.T) { testPoison(t, h, 0) })
	t.Run("NoIDDeadLettered", func(t *testing.T) { testNoID(t, h) })
	t.Run("RestartLosesNothing", func(t *testing.T) { testRestart(t, h) })
	t.Run("SwallowedSQLError", func(t *testing.T) { testSwallowed(t, h, 0) })
	t.Run("DeferredConstraintAtCommit", func(t *testing.T) { testDeferred(t, h, 0) })
	t.Run("StepsResumeCompensateReplay", func(t *testing.T) { testSteps(t, h, 0) })
	if f.Batch {
		t.Run("BatchDuplicatesRunOnce", func(t *testing.T) { testDuplicates(t, h, 50) })
		t.Run("BatchPoisonDeadLettered", func(t *testing.T) { testPoison(t, h, 20) })
		t.Run("BatchSwallowedSQLError", func(t *testing.T) { testSwallowed(t, h, 20) })
		t.Run("BatchDeferredConstraintAtCommit", func(t *testing.T) { testDeferred(t, h, 20) })
		t.Run("BatchStepsResumeCompensateReplay", func(t *testing.T) { testSteps(t, h, 20) })
	}
	if f.SharedGroup {
		t.Run("SharedGroupRunsOnce", func(t *testing.T) { testSharedGroup(t, h) })
	}
	// The long cases run side by side, after the others.
	if f.Crash {
		t.Run("Crash", func(t *testing.T) {
			t.Parallel()
			testCrash(t, s, 0)
		})
		if f.Batch {
			t.Run("BatchCrash", func(t *testing.T) {
				t.Parallel()
				testCrash(t, s, 20)
			})
		}
	}
	if f.Stall {
		t.Run("RetryingMessageHoldsOnlyItsLane", func(t *testing.T) {
			t.Parallel()
			testStall(t, s)
		})
	}
	if f.Replay {
		t.Run("ReplayRunsOnlyTheMissing", func(t *testing.T) {
			t.Parallel()
			testReplay(t, s)
		})
	}
}

// suite is one Run's harness, features and test name (the child process
// of a Crash case runs that test again).
type suite struct {
	h    Harness
	f    Features
	test string
}

// fixture is one case's database, ledger and effect counter.
type fixture struct {
	pool   *pgxpool.Pool // search_path: schema
	ledger *inbox.Ledger
	dsn    string       // the Harness's Postgres
	schema string       // the case's own
	runs   atomic.Int64 // handler calls that committed or not
	seen   atomic.Int64 // ledger outcomes Executed or Duplicate
}

func newFixture(t *testing.T, h Harness) *fixture {
	t.Helper()
	dsn := h.PostgresURL(t)
	l := justoncetest.Ledger(t, justoncetest.WithDatabase(dsn), justoncetest.WithMaxConns(10))
	fx := &fixture{pool: l.Pool(), ledger: l, dsn: dsn, schema: l.Pool().Config().ConnConfig.RuntimeParams["search_path"]}
	// No unique constraint: a doubled effect shows as a second row.
	fx.exec(t, `CREATE TABLE effects (event_id text NOT NULL, value bytea, n bigserial)`)
	return fx
}

// exec runs sql in the case's schema.
func (fx *fixture) exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	_, err := fx.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

// count returns the result of a count query.
func (fx *fixture) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, fx.pool.QueryRow(context.Background(), sql, args...).Scan(&n), sql)
	return n
}

// effects counts the effect rows.
func (fx *fixture) effects(t testing.TB) int { return fx.count(t, `SELECT count(*) FROM effects`) }

// eventually waits until cond holds, checking every 10 ms, and fails the
// test with msg when deadline passes first.
func eventually(t testing.TB, deadline time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	end := time.Now().Add(deadline)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("consumertest: not within %s: %s", deadline, fmt.Sprintf(msg, args...))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitAcked waits until group has acknowledged every message of topic.
func waitAcked(t *testing.T, h Harness, topic, group string) {
	t.Helper()
	eventually(t, 60*time.Second, func() bool { return h.Pending(t, topic, group) == 0 },
		"group %s acknowledged everything of %s (%d pending)", group, topic, h.Pending(t, topic, group))
}

func (fx *fixture) options(scope string, h consumer.Handler) Options {
	return Options{
		Config: consumer.Config{
			Ledger:      fx.ledger,
			Scope:       scope,
			MaxAttempts: 3,
			Backoff:     backoff.Backoff{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond},
			Hooks: consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
				if out.Disposition == inbox.Executed || out.Disposition == inbox.Duplicate {
					fx.seen.Add(1)
				}
			}},
		},
		Handler: h,
	}
}

// insert is the business handler: one effect row per run.
func (fx *fixture) insert(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	fx.runs.Add(1)
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
	return err
}

// assertExactlyOnce checks effects == unique IDs, each once.
func (fx *fixture) assertExactlyOnce(t *testing.T, unique int) {
	t.Helper()
	require.Equal(t, unique, fx.count(t, `SELECT count(*) FROM effects`), "effects (doubled if more, lost if fewer)")
	require.Equal(t, unique, fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`), "distinct effects")
	require.Equal(t, unique, fx.count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`), "ledger rows")
}

// ids returns messages with IDs prefix-from .. prefix-(to-1) over 7 keys.
func ids(prefix string, from, to int) []Msg { return events(prefix, from, to, 7) }

// events returns messages with IDs prefix-from .. prefix-(to-1), each ID
// also its value, spread over keys keys.
func events(prefix string, from, to, keys int) []Msg {
	out := make([]Msg, 0, to-from)
	for i := from; i < to; i++ {
		id := prefix + "-" + strconv.Itoa(i)
		out = append(out, Msg{ID: id, Key: strconv.Itoa(i % keys), Value: []byte(id)})
	}
	return out
}

func testDuplicates(t *testing.T, h Harness, batch int) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	const unique, dups = 500, 100
	msgs := ids("evt", 0, unique)
	// 20 % produced again with the same ID at later offsets.
	again := make([]Msg, 0, dups)
	for i := 0; i < dups; i++ {
		again = append(again, msgs[(i*5)%unique])
	}
	h.Publish(t, topic, msgs)
	h.Publish(t, topic, again)

	opts := fx.options("dups-"+topic, fx.insert)
	opts.BatchSize = batch
	stop := h.Start(t, topic, "g-"+topic, opts)
	eventually(t, 60*time.Second, func() bool { return fx.seen.Load() >= unique+dups },
		"all %d deliveries answered (got %d)", unique+dups, fx.seen.Load())
	stop()
	fx.assertExactlyOnce(t, unique)
	require.EqualValues(t, unique, fx.runs.Load(), "handler runs: duplicates must not run it")
}

func testPoison(t *testing.T, h Harness, batch int) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	msgs := ids("ok", 0, 40)
	poisonID := "poison-1"
	// The poison sits in the middle; in Kafka, with one key, on one
	// partition ahead of others.
	all := append(append(append([]Msg{}, msgs[:20]...), Msg{ID: poisonID, Key: "0", Value: []byte("bad")}), msgs[20:]...)
	h.Publish(t, topic, all)

	var poisonRuns atomic.Int64
	opts := fx.options("poison-"+topic, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == poisonID {
			poisonRuns.Add(1)
			return errors.New("cannot parse payload")
		}
		return fx.insert(ctx, tx, m)
	})
	opts.BatchSize = batch
	stop := h.Start(t, topic, "g-"+topic, opts)
	eventually(t, 60*time.Second, func() bool {
		return fx.count(t, `SELECT count(*) FROM effects`) >= len(msgs) && len(h.DeadLetters(t, topic)) >= 1
	}, "good messages run and the poison is dead-lettered")
	stop()
	fx.assertExactlyOnce(t, len(msgs))

	dl := h.DeadLetters(t, topic)
	require.Len(t, dl, 1)
	require.Equal(t, poisonID, dl[0].ID)
	require.Equal(t, "bad", string(dl[0].Value))
	require.Contains(t, dl[0].Headers[consumer.HeaderDLError], "cannot parse payload")
	require.Equal(t, "3", dl[0].Headers[consumer.HeaderDLAttempts])
	require.NotEmpty(t, dl[0].Headers[consumer.HeaderDLOrigin])
	require.GreaterOrEqual(t, poisonRuns.Load(), int64(3))
	require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed' AND event_id = $1`, poisonID))
}

func testNoID(t *testing.T, h Harness) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	h.Publish(t, topic, []Msg{{ID: "a", Value: []byte("a")}, {ID: "", Value: []byte("anonymous")}, {ID: "b", Value: []byte("b")}})
	stop := h.Start(t, topic, "g-"+topic, fx.options("noid-"+topic, fx.insert))
	eventually(t, 60*time.Second, func() bool {
		return fx.count(t, `SELECT count(*) FROM effects`) >= 2 && len(h.DeadLetters(t, topic)) >= 1
	}, "messages with IDs run, the one without is dead-lettered")
	stop()
	fx.assertExactlyOnce(t, 2)
	dl := h.DeadLetters(t, topic)
	require.Len(t, dl, 1)
	require.Equal(t, "anonymous", string(dl[0].Value))
	require.Contains(t, dl[0].Headers[consumer.HeaderDLError], "no event ID")
}

func testRestart(t *testing.T, h Harness) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	const n = 300
	h.Publish(t, topic, ids("r", 0, n))
	group := "g-" + topic
	scope := "restart-" + topic
	// Stop the consumer mid-stream, several times over: once the handler
	// has been called target times, every later call waits at a barrier,
	// so that when stop is called some but not all messages are done and
	// at least one handler is running. The barrier opens right after stop
	// is called; a graceful stop finishes the handlers it was waiting for.
	// A call is held only once some outcome of the round was recorded:
	// with batches and several partitions at once, holding every call past
	// the target could hold a message in every open transaction, and none
	// would commit before the stop.
	var calls atomic.Int64
	for round := 0; round < 3; round++ {
		target := int64((round + 1) * n / 4)
		release := make(chan struct{})
		var releaseOnce sync.Once
		open := func() { releaseOnce.Do(func() { close(release) }) }
		t.Cleanup(open) // a failed assertion must not leave handlers parked
		seenAtStart := fx.seen.Load()
		var heldMu sync.Mutex
		var held []string
		opts := fx.options(scope, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if calls.Add(1) > target && fx.seen.Load() > seenAtStart {
				heldMu.Lock()
				held = append(held, m.ID)
				heldMu.Unlock()
				<-release
			}
			return fx.insert(ctx, tx, m)
		})
		stop := h.Start(t, topic, group, opts)
		heldNow := func() []string {
			heldMu.Lock()
			defer heldMu.Unlock()
			return append([]string(nil), held...)
		}
		eventually(t, 60*time.Second, func() bool { return len(heldNow()) > 0 },
			"round %d: a handler waits at the barrier after %d calls", round, target)
		done := fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`)
		require.Positive(t, done, "round %d: some messages were done before the stop", round)
		require.Less(t, done, n, "round %d: not all messages were done before the stop", round)
		running := heldNow()

		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			stop()
		}()
		open()
		select {
		case <-stopped:
		case <-time.After(60 * time.Second):
			t.Fatalf("round %d: stop did not return within 60s", round)
		}
		for _, id := range running {
			require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, id),
				"round %d: the handler of %s, running at the stop, was finished and committed", round, id)
		}
	}
	// Produce more while nobody consumes, including redelivered IDs.
	h.Publish(t, topic, ids("r", n-50, n+100))
	stop := h.Start(t, topic, group, fx.options(scope, fx.insert))
	eventually(t, 60*time.Second, func() bool {
		return fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n+100
	}, "everything processed after restarts")
	stop()
	fx.assertExactlyOnce(t, n+100)
}

// hostileFixture is a fixture with the tables hostile handlers break:
// uniq, whose one row a handler inserts again; child, whose deferred
// foreign key fails at COMMIT.
func hostileFixture(t *testing.T, h Harness) *fixture {
	fx := newFixture(t, h)
	fx.exec(t, `CREATE TABLE uniq (n int PRIMARY KEY)`)
	fx.exec(t, `INSERT INTO uniq VALUES (1)`)
	fx.exec(t, `CREATE TABLE parent (id text PRIMARY KEY)`)
	fx.exec(t, `CREATE TABLE child (parent text REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)`)
	return fx
}

// requireFailed checks that id was dead-lettered once after 3 attempts
// with a cause containing one of causes, recorded failed, and has no
// effect.
func (fx *fixture) requireFailed(t *testing.T, h Harness, topic, id string, causes ...string) {
	t.Helper()
	var dls []DeadLetter
	for _, dl := range h.DeadLetters(t, topic) {
		if dl.ID == id {
			dls = append(dls, dl)
		}
	}
	require.Len(t, dls, 1, "%s dead-lettered once", id)
	require.Equal(t, "3", dls[0].Headers[consumer.HeaderDLAttempts], "%s dead-lettered after MaxAttempts", id)
	cause := dls[0].Headers[consumer.HeaderDLError]
	found := false
	for _, c := range causes {
		found = found || strings.Contains(cause, c)
	}
	require.True(t, found, "dead-letter cause %q names one of %q", cause, causes)
	require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed' AND event_id = $1`, id),
		"%s recorded failed", id)
	require.Equal(t, 0, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, id), "%s has no effect", id)
}

// testSwallowed: a handler ignores a SQL error (a unique violation) and
// returns success, which leaves its transaction aborted. Its message must
// never be acked without its effect: the ones that behave on their retry
// end with their effect once, the one that never behaves is dead-lettered
// after MaxAttempts and recorded failed; the others flow.
func testSwallowed(t *testing.T, h Harness, batch int) {
	fx := hostileFixture(t, h)
	topic := h.NewTopic(t)
	good := ids("ok", 0, 30)
	once := []string{"swallow-once-0", "swallow-once-1", "swallow-once-2"}
	const always = "swallow-always"
	var all []Msg
	for i, m := range good {
		all = append(all, m)
		if i%10 == 5 {
			id := once[i/10]
			all = append(all, Msg{ID: id, Key: "0", Value: []byte(id)})
		}
		if i == 15 {
			all = append(all, Msg{ID: always, Key: "0", Value: []byte(always)})
		}
	}
	h.Publish(t, topic, all)

	var mu sync.Mutex
	runs := map[string]int{}
	opts := fx.options("swallow-"+topic, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		runs[m.ID]++
		k := runs[m.ID]
		mu.Unlock()
		if m.ID == always || (strings.HasPrefix(m.ID, "swallow-once") && k == 1) {
			_, _ = tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
			_, _ = tx.Exec(ctx, `INSERT INTO uniq VALUES (1)`) // 23505, ignored
			return nil
		}
		return fx.insert(ctx, tx, m)
	})
	opts.BatchSize = batch
	stop := h.Start(t, topic, "g-"+topic, opts)
	want := len(good) + len(once)
	eventually(t, 60*time.Second, func() bool {
		return fx.count(t, `SELECT count(*) FROM effects`) >= want && len(h.DeadLetters(t, topic)) >= 1
	}, "every message ends: with its effect, or dead-lettered")
	stop()
	fx.assertExactlyOnce(t, want)
	for _, id := range once {
		require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, id), id)
		mu.Lock()
		require.GreaterOrEqual(t, runs[id], 2, "%s: its effect came from a real retry", id)
		mu.Unlock()
	}
	fx.requireFailed(t, h, topic, always, "aborted", "ROLLBACK")
	require.Len(t, h.DeadLetters(t, topic), 1, "only the hostile message is dead-lettered")
}

// testDeferred: a handler's deferred constraint fails at COMMIT every
// time. That is the handler's failure, not the database's: counted,
// dead-lettered after MaxAttempts and recorded failed, while the messages
// behind it (same key, same Kafka partition) keep flowing.
func testDeferred(t *testing.T, h Harness, batch int) {
	fx := hostileFixture(t, h)
	topic := h.NewTopic(t)
	good := ids("ok", 0, 40)
	const bad = "deferred-fk"
	all := append(append(append([]Msg{}, good[:20]...), Msg{ID: bad, Key: "0", Value: []byte(bad)}), good[20:]...)
	h.Publish(t, topic, all)

	var badRuns atomic.Int64
	opts := fx.options("deferred-"+topic, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID != bad {
			return fx.insert(ctx, tx, m)
		}
		badRuns.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO child VALUES ('no such parent')`) // checked at COMMIT
		return err
	})
	opts.BatchSize = batch
	stop := h.Start(t, topic, "g-"+topic, opts)
	eventually(t, 60*time.Second, func() bool {
		return fx.count(t, `SELECT count(*) FROM effects`) >= len(good) && len(h.DeadLetters(t, topic)) >= 1
	}, "the good messages run and the failing one is dead-lettered")
	stop()
	fx.assertExactlyOnce(t, len(good))
	fx.requireFailed(t, h, topic, bad, "23503")
	require.GreaterOrEqual(t, badRuns.Load(), int64(3))
	require.Len(t, h.DeadLetters(t, topic), 1)
}

func testSharedGroup(t *testing.T, h Harness) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	const n = 400
	group := "g-" + topic
	scope := "shared-" + topic
	var mu sync.Mutex
	var stops []func()
	start := func() {
		mu.Lock()
		defer mu.Unlock()
		stops = append(stops, h.Start(t, topic, group, fx.options(scope, fx.insert)))
	}
	start()
	h.Publish(t, topic, ids("s", 0, n/2))
	// A second member joins mid-stream: a rebalance.
	eventually(t, 60*time.Second, func() bool { return fx.runs.Load() >= n/8 }, "first member progresses")
	start()
	h.Publish(t, topic, ids("s", n/2, n))
	h.Publish(t, topic, ids("s", 0, n/4)) // redeliveries
	eventually(t, 90*time.Second, func() bool {
		return fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "all processed by the group (got %d)", fx.count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	for _, s := range stops {
		s()
	}
	fx.assertExactlyOnce(t, n)
	if fx.runs.Load() != int64(n) {
		t.Fatalf("handler ran %d times for %d events", fx.runs.Load(), n)
	}
}
