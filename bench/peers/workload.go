package main

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
)

// event is one record of the workload: its event ID (also the Kafka key, so
// a duplicate lands in its original's partition, as a producer retry does)
// and its position in the stream.
type event struct {
	ID  string
	Seq int
}

// idHeader carries the event ID. justonce's kafkainbox.DefaultID reads it,
// the hand-written inbox reads it, and Watermill's Kafka unmarshaler turns it
// into the metadata field its Deduplicator is keyed on.
const idHeader = "event-id"

// workload builds the same stream for every peer: n events of which
// n*dupPercent/100 are duplicates (the same ID again, later in the stream).
// Duplicates are placed only in the first 90 % of the stream, so the last
// event of every partition is a first occurrence: once every unique ID has
// its effect, an ordered consumer has read everything.
func workload(n, dupPercent int, seed uint64) (events []event, unique int) {
	r := rand.New(rand.NewPCG(seed, 0x6a757374))
	dups := n * dupPercent / 100
	limit := n * 9 / 10
	isDup := make([]bool, n)
	for placed := 0; placed < dups; {
		p := 1 + r.IntN(limit-1)
		if !isDup[p] {
			isDup[p] = true
			placed++
		}
	}
	events = make([]event, n)
	var ids []string
	for i := range events {
		if isDup[i] {
			events[i] = event{ID: ids[r.IntN(len(ids))], Seq: i}
			continue
		}
		id := fmt.Sprintf("evt-%d-%07d", seed, len(ids))
		ids = append(ids, id)
		events[i] = event{ID: id, Seq: i}
	}
	return events, len(ids)
}

// failing says which event IDs fail their first attempt in the failure
// phase: one in 250 (the first unique ID, then every 250th).
func failing(id string) bool {
	i := strings.LastIndexByte(id, '-')
	n, err := strconv.Atoi(id[i+1:])
	return err == nil && n%250 == 0
}

func payload(e event) []byte {
	b, _ := json.Marshal(map[string]any{"seq": e.Seq, "amount": 10 + e.Seq%90})
	return b
}

// createTopic creates topic with the given partitions and waits until every
// partition has a leader.
func createTopic(brokers []string, topic string, partitions int) error {
	conn, err := kafka.Dial("tcp", brokers[0])
	if err != nil {
		return fmt.Errorf("dial kafka: %w", err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		return fmt.Errorf("kafka controller: %w", err)
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		return fmt.Errorf("dial kafka controller: %w", err)
	}
	defer cc.Close()
	if err := cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}); err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ps, err := conn.ReadPartitions(topic)
		ok := err == nil && len(ps) == partitions
		for _, p := range ps {
			ok = ok && p.Leader.Host != ""
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("topic %s: partitions have no leader after 30 s", topic)
		}
	}
}

// partitionOf is the partition of an event ID among n: duplicates land in
// their original's partition, as a producer's retries do.
func partitionOf(id string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	return int(h.Sum32() % uint32(n))
}

// idBalancer places each message by partitionOf its key, so that the
// orchestrator knows each event's partition and offset.
type idBalancer struct{}

func (idBalancer) Balance(m kafka.Message, partitions ...int) int {
	return partitions[partitionOf(string(m.Key), len(partitions))]
}

// atRisk counts the deliveries a restarted consumer gets again although
// their effect is already there: the events at or past the group's
// committed offset of their partition whose ID has an effect. Without a
// dedupe that survives the crash, each is run again.
func atRisk(ctx context.Context, brokers []string, topic string, partitions int, events []event, done map[string]bool) (int, error) {
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	resp, err := c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: topic, Topics: map[string][]int{topic: ps}})
	if err != nil {
		return 0, fmt.Errorf("fetch committed offsets: %w", err)
	}
	if resp.Error != nil {
		return 0, fmt.Errorf("fetch committed offsets: %w", resp.Error)
	}
	committed := make([]int64, partitions)
	for _, p := range resp.Topics[topic] {
		if p.Error != nil {
			return 0, fmt.Errorf("fetch committed offset of partition %d: %w", p.Partition, p.Error)
		}
		committed[p.Partition] = max(p.CommittedOffset, 0) // -1: nothing committed, start at 0
	}
	next := make([]int64, partitions)
	n := 0
	for _, e := range events {
		p := partitionOf(e.ID, partitions)
		if next[p] >= committed[p] && done[e.ID] {
			n++
		}
		next[p]++
	}
	return n, nil
}

// produceKafka publishes the events to topic, keyed by event ID (hash
// partitioner), with the ID in the event-id header and, for Watermill's
// default unmarshaler, as the message UUID.
func produceKafka(ctx context.Context, brokers []string, topic string, events []event) error {
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     idBalancer{},
		RequiredAcks: kafka.RequireAll,
		BatchSize:    1000,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    &kafka.Transport{},
	}
	defer w.Close()
	const chunk = 1000
	for i := 0; i < len(events); i += chunk {
		end := min(i+chunk, len(events))
		msgs := make([]kafka.Message, 0, end-i)
		for _, e := range events[i:end] {
			msgs = append(msgs, kafka.Message{
				Key:   []byte(e.ID),
				Value: payload(e),
				Headers: []kafka.Header{
					{Key: idHeader, Value: []byte(e.ID)},
					{Key: "_watermill_message_uuid", Value: []byte(e.ID)},
				},
			})
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			return fmt.Errorf("produce to %s: %w", topic, err)
		}
	}
	return nil
}

// produceSQL publishes the events to Watermill's SQL (PostgreSQL) topic in
// the pool's schema.
func produceSQL(ctx context.Context, pool *pgxpool.Pool, topic string, events []event) error {
	pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(pool), wsql.PublisherConfig{
		SchemaAdapter:        wsql.DefaultPostgreSQLSchema{},
		AutoInitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		return fmt.Errorf("watermill-sql publisher: %w", err)
	}
	defer pub.Close()
	const chunk = 500
	for i := 0; i < len(events); i += chunk {
		end := min(i+chunk, len(events))
		msgs := make([]*message.Message, 0, end-i)
		for _, e := range events[i:end] {
			m := message.NewMessage(e.ID, payload(e))
			m.Metadata.Set(idHeader, e.ID)
			m.SetContext(ctx)
			msgs = append(msgs, m)
		}
		if err := pub.Publish(topic, msgs...); err != nil {
			return fmt.Errorf("publish to watermill-sql %s: %w", topic, err)
		}
	}
	return nil
}
