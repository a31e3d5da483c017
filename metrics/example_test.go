package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// Register the ledger's collector and serve /metrics.
func ExampleNewLedgerCollector() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewLedgerCollector(ledger, metrics.LedgerConfig{
		// The rows query scans processed_events: on a big table, reuse
		// its answer for a minute.
		StatsMaxAge: time.Minute,
	}))
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))

	// What the collector exports (pgxpool.New connects lazily, so this runs
	// without a database; a scrape queries it).
	descs := make(chan *prometheus.Desc, 16)
	metrics.NewLedgerCollector(ledger, metrics.LedgerConfig{}).Describe(descs)
	close(descs)
	for d := range descs {
		s := d.String()
		name := s[strings.Index(s, `"`)+1:]
		fmt.Println(name[:strings.Index(name, `"`)])
	}
	// Output:
	// justonce_ledger_calls_total
	// justonce_ledger_cache_replays_total
	// justonce_ledger_redis_fallbacks_total
	// justonce_ledger_redis_recoveries_total
	// justonce_ledger_leases_lost_total
	// justonce_ledger_overloaded_total
	// justonce_ledger_steps_total
	// justonce_ledger_steps_resumed_total
	// justonce_ledger_rows
	// justonce_ledger_oldest_lease_overdue_seconds
	// justonce_ledger_stats_up
}

// Give a processor the collector's hooks; the processor calls them. Here
// they are called by hand to show what each records.
func ExampleConsumerCollector_Hooks() {
	cc := metrics.NewConsumerCollector(metrics.ConsumerConfig{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(cc)

	hooks := cc.Hooks("billing", inbox.Source("kafka"))
	_ = consumer.Config{Scope: "billing", Source: inbox.Source("kafka"), Hooks: hooks} // with Ledger and a handler: consumer.New

	m := &consumer.Message{ID: "evt-1", Topic: "payments"}
	hooks.OnOutcome(m, inbox.Outcome{Disposition: inbox.Executed}, 3*time.Millisecond)
	hooks.OnOutcome(m, inbox.Outcome{Disposition: inbox.Duplicate}, time.Millisecond)
	hooks.OnRetry(m, errors.New("deadlock"))
	hooks.OnDeadLetter(&consumer.Message{}, consumer.ErrNoID)

	printMetrics(reg)
	// Output:
	// justonce_consumer_dead_lettered_total reason=handler scope=billing source=kafka: 0
	// justonce_consumer_dead_lettered_total reason=invalid_key scope=billing source=kafka: 0
	// justonce_consumer_dead_lettered_total reason=no_id scope=billing source=kafka: 1
	// justonce_consumer_handler_duration_seconds disposition=duplicate scope=billing source=kafka: 1 observed
	// justonce_consumer_handler_duration_seconds disposition=executed scope=billing source=kafka: 1 observed
	// justonce_consumer_retries_total scope=billing source=kafka: 1
}

// Give each bridge the collector's Observer; an observe-mode route or
// method calls it for every request it lets through. Here it is called by
// hand to show what it counts.
func ExampleBridgeCollector_Observer() {
	bc := metrics.NewBridgeCollector()
	reg := prometheus.NewRegistry()
	reg.MustRegister(bc)

	observe := bc.Observer("http") // httpbridge.Config{OnObserve: observe}
	observe("orders", "would_run")
	observe("orders", "would_replay")
	observe("orders", "would_replay")

	printMetrics(reg)
	// Output:
	// justonce_bridge_observed_total front=http route=orders would=would_replay: 2
	// justonce_bridge_observed_total front=http route=orders would=would_run: 1
}

// printMetrics prints what reg gathers: counters' values, histograms'
// sample counts.
func printMetrics(reg *prometheus.Registry) {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			labels := ""
			for _, lp := range s.GetLabel() {
				labels += " " + lp.GetName() + "=" + lp.GetValue()
			}
			switch {
			case s.Histogram != nil:
				fmt.Printf("%s%s: %d observed\n", mf.GetName(), labels, s.GetHistogram().GetSampleCount())
			default:
				fmt.Printf("%s%s: %g\n", mf.GetName(), labels, s.GetCounter().GetValue())
			}
		}
	}
}
