package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/outbox"
)

// partitions returns the partition column of the outbox's rows, by ID.
func (fx *fixture) partitions(t testing.TB) map[string]*int32 {
	t.Helper()
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT id, partition FROM outbox`)
	require.NoError(t, err)
	out := map[string]*int32{}
	for rows.Next() {
		var id string
		var p *int32
		require.NoError(t, rows.Scan(&id, &p))
		out[id] = p
	}
	require.NoError(t, rows.Err())
	return out
}

// Add keeps a message's partition in the table (NULL when it names
// none), one message at a time and several at once, and refuses a
// negative partition and a partition on NATS without inserting anything.
func TestAddPartition(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 4)
	one := fx.add(t, outbox.Message{ID: "one", Broker: outbox.Kafka, Topic: "t", Key: []byte("k"), Partition: new(int32(3))})
	none := fx.add(t, outbox.Message{ID: "none", Broker: outbox.Kafka, Topic: "t", Key: []byte("k")})
	many := fx.add(t,
		outbox.Message{ID: "m0", Broker: outbox.Kafka, Topic: "t", Key: []byte("k"), Partition: new(int32(0))},
		outbox.Message{ID: "m1", Broker: outbox.Kafka, Topic: "t", Key: []byte("k")},
		outbox.Message{ID: "m2", Broker: outbox.NATS, Topic: "s.k", Key: []byte("k")},
		outbox.Message{ID: "m3", Broker: outbox.Kafka, Topic: "t", Partition: new(int32(7))},
	)
	require.Equal(t, []string{"one"}, one)
	require.Equal(t, []string{"none"}, none)
	require.Equal(t, []string{"m0", "m1", "m2", "m3"}, many)
	got := fx.partitions(t)
	require.Equal(t, map[string]*int32{"one": new(int32(3)), "none": nil, "m0": new(int32(0)), "m1": nil, "m2": nil, "m3": new(int32(7))}, got)
	lanes := fx.pg.Count(t, `SELECT count(DISTINCT lane) FROM outbox WHERE id IN ('one', 'none', 'm0', 'm1')`)
	require.Equal(t, 1, lanes, "the partition does not change the lane: hash(broker, topic, key)")

	for name, m := range map[string]outbox.Message{
		"negative": {Broker: outbox.Kafka, Topic: "t", Partition: new(int32(-1))},
		"NATS":     {Broker: outbox.NATS, Topic: "s.k", Partition: new(int32(0))},
	} {
		err := pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
			_, err := fx.ob.Add(context.Background(), tx, outbox.Message{Broker: outbox.Kafka, Topic: "t"}, m)
			return err
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
	}
	require.Len(t, fx.partitions(t), 6, "nothing added by the refused calls")
}

// The NATS publisher refuses for good a message that names a partition
// (a row Add would not write), and the rest of the lane goes on.
func TestNATSRefusesPartition(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	e := newNATS(t)
	subject := testsvc.Unique("part")
	s := e.stream(t, subject, time.Minute)
	ids := fx.add(t,
		outbox.Message{Broker: outbox.NATS, Topic: subject, Key: []byte("k"), Value: []byte("0")},
		outbox.Message{Broker: outbox.NATS, Topic: subject, Key: []byte("k"), Value: []byte("1")},
	)
	fx.pg.Exec(t, `UPDATE outbox SET partition = 2 WHERE id = $1`, ids[0])
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(nil, e.publisher(t))})
	fx.waitDrained(t, 30*time.Second)
	msgs := e.streamMessages(t, s)
	require.Len(t, msgs, 1)
	require.Equal(t, "1", string(msgs[0].Data))
	failed, err := fx.ob.Failed(context.Background(), 10)
	require.NoError(t, err)
	require.Len(t, failed, 1)
	require.Equal(t, ids[0], failed[0].ID)
	require.Contains(t, failed[0].Error, "NATS subjects have none")
}

// Before migration version 5 (the table of version 2), Add goes on as
// before for messages that name no partition, refuses one that names a
// partition (the database has no column for it), and the relay, which
// reads the column, says to migrate.
func TestPartitionBeforeMigration5(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema}).Migrate(context.Background(), 2)
	require.NoError(t, err)
	var logs testsvc.LogBuffer
	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	fx := &fixture{pg: pg, ob: ob, brokers: testsvc.KafkaBrokers(t)}
	fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte("k")},
		outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte("k")})
	fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte("k")})
	err = pgx.BeginFunc(context.Background(), pg.Pool, func(tx pgx.Tx) error {
		_, err := ob.Add(context.Background(), tx, outbox.Message{Broker: outbox.Kafka, Topic: "t", Partition: new(int32(1))})
		return err
	})
	require.ErrorContains(t, err, `column "partition"`)
	require.ErrorContains(t, err, "justonce migrate up")
	require.Equal(t, 3, pg.Count(t, `SELECT count(*) FROM outbox`))

	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), nil)})
	testsvc.Eventually(t, 30*time.Second, func() bool {
		return strings.Contains(logs.String(), "justonce migrate up")
	}, "the relay says to migrate; logs:\n%s", logs.String())
	require.Equal(t, 3, pg.Count(t, `SELECT count(*) FROM outbox WHERE status = 'pending'`), "nothing published, nothing failed")
}
