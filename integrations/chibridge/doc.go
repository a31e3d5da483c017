// Package chibridge shows chi routes behind the justonce HTTP bridge
// (package httpbridge). There is nothing to adapt: the bridge's route
// middleware is a func(http.Handler) http.Handler, which chi takes as it
// is, per route with With or per group with Use:
//
//	r.With(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})).Post("/orders", createOrder)
//
// The handler reads the ledger's transaction with httpbridge.Tx(r.Context())
// and URL parameters with chi.URLParam as usual. The package holds only the
// example and the tests that keep this true against each chi release the
// module pins.
package chibridge
