package metrics

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/justonce/justonce/inbox"
)

// DefaultStatsTimeout bounds the ledger rows query of one scrape.
const DefaultStatsTimeout = 2 * time.Second

// LedgerConfig configures a LedgerCollector. The zero value queries the
// ledger's rows at every scrape, for at most DefaultStatsTimeout.
type LedgerConfig struct {
	// StatsTimeout bounds the rows query (inbox.Ledger.Stats) of a scrape.
	// When it runs out, or the query fails, justonce_ledger_stats_up is 0
	// and the row metrics are left out of that scrape; the counters are
	// exported anyway. Default DefaultStatsTimeout.
	StatsTimeout time.Duration
	// StatsMaxAge lets scrapes within this time of the last successful
	// query reuse its answer. The query counts the table's live rows
	// (a scan): on a large table, or with several Prometheus servers
	// scraping, set it to a minute or so. Default 0: every scrape queries.
	StatsMaxAge time.Duration
	// DisableStats exports the counters only and never queries the table,
	// for example on all instances but one.
	DisableStats bool
	// Replication also asks the database at each scrape, within
	// StatsTimeout, whether the ledger's commits are on a standby before
	// they are acknowledged (inbox.Ledger.CheckReplication), and exports
	// justonce_ledger_commit_durable, justonce_ledger_standbys,
	// justonce_ledger_sync_standbys and justonce_ledger_replication_up.
	// Set it where a failover promotes a standby. Default false.
	Replication bool
}

// LedgerCollector is a prometheus.Collector for an *inbox.Ledger: its
// counters, and the rows of processed_events by scope and status with the
// age of the oldest in-flight lease. Register it once per ledger.
type LedgerCollector struct {
	ledger *inbox.Ledger
	cfg    LedgerConfig

	calls, cacheReplays, redisFallbacks, redisRecoveries, leasesLost, overloaded *prometheus.Desc
	steps, stepsResumed                                                          *prometheus.Desc
	rows, leaseOverdue, statsUp                                                  *prometheus.Desc
	durable, standbys, syncStandbys, replicationUp                               *prometheus.Desc

	mu     sync.Mutex // one query at a time; guards the cache
	last   []inbox.ScopeStats
	lastAt time.Time
}

