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
// partitioner.
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
// not write to, and a topic that does not exist (franz-go gives up after
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
	return &outboxPublisher{cl: cl}, nil
}

// outboxPublisher is NewOutboxPublisher's publisher.
type outboxPublisher struct {
	cl *kgo.Client
}

// Close does nothing: the client stays the caller's.
func (p *outboxPublisher) Close() error { return nil }

// Publish produces msgs and waits for their answers; see
// NewOutboxPublisher.
func (p *outboxPublisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	answers := make([]kafkapub.Answer, len(msgs))
	p.produce(ctx, msgs, answers)
	kafkapub.ConfirmUnknownTopics(ctx, msgs, answers, unknownTopic, p.unknownTopics)
	return kafkapub.Errors(answers)
}

// produce sends msgs (one lane's, in order) and sets each one's answer.
// The broker refuses a partition's whole batch for one record (too
// large), and franz-go then fails the partition's other buffered records
// too: the refused ones are sent again alone to find which.
func (p *outboxPublisher) produce(ctx context.Context, msgs []outbox.Message, answers []kafkapub.Answer) {
	recs := make([]*kgo.Record, len(msgs))
	index := make(map[*kgo.Record]int, len(msgs))
	for i, m := range msgs {
		hs := make([]kgo.RecordHeader, 0, len(m.Headers)+1)
		hs = append(hs, kgo.RecordHeader{Key: outbox.KafkaIDHeader, Value: []byte(m.ID)})
		for _, h := range m.Headers {
			hs = append(hs, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		recs[i] = &kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value, Headers: hs}
		index[recs[i]] = i
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
		for i := range answers {
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
	req := kmsg.NewPtrMetadataRequest()
	req.AllowAutoTopicCreation = false
	for _, topic := range topics {
		t := kmsg.NewMetadataRequestTopic()
		t.Topic = kmsg.StringPtr(topic)
		req.Topics = append(req.Topics, t)
	}
	resp, err := req.RequestWith(ctx, p.cl)
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
