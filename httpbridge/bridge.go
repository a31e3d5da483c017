package httpbridge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
	"github.com/justonce/justonce/internal/fingerprint"
)

// Bridge gives net/http routes the Idempotency-Key behaviour on an
// inbox.Ledger. Make one per ledger with New and wrap each route with
// Route. Safe for concurrent use.
type Bridge struct {
	s settings
}

// New returns a Bridge for cfg, or an error matching inbox.ErrConfig.
func New(cfg Config) (*Bridge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Bridge{s: newSettings(cfg)}, nil
}

// Route returns the middleware for one route (or a group of routes sharing
// rc): it works with the standard mux, chi and gorilla as is.
//
//	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})
//	mux.Handle("POST /orders", orders(http.HandlerFunc(createOrder)))
//
// Route panics if rc is invalid (see RouteConfig.Validate): routes are
// wired once, at startup.
func (b *Bridge) Route(rc RouteConfig) func(http.Handler) http.Handler {
	if err := rc.Validate(); err != nil {
		panic(err)
	}
	rt := newRoute(rc, &b.s)
	return func(next http.Handler) http.Handler {
		return &handler{s: &b.s, rt: rt, next: next}
	}
}

type handler struct {
	s    *settings
	rt   route
	next http.Handler
}

// Sentinels a TxFunc returns to roll back while the middleware still
// answers.
var (
	errNotStored = errors.New("httpbridge: response status not stored")
	errTooLarge  = errors.New("httpbridge: response over the store cap")
	errPanicked  = errors.New("httpbridge: handler panicked")
)

// panicked carries a handler's panic past the ledger, to be re-raised once
// the transaction (and the Redis lock) are released.
type panicked struct {
	value any
	stack []byte
}

