package httpbridge

import (
	"net/http"
	"time"

	"github.com/justonce/justonce/inbox"
)

// StaleInfo describes a retry whose operation ran but whose stored
// response is gone (RouteConfig.ResultTTL): what RouteConfig.StaleResponse
// is given to find the resource's current state.
type StaleInfo struct {
	// Key is the client's idempotency key, as sent.
	Key string
	// Tenant is the request's tenant (Config.Tenant), "" without one.
	Tenant string
	// CompletedAt is when the operation completed.
	CompletedAt time.Time
	// KeyExpiresAt is when the key itself expires (the expiry header says
	// it too).
	KeyExpiresAt time.Time
}

// stale answers a retry whose stored response passed its clock: the
// route's StaleResponse, else 422 response-expired. rh are the replay
// headers (name, value, ...).
func (h *handler) stale(w http.ResponseWriter, r *http.Request, req inbox.Request, rec *inbox.Record, rh []string) {
	s := h.s
	for i := 0; i+1 < len(rh); i += 2 {
		w.Header().Set(rh[i], rh[i+1])
	}
	info := StaleInfo{Key: h.rawKey(r), Tenant: req.Tenant, CompletedAt: rec.CompletedAt, KeyExpiresAt: rec.ExpiresAt}
	if h.rt.StaleResponse != nil && h.rt.StaleResponse(w, r, info) {
		s.log.InfoContext(r.Context(), "justonce/httpbridge: stale response answered by the route's hook",
			h.attrs(r, "key", req.Key.String())...)
		return
	}
	s.log.InfoContext(r.Context(), "justonce/httpbridge: stored response expired", h.attrs(r, "key", req.Key.String())...)
	p := problem{Type: ProblemResponseExpired, Status: http.StatusUnprocessableEntity,
		Detail: "the operation for this key ran and its response is no longer kept; it will not run again under " +
			"this key: fetch the resource's current state instead"}
	if !rec.CompletedAt.IsZero() {
		p.CompletedAt = rec.CompletedAt.UTC().Format(time.RFC3339)
	}
	writeProblemOf(w, p)
}
