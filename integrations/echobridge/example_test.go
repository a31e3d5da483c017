package echobridge_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"github.com/labstack/echo/v4"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/echobridge"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// An echo route behind the bridge: the handler writes through the ledger's
// transaction; a retry with the same key gets the stored response, the same
// key with another body gets 422 problem+json.
func Example() {
	pool, done := itest.ExampleDB() // a Postgres schema with the ledger and an orders table
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}

	e := echo.New()
	idempotent := echobridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true}))
	e.POST("/orders", func(c echo.Context) error {
		var in struct {
			Item string `json:"item"`
		}
		if err := c.Bind(&in); err != nil {
			return err // a 400: stored like a success
		}
		ctx := c.Request().Context()
		var id int64
		err := httpbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, in.Item).Scan(&id)
		if err != nil {
			return err // a 500: rolled back, the key stays free
		}
		return c.JSON(http.StatusCreated, map[string]any{"order": id, "item": in.Item})
	}, idempotent)

	srv := httptest.NewServer(e)
	defer srv.Close()
	for _, body := range []string{`{"item":"book"}`, `{"item":"book"}`, `{"item":"pen"}`} {
		resp, err := itest.Post(srv.URL+"/orders", "order-key-1", body)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(resp)
	}
	// Output:
	// 201 {"item":"book","order":1}
	// 201 replayed {"item":"book","order":1}
	// 422 application/problem+json https://justonce.dev/problems/key-reused
}
