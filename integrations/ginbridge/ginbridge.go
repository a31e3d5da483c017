// Package ginbridge runs gin routes behind the justonce HTTP bridge
// (package httpbridge), which is net/http middleware.
//
//	orders := ginbridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true}))
//	r.POST("/orders", orders, createOrder)
//
// The handlers after Middleware read the ledger's transaction with
// httpbridge.Tx(c.Request.Context()) and write through c (c.JSON, c.String,
// c.Data, ...): the bridge buffers what they write, stores it with the
// transaction's commit, and sends it. When the bridge answers itself (a
// replay, 409 in progress, 422 key reused, 400 invalid key) the handlers
// after Middleware do not run: the chain is aborted.
package ginbridge

import (
	"bufio"
	"errors"
	"net"
	"net/http"

	"github.com/gin-gonic/gin"
)

// Middleware adapts route, a bridge route's middleware
// (httpbridge.Bridge.Route), to gin. It adapts any net/http middleware the
// same way, for example tracing.HTTP in front of the bridge:
//
//	r.POST("/orders", ginbridge.Middleware(tracing.HTTP(tp)), orders, createOrder)
func Middleware(route func(http.Handler) http.Handler) gin.HandlerFunc {
	return func(c *gin.Context) {
		orig := c.Writer
		ran := false
		route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ran = true
			c.Request = r
			c.Writer = &writer{ResponseWriter: w, status: http.StatusOK, size: -1}
			c.Next()
			c.Writer.WriteHeaderNow()
		})).ServeHTTP(orig, c.Request)
		c.Writer = orig
		if !ran {
			c.Abort()
		}
	}
}

// writer is a gin.ResponseWriter over the bridge's buffering writer. Like
// gin's own, it holds the status until the first write (or WriteHeaderNow).
type writer struct {
	http.ResponseWriter
	status int
	size   int // -1: header not written
}

var _ gin.ResponseWriter = (*writer)(nil)

// errHijack: a connection cannot be taken over under the bridge, which
// stores the response.
var errHijack = errors.New("ginbridge: Hijack is not supported behind the idempotency bridge")

func (w *writer) WriteHeader(code int) {
	if code > 0 && !w.Written() {
		w.status = code
	}
}

func (w *writer) WriteHeaderNow() {
	if !w.Written() {
		w.size = 0
		w.ResponseWriter.WriteHeader(w.status)
	}
}

func (w *writer) Write(b []byte) (int, error) {
	w.WriteHeaderNow()
	n, err := w.ResponseWriter.Write(b)
	w.size += n
	return n, err
}

func (w *writer) WriteString(s string) (int, error) { return w.Write([]byte(s)) }
func (w *writer) Status() int                       { return w.status }
func (w *writer) Size() int                         { return w.size }
func (w *writer) Written() bool                     { return w.size != -1 }
func (w *writer) Pusher() http.Pusher               { return nil }

// Hijack is refused: the bridge must see the whole response to store it.
func (w *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, errHijack }

// Flush writes the header; the body is sent when the bridge has stored it.
func (w *writer) Flush() { w.WriteHeaderNow() }

// CloseNotify never fires: a keyed request's handler runs to completion
// even when the client goes away, so that the client's retry gets the
// replay.
func (w *writer) CloseNotify() <-chan bool { return make(chan bool) }

// Unwrap gives http.ResponseController the bridge's writer.
func (w *writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
