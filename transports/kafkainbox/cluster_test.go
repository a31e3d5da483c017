//go:build kafkacluster

package kafkainbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// TestClusterBrokerKilledMidRun runs a consumer on a three-broker KRaft
// cluster (topics with replication factor 3, min.insync.replicas 2) while
// events are published with acks=all, and SIGKILLs the broker that
// coordinates the consumer group while both are mid-run: every event
// published has its effect exactly once. The events are published first
// by a kafka-go producer, then (with the killed broker restarted) by the
// outbox relay, from rows that transactions added to the outbox.
//
// Run with `go test -tags kafkacluster -run '^TestCluster' ./transports/kafkainbox`
// (scripts/kafka-cluster-test.sh); the cluster uses ports 27001-27013 (or the next free block of 20 up to 27199).
func TestClusterBrokerKilledMidRun(t *testing.T) {
	t0 := time.Now()
	cl := testsvc.StartKafkaCluster(t, testsvc.KafkaClusterConfig{})
	t.Logf("cluster of 3 ready in %s: %v", time.Since(t0).Round(time.Millisecond), cl.Brokers)

	var victim int
	t.Run("producer", func(t *testing.T) { victim = killMidRun(t, cl, publishDirect) })
	if t.Failed() {
		return
	}
	t0 = time.Now()
	cl.Start(victim)
	cl.WaitBrokers(3, 2*time.Minute)
	t.Logf("node %d restarted and registered in %s", victim, time.Since(t0).Round(time.Millisecond))
	t.Run("outbox relay", func(t *testing.T) { killMidRun(t, cl, publishOutbox) })
}

// A publisher publishes total events "ev-0".."ev-<total-1>" to topic at a
// steady pace, counting in acked those published for good (acked by the
// brokers, or committed to the outbox) and in retries the failed
// attempts, until done receives its result.
type publisher func(ctx context.Context, t *testing.T, brokers []string, topic string, fx *fixture, total int,
	acked, retries *atomic.Int64, done chan<- error)

const clusterBatch = 25

// publishDirect: a kafka-go producer, acks=all, each batch retried until
// acknowledged (a retry after a lost answer may write a batch twice: the
// ledger absorbs it).
func publishDirect(ctx context.Context, t *testing.T, brokers []string, topic string, _ *fixture, total int,
	acked, retries *atomic.Int64, done chan<- error) {
	tr := &kafka.Transport{}
	w := &kafka.Writer{
		Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
		RequiredAcks: kafka.RequireAll, BatchSize: clusterBatch, BatchTimeout: 2 * time.Millisecond,
		MaxAttempts: 3, WriteBackoffMin: 50 * time.Millisecond, WriteBackoffMax: 500 * time.Millisecond,
		Transport: tr,
	}
	defer func() {
		_ = w.Close()
		tr.CloseIdleConnections()
	}()
	for from := 0; from < total; from += clusterBatch {
		msgs := events("ev", from, min(from+clusterBatch, total), 64)
		for {
			err := w.WriteMessages(ctx, msgs...)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				done <- err
				return
			}
			retries.Add(1)
			time.Sleep(100 * time.Millisecond)
		}
		acked.Add(int64(len(msgs)))
		time.Sleep(20 * time.Millisecond) // a steady stream, so that the kill lands mid-run
	}
	done <- nil
}

