package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
)

// BridgeCollector is a prometheus.Collector of the request fronts' observe
// mode (httpbridge.RouteConfig.Observe, grpcbridge.MethodConfig.Observe):
//
//	justonce_bridge_observed_total{front,route,would}  requests an observe-mode route or method let
//	                                                   through, by what enforcing would have done
//
// front is http or grpc; route is the HTTP route's scope or the gRPC full
// method name; would is would_run, would_replay, would_refuse_missing_key,
// would_refuse_invalid_key, would_conflict or would_mismatch. One
// collector serves any number of bridges: give each its Observer.
type BridgeCollector struct {
	observed *prometheus.CounterVec
}

// NewBridgeCollector returns a collector; register it, then set each
// bridge's Config.OnObserve to its Observer.
func NewBridgeCollector() *BridgeCollector {
	return &BridgeCollector{
		observed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "justonce_bridge_observed_total",
			Help: "Requests an observe-mode route or method let through, by what enforcing would have done: would_run, would_replay, would_refuse_missing_key, would_refuse_invalid_key, would_conflict, would_mismatch.",
		}, []string{"front", "route", "would"}),
	}
}

// Describe implements prometheus.Collector.
func (c *BridgeCollector) Describe(ch chan<- *prometheus.Desc) { c.observed.Describe(ch) }

// Collect implements prometheus.Collector.
func (c *BridgeCollector) Collect(ch chan<- prometheus.Metric) { c.observed.Collect(ch) }

// Observer returns the function a bridge's Config.OnObserve takes, which
// counts under the front label front ("http" for httpbridge, "grpc" for
// grpcbridge):
//
//	httpbridge.Config{Ledger: ledger, OnObserve: bc.Observer("http")}
func (c *BridgeCollector) Observer(front string) func(route, would string) {
	vec := c.observed.MustCurryWith(prometheus.Labels{"front": front})
	return func(route, would string) { vec.WithLabelValues(route, would).Inc() }
}
