// Package stepspay is the payments example's payment in steps and its
// card provider, and the proof that kills it: a payment is an order row
// (a Postgres step), a charge at the provider (an outside step, whose key
// goes to the provider as its Idempotency-Key) and a receipt row (a
// Postgres step), served over HTTP, gRPC, Kafka (kafka-go and franz-go)
// and NATS JetStream alike. The provider is a separate HTTP service behind
// justonce's own HTTP bridge, which charges once per Idempotency-Key and
// counts its charges. Prove runs the service as a child process, SIGKILLs
// it between and inside the steps over many payments delivered twice, and
// checks that each was charged once, with one order row and one receipt;
// the example's test and the chaos harness (-steps-kills) run it.
package stepspay

import (
	"fmt"
	"io"
	"net/http"
	"sync/atomic"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// ProviderSchema is the provider's table: one row per charge it made. It
// has no unique key, so a card charged twice would show as a second row
// for the Idempotency-Key.
const ProviderSchema = `CREATE TABLE IF NOT EXISTS provider_charges (charge_id bigserial PRIMARY KEY,
	idempotency_key text NOT NULL, payment text NOT NULL, created_at timestamptz DEFAULT now())`

// Provider is the card provider of the example: a separate HTTP service
// that charges "cards" behind justonce's own HTTP bridge, so that it
// charges once per Idempotency-Key and answers a repeated key with the
// first charge (the bridge's replay), as real providers do. It counts the
// charge requests it gets (repeats included); provider_charges holds the
// charges it made.
type Provider struct {
	// Requests counts the charge requests the provider got, repeats of a
	// key included.
	Requests atomic.Int64
}

// Handler serves POST /charges: the body names the payment, the
// Idempotency-Key header is required; the answer is 201 and the charge ID.
func (p *Provider) Handler(ledger *inbox.Ledger) (http.Handler, error) {
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		return nil, err
	}
	charge := bridge.Route(httpbridge.RouteConfig{Scope: "provider", Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		key, _ := httpbridge.Key(ctx)
		payment, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var id int64
		if err := httpbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO provider_charges (idempotency_key, payment) VALUES ($1, $2) RETURNING charge_id`,
			key, string(payment)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable) // not stored: the key stays free
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "ch_%06d", id)
	}))
	mux := http.NewServeMux()
	mux.Handle("POST /charges", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Requests.Add(1)
		charge.ServeHTTP(w, r)
	}))
	return mux, nil
}
