package natsinbox

import (
	"context"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/horizontest"
	"github.com/justonce/justonce/harness/testsvc"
)

// horizonStream creates a memory stream on a fresh subject with maxAge,
// and, when dlMaxAge is not negative, a stream on its dead-letter subject
// with dlMaxAge; it returns the subject and the stream's name.
func horizonStream(t *testing.T, e *env, maxAge, dlMaxAge time.Duration) (subject, name string) {
	t.Helper()
	ctx := context.Background()
	subject = testsvc.Unique("horizon")
	name = "S-" + subject
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, MaxAge: maxAge, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.js.DeleteStream(context.Background(), name) })
	if dlMaxAge >= 0 {
		_, err = e.js.CreateStream(ctx, jetstream.StreamConfig{Name: "DLQ-" + subject, Subjects: []string{subject + DeadLetterSuffix},
			MaxAge: dlMaxAge, Storage: jetstream.MemoryStorage})
		require.NoError(t, err)
		t.Cleanup(func() { _ = e.js.DeleteStream(context.Background(), "DLQ-"+subject) })
	}
	return subject, name
}

// The check at start, on embedded JetStream: a stream's MaxAge 0 (kept
// forever: −Inf), above the ledger TTL (a warning with the numbers, a
// negative headroom) and below it (no warning, a positive headroom), with
// the durable's backlog; the refusal; the dead-letter stream's note; and
// core NATS, which does not redeliver and is not checked.
func TestHorizon(t *testing.T) {
	e := newEnv(t)
	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	ttl := horizontest.TTL
	never := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }

	for _, tc := range []struct {
		name   string
		maxAge time.Duration
	}{
		{"MaxAgeForever", 0},
		{"MaxAgeAboveTTL", 2 * ttl},
		{"MaxAgeBelowTTL", ttl / 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			subject, name := horizonStream(t, e, tc.maxAge, -1)
			for _, id := range []string{"a", "b", "c"} {
				e.publish(t, subject, id, []byte(id))
			}
			p := horizontest.NewProbe(t, pg, "d", Source, consumer.HorizonWarn)
			c, err := New(Config{Conn: e.nc, Stream: name, Durable: "d", Processor: p.Processor()}, never)
			require.NoError(t, err)
			stop := run(t, c) // the check runs before the consumer is ready
			stop()
			h := p.Horizon(t, name)
			require.Equal(t, tc.maxAge == 0, h.Unbounded)
			require.Equal(t, tc.maxAge, h.Retention)
			require.Equal(t, tc.maxAge > ttl || tc.maxAge == 0, h.Exceeded())
			require.Equal(t, int64(3), h.Behind, "the new durable has the three messages to deliver")
			require.Equal(t, int64(-1), h.Stale, "not known for JetStream")
			p.RequireReported(t, h)
		})
	}

	t.Run("Refused", func(t *testing.T) {
		subject, name := horizonStream(t, e, 0, -1)
		e.publish(t, subject, "waiting", []byte("x"))
		p := horizontest.NewProbe(t, pg, "d", Source, consumer.HorizonRefuse)
		var ran atomic.Bool
		c, err := New(Config{Conn: e.nc, Stream: name, Durable: "d", Processor: p.Processor()},
			func(context.Context, pgx.Tx, *consumer.Message) error {
				ran.Store(true)
				return nil
			})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = c.Run(ctx)
		require.ErrorIs(t, err, consumer.ErrRedeliveryHorizon)
		var he *consumer.HorizonError
		require.ErrorAs(t, err, &he)
		require.Equal(t, name, he.Horizons[0].Topic)
		require.False(t, ran.Load(), "nothing was pulled")
		info := e.consumerInfo(t, name, "d")
		require.Zero(t, info.Delivered.Consumer, "nothing was delivered")
		v, ok := p.Headroom(t, name)
		require.True(t, ok)
		require.True(t, math.IsInf(v, -1))
	})

	t.Run("DeadLetterStream", func(t *testing.T) {
		for _, tc := range []struct {
			name     string
			dlMaxAge time.Duration
			noted    bool
		}{{"KeptForever", 0, true}, {"KeptBelowTTL", ttl / 2, false}} {
			t.Run(tc.name, func(t *testing.T) {
				_, name := horizonStream(t, e, ttl/2, tc.dlMaxAge)
				p := horizontest.NewProbe(t, pg, "d", Source, consumer.HorizonRefuse)
				pc := p.Processor()
				pc.DeadLetter = nil // the front's own, to <subject>.dlq
				c, err := New(Config{Conn: e.nc, Stream: name, Durable: "d", Processor: pc}, never)
				require.NoError(t, err)
				stop := run(t, c)
				stop()
				require.Len(t, p.Horizons(), 1, "dead letters are not exported")
				line := p.Line(horizontest.DeadLetters, "=DLQ-")
				if !tc.noted {
					require.Empty(t, line, p.Logs())
					return
				}
				require.Contains(t, line, "level=INFO", p.Logs())
				require.Contains(t, line, "retention=forever")
				require.Contains(t, line, "ledger_ttl="+ttl.String())
			})
		}
	})

	t.Run("CoreNATS", func(t *testing.T) {
		p := horizontest.NewProbe(t, pg, "q", Source, consumer.HorizonRefuse)
		c, err := New(Config{Conn: e.nc, Subject: testsvc.Unique("core"), Queue: "q", Processor: p.Processor()}, never)
		require.NoError(t, err)
		stop := run(t, c)
		stop()
		require.Empty(t, p.Horizons())
		require.Empty(t, p.Line("redelivery horizon"))
	})
}
