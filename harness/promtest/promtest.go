// Package promtest reads what a Prometheus registry gathers, for tests of
// the metrics justonce exports. It is apart from testsvc so that modules
// using the test services do not link the Prometheus client.
package promtest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// CounterValue returns the value of the counter name with exactly the
// labels given that g gathers, and 0 when there is none.
func CounterValue(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("promtest: gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}