// buffered is a handler's complete response, as the client gets it.
type buffered struct {
	code   int
	header http.Header
	body   []byte
	size   int64 // full size written, also past the cap
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.rt.methods[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	if h.rt.Observe {
		h.observe(w, r)
		return
	}
	s := h.s
	key, present, err := h.key(r)
	if err != nil {
		s.log.WarnContext(r.Context(), "justonce/httpbridge: invalid key",
			h.attrs(r, "scope", h.rt.Scope, "reason", err.Error(), "key", inbox.Mask(h.rawKey(r)))...)
		writeProblem(w, ProblemInvalidKey, http.StatusBadRequest, err.Error())
		return
	}
	if !present {
		if h.rt.Required {
			s.log.WarnContext(r.Context(), "justonce/httpbridge: missing key", h.attrs(r, "scope", h.rt.Scope)...)
			writeProblem(w, ProblemMissingKey, http.StatusBadRequest,
				"this endpoint requires an "+s.Header+" header with a unique key per operation")
			return
		}
		h.serveKeyless(w, r)
		return
	}
	body, ok := h.readBody(w, r)
	if !ok {
		return
	}

	req, err := h.rt.spec.Request(s.Ledger, key, h.fingerprint(r, body), bridgereq.Call(s.Tenant, r), bridgereq.Call(s.Principal, r))
	if err != nil {
		var ke *bridgereq.KeyError
		if errors.As(err, &ke) {
			s.log.WarnContext(r.Context(), "justonce/httpbridge: invalid key",
				h.attrs(r, "scope", h.rt.Scope, "reason", ke.Error(), "key", inbox.Mask(key))...)
			writeProblem(w, ProblemInvalidKey, http.StatusBadRequest, ke.Error())
			return
		}
		s.log.ErrorContext(r.Context(), "justonce/httpbridge: request key rejected by the ledger", "key", req.Key.String(), "err", err)
		writeInternal(w)
		return
	}

	// The work a client started is finished and recorded even if the
	// client goes away: its retry then gets the replay.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), s.HandlerTimeout)
	defer cancel()
	ctx = bridgereq.WithKey(ctx, key)

	if !h.quotaOK(ctx, w, r, req) {
		return
	}
	switch {
	case h.rt.Lease:
		h.serveLeased(ctx, w, r, req, body)
	case h.rt.Steps:
		h.serveSteps(ctx, w, r, req, body)
	default:
		h.serveTx(ctx, w, r, req, body)
	}
}

// key reads the request's key: the route's KeyFormat, then its
// KeyValidator.
func (h *handler) key(r *http.Request) (key string, present bool, err error) {
	key, present, err = extractKey(r.Header, h.s.keyHeaders, h.rt.maxKeyLen, h.rt.KeyFormat)
	if err == nil && present && h.rt.KeyValidator != nil {
		if verr := h.rt.KeyValidator(key); verr != nil {
			reason := verr.Error()
			if reason == "" {
				reason = "the key is not of the form this endpoint requires"
			}
			return "", true, &keyError{reason}
		}
	}
	return key, present, err
}

// rawKey is the key header as sent, for a masked log line.
func (h *handler) rawKey(r *http.Request) string {
	for _, name := range h.s.keyHeaders {
		if v := r.Header.Get(name); v != "" {
			return v
		}
	}
	return ""
}

// attrs are a log line's attributes followed by the client's address and
// user agent.
func (h *handler) attrs(r *http.Request, kv ...any) []any {
	return append(kv, bridgereq.Client(r.RemoteAddr, r.UserAgent())...)
}

// fingerprint is the request's fingerprint, detailed unless
// Config.LegacyFingerprints.
func (h *handler) fingerprint(r *http.Request, body []byte) []byte {
	if h.s.LegacyFingerprints {
		return fingerprint.Request(r, body, h.rt.FingerprintHeaders)
	}
	return fingerprint.RequestDetailed(r, body, h.rt.FingerprintHeaders)
}

// serveTx runs the handler inside the ledger's transaction.
func (h *handler) serveTx(ctx context.Context, w http.ResponseWriter, r *http.Request, req inbox.Request, body []byte) {
	var resp buffered
	var pv *panicked
	out, err := h.rt.spec.Do(ctx, h.s.Ledger, &req, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		r2 := withBody(r.WithContext(bridgereq.WithTx(ctx, tx)), body)
		resp, pv = h.run(r2)
		switch {
		case pv != nil:
			return inbox.Result{}, errPanicked
		case resp.size > int64(len(resp.body)):
			return inbox.Result{}, errTooLarge
		case !h.rt.Store(resp.code):
			return inbox.Result{}, errNotStored
		}
		return h.s.result(req.Key, resp)
	})
	var kre *inbox.KeyRateError
	errors.As(err, &kre)
	switch {
	case pv != nil:
		h.repanic(req, pv)
	case kre != nil:
		h.rateLimited(ctx, w, r, req, kre)
	case errors.Is(err, errNotStored):
		h.s.log.DebugContext(ctx, "justonce/httpbridge: status not stored, rolled back", "key", req.Key.String(), "status", resp.code)
		writeResponse(w, resp.code, resp.header, resp.body)
	case errors.Is(err, errTooLarge):
		h.tooLarge(w, req, resp, "it was rolled back: nothing was done, and the key is free")
	case err != nil:
		h.s.txFailure(w, req, resp, err)
	case out.Disposition == inbox.Executed:
		h.setExpires(w, out.Record.ExpiresAt)
		writeResponse(w, resp.code, resp.header, resp.body)
	default:
		h.answer(w, r, req, out)
	}
}

// setExpires sets the expiry header: the time rounded down to the second,
// so that it never says the key lasts longer than it does.
func (h *handler) setExpires(w http.ResponseWriter, t time.Time) {
	w.Header().Set(h.s.ExpiresHeader, t.UTC().Truncate(time.Second).Format(http.TimeFormat))
}

// rateLimited answers a new key over the route's KeyRate.
func (h *handler) rateLimited(ctx context.Context, w http.ResponseWriter, r *http.Request, req inbox.Request, kre *inbox.KeyRateError) {
	h.s.log.InfoContext(ctx, "justonce/httpbridge: new-key rate limit reached",
		h.attrs(r, "key", req.Key.String(), "limit", kre.Limit, "window", kre.Window.String())...)
	secs := (kre.RetryAfter + time.Second - 1) / time.Second
	writeProblem(w, ProblemKeyRateExceeded, http.StatusTooManyRequests,
		fmt.Sprintf("this tenant started %d new keys here in the current window of %s, the limit; nothing was recorded, "+
			"send the request again with the same key after Retry-After", kre.Limit, kre.Window),
		"Retry-After", strconv.FormatInt(int64(secs), 10))
}

