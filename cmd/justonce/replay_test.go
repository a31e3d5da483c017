package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

func TestBinaryReplayDryRun(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t, t.TempDir())
	pg := testsvc.Postgres(t)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	// Events 0..5 were processed already in scope "billing".
	for i := 0; i < 6; i++ {
		do(t, l, inbox.Request{Key: inbox.Key{Scope: "billing", ID: fmt.Sprintf("e-%d", i)}}, inbox.Result{})
	}
	b := binary{t: t, path: bin, env: []string{"DATABASE_URL=" + pg.URL}}

	t.Run("NATS", func(t *testing.T) {
		ns := testsvc.StartNATS(t, "")
		nc, err := nats.Connect(ns.ClientURL())
		require.NoError(t, err)
		defer nc.Close()
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders"}})
		require.NoError(t, err)
		for i := 0; i < 10; i++ {
			m := nats.NewMsg("orders")
			m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("e-%d", i))
			_, err := js.PublishMsg(ctx, m)
			require.NoError(t, err)
		}
		r := b.on(t).must("replay", "nats", "--nats-url", ns.ClientURL(), "--stream", "ORDERS", "--scope", "billing")
		require.Contains(t, r.stdout, "seen 10, skipped as duplicates 6, would run 4, failed 0")
		require.Equal(t, 6, pg.Count(t, `SELECT count(*) FROM processed_events`), "a dry run records nothing")

		var rep replayJSON
		b.on(t).json(&rep, "replay", "nats", "--nats-url", ns.ClientURL(), "--stream", "ORDERS", "--scope", "billing", "--from-seq", "3")
		require.Equal(t, replayTotalJSON{Seen: 8, Skipped: 4, WouldRun: 4}, rep.Total)
		require.Equal(t, []replayCountsJSON{{Partition: 0, First: 3, Last: 10, replayTotalJSON: rep.Total}}, rep.Partitions)
		require.Equal(t, "nats", rep.Transport)
		require.Equal(t, "billing", rep.Scope)
		require.True(t, rep.DryRun)

		for _, args := range [][]string{
			{"--stream", "ORDERS", "--scope", "billing"},
			{"--nats-url", ns.ClientURL(), "--stream", "ORDERS"},
			{"--nats-url", ns.ClientURL(), "--stream", "ORDERS", "--scope", "billing", "--from-seq", "3", "--since", "1h"},
			{"--nats-url", ns.ClientURL(), "--stream", "ORDERS", "--scope", "billing", "--since", "1h", "--from-time", "2026-01-01T00:00:00Z"},
			{"--nats-url", ns.ClientURL(), "--stream", "ORDERS", "--scope", "billing", "--from-time", "yesterday"},
		} {
			r = b.on(t).run(append([]string{"replay", "nats"}, args...)...)
			require.Equal(t, exitUsage, r.code, "%v\n%s", args, r)
			require.Empty(t, r.stdout)
		}
	})

	t.Run("Kafka", func(t *testing.T) {
		brokers := testsvc.KafkaBrokers(t)
		topic := testsvc.Unique("replay-cli")
		require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic, 2))
		w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll}
		defer w.Close()
		var msgs []kafka.Message
		for i := 0; i < 10; i++ {
			id := fmt.Sprintf("e-%d", i)
			msgs = append(msgs, kafkainbox.NewMessage(id, []byte(id), []byte("{}")))
		}
		require.NoError(t, w.WriteMessages(ctx, msgs...))
		var rep replayJSON
		b.on(t).json(&rep, "replay", "kafka", "--brokers", brokers[0], "--topic", topic, "--scope", "billing")
		require.Equal(t, replayTotalJSON{Seen: 10, Skipped: 6, WouldRun: 4}, rep.Total)
		require.Len(t, rep.Partitions, 2)
		var seen int64
		for _, p := range rep.Partitions {
			seen += p.Seen
			require.Equal(t, p.Seen, p.Last-p.First+1, "%+v", p)
		}
		require.EqualValues(t, 10, seen)
		require.Equal(t, "kafka", rep.Transport)
		require.True(t, rep.DryRun)

		r := b.on(t).must("replay", "kafka", "--brokers", brokers[0], "--topic", topic, "--scope", "billing")
		require.Contains(t, r.stdout, "seen 10, skipped as duplicates 6, would run 4, failed 0")
		r = b.on(t).run("replay", "kafka", "--brokers", brokers[0], "--topic", topic, "--scope", "billing", "--from-offset", "-1")
		require.Equal(t, exitUsage, r.code, "%s", r)
	})
}
