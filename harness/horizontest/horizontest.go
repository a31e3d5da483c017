// Package horizontest runs the redelivery horizon check's tests
// (consumer.Config.Horizon) over a consumer front, against its real
// broker: a Probe observes a front's check (its logs, its OnHorizon hook
// and the metrics package's headroom gauge), and Kafka runs the same cases
// over both Kafka fronts, each called from the test files beside the front
// with a KafkaTarget that says how to reach the broker with its client.
// The package itself links no broker client.
package horizontest

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// TTL is the ledger TTL of a Probe's processor.
const TTL = time.Hour

// The start of the lines the fronts log (after their prefix).
const (
	// Outlives is the warning of a topic (or stream) that keeps messages
	// longer than the ledger keeps IDs (after "the topic " or "the
	// stream ").
	Outlives = "keeps messages longer than the ledger keeps their IDs"
	// Unchecked is the warning of a check that could not be made.
	Unchecked = "could not check the redelivery horizon"
	// Behind is the warning of a group with messages older than the TTL
	// waiting.
	Behind = "has not consumed were written more than the ledger TTL ago"
	// DeadLetters is the note of a dead-letter topic (or stream) that
	// keeps dead letters longer than the ledger keeps IDs.
	DeadLetters = "keeps dead letters longer than the ledger keeps IDs"
)

// Probe is a ledger and a consumer.Config whose front's check is
// observed: the ledger's log, the horizons its OnHorizon hook received,
// and a metrics.ConsumerCollector fed by the same hooks.
type Probe struct {
	logs     testsvc.LogBuffer
	reg      *prometheus.Registry
	pc       consumer.Config
	mu       sync.Mutex
	horizons []consumer.Horizon
}

// NewProbe returns a probe whose Processor has a ledger of its own on pg
// (logging at debug level), TTL, the policy, and the hooks of a
// ConsumerCollector for scope and source.
func NewProbe(t testing.TB, pg *testsvc.PG, scope string, source inbox.Source, policy consumer.HorizonPolicy) *Probe {
	t.Helper()
	p := &Probe{reg: prometheus.NewRegistry()}
	l, err := inbox.New(pg.Pool, inbox.Config{Logger: slog.New(slog.NewTextHandler(&p.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	cc := metrics.NewConsumerCollector(metrics.ConsumerConfig{})
	p.reg.MustRegister(cc)
	hooks := cc.Hooks(scope, source)
	record := hooks.OnHorizon
	hooks.OnHorizon = func(h consumer.Horizon) {
		record(h)
		p.mu.Lock()
		p.horizons = append(p.horizons, h)
		p.mu.Unlock()
	}
	p.pc = consumer.Config{Ledger: l, Scope: scope, Source: source, TTL: TTL, Horizon: policy, Hooks: hooks,
		DeadLetter: func(context.Context, *consumer.Message, error) error { return nil }}
	return p
}

// Processor is the consumer.Config to give the front. Its DeadLetter
// drops dead letters (the check then has no dead-letter topic to read);
// set it to nil to keep the front's own.
func (p *Probe) Processor() consumer.Config { return p.pc }

// Horizons returns what the OnHorizon hook received so far.
func (p *Probe) Horizons() []consumer.Horizon {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]consumer.Horizon(nil), p.horizons...)
}

// Horizon waits (up to a minute) for the hook to receive topic's horizon
// and returns it.
func (p *Probe) Horizon(t testing.TB, topic string) consumer.Horizon {
	t.Helper()
	var got consumer.Horizon
	testsvc.Eventually(t, time.Minute, func() bool {
		for _, h := range p.Horizons() {
			if h.Topic == topic {
				got = h
				return true
			}
		}
		return false
	}, "the horizon of %s reported; logs:\n%s", topic, p.Logs())
	return got
}

// Logs returns what the ledger's logger received.
func (p *Probe) Logs() string { return p.logs.String() }

// Line returns the first log line that holds every one of parts, or "".
func (p *Probe) Line(parts ...string) string {
	for l := range strings.SplitSeq(p.Logs(), "\n") {
		all := true
		for _, s := range parts {
			all = all && strings.Contains(l, s)
		}
		if all {
			return l
		}
	}
	return ""
}

// Headroom returns the value of
// justonce_consumer_redelivery_headroom_seconds for topic, and whether the
// series exists.
func (p *Probe) Headroom(t testing.TB, topic string) (float64, bool) {
	t.Helper()
	mfs, err := p.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "justonce_consumer_redelivery_headroom_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "topic" && l.GetValue() == topic {
					return m.GetGauge().GetValue(), true
				}
			}
		}
	}
	return 0, false
}