// serveLeased runs the handler under a lease, outside any transaction.
func (h *handler) serveLeased(ctx context.Context, w http.ResponseWriter, r *http.Request, req inbox.Request, body []byte) {
	s := h.s
	claimed := time.Now()
	lease, out, err := s.Ledger.AcquireLease(ctx, req, h.rt.LeaseDuration)
	if err == nil && lease == nil && bridgereq.PlainRetry(out, &req) {
		lease, out, err = s.Ledger.AcquireLease(ctx, req, h.rt.LeaseDuration)
	}
	if err != nil {
		s.storeFailure(w, req, err)
		return
	}
	if lease == nil {
		h.answer(w, r, req, out)
		return
	}
	count, err := h.rt.spec.CountNewKey(ctx, s.Ledger, nil, req.Tenant)
	if err != nil {
		if aerr := lease.Abandon(ctx); aerr != nil {
			s.log.WarnContext(ctx, "justonce/httpbridge: lease not released; it will expire", "key", req.Key.String(), "err", aerr)
		}
		var kre *inbox.KeyRateError
		if errors.As(err, &kre) {
			h.rateLimited(ctx, w, r, req, kre)
			return
		}
		s.storeFailure(w, req, err)
		return
	}
	// The lease is kept alive until its end is recorded, not only while
	// the handler runs: a lease that lapsed while its completion was being
	// retried would let a retry run the effect again.
	lost, stopKeepAlive := lease.KeepAlive(context.WithoutCancel(ctx))
	stop := sync.OnceFunc(stopKeepAlive)
	defer stop()
	runCtx, cancelRun := context.WithCancel(ctx)
	go func() {
		select {
		case <-lost:
			cancelRun()
		case <-runCtx.Done():
		}
	}()
	r2 := withBody(r.WithContext(bridgereq.WithFencingToken(runCtx, lease.Token())), body)
	resp, pv := h.run(r2)
	cancelRun()

	fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer fcancel()
	release := func() {
		stop()
		count.Undo(fctx)
		if err := lease.Abandon(fctx); err != nil {
			s.log.WarnContext(ctx, "justonce/httpbridge: lease not released; it will expire", "key", req.Key.String(), "err", err)
		}
	}
	switch {
	case pv != nil:
		release()
		h.repanic(req, pv)
	case resp.size > int64(len(resp.body)):
		// The effect happened outside the database and cannot be undone:
		// keep the key from running it again.
		stop()
		cause := fmt.Errorf("response of %d bytes is over the %d-byte store cap", resp.size, h.rt.MaxResponseBytes)
		if err := lease.Fail(fctx, cause); err != nil {
			s.log.WarnContext(ctx, "justonce/httpbridge: lease not marked failed", "key", req.Key.String(), "err", err)
		}
		h.tooLarge(w, req, resp, "the operation ran (lease mode) and will not run again under this key; its response is lost")
	case !h.rt.Store(resp.code):
		release()
		writeResponse(w, resp.code, resp.header, resp.body)
	default:
		res, err := s.result(req.Key, resp)
		if err != nil {
			release()
			s.storeFailure(w, req, err)
			return
		}
		err = h.complete(ctx, lease, res, lost)
		stop()
		switch {
		case err == nil:
			// The row was claimed after claimed, and expires its TTL after
			// its claim.
			h.setExpires(w, claimed.Add(h.rt.ttl))
			writeResponse(w, resp.code, resp.header, resp.body)
		case errors.Is(err, inbox.ErrLeaseLost):
			s.log.ErrorContext(ctx, "justonce/httpbridge: lease lost while the handler ran", "key", req.Key.String(), "err", err)
			writeProblem(w, ProblemLeaseLost, http.StatusInternalServerError,
				"the handler outlived its lease; another attempt may have taken the key over")
		case errors.Is(err, errCompleteGaveUp):
			s.log.ErrorContext(ctx, "justonce/httpbridge: lease-mode result not recorded; the key runs again once its lease expires",
				"key", req.Key.String(), "err", err)
			writeProblem(w, ProblemStoreUnavailable, http.StatusServiceUnavailable,
				"the operation ran, but the idempotency store was unavailable to record its result; a retry with the same key "+
					"gets 409 until the lease expires, then runs the operation again under a new fencing token",
				"Retry-After", s.retryAfter)
		default:
			s.storeFailure(w, req, err)
		}
	}
}

