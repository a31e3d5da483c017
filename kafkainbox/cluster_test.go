//go:build kafkacluster

package kafkainbox_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
)

// TestClusterBrokerKilledMidRun runs a consumer on a three-broker KRaft
// cluster (topic with replication factor 3, min.insync.replicas 2) while a
// producer publishes with acks=all, and SIGKILLs the broker that
// coordinates the consumer group while both are mid-run. Every acknowledged
// event has its effect exactly once.
//
// Run with `go test -tags kafkacluster -run '^TestCluster' ./kafkainbox`
// (scripts/kafka-cluster-test.sh); the cluster uses ports 47001-47013.
func TestClusterBrokerKilledMidRun(t *testing.T) {
	const (
		total     = 3000
		batch     = 25
		killAfter = 600 // effects before the kill
	)
	t0 := time.Now()
	cl := testsvc.StartKafkaCluster(t, testsvc.KafkaClusterConfig{})
	brokers := cl.Brokers
	t.Logf("cluster of 3 ready in %s: %v", time.Since(t0).Round(time.Millisecond), brokers)

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

	// The producer: acks=all, each batch retried until acknowledged (a
	// retry after a lost answer may write a batch twice: the ledger must
	// absorb it).
	var acked, retries atomic.Int64
	prodDone := make(chan error, 1)
	go func() {
		tr := &kafka.Transport{}
		w := &kafka.Writer{
			Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
			RequiredAcks: kafka.RequireAll, BatchSize: batch, BatchTimeout: 2 * time.Millisecond,
			MaxAttempts: 3, WriteBackoffMin: 50 * time.Millisecond, WriteBackoffMax: 500 * time.Millisecond,
			Transport: tr,
		}
		defer func() {
			_ = w.Close()
			tr.CloseIdleConnections()
		}()
		for from := 0; from < total; from += batch {
			msgs := events("ev", from, min(from+batch, total), 64)
			for {
				err := w.WriteMessages(ctx, msgs...)
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					prodDone <- err
					return
				}
				retries.Add(1)
				time.Sleep(100 * time.Millisecond)
			}
			acked.Add(int64(len(msgs)))
			time.Sleep(20 * time.Millisecond) // a steady stream, so that the kill lands mid-run
		}
		prodDone <- nil
	}()

	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor()}, fx.insert)
	defer stop()

	// Kill mid-run: the consumer has committed effects, the producer is
	// still publishing.
	testsvc.Eventually(t, 2*time.Minute, func() bool { return fx.effects(t) >= killAfter },
		"%d effects before the kill (have %d, acked %d)", killAfter, fx.effects(t), acked.Load())
	victim := coordinatorNode(t, cl, group)
	led := leadersOn(t, brokers, topic, cl.Addr(victim))
	effectsAtKill, ackedAtKill, runsAtKill := fx.effects(t), acked.Load(), fx.runs.Load()
	killedAt := time.Now()
	pid := cl.Kill(victim)
	t.Logf("SIGKILLed node %d (pid %d): group coordinator, leader of %d of the topic's 6 partitions; at the kill: %d effects, %d acked of %d, handler runs %d",
		victim, pid, led, effectsAtKill, ackedAtKill, total, runsAtKill)
	require.Less(t, effectsAtKill, total, "the consumer had work left at the kill")
	require.Less(t, ackedAtKill, int64(total), "the producer was still publishing at the kill")

	// Both go on through the two surviving brokers.
	select {
	case err := <-prodDone:
		require.NoError(t, err, "producer")
	case <-ctx.Done():
		t.Fatalf("producer did not finish: %d acked, %d retries", acked.Load(), retries.Load())
	}
	require.EqualValues(t, total, acked.Load())
	testsvc.Eventually(t, 2*time.Minute, func() bool { return fx.effects(t) >= total },
		"all %d events processed after the kill (have %d)", total, fx.effects(t))
	waitNoLag(t, brokers, group, topic)
	recovered := time.Since(killedAt)
	stop()

	records := len(readAll(t, brokers, topic))
	t.Logf("after the kill: producer retries %d, records in the topic %d (%d written twice by retries), handler runs %d, ledger duplicates %d, dead letters %d; all done %s after the kill",
		retries.Load(), records, records-total, fx.runs.Load(), fx.dups.Load(), fx.deadLetts.Load(), recovered.Round(time.Millisecond))
	require.Greater(t, fx.effects(t), effectsAtKill, "effects after the kill")
	require.GreaterOrEqual(t, records, total, "every acknowledged event is in the topic")
	require.Zero(t, fx.deadLetts.Load(), "dead letters")
	fx.assertExactlyOnce(t, total) // 0 lost, 0 doubled
	require.Equal(t, 0, fx.pg.Count(t, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) d`), "doubled effects")
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
