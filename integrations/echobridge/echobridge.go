// Package echobridge runs echo routes behind the justonce HTTP bridge
// (package httpbridge), which is net/http middleware.
//
//	orders := echobridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true}))
//	e.POST("/orders", createOrder, orders)
//
// The handler reads the ledger's transaction with
// httpbridge.Tx(c.Request().Context()). An error it returns is rendered by
// the echo instance's HTTPErrorHandler inside the bridge, so that the
// bridge sees, stores or rolls back the response the client gets: a 5xx
// (and an error that is not an echo.HTTPError, answered 500) rolls back and
// leaves the key free; a 4xx is stored like any other, per
// httpbridge.RouteConfig.Store.
//
// echo.WrapMiddleware would return the error after the bridge has already
// stored an empty 200 and let echo render it afterwards: use Middleware.
package echobridge

import (
	"net/http"

	"github.com/labstack/echo/v4"
)

// Middleware adapts route, a bridge route's middleware
// (httpbridge.Bridge.Route), to echo. It adapts any net/http middleware the
// same way, for example tracing.HTTP in front of the bridge:
//
//	e.POST("/orders", createOrder, echobridge.Middleware(tracing.HTTP(tp)), orders)
func Middleware(route func(http.Handler) http.Handler) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			orig := c.Response()
			route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				c.SetRequest(r)
				c.SetResponse(echo.NewResponse(w, c.Echo()))
				if err := next(c); err != nil {
					c.Error(err) // rendered now, through the bridge
				}
			})).ServeHTTP(orig, c.Request())
			c.SetResponse(orig)
			return nil
		}
	}
}
