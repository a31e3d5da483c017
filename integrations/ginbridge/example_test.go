package ginbridge_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"github.com/gin-gonic/gin"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/ginbridge"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// A gin route behind the bridge: the handler writes through the ledger's
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

	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	idempotent := ginbridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true}))
	r.POST("/orders", idempotent, func(c *gin.Context) {
		var in struct {
			Item string `json:"item" binding:"required"`
		}
		if err := c.ShouldBindJSON(&in); err != nil {
			c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()}) // 4xx: stored like a success
			return
		}
		ctx := c.Request.Context()
		var id int64
		err := httpbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, in.Item).Scan(&id)
		if err != nil {
			c.String(http.StatusServiceUnavailable, "try again") // 5xx: rolled back, key free
			return
		}
		c.JSON(http.StatusCreated, gin.H{"order": id, "item": in.Item})
	})

	srv := httptest.NewServer(r)
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