// RequireReported checks what the front reported of h's topic: the gauge
// is h's headroom (−Inf when unbounded), and a warning with the numbers
// was logged exactly when the horizon exceeds TTL (under HorizonWarn).
func (p *Probe) RequireReported(t testing.TB, h consumer.Horizon) {
	t.Helper()
	require.Equal(t, TTL, h.TTL)
	got, ok := p.Headroom(t, h.Topic)
	require.True(t, ok, "no headroom series for %s", h.Topic)
	if h.Unbounded {
		require.True(t, math.IsInf(got, -1), "headroom %v of a topic kept forever", got)
	} else {
		require.Equal(t, (TTL - h.Retention).Seconds(), got)
	}
	line := p.Line(Outlives, "="+h.Topic+" ")
	if !h.Exceeded() {
		require.Empty(t, line, "a warning for %+v; logs:\n%s", h, p.Logs())
		return
	}
	require.NotEmpty(t, line, "no warning for %+v; logs:\n%s", h, p.Logs())
	require.Contains(t, line, "level=WARN")
	require.Contains(t, line, "retention="+h.RetentionString())
	require.Contains(t, line, "ledger_ttl="+TTL.String())
}

// Record is a message KafkaTarget.Produce publishes.
type Record struct {
	ID   string
	Time time.Time // the record's timestamp (CreateTime)
}

// KafkaTarget is one Kafka front under the tests, with its client.
type KafkaTarget struct {
	// Source is the front's inbox.Source.
	Source inbox.Source
	// CreateTopic creates the topic name (empty: a new name) of 2
	// partitions with the given topic configs (none: the broker's
	// defaults) and returns its name.
	CreateTopic func(t testing.TB, brokers []string, name string, configs map[string]string) string
	// DeadLetterSuffix names a topic's dead-letter topic by default.
	DeadLetterSuffix string
	// Produce publishes recs to topic, each with its ID where the front's
	// DefaultID reads it and with its Time.
	Produce func(t testing.TB, brokers []string, topic string, recs []Record)
	// Consumer returns a consumer of topic in group running pc and h,
	// whose client dials through dial (kafka-go: the reader's Dialer;
	// franz-go: kgo.Dialer).
	Consumer func(t testing.TB, brokers []string, topic, group string, pc consumer.Config, h consumer.Handler,
		dial func(ctx context.Context, network, addr string) (net.Conn, error)) interface {
		Run(context.Context) error
	}
}