// errCompleteGaveUp: a lease-mode result could not be recorded before the
// bridge stopped retrying.
var errCompleteGaveUp = errors.New("httpbridge: gave up recording a lease-mode result")

// complete records a lease-mode result. The effect has happened, and
// recording it is what keeps it from running again, so a transient failure
// is retried (Lease.CompleteRetrying, while KeepAlive renews the lease)
// until it succeeds, fails for good, the lease is lost, or
// Config.HandlerTimeout has passed since the handler ended.
func (h *handler) complete(ctx context.Context, lease *inbox.Lease, res inbox.Result, lost <-chan struct{}) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.s.HandlerTimeout)
	defer cancel()
	err := lease.CompleteRetrying(wctx, res, lost)
	if err != nil && wctx.Err() != nil {
		return fmt.Errorf("%w: %w", errCompleteGaveUp, err)
	}
	return err
}

// keylessTx is a plain transaction handed to a handler of a request without
// a key; like the ledger's, it is the middleware's to end.
type keylessTx struct{ pgx.Tx }

func (keylessTx) Commit(context.Context) error   { return inbox.ErrTxOwned }
func (keylessTx) Rollback(context.Context) error { return inbox.ErrTxOwned }

// serveKeyless runs a request without a key on an optional route: without
// dedupe, but in a transaction on transactional routes, so that the handler
// has one code path.
func (h *handler) serveKeyless(w http.ResponseWriter, r *http.Request) {
	if h.rt.Lease || h.rt.Steps {
		h.next.ServeHTTP(w, r)
		return
	}
	s := h.s
	ctx := r.Context()
	tx, err := bridgereq.Begin(ctx, s.Ledger.Pool(), s.AcquireWait)
	if err != nil {
		s.storeFailure(w, inbox.Request{Key: inbox.Key{Scope: h.rt.Scope}}, &inbox.StoreError{Op: "begin", Err: err})
		return
	}
	rollback := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_ = tx.Rollback(rctx)
		cancel()
	}
	resp, pv := h.run(r.WithContext(bridgereq.WithTx(ctx, keylessTx{tx})))
	switch {
	case pv != nil:
		rollback()
		h.repanic(inbox.Request{Key: inbox.Key{Scope: h.rt.Scope}}, pv)
	case resp.size > int64(len(resp.body)):
		rollback()
		h.tooLarge(w, inbox.Request{Key: inbox.Key{Scope: h.rt.Scope}}, resp, "it was rolled back: nothing was done")
	case !h.rt.Store(resp.code):
		rollback()
		writeResponse(w, resp.code, resp.header, resp.body)
	default:
		if err := tx.Commit(ctx); err != nil {
			rollback()
			s.txFailure(w, inbox.Request{Key: inbox.Key{Scope: h.rt.Scope}}, resp, &inbox.StoreError{Op: "commit", Err: err})
			return
		}
		writeResponse(w, resp.code, resp.header, resp.body)
	}
}

// run calls the handler with a buffering writer and catches its panic.
func (h *handler) run(r *http.Request) (resp buffered, p *panicked) {
	rec := newRecorder(h.rt.MaxResponseBytes)
	defer func() {
		if v := recover(); v != nil {
			p = &panicked{value: v, stack: debug.Stack()}
		}
	}()
	h.next.ServeHTTP(rec, r)
	resp.code, resp.header, resp.body = rec.finish()
	resp.size = rec.size()
	return resp, nil
}

// repanic re-raises a handler's panic once the transaction or lease is
// released, for the server (or an outer recovery middleware) to handle.
func (h *handler) repanic(req inbox.Request, p *panicked) {
	if p.value != http.ErrAbortHandler {
		h.s.log.Error("justonce/httpbridge: handler panicked; rolled back, key released",
			"key", req.Key.String(), "panic", fmt.Sprint(p.value), "stack", string(p.stack))
	}
	panic(p.value)
}