// publishOutbox: transactions add the events to the outbox (a batch per
// transaction) while a relay publishes them (acks=all); done when the
// outbox is empty.
func publishOutbox(ctx context.Context, t *testing.T, brokers []string, topic string, fx *fixture, total int,
	acked, retries *atomic.Int64, done chan<- error) {
	pool, err := pgxpool.New(ctx, fx.pg.URL)
	if err != nil {
		done <- err
		return
	}
	defer pool.Close()
	ob, err := outbox.New(pool, outbox.Config{})
	if err != nil {
		done <- err
		return
	}
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Transport: tr, MaxAttempts: 3,
		WriteBackoffMin: 50 * time.Millisecond, WriteBackoffMax: 500 * time.Millisecond}
	defer w.Close()
	pub, err := kafkainbox.NewOutboxPublisher(w)
	if err != nil {
		done <- err
		return
	}
	relay, err := ob.Relay(outbox.RelayConfig{
		Publishers:   map[outbox.Broker]outbox.Publisher{outbox.Kafka: pub},
		PollInterval: 100 * time.Millisecond, PublishTimeout: 10 * time.Second,
		Backoff: backoff.Backoff{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond},
		Hooks: outbox.RelayHooks{
			OnRetry:  func(*outbox.PublishError) { retries.Add(1) },
			OnFailed: func(e *outbox.PublishError) { t.Errorf("outbox: failed for good: %v", e) },
		},
	})
	if err != nil {
		done <- err
		return
	}
	if w.RequiredAcks != kafka.RequireAll {
		done <- errors.New("the relay's writer does not wait for acks=all")
		return
	}
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	finish := func(err error) {
		stopRelay()
		if rerr := <-relayDone; err == nil {
			err = rerr
		}
		done <- err
	}
	for from := 0; from < total; from += clusterBatch {
		msgs := make([]outbox.Message, 0, clusterBatch)
		for i := from; i < min(from+clusterBatch, total); i++ {
			id := "ev-" + strconv.Itoa(i)
			msgs = append(msgs, outbox.Message{ID: id, Broker: outbox.Kafka, Topic: topic,
				Key: []byte("k" + strconv.Itoa(i%64)), Value: []byte(id)})
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := ob.Add(ctx, tx, msgs...)
			return err
		})
		if err != nil {
			finish(err)
			return
		}
		acked.Add(int64(len(msgs)))
		time.Sleep(20 * time.Millisecond)
	}
	for {
		st, err := ob.Stats(ctx)
		if err != nil {
			finish(err)
			return
		}
		if st.Pending == 0 && st.Failed == 0 {
			break
		}
		if ctx.Err() != nil {
			finish(fmt.Errorf("outbox not drained: %+v", st))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	finish(nil)
}

// killMidRun creates a topic, publishes into it with pub while a consumer
// runs, SIGKILLs the group's coordinator mid-run, and checks every event
// has its effect exactly once. It returns the killed node.
func killMidRun(t *testing.T, cl *testsvc.KafkaCluster, pub publisher) int {
	const (
		total     = 3000
		killAfter = 600 // effects before the kill
	)
	brokers := cl.Brokers
	topic := testsvc.Unique("jo-cluster")
	isr2 := []kafka.ConfigEntry{{ConfigName: "min.insync.replicas", ConfigValue: "2"}}
	createTopics(t, brokers,
		kafka.TopicConfig{Topic: topic, NumPartitions: 6, ReplicationFactor: 3, ConfigEntries: isr2},
		kafka.TopicConfig{Topic: topic + kafkainbox.DeadLetterSuffix, NumPartitions: 1, ReplicationFactor: 3, ConfigEntries: isr2})
	requireReplicated(t, brokers, topic)

	fx := newFixture(t)
	group := testsvc.Unique("g")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	var acked, retries atomic.Int64
	pubDone := make(chan error, 1)
	go pub(ctx, t, brokers, topic, fx, total, &acked, &retries, pubDone)

	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor()}, fx.insert)
	defer stop()

	// Kill mid-run: the consumer has committed effects, the publisher is
	// still publishing.
	testsvc.Eventually(t, 2*time.Minute, func() bool { return fx.effects(t) >= killAfter },
		"%d effects before the kill (have %d, published %d)", killAfter, fx.effects(t), acked.Load())
	victim := coordinatorNode(t, cl, group)
	led := leadersOn(t, brokers, topic, cl.Addr(victim))
	effectsAtKill, ackedAtKill, runsAtKill := fx.effects(t), acked.Load(), fx.runs.Load()
	killedAt := time.Now()
	pid := cl.Kill(victim)
	t.Logf("SIGKILLed node %d (pid %d): group coordinator, leader of %d of the topic's 6 partitions; at the kill: %d effects, %d published of %d, handler runs %d",
		victim, pid, led, effectsAtKill, ackedAtKill, total, runsAtKill)
	var alive []string // the helpers below dial their first broker
	for _, b := range brokers {
		if b != cl.Addr(victim) {
			alive = append(alive, b)
		}
	}
	require.Less(t, effectsAtKill, total, "the consumer had work left at the kill")
	require.Less(t, ackedAtKill, int64(total), "the publisher was still publishing at the kill")

	// Both go on through the two surviving brokers.
	select {
	case err := <-pubDone:
		require.NoError(t, err, "publisher")
	case <-ctx.Done():
		t.Fatalf("publisher did not finish: %d published, %d retries", acked.Load(), retries.Load())
	}
	require.EqualValues(t, total, acked.Load())
	testsvc.Eventually(t, 2*time.Minute, func() bool { return fx.effects(t) >= total },
		"all %d events processed after the kill (have %d)", total, fx.effects(t))
	waitNoLag(t, alive, group, topic)
	recovered := time.Since(killedAt)
	stop()

	records := len(readAll(t, alive, topic))
	t.Logf("after the kill: publish retries %d, records in the topic %d (%d written twice by retries), handler runs %d, ledger duplicates %d, dead letters %d; all done %s after the kill",
		retries.Load(), records, records-total, fx.runs.Load(), fx.dups.Load(), fx.deadLetts.Load(), recovered.Round(time.Millisecond))
	require.Greater(t, fx.effects(t), effectsAtKill, "effects after the kill")
	require.GreaterOrEqual(t, records, total, "every published event is in the topic")
	require.Zero(t, fx.deadLetts.Load(), "dead letters")
	fx.assertExactlyOnce(t, total) // 0 lost, 0 doubled
	require.Equal(t, 0, fx.pg.Count(t, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) d`), "doubled effects")
	return victim
}

// requireReplicated checks every partition of topic has 3 replicas, all in
// sync, and the topic has min.insync.replicas 2.
func requireReplicated(t *testing.T, brokers []string, topic string) {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ps, err := conn.ReadPartitions(topic)
	require.NoError(t, err)
	for _, p := range ps {
		require.Len(t, p.Replicas, 3, "partition %d replicas", p.ID)
		require.Len(t, p.Isr, 3, "partition %d in-sync replicas", p.ID)
	}
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	res, err := client.DescribeConfigs(context.Background(), &kafka.DescribeConfigsRequest{
		Resources: []kafka.DescribeConfigRequestResource{{ResourceType: kafka.ResourceTypeTopic, ResourceName: topic, ConfigNames: []string{"min.insync.replicas"}}},
	})
	require.NoError(t, err)
	require.Len(t, res.Resources, 1)
	require.NoError(t, res.Resources[0].Error)
	require.Len(t, res.Resources[0].ConfigEntries, 1)
	require.Equal(t, "2", res.Resources[0].ConfigEntries[0].ConfigValue, "min.insync.replicas")
}

// coordinatorNode returns the cluster node that coordinates group.
func coordinatorNode(t *testing.T, cl *testsvc.KafkaCluster, group string) int {
	t.Helper()
	client := &kafka.Client{Addr: kafka.TCP(cl.Brokers...), Timeout: 10 * time.Second}
	res, err := client.FindCoordinator(context.Background(), &kafka.FindCoordinatorRequest{Key: group, KeyType: kafka.CoordinatorKeyTypeConsumer})
	require.NoError(t, err)
	if res.Error != nil {
		require.NoError(t, errors.Unwrap(res.Error))
	}
	n := cl.Node(net.JoinHostPort(res.Coordinator.Host, strconv.Itoa(res.Coordinator.Port)))
	require.NotZero(t, n, "coordinator %+v is a node of the cluster", res.Coordinator)
	return n
}

// leadersOn counts the partitions of topic led by addr.
func leadersOn(t *testing.T, brokers []string, topic, addr string) int {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ps, err := conn.ReadPartitions(topic)
	require.NoError(t, err)
	n := 0
	for _, p := range ps {
		if net.JoinHostPort(p.Leader.Host, strconv.Itoa(p.Leader.Port)) == addr {
			n++
		}
	}
	return n
}
