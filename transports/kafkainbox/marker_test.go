package kafkainbox_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// txnProduce writes msgs to partition of topic in one transaction of a
// transactional producer and commits it: the broker then appends a real
// control batch (the COMMIT marker) after them. kafka-go has no
// transactional producer, so the batch is kafka-go's own encoding with the
// producer ID, epoch and transactional attribute set by hand.
func txnProduce(t *testing.T, brokers []string, topic string, partition int, msgs ...kafka.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: tr}
	txnID := testsvc.Unique("txn")

	var pid kafka.ProducerSession
	testsvc.Eventually(t, 30*time.Second, func() bool {
		res, err := client.InitProducerID(ctx, &kafka.InitProducerIDRequest{TransactionalID: txnID, TransactionTimeoutMs: 60000})
		if err != nil || res.Error != nil || res.Producer == nil {
			return false // the transaction coordinator may still be loading
		}
		pid = *res.Producer
		return true
	}, "transactional producer initialised")
	added, err := client.AddPartitionsToTxn(ctx, &kafka.AddPartitionsToTxnRequest{
		TransactionalID: txnID, ProducerID: pid.ProducerID, ProducerEpoch: pid.ProducerEpoch,
		Topics: map[string][]kafka.AddPartitionToTxn{topic: {{Partition: partition}}},
	})
	require.NoError(t, err)
	for _, p := range added.Topics[topic] {
		require.NoError(t, p.Error)
	}

	records := make([]kafka.Record, len(msgs))
	for i, m := range msgs {
		records[i] = kafka.Record{Key: protocol.NewBytes(m.Key), Value: protocol.NewBytes(m.Value), Headers: m.Headers}
	}
	var buf bytes.Buffer
	_, err = (&protocol.RecordSet{Version: 2, Records: kafka.NewRecordReader(records...)}).WriteTo(&buf)
	require.NoError(t, err)
	b := buf.Bytes()
	batch := b[4:] // after the record set's size
	// Record batch v2: attributes at 21, producer ID at 43, epoch at 51,
	// base sequence at 53; CRC-32C at 17 covers everything from 21 on.
	binary.BigEndian.PutUint16(batch[21:], 0x10) // transactional
	binary.BigEndian.PutUint64(batch[43:], uint64(pid.ProducerID))
	binary.BigEndian.PutUint16(batch[51:], uint16(pid.ProducerEpoch))
	binary.BigEndian.PutUint32(batch[53:], 0)
	binary.BigEndian.PutUint32(batch[17:], crc32.Checksum(batch[21:], crc32.MakeTable(crc32.Castagnoli)))

	// A topic just created may not have its leader known everywhere yet:
	// retry the broker's retriable answers, for a bounded time.
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := client.RawProduce(ctx, &kafka.RawProduceRequest{
			Topic: topic, Partition: partition, RequiredAcks: kafka.RequireAll,
			TransactionalID: txnID, RawRecords: protocol.RawRecordSet{Reader: bytes.NewReader(b)},
		})
		if err == nil {
			err = res.Error
		}
		var ke kafka.Error
		if err == nil || !errors.As(err, &ke) || !ke.Temporary() || time.Now().After(deadline) {
			require.NoError(t, err)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}

	end, err := client.EndTxn(ctx, &kafka.EndTxnRequest{TransactionalID: txnID, ProducerID: pid.ProducerID, ProducerEpoch: pid.ProducerEpoch, Committed: true})
	require.NoError(t, err)
	require.NoError(t, end.Error)
}

// markerShaped reports whether a message read back has the shape of a
// transaction marker as kafka-go delivers it (no headers, 4-byte key with
// version 0 and type 0 or 1).
func markerShaped(m kafka.Message) bool {
	return len(m.Headers) == 0 && bytes.Equal(m.Key[:min(len(m.Key), 3)], []byte{0, 0, 0}) && len(m.Key) == 4 && m.Key[3] <= 1
}