// NewLedgerCollector returns a collector for l.
func NewLedgerCollector(l *inbox.Ledger, cfg LedgerConfig) *LedgerCollector {
	if cfg.StatsTimeout <= 0 {
		cfg.StatsTimeout = DefaultStatsTimeout
	}
	return &LedgerCollector{
		ledger: l,
		cfg:    cfg,
		calls: prometheus.NewDesc("justonce_ledger_calls_total",
			"Ledger calls by what they did: executed (the handler ran and committed), duplicate (done before; the handler did not run), in_flight (another caller held the key), mismatch (same key, other fingerprint), error (the handler or the database failed).",
			[]string{"disposition"}, nil),
		cacheReplays: prometheus.NewDesc("justonce_ledger_cache_replays_total",
			"Duplicates answered from the Redis replay cache without asking Postgres.", nil, nil),
		redisFallbacks: prometheus.NewDesc("justonce_ledger_redis_fallbacks_total",
			"Redis calls that failed or timed out; Postgres carried on alone.", nil, nil),
		redisRecoveries: prometheus.NewDesc("justonce_ledger_redis_recoveries_total",
			"Redis calls answered after one or more had failed: the end of a fallback episode, when the fast path is back (after a Sentinel failover, once the new master answers).", nil, nil),
		leasesLost: prometheus.NewDesc("justonce_ledger_leases_lost_total",
			"Leases found taken over or released when renewing or completing them, or recording a step.", nil, nil),
		overloaded: prometheus.NewDesc("justonce_ledger_overloaded_total",
			"Ledger calls shed because no database connection came free within their acquire wait (inbox.Request.AcquireWait, the bridges' Config.AcquireWait): nothing ran; the bridges answered 503 or Unavailable. Also counted as calls with disposition error.", nil, nil),
		steps: prometheus.NewDesc("justonce_ledger_steps_total",
			"Steps (inbox.Ledger.DoSteps) this process ran and recorded, by kind: tx (a Postgres step, its writes and its record in one transaction), call (an outside call, recorded after it returned), compensate (the undoing of a completed step after a permanent failure).",
			[]string{"kind"}, nil),
		stepsResumed: prometheus.NewDesc("justonce_ledger_steps_resumed_total",
			"Steps skipped because they were recorded already: attempts resuming after an error, a crash or a lost lease.", nil, nil),
		rows: prometheus.NewDesc("justonce_ledger_rows",
			"Live (unexpired) rows of processed_events by scope and status.",
			[]string{"scope", "status"}, nil),
		leaseOverdue: prometheus.NewDesc("justonce_ledger_oldest_lease_overdue_seconds",
			"Seconds since the earliest lease of the scope's processing rows ran out (negative while it still runs). A large value is a stuck key.",
			[]string{"scope"}, nil),
		statsUp: prometheus.NewDesc("justonce_ledger_stats_up",
			"1 when the last query of the ledger's rows answered in time, else 0.", nil, nil),
		durable: prometheus.NewDesc("justonce_ledger_commit_durable",
			"1 when the database acknowledges the ledger's commits only once a synchronous standby has them (a failover to it loses none), 0 when it acknowledges them before any standby has them (synchronous_commit local or off, synchronous_standby_names empty, or the server is a standby).", nil, nil),
		standbys: prometheus.NewDesc("justonce_ledger_standbys",
			"Standbys streaming from the ledger's database (pg_stat_replication).", nil, nil),
		syncStandbys: prometheus.NewDesc("justonce_ledger_sync_standbys",
			"Standbys the ledger's database waits for at each commit now; absent when the ledger's role may not read it (grant pg_read_all_stats).", nil, nil),
		replicationUp: prometheus.NewDesc("justonce_ledger_replication_up",
			"1 when the last replication query answered in time, else 0.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *LedgerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.calls, c.cacheReplays, c.redisFallbacks, c.redisRecoveries, c.leasesLost, c.overloaded,
		c.steps, c.stepsResumed} {
		ch <- d
	}
	if !c.cfg.DisableStats {
		ch <- c.rows
		ch <- c.leaseOverdue
		ch <- c.statsUp
	}
	if c.cfg.Replication {
		ch <- c.durable
		ch <- c.standbys
		ch <- c.syncStandbys
		ch <- c.replicationUp
	}
}

// Collect implements prometheus.Collector. It queries the ledger's rows
// (unless DisableStats) and its database's replication (with
// Replication), each for at most StatsTimeout.
func (c *LedgerCollector) Collect(ch chan<- prometheus.Metric) {
	n := c.ledger.Counters()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(c.calls, n.Executed, inbox.Executed.String())
	counter(c.calls, n.Duplicates, inbox.Duplicate.String())
	counter(c.calls, n.InFlight, inbox.InFlight.String())
	counter(c.calls, n.Mismatches, inbox.Mismatch.String())
	counter(c.calls, n.Errors, "error")
	counter(c.cacheReplays, n.CacheHits)
	counter(c.redisFallbacks, n.RedisFallbacks)
	counter(c.redisRecoveries, n.RedisRecoveries)
	counter(c.leasesLost, n.LeasesLost)
	counter(c.overloaded, n.Overloaded)
	counter(c.steps, n.StepsTx, string(inbox.StepTx))
	counter(c.steps, n.StepsCall, string(inbox.StepCall))
	counter(c.steps, n.StepsCompensate, string(inbox.StepCompensate))
	counter(c.stepsResumed, n.StepsResumed)
	if c.cfg.Replication {
		c.collectReplication(ch)
	}
	if c.cfg.DisableStats {
		return
	}

	st, now, err := c.stats()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.statsUp, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.statsUp, prometheus.GaugeValue, 1)
	for _, s := range st {
		ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(s.Rows), s.Scope, string(s.Status))
		if s.Status == inbox.StatusProcessing && !s.OldestLease.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.leaseOverdue, prometheus.GaugeValue, now.Sub(s.OldestLease).Seconds(), s.Scope)
		}
	}
}

// stats returns the ledger's rows, from the cache when fresh enough, and
// the time they stand for.
func (c *LedgerCollector) stats() ([]inbox.ScopeStats, time.Time, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cfg.StatsMaxAge > 0 && !c.lastAt.IsZero() && time.Since(c.lastAt) < c.cfg.StatsMaxAge {
		// The overdue gauge is as of the query: a cached answer repeats
		// it rather than extrapolating from rows that may have changed.
		return c.last, c.lastAt, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatsTimeout)
	defer cancel()
	st, err := c.ledger.Stats(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	c.last, c.lastAt = st, time.Now()
	return st, c.lastAt, nil
}

// collectReplication exports what the ledger's database says about its
// standbys.
func (c *LedgerCollector) collectReplication(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatsTimeout)
	defer cancel()
	r, err := c.ledger.CheckReplication(ctx)
	if err != nil && !errors.Is(err, inbox.ErrNotReplicated) {
		gauge(c.replicationUp, 0)
		return
	}
	gauge(c.replicationUp, 1)
	durable := 0.0
	if r.Durable() {
		durable = 1
	}
	gauge(c.durable, durable)
	gauge(c.standbys, float64(r.Standbys))
	if r.SyncStandbys >= 0 {
		gauge(c.syncStandbys, float64(r.SyncStandbys))
	}
}
