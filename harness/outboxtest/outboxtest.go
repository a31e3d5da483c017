// Package outboxtest runs the outbox relay's end-to-end tests over one
// outbox.Publisher, against its real broker: the same tests for every
// publisher (kafkainbox's on kafka-go, franzinbox's on franz-go,
// natsinbox's on NATS JetStream), each called from the test files beside
// the publisher with a Target that says how to reach its broker with its
// client. The package itself links no broker client.
//
//   - Refusals: messages the broker refuses for good are marked failed,
//     the rest of their lane is published, in order, with IDs and headers.
//   - BrokerAway: a broker that cannot be reached makes the relay retry,
//     and once it is back everything is published once, in order.
//   - TwoHop: events (with duplicates, and handler runs that fail after
//     adding their message) through a consumer that adds one outbox
//     message each, the relay, and a second consumer: one message per
//     event, with the ID derived from it, and one effect per event.
//   - KilledRelay (Linux): a relay process SIGKILLed between the broker's
//     ack and its commit, three times: the killed batches are the only
//     repeats, none is lost, each key's first deliveries are in order, and
//     a consumer downstream answers the repeats as duplicates.
//   - Partitions (Kafka): messages that name their partition land there,
//     the others on their key's partition; a partition the topic does not
//     have is refused for good.
//   - LinksNone: the package under test links none of the named modules.
package outboxtest

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// Target is one publisher under test and what the tests need of its
// broker and client. Every field is required.
type Target struct {
	// Name names the publisher ("kafka-go"). KilledRelay's relay process
	// finds its Target by it (see RelayChild).
	Name string
	// Broker is the outbox broker the publisher publishes to.
	Broker outbox.Broker
	// Addr returns the test broker's address as Publisher takes it (Kafka
	// brokers, comma-separated; a NATS URL).
	Addr func(t testing.TB) string
	// Publisher returns a publisher on addr and a function that closes it
	// and the client it made. KilledRelay's relay process calls it too,
	// outside any test.
	Publisher func(addr string) (outbox.Publisher, func(), error)
	// Server returns the host:port of addr's (first) server, and At the
	// address of the server at a host:port: BrokerAway puts a proxy
	// between them.
	Server func(addr string) string
	At     func(hostPort string) string
	// Destination creates a fresh destination with partitions ordered
	// parts (Kafka: a topic with as many partitions; NATS: a stream on the
	// subjects name.>, whose duplicate window is short enough that a
	// message published again a second later is stored again) and returns
	// its name.
	Destination func(t testing.TB, addr string, partitions int) string
	// Topic returns Message.Topic for key's messages to the destination
	// (Kafka: dest; NATS: dest.key).
	Topic func(dest, key string) string
	// Read returns every message published to dest so far, each
	// partition (or stream) in order.
	Read func(t testing.TB, addr, dest string) []Received
	// Produce publishes events to dest, in order, each with its ID where
	// the front's DefaultID reads it.
	Produce func(t testing.TB, addr, dest string, events []Event)
	// Consumer returns a consumer of the publisher's front reading dest,
	// in the consumer group (or durable) group, running pc and h.
	Consumer func(t testing.TB, addr, dest, group string, pc consumer.Config, h consumer.Handler) interface {
		Run(context.Context) error
	}
	// Refused returns messages to dest the broker refuses for good, with
	// the text their error must contain (case aside).
	Refused func(t testing.TB, addr, dest string) []Refusal
}

// Received is one message Target.Read found.
type Received struct {
	// ID is the message's ID header (Kafka: ce_id; NATS: Nats-Msg-Id).
	ID string
	// Order names the order the message is in: its key (Kafka) or
	// subject (NATS).
	Order   string
	Value   []byte
	Headers []consumer.Header
}

// Header returns the value of the received message's header k.
func (r Received) Header(k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// Event is a source event Target.Produce publishes.
type Event struct {
	ID    string
	Key   string
	Value []byte
}

// Refusal is a message the broker refuses for good and the text its error
// contains.
type Refusal struct {
	Message outbox.Message
	Want    string
}

// fixture is one test's schema and outbox, and the target's broker.
type fixture struct {
	tg   Target
	pg   *testsvc.PG
	ob   *outbox.Outbox
	addr string
}

func newFixture(t testing.TB, tg Target, lanes int) *fixture {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.MaxConns(16))
	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema, Lanes: lanes})
	require.NoError(t, err)
	return &fixture{tg: tg, pg: pg, ob: ob, addr: tg.Addr(t)}
}

// add adds msgs in a transaction of their own and returns their IDs.
func (fx *fixture) add(t testing.TB, msgs ...outbox.Message) []string {
	t.Helper()
	var ids []string
	err := pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = fx.ob.Add(context.Background(), tx, msgs...)
		return err
	})
	require.NoError(t, err)
	return ids
}

// publisher is the target's publisher on addr, closed when the test ends.
func (fx *fixture) publisher(t testing.TB, addr string) outbox.Publisher {
	t.Helper()
	p, closeAll, err := fx.tg.Publisher(addr)
	require.NoError(t, err)
	t.Cleanup(closeAll)
	return p
}