// Real COMMIT markers (from a transactional producer) are skipped, not
// dead-lettered, and the commit passes them. A plain record that has the
// very shape kafka-go gives a marker is not skipped: it has no event ID, so
// it is dead-lettered, or with AllowNoID it runs.
func TestTransactionMarkersSkippedLookAlikesNot(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		allowNoID bool
		batch     int
	}{
		{"DeadLettered", false, 0},
		{"AllowNoID", true, 0},
		{"BatchDeadLettered", false, 10},
	} {
		allowNoID := tc.allowNoID
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			brokers := testsvc.KafkaBrokers(t)
			fx := newFixture(t)
			topic := newTopic(t, brokers, 1)
			group := "g-" + topic
			lookAlike := kafka.Message{Key: []byte{0, 0, 0, 1}, Value: []byte{0, 0, 0, 0, 0, 0}}

			txnProduce(t, brokers, topic, 0, events("tx", 0, 3, 1)...)
			publish(t, brokers, topic, lookAlike)
			txnProduce(t, brokers, topic, 0, events("tx", 3, 5, 1)...)
			publish(t, brokers, topic, events("p", 0, 3, 1)...)

			// A transaction's COMMIT marker is written after EndTxn answers:
			// wait until both are in the log before reading it.
			testsvc.Eventually(t, 30*time.Second, func() bool { return endOffsets(t, brokers, topic)[0] >= 11 },
				"8 events, 2 COMMIT markers and the look-alike written (end offset 11)")
			// kafka-go delivers the two markers and the look-alike in the
			// same shape: three marker-shaped messages among 11 offsets.
			all := readAll(t, brokers, topic)
			require.Len(t, all, 11, "8 events, 2 COMMIT markers, 1 look-alike")
			shaped := 0
			for _, m := range all {
				if markerShaped(m) {
					shaped++
				}
			}
			require.Equal(t, 3, shaped, "kafka-go hands the markers out as messages")

			var noID atomic.Int64
			pc := fx.processor()
			pc.AllowNoID = allowNoID
			stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: pc, Scheduling: consumer.Scheduling{BatchSize: tc.batch}},
				func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					if m.ID == "" {
						require.Equal(t, lookAlike.Key, m.Key)
						noID.Add(1)
						return nil
					}
					return fx.insert(ctx, tx, m)
				})
			waitNoLag(t, brokers, group, topic)
			stop()
			fx.assertExactlyOnce(t, 8)

			dl := readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
			if allowNoID {
				require.EqualValues(t, 1, noID.Load(), "the look-alike ran without dedupe")
				require.Empty(t, dl, "nothing dead-lettered: markers skipped, the look-alike ran")
				return
			}
			require.Zero(t, noID.Load())
			require.Len(t, dl, 1, "the look-alike is dead-lettered, the markers are not")
			if tc.batch == 0 {
				// A replay skips the markers and not the look-alike too.
				src, err := kafkainbox.NewReplaySource(context.Background(), kafkainbox.ReplayConfig{Brokers: brokers, Topic: topic})
				require.NoError(t, err)
				var replayed, lookAlikes int
				for {
					m, err := src.Next(context.Background())
					if errors.Is(err, io.EOF) {
						break
					}
					require.NoError(t, err)
					replayed++
					if bytes.Equal(m.Key, lookAlike.Key) {
						lookAlikes++
					}
				}
				require.NoError(t, src.Close())
				require.Equal(t, 9, replayed, "8 events and the look-alike")
				require.Equal(t, 1, lookAlikes)
			}
			require.Equal(t, lookAlike.Key, dl[0].Key)
			require.Equal(t, lookAlike.Value, dl[0].Value)
			h := map[string]string{}
			for _, hd := range dl[0].Headers {
				h[hd.Key] = string(hd.Value)
			}
			require.Contains(t, h[consumer.HeaderDLError], "no event ID")
			require.EqualValues(t, 1, fx.deadLetts.Load())
		})
	}
}
