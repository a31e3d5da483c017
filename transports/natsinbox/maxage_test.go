package natsinbox

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// Run warns when the stream may hand out a message after the ledger
// forgot its ID: a MaxAge above the ledger's TTL, and JetStream's default
// MaxAge 0 (messages kept for ever), the riskiest case. A MaxAge below the
// TTL is safe and draws no warning.
func TestWarnsWhenTheStreamOutlivesTheLedger(t *testing.T) {
	e := newEnv(t)
	pg := testsvc.Postgres(t, testsvc.MaxConns(4))
	const ttl = time.Hour
	const warning = "the stream keeps messages longer than the ledger keeps their IDs"
	for _, tc := range []struct {
		name   string
		maxAge time.Duration
		warn   bool
	}{
		{"MaxAge 0 (for ever)", 0, true},
		{"MaxAge above the TTL", 2 * ttl, true},
		{"MaxAge below the TTL", ttl / 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testsvc.LogBuffer
			ledger, err := inbox.New(pg.Pool, inbox.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			require.NoError(t, err)
			subject := testsvc.Unique("maxage")
			name := "S-" + subject
			_, err = e.js.CreateStream(context.Background(), jetstream.StreamConfig{
				Name: name, Subjects: []string{subject}, MaxAge: tc.maxAge, Storage: jetstream.MemoryStorage,
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = e.js.DeleteStream(context.Background(), name) })
			c, err := New(Config{Conn: e.nc, Stream: name, Durable: "d",
				Processor: consumer.Config{Ledger: ledger, TTL: ttl, DeadLetter: func(context.Context, *consumer.Message, error) error { return nil }},
			}, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
			require.NoError(t, err)
			stop := run(t, c) // the check runs before the consumer is ready
			stop()
			got := strings.Contains(logs.String(), warning)
			if tc.warn {
				require.True(t, got, "no warning for a stream with MaxAge %s and a ledger TTL of %s; logs:\n%s", tc.maxAge, ttl, logs.String())
			} else {
				require.False(t, got, "a warning for a stream with MaxAge %s below the ledger TTL %s; logs:\n%s", tc.maxAge, ttl, logs.String())
			}
		})
	}
}
