package natsinbox

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// env is one test's NATS server, connection and JetStream context.
type env struct {
	url string
	nc  *nats.Conn
	js  jetstream.JetStream
}

func newEnv(t testing.TB) *env {
	t.Helper()
	url := testsvc.NATSURL(t)
	nc := connect(t, url)
	return &env{url: url, nc: nc, js: mustJS(t, nc)}
}

func connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	require.NoError(t, err, "connect to NATS at %s (set %s to use an external server)", url, testsvc.EnvNATS)
	t.Cleanup(nc.Close)
	return nc
}

func mustJS(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

// stream creates a file-backed stream on subject and a dead-letter stream
// on subject.dlq, and returns the stream's name.
func (e *env) stream(t testing.TB, subject string, dupWindow time.Duration) string {
	t.Helper()
	ctx := context.Background()
	name := "S-" + subject
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{subject}, Storage: jetstream.FileStorage, Duplicates: dupWindow,
	})
	require.NoError(t, err)
	_, err = e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "DLQ-" + subject, Subjects: []string{subject + DeadLetterSuffix}, Storage: jetstream.FileStorage,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = e.js.DeleteStream(context.Background(), name)
		_ = e.js.DeleteStream(context.Background(), "DLQ-"+subject)
	})
	return name
}

// publish publishes one message with id in Nats-Msg-Id (none when empty)
// and returns the ack.
func (e *env) publish(t testing.TB, subject, id string, value []byte, hdr ...string) *jetstream.PubAck {
	t.Helper()
	m := nats.NewMsg(subject)
	m.Data = value
	if id != "" {
		m.Header.Set(jetstream.MsgIDHeader, id)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		m.Header.Set(hdr[i], hdr[i+1])
	}
	ack, err := e.js.PublishMsg(context.Background(), m)
	require.NoError(t, err)
	return ack
}

// deadLetters reads every message of subject's dead-letter stream.
func (e *env) deadLetters(t testing.TB, subject string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx := context.Background()
	s, err := e.js.Stream(ctx, "DLQ-"+subject)
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		out = append(out, m)
	}
	return out
}

func (e *env) consumerInfo(t testing.TB, stream, durable string) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := e.js.Consumer(context.Background(), stream, durable)
	require.NoError(t, err)
	info, err := c.Info(context.Background())
	require.NoError(t, err)
	return info
}

// fixture is one test's database, ledger and counters.
type fixture struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
	runs   atomic.Int64

	mu       sync.Mutex
	outcomes map[string][]inbox.Disposition // by event ID
	attempts map[string][]int               // Message.Attempt per delivery, by event ID
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.MaxConns(10))
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL, value bytea, n bigserial)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	return &fixture{pg: pg, ledger: l, outcomes: map[string][]inbox.Disposition{}, attempts: map[string][]int{}}
}

// processor returns a runtime config with quick backoff that records
// outcomes and attempts.
func (fx *fixture) processor(scope string) consumer.Config {
	return consumer.Config{
		Ledger:       fx.ledger,
		Scope:        scope,
		MaxAttempts:  3,
		Backoff:      backoff.Backoff{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond},
		StoreBackoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond},
		Hooks: consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
			fx.mu.Lock()
			defer fx.mu.Unlock()
			fx.outcomes[m.ID] = append(fx.outcomes[m.ID], out.Disposition)
		}},
		Middleware: []consumer.Middleware{func(next consumer.Handler) consumer.Handler {
			return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				fx.mu.Lock()
				fx.attempts[m.ID] = append(fx.attempts[m.ID], m.Attempt)
				fx.mu.Unlock()
				return next(ctx, tx, m)
			}
		}},
	}
}

func (fx *fixture) outcomesOf(id string) []inbox.Disposition {
	fx.mu.Lock()
	defer fx.mu.Unlock()
	return append([]inbox.Disposition(nil), fx.outcomes[id]...)
}

func (fx *fixture) count(d inbox.Disposition) int {
	fx.mu.Lock()
	defer fx.mu.Unlock()
	n := 0
	for _, ds := range fx.outcomes {
		for _, x := range ds {
			if x == d {
				n++
			}
		}
	}
	return n
}

// insert is the business handler: one effect row per run.
func (fx *fixture) insert(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	fx.runs.Add(1)
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
	return err
}

func (fx *fixture) effects(t testing.TB, id string) int {
	return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, id)
}

// run starts c, waits until its subscription or durable is in place, and
// returns a stop function that cancels it, waits for Run and checks it
// ended cleanly.
func run(t testing.TB, c *Consumer) (stop func()) {
	t.Helper()
	ready := make(chan struct{})
	next := c.cfg.ready
	c.cfg.ready = func() {
		close(ready)
		if next != nil {
			next()
		}
	}
	stop, exited := consumertest.Start(t, c)
	select {
	case <-ready:
	case <-exited:
		stop() // reports Run's error
		t.FailNow()
	}
	return stop
}
