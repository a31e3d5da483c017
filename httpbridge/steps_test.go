package httpbridge_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// A steps route: the first request records the order and the charge and
// fails at the receipt (503, not stored); the retry resumes after them;
// a third is a replay. Another key fails for good after its charge: the
// charge is refunded, and its retry is answered key-failed.
func TestStepsRoute(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	charges, refunds, receipts := map[string]int{}, map[string]int{}, 0
	mailerUp := false
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "payments", Steps: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		s := httpbridge.Steps(ctx)
		require.NotNil(t, s)
		require.Nil(t, httpbridge.Tx(ctx))
		token, ok := httpbridge.FencingToken(ctx)
		require.True(t, ok)
		require.Equal(t, s.Token(), token)
		s.Compensate("charge", func(ctx context.Context, key string, _ []byte) error {
			refunds[key]++
			return nil
		})
		if _, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO orders (body) VALUES ($1)`, s.Key().ID)
			return nil, err
		}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			charges[key]++
			return []byte("ch_" + s.Key().ID), nil
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if strings.Contains(r.URL.Path, "refused") {
			httpbridge.FailSteps(ctx, errors.New("card refused"))
			http.Error(w, "card refused", http.StatusPaymentRequired)
			return
		}
		if _, err := s.Call(ctx, "receipt", func(ctx context.Context, key string) ([]byte, error) {
			if !mailerUp {
				return nil, errors.New("mailer down")
			}
			receipts++
			return nil, nil
		}); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(charge)
	}))
	send := func(path, key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	rec := send("/pay", "k1")
	require.Equal(t, http.StatusServiceUnavailable, rec.Code)
	steps, err := b.ledger.Steps(context.Background(), inbox.Key{Scope: "payments", ID: "k1"})
	require.NoError(t, err)
	require.Len(t, steps, 2, "order and charge recorded")
	mailerUp = true
	rec = send("/pay", "k1")
	require.Equal(t, http.StatusCreated, rec.Code)
	require.Equal(t, "ch_k1", rec.Body.String())
	rec = send("/pay", "k1")
	require.Equal(t, http.StatusCreated, rec.Code)
	require.Equal(t, "ch_k1", rec.Body.String())
	require.Equal(t, "true", rec.Header().Get("Idempotent-Replayed"))
	k1 := inbox.Key{Scope: "payments", ID: "k1"}
	require.Equal(t, map[string]int{inbox.StepKey(k1, "charge"): 1}, charges, "the charge recorded on attempt 1 is not run on attempt 2")
	require.Equal(t, 1, receipts)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM orders`))

	rec = send("/refused", "k2")
	require.Equal(t, http.StatusPaymentRequired, rec.Code)
	k2 := inbox.Key{Scope: "payments", ID: "k2"}
	require.Equal(t, map[string]int{inbox.StepKey(k2, "compensate:charge"): 1}, refunds)
	rec = send("/refused", "k2")
	require.Equal(t, http.StatusUnprocessableEntity, rec.Code)
	require.Contains(t, rec.Body.String(), "failed for good")
	require.Equal(t, 1, charges[inbox.StepKey(k2, "charge")])
	require.Len(t, refunds, 1)
	rec2, err := b.ledger.Lookup(context.Background(), k2)
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec2.Status)
}

func TestStepsRouteConfig(t *testing.T) {
	t.Parallel()
	for _, rc := range []httpbridge.RouteConfig{
		{Scope: "s", Steps: true, Lease: true},
		{Scope: "s", Steps: true, Observe: true},
		{Scope: "s", Steps: true, KeyRate: &inbox.KeyRate{Limit: func(string) int64 { return 1 }}},
	} {
		require.ErrorIs(t, rc.Validate(), inbox.ErrConfig)
	}
	require.NoError(t, httpbridge.RouteConfig{Scope: "s", Steps: true, LeaseDuration: 1e9}.Validate())
	require.Nil(t, httpbridge.Steps(context.Background()))
}