func (h *handler) tooLarge(w http.ResponseWriter, req inbox.Request, resp buffered, what string) {
	h.s.log.Error("justonce/httpbridge: response over the store cap", "key", req.Key.String(),
		"status", resp.code, "bytes", resp.size, "cap", h.rt.MaxResponseBytes)
	writeProblem(w, ProblemResponseTooLarge, http.StatusInternalServerError,
		fmt.Sprintf("the response (%d bytes) is over this endpoint's store cap of %d bytes; %s",
			resp.size, h.rt.MaxResponseBytes, what))
}

// readBody reads the request body for the fingerprint, up to the cap.
func (h *handler) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	limit := h.rt.MaxBodyBytes
	tooLarge := func() ([]byte, bool) {
		writeProblem(w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge,
			fmt.Sprintf("the request body is over this endpoint's limit of %d bytes", limit))
		return nil, false
	}
	if r.ContentLength > limit {
		return tooLarge()
	}
	var b []byte
	if r.Body != nil && r.Body != http.NoBody {
		var err error
		if b, err = io.ReadAll(io.LimitReader(r.Body, limit+1)); err != nil {
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				return tooLarge()
			}
			writeProblem(w, ProblemBodyUnreadable, http.StatusBadRequest, "the request body could not be read")
			return nil, false
		}
	}
	if int64(len(b)) > limit {
		return tooLarge()
	}
	if r.PostForm != nil || r.MultipartForm != nil || r.ContentLength > 0 && len(b) == 0 {
		// Something in front of the bridge (a middleware that parsed the
		// form) used the body up: the fingerprint would cover an empty
		// body, and requests with other bodies would replay this one's
		// response.
		h.s.log.ErrorContext(r.Context(), "justonce/httpbridge: the request body was read before the bridge; put the bridge first",
			"content_length", r.ContentLength)
		writeInternal(w)
		return nil, false
	}
	return b, true
}

// withBody gives r a fresh reader over the body already read.
func withBody(r *http.Request, body []byte) *http.Request {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return r
}

// quotaOK enforces the route's live-key quota for a new key. A key the
// ledger already holds passes, so that its replay is served.
func (h *handler) quotaOK(ctx context.Context, w http.ResponseWriter, r *http.Request, req inbox.Request) bool {
	if h.rt.MaxLiveKeys == nil {
		return true
	}
	limit := h.rt.MaxLiveKeys(req.Tenant)
	if limit <= 0 {
		return true
	}
	s := h.s
	n, err := s.Ledger.LiveKeys(ctx, req.Scope, req.Tenant)
	if err != nil {
		s.storeFailure(w, req, err)
		return false
	}
	if n < limit {
		return true
	}
	_, err = s.Ledger.Lookup(ctx, req.Key)
	switch {
	case err == nil:
		return true
	case errors.Is(err, inbox.ErrNotFound):
		s.log.InfoContext(ctx, "justonce/httpbridge: live-key quota exceeded", h.attrs(r, "key", req.Key.String(), "live", n, "limit", limit)...)
		writeProblem(w, ProblemQuotaExceeded, http.StatusTooManyRequests,
			fmt.Sprintf("this tenant holds %d live keys here, the limit is %d; keys are freed as they expire", n, limit))
		return false
	default:
		s.storeFailure(w, req, err)
		return false
	}
}

// result is what the ledger stores for a response: denied headers removed,
// the body encrypted when configured.
func (s *settings) result(k inbox.Key, resp buffered) (inbox.Result, error) {
	hdr := s.storedHeader(resp.header)
	body := resp.body
	if s.Encryption != nil && len(body) > 0 {
		var err error
		if body, err = s.Encryption.seal(k, resp.code, hdr, body); err != nil {
			return inbox.Result{}, fmt.Errorf("httpbridge: encrypt stored body: %w", err)
		}
	}
	return inbox.Result{Code: resp.code, Header: hdr, Body: body}, nil
}

