package metrics

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/justonce/justonce/outbox"
)

// OutboxConfig configures an OutboxCollector. The zero value queries the
// outbox table at every scrape, for at most DefaultStatsTimeout.
type OutboxConfig struct {
	// StatsTimeout bounds the table query (outbox.Outbox.Stats) of a
	// scrape. When it runs out, or the query fails,
	// justonce_outbox_stats_up is 0 and the table metrics are left out of
	// that scrape; the counters are exported anyway. Default
	// DefaultStatsTimeout.
	StatsTimeout time.Duration
	// StatsMaxAge lets scrapes within this time of the last successful
	// query reuse its answer. Default 0: every scrape queries.
	StatsMaxAge time.Duration
	// DisableStats exports the counters only and never queries the table,
	// for example on all instances but one.
	DisableStats bool
}

// OutboxCollector is a prometheus.Collector for a transactional outbox:
// the relays' counters, fed by the outbox.RelayHooks that Hooks returns,
// and the table as every instance sees it, queried at each scrape:
//
//	justonce_outbox_pending                     messages waiting for a relay
//	justonce_outbox_oldest_pending_age_seconds  age of the oldest pending message; 0 when none
//	justonce_outbox_failed                      messages refused for good, waiting for retry or purge
//	justonce_outbox_stats_up                    1 when the last query answered, else 0
//	justonce_outbox_published_total{broker}     messages published (acked) by this process's relays
//	justonce_outbox_failed_total{broker}        messages this process's relays marked failed
//	justonce_outbox_publish_retries_total{broker}
//	                                            publishes that failed for the time being (retried)
//
// Register it once per outbox; give every relay of the process its Hooks.
type OutboxCollector struct {
	outbox *outbox.Outbox
	cfg    OutboxConfig

	published, failedTotal, retries *prometheus.CounterVec
	pending, oldestAge, failed, up  *prometheus.Desc

	mu     sync.Mutex // one query at a time; guards the cache
	last   outbox.Stats
	lastAt time.Time
}

// NewOutboxCollector returns a collector for o.
func NewOutboxCollector(o *outbox.Outbox, cfg OutboxConfig) *OutboxCollector {
	if cfg.StatsTimeout <= 0 {
		cfg.StatsTimeout = DefaultStatsTimeout
	}
	return &OutboxCollector{
		outbox: o,
		cfg:    cfg,
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_outbox_published_total",
			Help: "Outbox messages the broker acked and the relay deleted, by broker (kafka, nats).",
		}, []string{"broker"}),
		failedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_outbox_failed_total",
			Help: "Outbox messages the broker refused for good (too large, unknown topic, no stream), marked failed, by broker.",
		}, []string{"broker"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_outbox_publish_retries_total",
			Help: "Outbox publishes that failed for the time being; the message stays pending and its lane is retried with backoff.",
		}, []string{"broker"}),
		pending: prometheus.NewDesc("justonce_outbox_pending",
			"Outbox messages waiting for a relay.", nil, nil),
		oldestAge: prometheus.NewDesc("justonce_outbox_oldest_pending_age_seconds",
			"Age of the oldest pending outbox message (0 when none): a value that keeps growing means no relay publishes.", nil, nil),
		failed: prometheus.NewDesc("justonce_outbox_failed",
			"Outbox messages refused for good, waiting for `justonce outbox retry` or `purge`.", nil, nil),
		up: prometheus.NewDesc("justonce_outbox_stats_up",
			"1 when the last query of the outbox table answered in time, else 0.", nil, nil),
	}
}

// Hooks returns the relay hooks that feed the collector's counters.
func (c *OutboxCollector) Hooks() outbox.RelayHooks {
	return outbox.RelayHooks{
		OnPublished: func(b outbox.Broker, _, n int) { c.published.WithLabelValues(string(b)).Add(float64(n)) },
		OnFailed:    func(err *outbox.PublishError) { c.failedTotal.WithLabelValues(string(err.Broker)).Inc() },
		OnRetry:     func(err *outbox.PublishError) { c.retries.WithLabelValues(string(err.Broker)).Inc() },
	}
}

// Describe implements prometheus.Collector.
func (c *OutboxCollector) Describe(ch chan<- *prometheus.Desc) {
	c.published.Describe(ch)
	c.failedTotal.Describe(ch)
	c.retries.Describe(ch)
	if !c.cfg.DisableStats {
		ch <- c.pending
		ch <- c.oldestAge
		ch <- c.failed
		ch <- c.up
	}
}

// Collect implements prometheus.Collector. It queries the outbox table
// (unless DisableStats), for at most StatsTimeout.
func (c *OutboxCollector) Collect(ch chan<- prometheus.Metric) {
	c.published.Collect(ch)
	c.failedTotal.Collect(ch)
	c.retries.Collect(ch)
	if c.cfg.DisableStats {
		return
	}
	st, err := c.stats()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(st.Pending))
	ch <- prometheus.MustNewConstMetric(c.oldestAge, prometheus.GaugeValue, st.OldestPendingAge.Seconds())
	ch <- prometheus.MustNewConstMetric(c.failed, prometheus.GaugeValue, float64(st.Failed))
}

func (c *OutboxCollector) stats() (outbox.Stats, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cfg.StatsMaxAge > 0 && !c.lastAt.IsZero() && time.Since(c.lastAt) < c.cfg.StatsMaxAge {
		return c.last, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatsTimeout)
	defer cancel()
	st, err := c.outbox.Stats(ctx)
	if err != nil {
		return outbox.Stats{}, err
	}
	c.last, c.lastAt = st, time.Now()
	return st, nil
}
