package httpbridge

import (
	"bytes"
	"net/http"
	"strconv"
)

// recorder buffers a handler's response so that it can be stored in the
// ledger transaction and written to the client after the commit. It
// implements only http.ResponseWriter: Flush, Hijack and the
// http.ResponseController extras are not available to a buffered handler.
type recorder struct {
	header  http.Header
	sent    http.Header // snapshot at WriteHeader, as net/http does
	code    int
	body    bytes.Buffer
	limit   int
	dropped int64 // bytes written beyond limit and discarded
}

func newRecorder(limit int) *recorder {
	return &recorder{header: http.Header{}, limit: limit}
}

func (w *recorder) Header() http.Header { return w.header }

func (w *recorder) WriteHeader(code int) {
	if w.code != 0 {
		return
	}
	if code >= 100 && code < 200 {
		return // informational responses are not buffered
	}
	if code < 100 || code > 999 {
		panic("httpbridge: invalid WriteHeader code " + strconv.Itoa(code))
	}
	w.code = code
	w.sent = w.header.Clone()
}

func (w *recorder) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !bodyAllowed(w.code) {
		return 0, http.ErrBodyNotAllowed
	}
	room := w.limit - w.body.Len()
	if room >= len(p) {
		return w.body.Write(p)
	}
	if room > 0 {
		w.body.Write(p[:room])
	}
	w.dropped += int64(len(p) - max(room, 0))
	return len(p), nil
}

// WriteString avoids a copy for io.WriteString callers.
func (w *recorder) WriteString(s string) (int, error) {
	return w.Write([]byte(s))
}

// size is the full body size the handler wrote.
func (w *recorder) size() int64 { return int64(w.body.Len()) + w.dropped }

// finish settles what the handler left implicit, as net/http would: status
// 200, and a sniffed Content-Type for a body without one. The result is
// what the client is sent and what is stored.
func (w *recorder) finish() (int, http.Header, []byte) {
	if w.code == 0 {
		w.WriteHeader(http.StatusOK)
	}
	h := w.sent
	body := w.body.Bytes()
	if _, ok := h["Content-Type"]; !ok && len(body) > 0 && h.Get("Content-Encoding") == "" {
		h.Set("Content-Type", http.DetectContentType(body))
	}
	return w.code, h, body
}

func bodyAllowed(code int) bool {
	return code >= 200 && code != http.StatusNoContent && code != http.StatusNotModified
}

// storedHeader is h without the denied headers.
func (s *settings) storedHeader(h http.Header) map[string][]string {
	out := make(map[string][]string, len(h))
	for k, v := range h {
		if s.deny[http.CanonicalHeaderKey(k)] || len(v) == 0 {
			continue
		}
		out[k] = append([]string(nil), v...)
	}
	return out
}

// writeResponse writes a complete buffered response. Content-Length is set
// (when the handler did not) so that the first response and its replays
// are framed alike.
func writeResponse(w http.ResponseWriter, code int, h map[string][]string, body []byte) {
	dst := w.Header()
	for k, v := range h {
		dst[k] = append([]string(nil), v...)
	}
	if bodyAllowed(code) {
		if _, ok := dst["Content-Length"]; !ok {
			dst.Set("Content-Length", strconv.Itoa(len(body)))
		}
	} else {
		body = nil
	}
	w.WriteHeader(code)
	if len(body) > 0 {
		_, _ = w.Write(body)
	}
}