// answer handles an Outcome whose handler did not run now. Every answer
// says when the key expires.
func (h *handler) answer(w http.ResponseWriter, r *http.Request, req inbox.Request, out inbox.Outcome) {
	s := h.s
	if exp, ok := bridgereq.Expiry(out, time.Now(), h.rt.ttl, s.HandlerTimeout); ok {
		h.setExpires(w, exp)
	}
	switch out.Disposition {
	case inbox.InFlight:
		s.log.InfoContext(r.Context(), "justonce/httpbridge: in flight", h.attrs(r, "key", req.Key.String())...)
		writeProblem(w, ProblemInProgress, http.StatusConflict,
			"a request with this key is being processed; retry after Retry-After with the same key",
			"Retry-After", s.retryAfter)
	case inbox.Mismatch:
		if rec := out.Record; rec != nil && rec.Source != "" && rec.Source != Source {
			// Another front (gRPC, say) holds or ran this key with a
			// fingerprint of its own kind, which never equals an HTTP one:
			// answered as for a consumer's key, in flight, failed or done.
			if rec.Status == inbox.StatusProcessing {
				h.answer(w, r, req, inbox.Outcome{Disposition: inbox.InFlight, Record: rec})
				return
			}
			h.replay(w, r, req, inbox.Outcome{Disposition: inbox.Duplicate, Record: rec})
			return
		}
		diff := bridgereq.Differences(out, req.Fingerprint)
		s.log.InfoContext(r.Context(), "justonce/httpbridge: key reused with another request",
			h.attrs(r, "key", req.Key.String(), "differences", diff)...)
		detail := "this key was used with a different request (method, path, body or headers); use a new key for a new request"
		if len(diff) > 0 {
			detail = "this key was used with a different request (it differs in " + strings.Join(diff, ", ") +
				"); use a new key for a new request"
		}
		writeProblemOf(w, problem{Type: ProblemKeyReused, Status: http.StatusUnprocessableEntity, Detail: detail, Differences: diff})
	case inbox.Duplicate:
		h.replay(w, r, req, out)
	default:
		s.log.Error("justonce/httpbridge: unexpected ledger outcome", "key", req.Key.String(), "disposition", out.Disposition.String())
		writeInternal(w)
	}
}

// consumerDefault is the body replayed for a key a consumer processed
// without recording an HTTP response.
type consumerDefault struct {
	Status string `json:"status"`
	Source string `json:"source,omitempty"`
}

// replay answers a Duplicate with the stored response, byte for byte.
func (h *handler) replay(w http.ResponseWriter, r *http.Request, req inbox.Request, out inbox.Outcome) {
	s := h.s
	rh := []string{s.ReplayHeader, "true"}
	if s.LegacyReplayHeader != "" {
		rh = append(rh, s.LegacyReplayHeader, "true")
	}
	rec := out.Record
	source := ""
	if rec != nil {
		source = string(rec.Source)
	}
	if rec != nil && rec.Status == inbox.StatusFailed {
		s.log.InfoContext(r.Context(), "justonce/httpbridge: replay of a failed key", h.attrs(r, "key", req.Key.String(), "source", source)...)
		writeProblem(w, ProblemKeyFailed, http.StatusUnprocessableEntity,
			fmt.Sprintf("the operation for this key failed for good (recorded by %s) and will not run again under this key; send a new key", sourceName(source)),
			rh...)
		return
	}
	if rec != nil && rec.ResultGone {
		h.stale(w, r, req, rec, rh)
		return
	}
	res := out.Result
	if res.Code == 0 {
		// A consumer ran this key and recorded no HTTP response.
		s.log.InfoContext(r.Context(), "justonce/httpbridge: replay of a key run elsewhere", h.attrs(r, "key", req.Key.String(), "source", source)...)
		body, _ := json.Marshal(consumerDefault{Status: "already_processed", Source: source})
		for i := 0; i+1 < len(rh); i += 2 {
			w.Header().Set(rh[i], rh[i+1])
		}
		writeResponse(w, http.StatusOK, map[string][]string{"Content-Type": {"application/json"}}, body)
		return
	}
	hdr := make(map[string][]string, len(res.Header)+len(rh)/2)
	for k, v := range res.Header {
		if !s.deny[http.CanonicalHeaderKey(k)] {
			hdr[k] = v
		}
	}
	body := res.Body
	if kid := res.Header[encHeader]; len(kid) == 1 {
		var err error
		if body, err = s.Encryption.open(req.Key, res.Code, kid[0], res.Body); err != nil {
			s.log.Error("justonce/httpbridge: stored body cannot be decrypted", "key", req.Key.String(), "key_id", kid[0], "err", err)
			writeProblem(w, ProblemReplayUnavailable, http.StatusInternalServerError,
				"the stored response for this key cannot be decrypted; the operation will not run again under this key")
			return
		}
	}
	for i := 0; i+1 < len(rh); i += 2 {
		hdr[http.CanonicalHeaderKey(rh[i])] = []string{rh[i+1]}
	}
	s.log.InfoContext(r.Context(), "justonce/httpbridge: replay",
		h.attrs(r, "key", req.Key.String(), "status", res.Code, "cached", out.Cached)...)
	writeResponse(w, res.Code, hdr, body)
}

