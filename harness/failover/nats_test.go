package failover_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
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
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

const (
	natsStream  = "ORDERS"
	natsDurable = "billing"
	natsEvents  = 1200
)

// natsRun is a three-node JetStream cluster with a stream of three
// replicas, a natsinbox consumer on it whose effects are counted in
// Postgres, and a publisher that retries each message (same Nats-Msg-Id)
// until the stream acknowledges it.
type natsRun struct {
	t       *testing.T
	cluster *testsvc.NATSCluster
	pg      *testsvc.PG
	ledger  *inbox.Ledger
	client  int // the node the consumer's connection is on
	js      jetstream.JetStream

	published  atomic.Int64
	pubRetries atomic.Int64
	mu         sync.Mutex
	pubStarted map[string]time.Time // when each message's first publish started
}

// startNATSRun starts everything but the publisher; the consumer's
// connection goes to a node the fault spares (spare picks it, given the
// stream's and the durable's leaders), as do the publisher's.
func startNATSRun(t *testing.T, spare func(streamLeader, consumerLeader int) int) *natsRun {
	t.Helper()
	ctx := context.Background()
	c := testsvc.StartNATSCluster(t)
	admin, err := nats.Connect(c.ClientURLs(), nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	js, err := jetstream.New(admin)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: natsStream, Subjects: []string{"orders.*"},
		Storage: jetstream.FileStorage, Replicas: 3, Duplicates: 5 * time.Minute})
	require.NoError(t, err)
	// The durable as natsinbox creates it (its ack wait, 30 s, is the
	// server's default too), so that its leader is known before the
	// consumer connects.
	_, err = js.CreateOrUpdateConsumer(ctx, natsStream, jetstream.ConsumerConfig{Durable: natsDurable,
		AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: -1})
	require.NoError(t, err)
	c.WaitStreamCurrent(natsStream, 30*time.Second)
	testsvc.Eventually(t, 30*time.Second, func() bool { return c.ConsumerLeader(natsStream, natsDurable) >= 0 }, "the durable has a leader")

	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	createEffects(t, pg.Pool)
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	r := &natsRun{t: t, cluster: c, pg: pg, ledger: l, js: js, pubStarted: map[string]time.Time{}}
	r.client = spare(c.StreamLeader(natsStream), c.ConsumerLeader(natsStream, natsDurable))

	nc := r.connect()
	cons, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: natsStream, Durable: natsDurable,
		Processor: consumer.Config{Ledger: l, StoreBackoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, m.ID)
			return err
		})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cons.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Error("natsinbox consumer did not stop within a minute")
		}
	})
	return r
}

// connect returns a connection to the node the fault spares, falling back
// to the others only if it goes down (a connection to a node cut off from
// the others would stay there, stalled).
func (r *natsRun) connect() *nats.Conn {
	urls := []string{r.cluster.ClientURL(r.client)}
	for i := range testsvc.NATSClusterSize {
		if i != r.client {
			urls = append(urls, r.cluster.ClientURL(i))
		}
	}
	nc, err := nats.Connect(strings.Join(urls, ","), nats.DontRandomize(), nats.IgnoreDiscoveredServers(),
		nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(r.t, err)
	r.t.Cleanup(nc.Close)
	return nc
}

// publish publishes natsEvents messages, rate messages a second, each
// until the stream acknowledges it, on a connection of its own to the
// node the fault spares.
func (r *natsRun) publish(rate int) (wait func()) {
	js, err := jetstream.New(r.connect())
	require.NoError(r.t, err)
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for i := range natsEvents {
			<-tick.C
			id := fmt.Sprintf("m-%d", i)
			r.mu.Lock()
			r.pubStarted[id] = time.Now()
			r.mu.Unlock()
			for {
				m := nats.NewMsg(fmt.Sprintf("orders.%d", i%7))
				m.Header.Set(jetstream.MsgIDHeader, id)
				m.Data = []byte(id)
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				_, err := js.PublishMsg(ctx, m)
				cancel()
				if err == nil {
					break
				}
				r.pubRetries.Add(1)
				time.Sleep(50 * time.Millisecond)
			}
			r.published.Add(1)
		}
	})
	return wg.Wait
}

// begin starts the publisher, at 100 messages a second, and waits until
// the consumer has run 200 of them; wait waits for the publisher.
func (r *natsRun) begin() (wait func()) {
	wait = r.publish(100)
	testsvc.Eventually(r.t, 30*time.Second, func() bool { return r.effects() >= 200 }, "the consumer runs")
	return wait
}

