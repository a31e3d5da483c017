package kafkainbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/internal/kafkapub"
)

// NewOutboxPublisher returns the outbox relay's publisher of Kafka messages
// with kafka-go: give it as RelayConfig.Publishers[outbox.Kafka]. Each
// message goes to its Topic with its Key, the message ID in the header
// ce_id (outbox.KafkaIDHeader), then its headers.
//
// The publisher writes with w, which must be synchronous (Async false) and
// without a Topic of its own (each message names its topic). It sets on
// w, now: RequiredAcks = kafka.RequireAll (a message counts as published
// once every in-sync replica has it); when zero, Balancer =
// kafka.Murmur2Balancer (a key always lands on the same partition, as
// with the Java client and franz-go), BatchSize = outbox.DefaultBatchSize
// (set it to the relay's BatchSize when that is larger) and BatchTimeout
// = 1 ms (the relay hands it whole batches; kafka-go's 1 s default would
// hold each one back). Then it wraps w's Balancer: kafka-go's writer
// ignores kafka.Message.Partition, so a message that names its partition
// (outbox.Message.Partition) is sent there by the wrapper, and every
// other message where the Balancer sends it (w's other writes too). w
// stays the caller's: close it after the relays that use the publisher
// have stopped.
//
// What the broker refuses for good is reported permanent (the relay marks
// the message failed): a message too large, an invalid topic or record, a
// topic it may not write to, a partition the topic does not have (after
// the cluster confirms its count), and a topic that does not exist, once the
// cluster confirms it (kafka-go's writer answers from metadata it caches
// for up to its transport's MetadataTTL, in which a topic created since is
// unknown). The broker's other errors, and ctx ending, are failures for
// the time being.
//
// It refuses (inbox.ErrConfig) a nil, asynchronous or single-topic writer.
func NewOutboxPublisher(w *kafka.Writer) (outbox.Publisher, error) {
	bad := func(why string) error {
		return fmt.Errorf("%w: kafkainbox: NewOutboxPublisher: %s", inbox.ErrConfig, why)
	}
	switch {
	case w == nil:
		return nil, bad("nil writer")
	case w.Async:
		return nil, bad("the writer must be synchronous (Async false)")
	case w.Topic != "":
		return nil, bad("the writer must not set Topic: each message names its own")
	}
	w.RequiredAcks = kafka.RequireAll
	if w.Balancer == nil {
		w.Balancer = kafka.Murmur2Balancer{}
	}
	if _, ok := w.Balancer.(partitionBalancer); !ok {
		w.Balancer = partitionBalancer{next: w.Balancer}
	}
	if w.BatchSize == 0 {
		w.BatchSize = outbox.DefaultBatchSize
	}
	if w.BatchTimeout == 0 {
		w.BatchTimeout = time.Millisecond
	}
	return &outboxPublisher{w: w}, nil
}

// outboxPublisher is NewOutboxPublisher's publisher.
type outboxPublisher struct {
	w *kafka.Writer
}

// Publish writes msgs in one WriteMessages call; see NewOutboxPublisher.
func (p *outboxPublisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	return kafkapub.Publish(ctx, kafkapub.Client{Send: p.write, Partitions: p.partitions,
		UnknownTopic: unknownTopic, UnknownTopics: p.unknownTopics}, msgs)
}

// partitionBalancer is the Balancer NewOutboxPublisher gives its writer:
// a message whose WriterData names a partition (namedPartition) goes
// there, every other one where next sends it.
type partitionBalancer struct {
	next kafka.Balancer
}

// namedPartition, in a kafka.Message's WriterData, is the partition the
// publisher sends the message to.
type namedPartition int32

// Balance returns the named partition, or next's choice.
func (b partitionBalancer) Balance(msg kafka.Message, partitions ...int) int {
	if p, ok := msg.WriterData.(namedPartition); ok {
		return int(p)
	}
	return b.next.Balance(msg, partitions...)
}

// Close does nothing: the writer stays the caller's.
func (p *outboxPublisher) Close() error { return nil }