func sourceName(s string) string {
	if s == "" {
		return "an earlier attempt"
	}
	return "the " + s + " path"
}

// txFailure answers the error of a transactional request: the handler's
// transaction that did not commit for a cause of its own is the handler's
// failure (500 not-committed, nothing stored, key free); anything else is
// a store failure.
func (s *settings) txFailure(w http.ResponseWriter, req inbox.Request, resp buffered, err error) {
	detail, ok := notCommitted(err)
	if !ok {
		s.storeFailure(w, req, err)
		return
	}
	s.log.Error("justonce/httpbridge: the handler's transaction did not commit; nothing stored, key released",
		"key", req.Key.String(), "status", resp.code, "err", err)
	writeProblem(w, ProblemNotCommitted, http.StatusInternalServerError, detail)
}

// notCommitted reports whether err says that the handler's transaction
// failed for a cause of its own, not the database's availability, and the
// detail to answer. SQL details stay in the log.
func notCommitted(err error) (string, bool) {
	const after = "; nothing was done or stored, and a retry with the same key runs the operation again"
	if inbox.IsTransient(err) {
		return "", false
	}
	if errors.Is(err, inbox.ErrRolledBack) || errors.Is(err, pgx.ErrTxCommitRollback) {
		return "the handler answered success, but a statement in its transaction had failed, so the transaction rolled back" + after, true
	}
	var se *inbox.StoreError
	var pgErr *pgconn.PgError
	if errors.As(err, &se) && se.Op == "commit" && errors.As(err, &pgErr) {
		if strings.HasPrefix(pgErr.Code, "23") {
			return "the database refused to commit the handler's transaction: a constraint checked at commit failed" + after, true
		}
		return "the database refused to commit the handler's transaction" + after, true
	}
	return "", false
}

// storeFailure answers a ledger or database error: 503 overloaded when the
// request was shed (no connection within Config.AcquireWait), 503 when the
// store is unavailable or the transaction lost a race (retrying is safe),
// else 500.
func (s *settings) storeFailure(w http.ResponseWriter, req inbox.Request, err error) {
	if errors.Is(err, inbox.ErrOverloaded) {
		// Debug: under overload a line per shed request would be a log
		// storm; justonce_ledger_overloaded_total counts them.
		s.log.Debug("justonce/httpbridge: overloaded, request shed", "key", req.Key.String(), "err", err)
		writeProblem(w, ProblemOverloaded, http.StatusServiceUnavailable,
			"the server is overloaded; no database connection came free in time, so the request did not run and nothing was "+
				"recorded; send it again with the same key after Retry-After",
			"Retry-After", s.retryAfter)
		return
	}
	if inbox.IsTransient(err) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		s.log.Warn("justonce/httpbridge: store unavailable", "key", req.Key.String(), "err", err)
		writeProblem(w, ProblemStoreUnavailable, http.StatusServiceUnavailable,
			"the idempotency store is unavailable; retry with the same key (it runs again only if it was not recorded)",
			"Retry-After", s.retryAfter)
		return
	}
	s.log.Error("justonce/httpbridge: request failed", "key", req.Key.String(), "err", err)
	writeInternal(w)
}

func writeInternal(w http.ResponseWriter) {
	writeProblem(w, "about:blank", http.StatusInternalServerError, "")
}
