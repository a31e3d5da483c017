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

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/kafkaadmin"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
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

		r = b.on(t).run("replay", "nats", "--stream", "ORDERS", "--scope", "billing")
		require.Equal(t, 2, r.code, r.String())
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
		r := b.on(t).must("replay", "kafka", "--brokers", brokers[0], "--topic", topic, "--scope", "billing", "--json")
		require.Contains(t, r.stdout, `"Seen": 10`)
		require.Contains(t, r.stdout, `"Skipped": 6`)
		require.Contains(t, r.stdout, `"Ran": 4`)
	})
}