// write sends msgs (one lane's, in order) and sets each one's answer. A
// refusal of the whole call that is permanent (kafka-go checks sizes and
// topics before sending anything) is narrowed down by sending the
// messages one by one.
func (p *outboxPublisher) write(ctx context.Context, msgs []outbox.Message, answers []kafkapub.Answer) {
	km := make([]kafka.Message, len(msgs))
	for i, m := range msgs {
		hs := make([]kafka.Header, 0, len(m.Headers)+1)
		hs = append(hs, kafka.Header{Key: outbox.KafkaIDHeader, Value: []byte(m.ID)})
		for _, h := range m.Headers {
			hs = append(hs, kafka.Header{Key: h.Key, Value: h.Value})
		}
		km[i] = kafka.Message{Topic: m.Topic, Key: m.Key, Value: m.Value, Headers: hs}
		if m.Partition != nil {
			km[i].WriterData = namedPartition(*m.Partition)
		}
	}
	err := p.w.WriteMessages(ctx, km...)
	if err == nil {
		clear(answers)
		return
	}
	var werr kafka.WriteErrors
	if errors.As(err, &werr) && len(werr) == len(msgs) {
		var refused []int
		for i := range msgs {
			answers[i] = answerOf(werr[i])
			if answers[i].Permanent {
				refused = append(refused, i)
			}
		}
		// The broker refuses a partition's whole request for one message
		// (too large): send the refused ones alone to find which.
		if len(msgs) > 1 {
			for _, i := range refused {
				p.write(ctx, msgs[i:i+1], answers[i:i+1])
			}
		}
		return
	}
	if len(msgs) > 1 && permanentKafka(err) {
		for i := range msgs {
			p.write(ctx, msgs[i:i+1], answers[i:i+1])
		}
		return
	}
	for i := range answers {
		answers[i] = answerOf(err)
	}
}

func answerOf(err error) kafkapub.Answer {
	return kafkapub.Answer{Err: err, Permanent: err != nil && permanentKafka(err)}
}

// permanentKafka reports whether a kafka-go error is a refusal for good.
func permanentKafka(err error) bool {
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		return true
	}
	var ke kafka.Error
	return errors.As(err, &ke) && kafkapub.Permanent(int(ke))
}

func unknownTopic(err error) bool { return errors.Is(err, kafka.UnknownTopicOrPartition) }

// partitions returns the partition counts of topics: from the metadata
// the writer's transport caches (a topic it has not cached yet is left
// out), or fresh from the cluster through a transport of its own.
func (p *outboxPublisher) partitions(ctx context.Context, topics []string, fresh bool) map[string]int {
	c, done := p.client(fresh)
	defer done()
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return nil
	}
	counts := map[string]int{}
	for _, tp := range md.Topics {
		if tp.Error == nil {
			counts[tp.Name] = len(tp.Partitions)
		}
	}
	return counts
}

// client returns a client on the writer's brokers: through the writer's
// transport, or (fresh) through a transport of its own with the writer's
// dial, TLS and SASL settings, closed by done.
func (p *outboxPublisher) client(fresh bool) (c *kafka.Client, done func()) {
	if !fresh {
		return &kafka.Client{Addr: p.w.Addr, Transport: p.w.Transport}, func() {}
	}
	t := &kafka.Transport{}
	if wt, ok := p.w.Transport.(*kafka.Transport); ok {
		t = &kafka.Transport{Dial: wt.Dial, DialTimeout: wt.DialTimeout, ClientID: wt.ClientID,
			TLS: wt.TLS, SASL: wt.SASL, Context: wt.Context, Resolver: wt.Resolver}
	}
	return &kafka.Client{Addr: p.w.Addr, Transport: t}, t.CloseIdleConnections
}

// unknownTopics returns the topics the cluster does not know. kafka-go
// answers a writer's metadata from its transport's cache, refreshed every
// MetadataTTL (6 s by default): a topic created since is "unknown" to it
// for a while. This asks the cluster through a transport of its own,
// without creating the topics.
func (p *outboxPublisher) unknownTopics(ctx context.Context, topics []string) map[string]bool {
	c, done := p.client(true)
	defer done()
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return nil
	}
	unknown := map[string]bool{}
	for _, tp := range md.Topics {
		if errors.Is(tp.Error, kafka.UnknownTopicOrPartition) {
			unknown[tp.Name] = true
		}
	}
	return unknown
}
