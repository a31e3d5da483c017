package franzinbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/harness/outboxtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// The relay's messages that name their partition land there through
// franz-go's publisher on a client with OutboxPartitioner; the others
// still hash by key (murmur2).
func TestOutboxPublisherPartitions(t *testing.T) {
	tg := franzGo
	tg.Publisher = func(addr string) (outbox.Publisher, func(), error) {
		cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(addr, ",")...),
			kgo.RecordPartitioner(franzinbox.OutboxPartitioner(nil)))
		if err != nil {
			return nil, nil, err
		}
		p, err := franzinbox.NewOutboxPublisher(cl)
		if err != nil {
			cl.Close()
			return nil, nil, err
		}
		return p, func() { _ = p.Close(); cl.Close() }, nil
	}
	outboxtest.Partitions(t, tg, outboxtest.KafkaPartitions{
		Read: func(t testing.TB, addr, dest string) []outboxtest.Placed {
			var out []outboxtest.Placed
			for _, r := range readAll(t, strings.Split(addr, ","), dest) {
				out = append(out, outboxtest.Placed{Received: outboxtest.Received{Order: string(r.Key), Value: r.Value}, Partition: int(r.Partition)})
			}
			return out
		},
		KeyPartition: func(key []byte, n int) int {
			return kgo.StickyKeyPartitioner(nil).ForTopic("t").Partition(&kgo.Record{Key: key}, n)
		},
	})
}

// A client whose partitioner would not honour a named partition (here
// franz-go's default) has such a message refused for good, with what to
// do; the lane goes on.
func TestOutboxPublisherPartitionIgnored(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	topic := newTopic(t, brokers, 2)
	cl := producer(t, brokers)
	p, err := franzinbox.NewOutboxPublisher(cl)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := p.Publish(ctx, []outbox.Message{
		{ID: "1", Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("named"), Partition: new(int32(1))},
		{ID: "2", Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("hashed")},
	})
	require.Len(t, errs, 2)
	require.ErrorIs(t, errs[0], outbox.ErrPermanent)
	require.ErrorContains(t, errs[0], "kgo.RecordPartitioner(franzinbox.OutboxPartitioner(nil))")
	require.NoError(t, errs[1])
	recs := readAll(t, brokers, topic)
	require.Len(t, recs, 1)
	require.Equal(t, "hashed", string(recs[0].Value))
}

// OutboxPartitioner sends the records that name no partition where its
// base sends them: franz-go's default when nil, murmur2 for keys, with
// the base's optional methods (partitioning by backup, new batches).
func TestOutboxPartitionerDelegates(t *testing.T) {
	t.Parallel()
	for name, base := range map[string]kgo.Partitioner{
		"default":     nil,
		"sticky key":  kgo.StickyKeyPartitioner(nil),
		"round robin": kgo.RoundRobinPartitioner(),
	} {
		tp := franzinbox.OutboxPartitioner(base).ForTopic("t")
		if base == nil {
			base = kgo.UniformBytesPartitioner(64<<10, true, true, nil)
		}
		want := base.ForTopic("t")
		_, wantBackup := want.(kgo.TopicBackupPartitioner)
		_, gotBackup := tp.(kgo.TopicBackupPartitioner)
		require.Equal(t, wantBackup, gotBackup, name)
		_, wantOnNew := want.(kgo.TopicPartitionerOnNewBatch)
		_, gotOnNew := tp.(kgo.TopicPartitionerOnNewBatch)
		require.Equal(t, wantOnNew, gotOnNew, name)
		if name == "round robin" {
			continue // stateful: no two instances agree
		}
		for i := range 100 {
			r := &kgo.Record{Key: []byte("key-" + string(rune('a'+i%26)) + string(rune('a'+i/26)))}
			require.True(t, tp.RequiresConsistency(r), name)
			hash := kgo.StickyKeyPartitioner(nil).ForTopic("t").Partition(r, 12)
			require.Equal(t, hash, partition(tp, r, 12), "%s: %s", name, r.Key)
		}
	}
}

// partition asks tp for r's partition among n as franz-go does: by backup
// when tp partitions by backup.
func partition(tp kgo.TopicPartitioner, r *kgo.Record, n int) int {
	if b, ok := tp.(kgo.TopicBackupPartitioner); ok {
		return b.PartitionByBackup(r, n, &emptyBackup{n: n})
	}
	return tp.Partition(r, n)
}

// emptyBackup is a TopicBackupIter over n partitions with nothing buffered.
type emptyBackup struct{ i, n int }

func (b *emptyBackup) Next() (int, int64) { b.i++; return b.i - 1, 0 }
func (b *emptyBackup) Rem() int           { return b.n - b.i }