// waitLeader waits until leader names a node other than old, and returns
// how long after t0 that was.
func (r *natsRun) waitLeader(t0 time.Time, old int, leader func() int, what string) time.Duration {
	r.t.Helper()
	testsvc.Eventually(r.t, 30*time.Second, func() bool {
		l := leader()
		return l >= 0 && l != old
	}, "a new leader of the %s", what)
	return time.Since(t0)
}

func (r *natsRun) streamLeader() int   { return r.cluster.StreamLeader(natsStream) }
func (r *natsRun) consumerLeader() int { return r.cluster.ConsumerLeader(natsStream, natsDurable) }

// effects returns the number of effect rows.
func (r *natsRun) effects() int {
	return r.pg.Count(r.t, `SELECT count(*) FROM effects`)
}

// resumed returns how long after t0 the first message whose publish
// started after t0 had its effect committed.
func (r *natsRun) resumed(t0 time.Time) time.Duration {
	r.mu.Lock()
	var after []string
	for id, at := range r.pubStarted {
		if at.After(t0) {
			after = append(after, id)
		}
	}
	r.mu.Unlock()
	require.NotEmpty(r.t, after, "messages were published after the fault")
	var first time.Time
	require.NoError(r.t, r.pg.Pool.QueryRow(context.Background(), `SELECT min(at) FROM effects WHERE id = ANY($1)`, after).Scan(&first))
	return first.Sub(t0)
}

// resumedBy reports whether a message whose publish started after t0 has
// its effect.
func (r *natsRun) resumedBy(t0 time.Time) bool {
	r.mu.Lock()
	var after []string
	for id, at := range r.pubStarted {
		if at.After(t0) {
			after = append(after, id)
		}
	}
	r.mu.Unlock()
	return len(after) > 0 && r.pg.Count(r.t, `SELECT count(*) FROM effects WHERE id = ANY($1)`, after) > 0
}

// finish waits until every message has its effect and the durable has
// every message acked (redeliveries of messages whose ack was lost
// included, after the ack wait), then checks: one effect per message (0
// lost, 0 doubled), each with its ledger row.
func (r *natsRun) finish(within time.Duration) {
	r.t.Helper()
	testsvc.Eventually(r.t, within, func() bool { return r.effects() >= natsEvents }, "every message's effect committed")
	for end := time.Now().Add(within); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		info, err := r.js.Consumer(ctx, natsStream, natsDurable)
		var ci *jetstream.ConsumerInfo
		if err == nil {
			ci, err = info.Info(ctx)
		}
		cancel()
		if err == nil && ci.NumPending == 0 && ci.NumAckPending == 0 {
			break
		}
		if time.Now().After(end) {
			r.t.Fatalf("messages not all acked within %s: %+v %v", within, ci, err)
		}
	}
	var doubled []string
	rows, err := r.pg.Pool.Query(context.Background(), `SELECT id FROM effects GROUP BY id HAVING count(*) > 1`)
	require.NoError(r.t, err)
	for rows.Next() {
		var id string
		require.NoError(r.t, rows.Scan(&id))
		doubled = append(doubled, id)
	}
	require.NoError(r.t, rows.Err())
	sort.Strings(doubled)
	require.Empty(r.t, doubled, "0 doubled")
	require.Equal(r.t, natsEvents, r.pg.Count(r.t, `SELECT count(DISTINCT id) FROM effects`), "0 lost")
	require.Equal(r.t, natsEvents, r.pg.Count(r.t, `SELECT count(*) FROM effects e JOIN processed_events p ON p.event_id = e.id AND p.status = 'done'`))
}

// TestNATSStreamLeaderKilled: the node leading the stream (three
// replicas) is killed while messages are published and consumed; the
// others elect a new leader, the publisher's retries land once (the
// stream's duplicate window and the ledger), and every message has its
// effect once. The node is restarted and catches up.
func TestNATSStreamLeaderKilled(t *testing.T) {
	r := startNATSRun(t, func(sl, _ int) int { return (sl + 1) % testsvc.NATSClusterSize })
	wait := r.begin()
	leader, consumerLeader := r.streamLeader(), r.consumerLeader()
	r.cluster.Kill(leader)
	killed := time.Now()
	elected := r.waitLeader(killed, leader, r.streamLeader, "stream")
	r.cluster.Restart(leader)
	wait()
	r.finish(90 * time.Second)
	r.cluster.WaitStreamCurrent(natsStream, 30*time.Second)
	t.Logf("stream leader node %d killed (the durable's leader: node %d; the consumer's connection: node %d); new stream leader after %s; first message published after the kill processed %s after it; publish retries %d; ledger: %+v",
		leader, consumerLeader, r.client, elected.Round(time.Millisecond), r.resumed(killed).Round(time.Millisecond), r.pubRetries.Load(), r.ledger.Counters())
}

