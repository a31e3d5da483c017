package httpbridge

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// observeMessages are the log messages of observe mode, by Would value.
var observeMessages = map[string]string{
	bridgereq.WouldRun:              "justonce/httpbridge: observe mode: new key, would run",
	bridgereq.WouldReplay:           "justonce/httpbridge: observe mode: duplicate, would replay the stored response",
	bridgereq.WouldRefuseMissingKey: "justonce/httpbridge: observe mode: missing key, would refuse (400)",
	bridgereq.WouldRefuseInvalidKey: "justonce/httpbridge: observe mode: invalid key, would refuse (400)",
	bridgereq.WouldConflict:         "justonce/httpbridge: observe mode: key in flight, would answer 409",
	bridgereq.WouldMismatch:         "justonce/httpbridge: observe mode: key reused with another request, would answer 422",
}

// observe serves a request of an observe-mode route: the handler gets it
// as it came, on the client's writer, while the ledger records its key
// and fingerprint (under a lease, as the handler runs outside any
// transaction of the bridge's) and the log and OnObserve say what
// enforcing would have done.
func (h *handler) observe(w http.ResponseWriter, r *http.Request) {
	s := h.s
	key, present, err := h.key(r)
	switch {
	case err != nil:
		h.observed(r, bridgereq.WouldRefuseInvalidKey, slog.LevelWarn, "reason", err.Error(), "key", inbox.Mask(h.rawKey(r)))
		h.next.ServeHTTP(w, r)
		return
	case !present:
		if h.rt.Required {
			h.observed(r, bridgereq.WouldRefuseMissingKey, slog.LevelWarn)
		}
		h.next.ServeHTTP(w, r)
		return
	}
	body, r, ok := h.peekBody(r)
	if !ok {
		s.log.DebugContext(r.Context(), "justonce/httpbridge: observe mode: body not fingerprinted (over MaxBodyBytes, or unreadable)",
			"scope", h.rt.Scope)
		h.next.ServeHTTP(w, r)
		return
	}
	req, err := h.rt.spec.Request(s.Ledger, key, h.fingerprint(r, body), bridgereq.Call(s.Tenant, r), bridgereq.Call(s.Principal, r))
	if err != nil {
		var ke *bridgereq.KeyError
		if errors.As(err, &ke) {
			h.observed(r, bridgereq.WouldRefuseInvalidKey, slog.LevelWarn, "reason", ke.Error(), "key", inbox.Mask(key))
		} else {
			s.log.ErrorContext(r.Context(), "justonce/httpbridge: observe mode: request key rejected by the ledger", "key", req.Key.String(), "err", err)
		}
		h.next.ServeHTTP(w, r)
		return
	}
	req.LockWait = 0 // never hold the request back

	// The ledger's work does not end with the client's request.
	lctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), s.HandlerTimeout)
	defer cancel()
	lease, out, err := s.Ledger.AcquireLease(lctx, req, s.HandlerTimeout)
	if err == nil && lease == nil && bridgereq.PlainRetry(out, &req) {
		lease, out, err = s.Ledger.AcquireLease(lctx, req, s.HandlerTimeout)
	}
	switch {
	case err != nil:
		s.log.WarnContext(r.Context(), "justonce/httpbridge: observe mode: store unavailable, nothing observed", "key", req.Key.String(), "err", err)
		h.next.ServeHTTP(w, r)
		return
	case lease == nil:
		would := bridgereq.Would(out, Source)
		attrs := []any{"key", req.Key.String()}
		if would == bridgereq.WouldMismatch {
			attrs = append(attrs, "differences", bridgereq.Differences(out, req.Fingerprint))
		}
		h.observed(r, would, slog.LevelInfo, attrs...)
		h.next.ServeHTTP(w, r)
		return
	}
	h.observed(r, bridgereq.WouldRun, slog.LevelDebug, "key", req.Key.String())
	sw := &statusWriter{ResponseWriter: w}
	done := false
	defer func() {
		if !done { // the handler panicked: the key is free, as enforcing would leave it
			_ = lease.Abandon(lctx)
		}
	}()
	h.next.ServeHTTP(sw, r)
	done = true
	code := sw.code
	if code == 0 {
		code = http.StatusOK
	}
	if h.rt.Store(code) {
		err = lease.Complete(lctx, inbox.Result{})
	} else {
		err = lease.Abandon(lctx)
	}
	if err != nil {
		s.log.DebugContext(r.Context(), "justonce/httpbridge: observe mode: key not recorded", "key", req.Key.String(), "err", err)
	}
}

// observed tells OnObserve and the log what enforcing would have done.
func (h *handler) observed(r *http.Request, would string, level slog.Level, kv ...any) {
	if f := h.s.OnObserve; f != nil {
		f(h.rt.Scope, would)
	}
	h.s.log.Log(r.Context(), level, observeMessages[would], h.attrs(r, append([]any{"scope", h.rt.Scope, "would", would}, kv...)...)...)
}

// peekBody reads the body for the fingerprint and gives r a body that
// reads the same bytes again. ok is false when it was not read whole (over
// MaxBodyBytes, unreadable, or read before the bridge): the request then
// goes on with its body as it was.
func (h *handler) peekBody(r *http.Request) ([]byte, *http.Request, bool) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, r, r.PostForm == nil && r.MultipartForm == nil
	}
	if r.ContentLength > h.rt.MaxBodyBytes || r.PostForm != nil || r.MultipartForm != nil {
		return nil, r, false
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, h.rt.MaxBodyBytes+1))
	if err != nil || int64(len(b)) > h.rt.MaxBodyBytes {
		// Hand the handler what was read, then the rest (or the error).
		rest := r.Body
		if err != nil {
			rest = io.NopCloser(&errReader{err})
		}
		r2 := *r
		r2.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(b), rest), r.Body}
		return nil, &r2, false
	}
	_ = r.Body.Close()
	// A body used up before the bridge (ContentLength says there was one)
	// would be fingerprinted empty: not observed.
	return b, withBody(r, b), r.ContentLength <= 0 || len(b) > 0
}

type errReader struct{ err error }

// Read returns the error the body's read met.
func (e *errReader) Read([]byte) (int, error) { return 0, e.err }

// statusWriter passes everything through to the client's writer and notes
// the status, for observe mode. Flush, Hijack and http.ResponseController
// reach the client's writer.
type statusWriter struct {
	http.ResponseWriter
	code int
}

// WriteHeader notes the first final status and passes it on.
func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 && code >= 200 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write passes p on; a write before WriteHeader means 200.
func (w *statusWriter) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

// Flush implements http.Flusher.
func (w *statusWriter) Flush() {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack implements http.Hijacker.
func (w *statusWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// Unwrap lets http.ResponseController reach the client's writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
