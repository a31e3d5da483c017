package metrics_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/justonce/justonce/metrics"
)

// TestAlertRules checks alerts.yml: it parses as Prometheus rule groups,
// every rule is complete, and every metric it names is one this package
// exports.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("alerts.yml")
	require.NoError(t, err)
	var doc struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&doc))
	require.Len(t, doc.Groups, 1)

	exported := exportedNames(t)
	metricName := regexp.MustCompile(`justonce_[a-z_]+`)
	seen := map[string]bool{}
	alerts := map[string]bool{}
	for _, r := range doc.Groups[0].Rules {
		require.Regexp(t, `^Justonce[A-Za-z]+$`, r.Alert)
		require.False(t, alerts[r.Alert], "duplicate alert %s", r.Alert)
		alerts[r.Alert] = true
		require.NotEmpty(t, r.Expr, r.Alert)
		require.Contains(t, []string{"info", "warning", "critical"}, r.Labels["severity"], r.Alert)
		require.NotEmpty(t, r.Annotations["summary"], r.Alert)
		require.Equal(t, strings.Count(r.Expr, "("), strings.Count(r.Expr, ")"), r.Alert)
		names := metricName.FindAllString(r.Expr, -1)
		require.NotEmpty(t, names, r.Alert)
		for _, n := range names {
			base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_count"), "_sum")
			require.True(t, exported[n] || exported[base], "%s uses %s, which the package does not export", r.Alert, n)
			seen[base] = true
		}
	}
	// The alerts: stuck leases, conflict rate, Redis fallback, dead letters.
	for _, n := range []string{"justonce_ledger_oldest_lease_overdue_seconds", "justonce_ledger_calls_total",
		"justonce_ledger_redis_fallbacks_total", "justonce_consumer_dead_lettered_total",
		"justonce_outbox_oldest_pending_age_seconds", "justonce_outbox_pending", "justonce_outbox_failed"} {
		require.True(t, seen[n], "no alert on %s", n)
	}
}

// exportedNames lists the metric names the collectors describe.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	ch := make(chan *prometheus.Desc, 64)
	metrics.NewConsumerCollector(metrics.ConsumerConfig{}).Describe(ch)
	// Describing needs no ledger.
	metrics.NewLedgerCollector(nil, metrics.LedgerConfig{Replication: true}).Describe(ch)
	metrics.NewOutboxCollector(nil, metrics.OutboxConfig{}).Describe(ch)
	close(ch)
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	for d := range ch {
		m := fq.FindStringSubmatch(d.String())
		require.NotNil(t, m, d.String())
		names[m[1]] = true
	}
	require.Len(t, names, 27)
	return names
}
