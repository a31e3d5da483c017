package metrics

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// DefaultBuckets are the handler duration histogram's buckets, in seconds:
// from half a millisecond (a duplicate answered by the ledger) to 30 s.
var DefaultBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// Dead-letter reasons, the values of the reason label of
// justonce_consumer_dead_lettered_total.
const (
	ReasonNoID       = "no_id"       // the message had no event ID
	ReasonInvalidKey = "invalid_key" // the event ID or tenant was rejected (too long, not UTF-8, ...)
	ReasonHandler    = "handler"     // the handler failed for good: a permanent error, or out of attempts
)

// ConsumerConfig configures a ConsumerCollector.
type ConsumerConfig struct {
	// Buckets of the handler duration histogram, in seconds. Default
	// DefaultBuckets.
	Buckets []float64
}

// ConsumerCollector is a prometheus.Collector of consumer metrics, fed by
// the consumer.Hooks that Hooks returns. One collector serves any number
// of processors.
type ConsumerCollector struct {
	duration     *prometheus.HistogramVec
	retries      *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	headroom     *prometheus.GaugeVec
	observed     *prometheus.CounterVec
}

// NewConsumerCollector returns a collector; register it, then give each
// processor its Hooks.
func NewConsumerCollector(cfg ConsumerConfig) *ConsumerCollector {
	if len(cfg.Buckets) == 0 {
		cfg.Buckets = DefaultBuckets
	}
	return &ConsumerCollector{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "justonce_consumer_handler_duration_seconds",
			Help:    "Duration of one attempt whose ledger call answered, from claim to commit (or to the ledger's answer when the handler did not run), by disposition: executed, duplicate, in_flight, mismatch.",
			Buckets: cfg.Buckets,
		}, []string{"scope", "source", "disposition"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_consumer_retries_total",
			Help: "Attempts that did not succeed and will be retried (handler error, database unavailable, event in flight elsewhere, dead-letter publish failed).",
		}, []string{"scope", "source"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_consumer_dead_lettered_total",
			Help: "Messages given up and dead-lettered, by reason: no_id, invalid_key, handler.",
		}, []string{"scope", "source", "reason"}),
		headroom: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "justonce_consumer_redelivery_headroom_seconds",
			Help: "How long the ledger keeps an event ID beyond the broker's redelivery horizon, measured when a consumer front's Run started: the ledger TTL minus how long the topic (Kafka: retention.ms + segment.ms) or stream (JetStream: MaxAge) keeps messages. Negative: a message may come again after the ledger forgot its ID, and run again; -Inf: the broker keeps messages without a time limit.",
		}, []string{"scope", "source", "topic"}),
		observed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_consumer_observed_total",
			Help: "Attempts an observe-mode consumer ran, by what dedupe would have done: would_run, would_skip, would_conflict, would_refuse_missing_key, would_refuse_invalid_key.",
		}, []string{"scope", "source", "would"}),
	}
}

// Describe implements prometheus.Collector.
func (c *ConsumerCollector) Describe(ch chan<- *prometheus.Desc) {
	c.duration.Describe(ch)
	c.retries.Describe(ch)
	c.deadLettered.Describe(ch)
	c.headroom.Describe(ch)
	c.observed.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *ConsumerCollector) Collect(ch chan<- prometheus.Metric) {
	c.duration.Collect(ch)
	c.retries.Collect(ch)
	c.deadLettered.Collect(ch)
	c.headroom.Collect(ch)
	c.observed.Collect(ch)
}

// Hooks returns the hooks that record a processor's work under the scope
// and source labels; give them the processor's consumer.Config.Scope (the
// consumer group when the transport defaults it) and Source. The retry and
// dead-letter counters of the pair start at zero, so rate() sees their
// first increase. The headroom gauge gets a series per topic (or stream)
// when a front's Run checks it at start (consumer.Hooks.OnHorizon), and
// the observe counter a series per would value an observe-mode consumer
// reports (consumer.Config.Observe, consumer.Hooks.OnObserve).
//
// To keep hooks of your own, call both from one consumer.Hooks.
func (c *ConsumerCollector) Hooks(scope string, source inbox.Source) consumer.Hooks {
	src := string(source)
	duration := c.duration.MustCurryWith(prometheus.Labels{"scope": scope, "source": src})
	retries := c.retries.WithLabelValues(scope, src)
	headroom := c.headroom.MustCurryWith(prometheus.Labels{"scope": scope, "source": src})
	observed := c.observed.MustCurryWith(prometheus.Labels{"scope": scope, "source": src})
	dead := map[string]prometheus.Counter{}
	for _, r := range []string{ReasonNoID, ReasonInvalidKey, ReasonHandler} {
		dead[r] = c.deadLettered.WithLabelValues(scope, src, r)
	}
	return consumer.Hooks{
		OnOutcome: func(_ *consumer.Message, out inbox.Outcome, took time.Duration) {
			duration.WithLabelValues(out.Disposition.String()).Observe(took.Seconds())
		},
		OnRetry: func(*consumer.Message, error) {
			retries.Inc()
		},
		OnDeadLetter: func(_ *consumer.Message, cause error) {
			dead[deadLetterReason(cause)].Inc()
		},
		OnHorizon: func(h consumer.Horizon) {
			headroom.WithLabelValues(h.Topic).Set(h.Headroom())
		},
		OnObserve: func(_ *consumer.Message, would string) {
			observed.WithLabelValues(would).Inc()
		},
	}
}

func deadLetterReason(cause error) string {
	switch {
	case errors.Is(cause, consumer.ErrNoID):
		return ReasonNoID
	case errors.Is(cause, inbox.ErrInvalidKey):
		return ReasonInvalidKey
	default:
		return ReasonHandler
	}
}
