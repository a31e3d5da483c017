package franzinbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/internal/kafkapub"
)

// NewOutboxPublisher returns the outbox relay's publisher of Kafka messages
// with franz-go: give it as RelayConfig.Publishers[outbox.Kafka], and the
// relay links no other Kafka client. Each message goes to its Topic with
// its Key, the message ID in the header ce_id (outbox.KafkaIDHeader), then
// its headers. Messages of one key land on one partition as with the Java
// client and kafka-go's relay publisher, under franz-go's default
// partitioner. A message that names its partition (outbox.Message.Partition)
// goes there when cl was made with kgo.RecordPartitioner(OutboxPartitioner(nil))
// (or OutboxPartitioner of the partitioner cl would otherwise use); with
// another partitioner such a message is refused for good, with the reason.
//
// The publisher produces a batch with cl (kgo.Client.ProduceSync: the
// batch is sent at once, whatever cl's linger) and waits for every
// record's answer. cl must produce with acks from every in-sync replica
// (franz-go's default, kgo.RequiredAcks(kgo.AllISRAcks())), outside
// transactions (no kgo.TransactionalID), to each record's own topic (no
// kgo.DefaultProduceTopicAlways) and flush by itself (no
// kgo.ManualFlushing); NewOutboxPublisher refuses (inbox.ErrConfig) a
// client that does not. franz-go's default idempotent producer keeps a
// partition's records in order through its retries. cl stays the caller's:
// close it after the relays that use the publisher have stopped (it may
// produce other records meanwhile).
//
// What the broker refuses for good is reported permanent (the relay marks
// the message failed): a record too large (for the broker, or for cl's
// kgo.ProducerBatchMaxBytes), an invalid topic or record, a topic cl may
// not write to, a partition the topic does not have, a partition named
// while cl's partitioner ignores it, and a topic that does not exist (franz-go gives up after
// kgo.UnknownTopicRetries metadata refreshes), once the cluster confirms
// it. Other errors, and ctx ending before every answer, are failures for
// the time being. With ctx ended franz-go fails the records it has not
// sent yet; records already sent by an idempotent producer are answered by
// the broker later, and may be published besides the relay's retry (a
// duplicate with the same ID, as after a relay crash).
func NewOutboxPublisher(cl *kgo.Client) (outbox.Publisher, error) {
	bad := func(why string) error {
		return fmt.Errorf("%w: franzinbox: NewOutboxPublisher: %s", inbox.ErrConfig, why)
	}
	if cl == nil {
		return nil, bad("nil client")
	}
	if acks, _ := cl.OptValue(kgo.RequiredAcks).(kgo.Acks); acks != kgo.AllISRAcks() {
		return nil, bad("the client must require acks from all in-sync replicas (kgo.RequiredAcks(kgo.AllISRAcks()))")
	}
	if txn := cl.OptValues(kgo.TransactionalID); len(txn) == 2 && txn[1] == true {
		return nil, bad("the client must not be transactional (kgo.TransactionalID)")
	}
	if always, _ := cl.OptValue(kgo.DefaultProduceTopicAlways).(bool); always {
		return nil, bad("the client must produce to each record's topic (no kgo.DefaultProduceTopicAlways)")
	}
	if manual, _ := cl.OptValue(kgo.ManualFlushing).(bool); manual {
		return nil, bad("the client must flush by itself (no kgo.ManualFlushing)")
	}
	_, named := cl.OptValue(kgo.RecordPartitioner).(*outboxPartitioner)
	return &outboxPublisher{cl: cl, named: named}, nil
}

// outboxPublisher is NewOutboxPublisher's publisher.
type outboxPublisher struct {
	cl    *kgo.Client
	named bool // cl's partitioner is an OutboxPartitioner
}

// Close does nothing: the client stays the caller's.
func (p *outboxPublisher) Close() error { return nil }

