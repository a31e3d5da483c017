package chibridge_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// A chi group with the bridge in Use and a URL parameter: the parameter
// reaches the handler through the bridge, the deposit is made once for two
// sends of one key, and keys are per route pattern's scope, not per URL.
func TestChiGroupURLParamOnce(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)

	var ran atomic.Int32
	r := chi.NewRouter()
	r.Route("/accounts/{account}", func(r chi.Router) {
		r.Use(bridge.Route(httpbridge.RouteConfig{Scope: "deposits", Required: true}))
		r.Post("/deposits", func(w http.ResponseWriter, r *http.Request) {
			ran.Add(1)
			ctx := r.Context()
			account := chi.URLParam(r, "account")
			_, err := httpbridge.Tx(ctx).Exec(ctx, `INSERT INTO orders (item) VALUES ($1)`, "deposit:"+account)
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "deposited to %s", account)
		})
		r.Get("/deposits", func(w http.ResponseWriter, r *http.Request) { // not covered: GET
			_, _ = w.Write([]byte("list"))
		})
	})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)

	first, err := itest.Post(srv.URL+"/accounts/a1/deposits", "dep-1", `{"amount":5}`)
	require.NoError(t, err)
	require.Equal(t, "201 deposited to a1", first.String())
	again, err := itest.Post(srv.URL+"/accounts/a1/deposits", "dep-1", `{"amount":5}`)
	require.NoError(t, err)
	require.Equal(t, "201 replayed deposited to a1", again.String())
	// Another URL with the same key and body is another request: 422.
	other, err := itest.Post(srv.URL+"/accounts/a2/deposits", "dep-1", `{"amount":5}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusUnprocessableEntity, other.Status)
	require.Equal(t, httpbridge.ProblemKeyReused, other.ProblemType)
	missing, err := itest.Post(srv.URL+"/accounts/a1/deposits", "", `{"amount":5}`)
	require.NoError(t, err)
	require.Equal(t, httpbridge.ProblemMissingKey, missing.ProblemType)

	require.Equal(t, int32(1), ran.Load(), "the handler ran once")
	var n int
	require.NoError(t, pool.QueryRow(t.Context(), `SELECT count(*) FROM orders WHERE item = 'deposit:a1'`).Scan(&n))
	require.Equal(t, 1, n)

	resp, err := http.Get(srv.URL + "/accounts/a1/deposits")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}