// Kafka runs the horizon check's cases over tg:
//
//   - a topic whose retention.ms + segment.ms is within TTL: no warning,
//     the headroom is TTL minus both, and retention.bytes is named as
//     not counted;
//   - a topic with the broker's defaults (a week each in stock Kafka): a
//     warning with the numbers, a negative headroom;
//   - retention.ms -1, and a compacted topic: unbounded, −Inf;
//   - HorizonRefuse on a topic that outlives the ledger: Run returns a
//     *consumer.HorizonError (ErrRedeliveryHorizon) before it consumes
//     the message waiting, having asked through the front's dialer;
//   - the group's lag: a new group with records older than TTL waiting is
//     warned about with the counts; once it has consumed, none;
//   - a topic that does not exist, under HorizonRefuse: the check fails,
//     is logged, and Run consumes;
//   - the front's own dead letters, to a topic kept forever: noted (at
//     info level), neither warned about nor exported;
//   - HorizonOff: no series, no warning.
func Kafka(t *testing.T, tg KafkaTarget) {
	brokers := testsvc.KafkaBrokers(t)
	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	never := func(context.Context, pgx.Tx, *consumer.Message) error { return errors.New("the handler ran") }
	// check runs a consumer of topic under policy until its check
	// reported (or failed), stops it, and returns the probe.
	check := func(t *testing.T, topic string, policy consumer.HorizonPolicy) *Probe {
		group := testsvc.Unique("horizon")
		p := NewProbe(t, pg, group, tg.Source, policy)
		stop, _ := consumertest.Start(t, tg.Consumer(t, brokers, topic, group, p.Processor(), never, nil))
		testsvc.Eventually(t, time.Minute, func() bool {
			return len(p.Horizons()) > 0 || p.Line(Unchecked) != ""
		}, "the check of %s; logs:\n%s", topic, p.Logs())
		stop() // Run returns: every line of the check is written
		return p
	}

	t.Run("WithinTTL", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", map[string]string{"retention.ms": "600000", "segment.ms": "900000", "retention.bytes": "1048576"})
		p := check(t, topic, consumer.HorizonWarn)
		h := p.Horizon(t, topic)
		require.False(t, h.Unbounded)
		require.Equal(t, 25*time.Minute, h.Retention, "retention.ms + segment.ms")
		require.Contains(t, h.Basis, "retention.bytes 1048576")
		p.RequireReported(t, h)
	})
	t.Run("BrokerDefaults", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", nil)
		p := check(t, topic, consumer.HorizonWarn)
		h := p.Horizon(t, topic)
		require.True(t, h.Exceeded(), "%+v", h)
		require.Contains(t, h.Basis, "retention.ms")
		require.Contains(t, h.Basis, "segment.ms")
		p.RequireReported(t, h)
		require.Less(t, h.Headroom(), 0.0)
	})
	for name, configs := range map[string]map[string]string{
		"RetentionForever": {"retention.ms": "-1"},
		"Compacted":        {"cleanup.policy": "compact"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			topic := tg.CreateTopic(t, brokers, "", configs)
			p := check(t, topic, consumer.HorizonWarn)
			h := p.Horizon(t, topic)
			require.True(t, h.Unbounded, "%+v", h)
			p.RequireReported(t, h)
		})
	}
	t.Run("Refused", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", map[string]string{"retention.ms": "-1"})
		tg.Produce(t, brokers, topic, []Record{{ID: "waiting", Time: time.Now()}})
		group := testsvc.Unique("horizon")
		p := NewProbe(t, pg, group, tg.Source, consumer.HorizonRefuse)
		var dials atomic.Int64
		var d net.Dialer
		dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, network, addr)
		}
		var ran atomic.Bool
		c := tg.Consumer(t, brokers, topic, group, p.Processor(), func(context.Context, pgx.Tx, *consumer.Message) error {
			ran.Store(true)
			return nil
		}, dial)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err := c.Run(ctx)
		require.ErrorIs(t, err, consumer.ErrRedeliveryHorizon)
		var he *consumer.HorizonError
		require.ErrorAs(t, err, &he)
		require.Len(t, he.Horizons, 1)
		require.Equal(t, topic, he.Horizons[0].Topic)
		require.True(t, he.Horizons[0].Unbounded)
		require.Contains(t, err.Error(), topic)
		require.NoError(t, ctx.Err(), "Run returned at once")
		require.False(t, ran.Load(), "nothing was consumed")
		require.Positive(t, dials.Load(), "the check dials as the front's client does (TLS, SASL)")
		v, ok := p.Headroom(t, topic)
		require.True(t, ok)
		require.True(t, math.IsInf(v, -1))
		require.Empty(t, p.Line(Outlives), "refused, not warned")
	})
	t.Run("GroupBehind", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", nil)
		old := time.Now().Add(-2 * TTL)
		tg.Produce(t, brokers, topic, []Record{
			{ID: "old-1", Time: old}, {ID: "old-2", Time: old}, {ID: "old-3", Time: old},
			{ID: "new-1", Time: time.Now()}, {ID: "new-2", Time: time.Now()},
		})
		group := testsvc.Unique("horizon")
		p := NewProbe(t, pg, group, tg.Source, consumer.HorizonWarn)
		var ran atomic.Int64
		stop, _ := consumertest.Start(t, tg.Consumer(t, brokers, topic, group, p.Processor(),
			func(context.Context, pgx.Tx, *consumer.Message) error {
				ran.Add(1)
				return nil
			}, nil))
		h := p.Horizon(t, topic)
		require.Equal(t, int64(5), h.Behind, "a new group reads from the start")
		require.Equal(t, int64(3), h.Stale, "three records were written two TTLs ago")
		testsvc.Eventually(t, time.Minute, func() bool { return ran.Load() == 5 }, "the five records ran")
		stop() // commits
		line := p.Line(Behind, "="+topic+" ")
		require.Contains(t, line, "level=WARN")
		require.Contains(t, line, "behind=5")
		require.Contains(t, line, "older_than_ttl=3")

		// The same group, caught up: nothing behind, no warning.
		again := NewProbe(t, pg, group, tg.Source, consumer.HorizonWarn)
		stop, _ = consumertest.Start(t, tg.Consumer(t, brokers, topic, group, again.Processor(), never, nil))
		h = again.Horizon(t, topic)
		stop()
		require.Zero(t, h.Behind)
		require.Zero(t, h.Stale)
		require.Empty(t, again.Line(Behind), again.Logs())
	})
	t.Run("CheckFails", func(t *testing.T) {
		t.Parallel()
		topic := testsvc.Unique("missing")
		p := check(t, topic, consumer.HorizonRefuse)
		line := p.Line(Unchecked)
		require.Contains(t, line, "level=WARN")
		require.Contains(t, line, topic)
		require.Empty(t, p.Horizons())
		_, ok := p.Headroom(t, topic)
		require.False(t, ok)
	})
	t.Run("DeadLetters", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", map[string]string{"retention.ms": "600000", "segment.ms": "600000"})
		dlq := tg.CreateTopic(t, brokers, topic+tg.DeadLetterSuffix, map[string]string{"retention.ms": "-1"})
		group := testsvc.Unique("horizon")
		p := NewProbe(t, pg, group, tg.Source, consumer.HorizonRefuse)
		pc := p.Processor()
		pc.DeadLetter = nil // the front's own
		stop, _ := consumertest.Start(t, tg.Consumer(t, brokers, topic, group, pc, never, nil))
		h := p.Horizon(t, topic)
		stop()
		require.False(t, h.Exceeded())
		line := p.Line(DeadLetters, "="+dlq+" ")
		require.Contains(t, line, "level=INFO", p.Logs())
		require.Contains(t, line, "retention=forever")
		require.Len(t, p.Horizons(), 1, "dead letters are not exported")
		require.Empty(t, p.Line(Outlives))
	})
	t.Run("Off", func(t *testing.T) {
		t.Parallel()
		topic := tg.CreateTopic(t, brokers, "", map[string]string{"retention.ms": "-1"})
		group := testsvc.Unique("horizon")
		p := NewProbe(t, pg, group, tg.Source, consumer.HorizonOff)
		ready := make(chan struct{})
		var once sync.Once
		c := tg.Consumer(t, brokers, topic, group, p.Processor(), func(context.Context, pgx.Tx, *consumer.Message) error {
			once.Do(func() { close(ready) })
			return nil
		}, nil)
		tg.Produce(t, brokers, topic, []Record{{ID: "off-1", Time: time.Now()}})
		stop, _ := consumertest.Start(t, c)
		select {
		case <-ready:
		case <-time.After(time.Minute):
			t.Fatal("the message did not run")
		}
		stop()
		require.Empty(t, p.Horizons())
		require.Empty(t, p.Line(Outlives))
		require.Empty(t, p.Line(Unchecked))
	})
}