// Publish produces msgs and waits for their answers; see
// NewOutboxPublisher.
func (p *outboxPublisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	return kafkapub.Publish(ctx, kafkapub.Client{Send: p.produce, Partitions: p.partitions,
		UnknownTopic: unknownTopic, UnknownTopics: p.unknownTopics}, msgs)
}

// errPartitionIgnored refuses a message that names its partition when the
// client's partitioner would not honour it.
var errPartitionIgnored = errors.New("the message names its partition, and the client's partitioner ignores it: make the client with kgo.RecordPartitioner(franzinbox.OutboxPartitioner(nil))")

// produce sends msgs (one lane's, in order) and sets each one's answer.
// The broker refuses a partition's whole batch for one record (too
// large), and franz-go then fails the partition's other buffered records
// too: the refused ones are sent again alone to find which.
func (p *outboxPublisher) produce(ctx context.Context, msgs []outbox.Message, answers []kafkapub.Answer) {
	recs := make([]*kgo.Record, 0, len(msgs))
	index := make(map[*kgo.Record]int, len(msgs))
	for i, m := range msgs {
		if m.Partition != nil && !p.named {
			answers[i] = kafkapub.Answer{Err: errPartitionIgnored, Permanent: true}
			continue
		}
		hs := make([]kgo.RecordHeader, 0, len(m.Headers)+1)
		hs = append(hs, kgo.RecordHeader{Key: outbox.KafkaIDHeader, Value: []byte(m.ID)})
		for _, h := range m.Headers {
			hs = append(hs, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		r := &kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value, Headers: hs}
		if m.Partition != nil {
			r.Partition = *m.Partition
			r.Context = context.WithValue(ctx, namedPartition{}, true)
		}
		recs = append(recs, r)
		index[r] = i
	}
	// ProduceSync returns once every record has its answer, which for a
	// record an idempotent producer has sent may come after ctx ends: the
	// wait for it is bounded by ctx here.
	done := make(chan kgo.ProduceResults, 1)
	go func() { done <- p.cl.ProduceSync(ctx, recs...) }()
	var results kgo.ProduceResults
	select {
	case results = <-done:
	case <-ctx.Done():
		err := fmt.Errorf("waiting for the acks: %w", ctx.Err())
		for _, i := range index {
			answers[i] = kafkapub.Answer{Err: err}
		}
		return
	}
	var refused []int
	for _, r := range results {
		i, ok := index[r.Record]
		if !ok {
			continue
		}
		answers[i] = kafkapub.Answer{Err: r.Err, Permanent: r.Err != nil && permanentFranz(r.Err)}
		if answers[i].Permanent {
			refused = append(refused, i)
		}
	}
	if len(msgs) > 1 {
		for _, i := range refused {
			p.produce(ctx, msgs[i:i+1], answers[i:i+1])
		}
	}
}

// permanentFranz reports whether a franz-go produce error is a refusal
// for good.
func permanentFranz(err error) bool {
	var ke *kerr.Error
	return errors.As(err, &ke) && kafkapub.Permanent(int(ke.Code))
}

func unknownTopic(err error) bool { return errors.Is(err, kerr.UnknownTopicOrPartition) }

// unknownTopics returns the topics the cluster does not know, by a
// metadata request that does not create them.
func (p *outboxPublisher) unknownTopics(ctx context.Context, topics []string) map[string]bool {
	resp, err := p.metadata(ctx, topics)
	if err != nil {
		return nil
	}
	unknown := map[string]bool{}
	for _, t := range resp.Topics {
		if t.Topic != nil && t.ErrorCode == kafkapub.UnknownTopicOrPartition {
			unknown[*t.Topic] = true
		}
	}
	return unknown
}

// partitions returns the partition counts of topics, from the cluster
// (franz-go keeps its metadata to itself: cached or fresh alike).
func (p *outboxPublisher) partitions(ctx context.Context, topics []string, _ bool) map[string]int {
	resp, err := p.metadata(ctx, topics)
	if err != nil {
		return nil
	}
	counts := map[string]int{}
	for _, t := range resp.Topics {
		if t.Topic != nil && t.ErrorCode == 0 {
			counts[*t.Topic] = len(t.Partitions)
		}
	}
	return counts
}

// metadata asks the cluster about topics without creating them.
func (p *outboxPublisher) metadata(ctx context.Context, topics []string) (*kmsg.MetadataResponse, error) {
	req := kmsg.NewPtrMetadataRequest()
	req.AllowAutoTopicCreation = false
	for _, topic := range topics {
		t := kmsg.NewMetadataRequestTopic()
		t.Topic = kmsg.StringPtr(topic)
		req.Topics = append(req.Topics, t)
	}
	return req.RequestWith(ctx, p.cl)
}

// namedPartition is the key of the value, in a kgo.Record's Context, that
// marks a record whose Partition the publisher chose.
type namedPartition struct{}

// OutboxPartitioner returns a partitioner (for kgo.RecordPartitioner) that
// sends a record of the outbox publisher that names its partition
// (outbox.Message.Partition) to that partition, and every other record,
// the client's other records included, where base sends it. Nil base is
// franz-go's default partitioner (kgo.UniformBytesPartitioner(64 KiB,
// true, true, nil): keyed records hashed with murmur2, as the Java client
// and kafka-go's outbox publisher do). Give it to the client
// NewOutboxPublisher is made with:
//
//	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
//		kgo.RecordPartitioner(franzinbox.OutboxPartitioner(nil)))
func OutboxPartitioner(base kgo.Partitioner) kgo.Partitioner {
	if base == nil {
		base = kgo.UniformBytesPartitioner(64<<10, true, true, nil)
	}
	return &outboxPartitioner{base: base}
}

// outboxPartitioner is OutboxPartitioner's partitioner.
type outboxPartitioner struct {
	base kgo.Partitioner
}

// ForTopic returns topic's partitioner, with the optional methods of
// base's.
func (p *outboxPartitioner) ForTopic(topic string) kgo.TopicPartitioner {
	tp := topicPartitioner{base: p.base.ForTopic(topic)}
	backup, isBackup := tp.base.(kgo.TopicBackupPartitioner)
	onNew, isOnNew := tp.base.(kgo.TopicPartitionerOnNewBatch)
	switch {
	case isBackup && isOnNew:
		return struct {
			backupPartitioner
			kgo.TopicPartitionerOnNewBatch
		}{backupPartitioner{tp, backup}, onNew}
	case isBackup:
		return backupPartitioner{tp, backup}
	case isOnNew:
		return struct {
			topicPartitioner
			kgo.TopicPartitionerOnNewBatch
		}{tp, onNew}
	}
	return tp
}

// named reports whether r is a record whose partition the publisher chose.
func named(r *kgo.Record) bool {
	return r.Context != nil && r.Context.Value(namedPartition{}) != nil
}

// topicPartitioner sends the named records to their partition, the others
// where base does.
type topicPartitioner struct {
	base kgo.TopicPartitioner
}

// RequiresConsistency is true for a named record: franz-go then chooses
// among every partition of the topic, whose index is its number.
func (p topicPartitioner) RequiresConsistency(r *kgo.Record) bool {
	return named(r) || p.base.RequiresConsistency(r)
}

// Partition returns a named record's partition, or base's choice.
func (p topicPartitioner) Partition(r *kgo.Record, n int) int {
	if named(r) {
		return int(r.Partition)
	}
	return p.base.Partition(r, n)
}

// backupPartitioner is topicPartitioner for a base that partitions by
// backup (franz-go then calls PartitionByBackup, never Partition).
type backupPartitioner struct {
	topicPartitioner
	backup kgo.TopicBackupPartitioner
}

// PartitionByBackup returns a named record's partition, or base's choice.
func (p backupPartitioner) PartitionByBackup(r *kgo.Record, n int, it kgo.TopicBackupIter) int {
	if named(r) {
		return int(r.Partition)
	}
	return p.backup.PartitionByBackup(r, n, it)
}