// relay runs a relay over p until the test ends.
func (fx *fixture) relay(t testing.TB, p outbox.Publisher, cfg outbox.RelayConfig) {
	t.Helper()
	cfg.Publishers = map[outbox.Broker]outbox.Publisher{fx.tg.Broker: p}
	r, err := fx.ob.Relay(cfg)
	require.NoError(t, err)
	stop, _ := consumertest.Start(t, r)
	t.Cleanup(stop)
}

// pending counts the outbox's pending messages.
func (fx *fixture) pending(t testing.TB) int {
	return fx.pg.Count(t, `SELECT count(*) FROM outbox WHERE status = 'pending'`)
}

// waitDrained waits until the outbox has no pending message.
func (fx *fixture) waitDrained(t testing.TB, deadline time.Duration) {
	t.Helper()
	testsvc.Eventually(t, deadline, func() bool { return fx.pending(t) == 0 }, "outbox drained")
}

// values returns the received messages' values.
func values(rs []Received) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = string(r.Value)
	}
	return out
}

// Refusals: in one lane, a message, the target's refused ones, and
// another message. The two are published, in order, each with its ID and
// headers; the refused ones are marked failed with the broker's error
// (the hooks see them permanent), and nothing is retried.
func Refusals(t *testing.T, tg Target) {
	t.Parallel()
	fx := newFixture(t, tg, 1) // one lane: the refusals sit in the way of the rest
	dest := tg.Destination(t, fx.addr, 1)
	refused := tg.Refused(t, fx.addr, dest)
	require.NotEmpty(t, refused)
	hdr := []consumer.Header{{Key: "type", Value: []byte("order.created")}}
	msgs := []outbox.Message{{Broker: tg.Broker, Topic: tg.Topic(dest, "k"), Key: []byte("k"), Value: []byte("0"), Headers: hdr}}
	for _, r := range refused {
		msgs = append(msgs, r.Message)
	}
	msgs = append(msgs, outbox.Message{ID: "my-id", Broker: tg.Broker, Topic: tg.Topic(dest, "k"), Key: []byte("k"), Value: []byte("1")})
	ids := fx.add(t, msgs...)

	var mu sync.Mutex
	var failed []*outbox.PublishError
	var retries atomic.Int64
	fx.relay(t, fx.publisher(t, fx.addr), outbox.RelayConfig{Hooks: outbox.RelayHooks{
		OnFailed: func(err *outbox.PublishError) { mu.Lock(); failed = append(failed, err); mu.Unlock() },
		OnRetry:  func(*outbox.PublishError) { retries.Add(1) },
	}})
	fx.waitDrained(t, 60*time.Second)

	got := tg.Read(t, fx.addr, dest)
	require.Equal(t, 2, len(got), "published: the two messages the broker takes, alone")
	require.Equal(t, []string{"0", "1"}, values(got), "a later message of the key overtakes the refused ones")
	require.Equal(t, ids[0], got[0].ID)
	require.Equal(t, "order.created", got[0].Header("type"))
	require.Equal(t, "my-id", got[1].ID)

	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT id, error FROM outbox WHERE status = 'failed' ORDER BY seq`)
	require.NoError(t, err)
	type row struct {
		ID    string
		Error string
	}
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.Len(t, rs, len(refused))
	for i, r := range refused {
		require.Equal(t, ids[1+i], rs[i].ID)
		require.Contains(t, strings.ToLower(rs[i].Error), strings.ToLower(r.Want), "refusal %d", i)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, failed, len(refused))
	for _, f := range failed {
		require.ErrorIs(t, f, outbox.ErrPermanent)
		require.True(t, f.Permanent)
		require.Equal(t, tg.Broker, f.Broker)
	}
	require.Zero(t, retries.Load(), "a refusal for good was retried")
}

// BrokerAway: the relay's publisher reaches the broker through a proxy
// that refuses every connection. The relay retries the lane with backoff
// (nothing marked failed), and once the proxy lets connections through,
// the lane's messages are published once each, in order.
func BrokerAway(t *testing.T, tg Target) {
	t.Parallel()
	fx := newFixture(t, tg, 1)
	dest := tg.Destination(t, fx.addr, 1)
	proxy := testsvc.Proxy(t, tg.Server(fx.addr))
	proxy.Refuse(true)
	var retries, failed atomic.Int64
	fx.relay(t, fx.publisher(t, tg.At(proxy.Addr())), outbox.RelayConfig{PublishTimeout: 2 * time.Second,
		Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond},
		Hooks: outbox.RelayHooks{
			OnRetry:  func(*outbox.PublishError) { retries.Add(1) },
			OnFailed: func(*outbox.PublishError) { failed.Add(1) },
		}})
	const n = 20
	want := make([]string, n)
	for i := range n {
		want[i] = strconv.Itoa(i)
		fx.add(t, outbox.Message{Broker: tg.Broker, Topic: tg.Topic(dest, "k"), Key: []byte("k"), Value: []byte(want[i])})
	}
	testsvc.Eventually(t, 60*time.Second, func() bool { return retries.Load() >= 3 }, "relay retrying")
	require.Equal(t, n, fx.pending(t), "nothing published while the broker is away")
	proxy.Refuse(false)
	fx.waitDrained(t, 60*time.Second)
	require.Zero(t, failed.Load(), "a broker away is no reason to give a message up")
	require.Equal(t, want, values(tg.Read(t, fx.addr, dest)))
}

// TwoHop: N source events, each produced twice, run by A (the target's
// front), whose handler adds one outbox message per event (and fails
// after adding it on the first attempt of every fifth event); a relay
// publishes A's messages; B (the target's front) runs one effect per
// message. The destination holds N messages, one per event, each with
// the ID derived from A's event; B ran each event's effect once, and
// received that ID.
func TwoHop(t *testing.T, tg Target) {
	t.Parallel()
	fx := newFixture(t, tg, 8)
	src := tg.Destination(t, fx.addr, 2)
	dst := tg.Destination(t, fx.addr, 4)
	fx.pg.Exec(t, `CREATE TABLE effects (source text NOT NULL, msg_id text NOT NULL)`)
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{})
	require.NoError(t, err)
	pc := func(scope string) consumer.Config {
		return consumer.Config{Ledger: ledger, Scope: scope, MaxAttempts: 5,
			Backoff: backoff.Backoff{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond}}
	}
	const n = 200
	keyOf := func(i int) string { return "key-" + strconv.Itoa(i%10) }
	var events []Event
	for i := range n {
		events = append(events, Event{ID: "evt-" + strconv.Itoa(i), Key: keyOf(i), Value: []byte(strconv.Itoa(i))})
	}
	tg.Produce(t, fx.addr, src, events)
	tg.Produce(t, fx.addr, src, events) // every event twice

	var failedFirst atomic.Int64
	a := tg.Consumer(t, fx.addr, src, "hop-a-"+src, pc("hop-a"), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		i, err := strconv.Atoi(string(m.Value))
		if err != nil {
			return consumer.Permanent(err)
		}
		key := keyOf(i) // the event's (a NATS message has no key)
		if _, err := fx.ob.Add(ctx, tx, outbox.Message{Broker: tg.Broker, Topic: tg.Topic(dst, key), Key: []byte(key), Value: m.Value,
			Headers: []consumer.Header{{Key: "source", Value: []byte(m.ID)}}}); err != nil {
			return err
		}
		if i%5 == 0 && m.Attempt == 1 {
			failedFirst.Add(1)
			return errors.New("the first attempt fails after adding its message")
		}
		return nil
	})
	var delivered atomic.Int64
	bpc := pc("hop-b")
	bpc.Hooks.OnOutcome = func(*consumer.Message, inbox.Outcome, time.Duration) { delivered.Add(1) }
	b := tg.Consumer(t, fx.addr, dst, "hop-b-"+dst, bpc, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		var source string
		for _, h := range m.Headers {
			if h.Key == "source" {
				source = string(h.Value)
			}
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (source, msg_id) VALUES ($1, $2)`, source, m.ID)
		return err
	})
	for _, c := range []interface{ Run(context.Context) error }{a, b} {
		stop, _ := consumertest.Start(t, c)
		t.Cleanup(stop)
	}
	fx.relay(t, fx.publisher(t, fx.addr), outbox.RelayConfig{PollInterval: 50 * time.Millisecond})

	testsvc.Eventually(t, 120*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT source) FROM effects`) == n
	}, "an effect at B for every event")
	fx.waitDrained(t, 30*time.Second)
	got := tg.Read(t, fx.addr, dst)
	require.Len(t, got, n, "one message per event: A's duplicates and failed runs published nothing")
	testsvc.Eventually(t, 60*time.Second, func() bool { return delivered.Load() >= int64(len(got)) }, "B read every message")
	require.Positive(t, failedFirst.Load())

	want := map[string]string{} // source event -> message ID
	for _, e := range events {
		want[e.ID] = outbox.EventID(inbox.Key{Scope: "hop-a", ID: e.ID}, 0)
	}
	for _, r := range got {
		require.Equal(t, want[r.Header("source")], r.ID, "the ID derived from A's event")
	}
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT source, msg_id FROM effects`)
	require.NoError(t, err)
	effects, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) ([2]string, error) {
		var e [2]string
		return e, row.Scan(&e[0], &e[1])
	})
	require.NoError(t, err)
	require.Len(t, effects, n, "one effect per event")
	for _, e := range effects {
		require.Equal(t, want[e[0]], e[1], "B deduplicates on the outbox message's ID")
	}
}

// LinksNone fails the test when the package in the current directory (a
// test's) links a package whose import path starts with one of prefixes
// (go list -deps).
func LinksNone(t *testing.T, prefixes ...string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("go list -deps: %v: %s", err, ee.Stderr)
	}
	require.NoError(t, err, "go list -deps")
	deps := strings.Fields(string(out))
	require.NotEmpty(t, deps)
	for _, d := range deps {
		for _, p := range prefixes {
			require.False(t, strings.HasPrefix(d, p), "the package links %s", d)
		}
	}
}