// TestNATSConsumerLeaderKilled: the node leading the durable consumer
// (three replicas, on another node than the stream's leader) is killed
// while messages are consumed; the others elect a new leader of the
// durable, the consumer pulls from it, and every message has its effect
// once (acks sent to the dead leader are lost: their messages come again
// and are answered Duplicate by the ledger).
func TestNATSConsumerLeaderKilled(t *testing.T) {
	r := startNATSRun(t, func(sl, cl int) int {
		for i := range testsvc.NATSClusterSize {
			if i != sl && i != cl {
				return i
			}
		}
		return (cl + 1) % testsvc.NATSClusterSize
	})
	// The durable's leader apart from the stream's, so that the kill hits
	// the durable alone.
	for try := 0; r.consumerLeader() == r.streamLeader(); try++ {
		require.Less(t, try, 10, "the durable's leader stays with the stream's")
		sl := r.streamLeader()
		require.NoError(t, r.cluster.Server(sl).JetStreamStepdownStream(testsvc.NATSAccount, natsStream))
		r.waitLeader(time.Now(), sl, r.streamLeader, "stream")
	}
	wait := r.begin()
	leader, streamLeader := r.consumerLeader(), r.streamLeader()
	require.NotEqual(t, leader, streamLeader)
	r.cluster.Kill(leader)
	killed := time.Now()
	elected := r.waitLeader(killed, leader, r.consumerLeader, "durable")
	r.cluster.Restart(leader)
	wait()
	r.finish(90 * time.Second)
	t.Logf("durable's leader node %d killed (the stream's leader: node %d; the consumer's connection: node %d); new leader of the durable after %s; first message published after the kill processed %s after it; publish retries %d; ledger: %+v",
		leader, streamLeader, r.client, elected.Round(time.Millisecond), r.resumed(killed).Round(time.Millisecond), r.pubRetries.Load(), r.ledger.Counters())
}

// TestNATSNodeCutOff: the node leading the stream is cut off from the two
// others (its routes closed through the fault proxies) while it runs; the
// two elect new leaders, the consumer (connected to one of them) goes on,
// and once the node is back it rejoins as a follower. Every message has
// its effect once.
func TestNATSNodeCutOff(t *testing.T) {
	r := startNATSRun(t, func(sl, _ int) int { return (sl + 1) % testsvc.NATSClusterSize })
	wait := r.begin()
	cut, consumerLeader := r.streamLeader(), r.consumerLeader()
	r.cluster.Cut(cut)
	cutAt := time.Now()
	testsvc.Eventually(t, 10*time.Second, func() bool { return r.cluster.Server(cut).NumRoutes() == 0 }, "node %d has no route left", cut)
	// The node cut off believes it leads until it sees it lost its
	// quorum: ask the two others.
	elected := r.waitLeader(cutAt, cut, func() int {
		for i := range testsvc.NATSClusterSize {
			if i != cut && r.cluster.Server(i).JetStreamIsStreamLeader(testsvc.NATSAccount, natsStream) {
				return i
			}
		}
		return -1
	}, "stream among the two others")
	testsvc.Eventually(t, 60*time.Second, func() bool { return r.resumedBy(cutAt) }, "a message published after the cut processed")
	r.cluster.Heal(cut)
	wait()
	r.finish(90 * time.Second)
	r.cluster.WaitStreamCurrent(natsStream, 30*time.Second)
	t.Logf("stream leader node %d cut off (the durable's leader: node %d; the consumer's connection: node %d); new stream leader after %s; first message published after the cut processed %s after it; publish retries %d; ledger: %+v",
		cut, consumerLeader, r.client, elected.Round(time.Millisecond), r.resumed(cutAt).Round(time.Millisecond), r.pubRetries.Load(), r.ledger.Counters())
}
