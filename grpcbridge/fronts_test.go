package grpcbridge_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// One ledger across fronts: an RPC with key K, an HTTP request with key K
// (no principal) and a Kafka consumer's event with ID K, in the same
// scope, run once between them, whichever comes first.
func TestOneLedgerAcrossFronts(t *testing.T) {
	const scope = "payments"
	e := setup(t, envOpts{cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: scope}}}})
	ctx := ctxT(t)

	// HTTP: the same business effect, in the bridge's transaction.
	hb, err := httpbridge.New(httpbridge.Config{Ledger: e.ledger})
	require.NoError(t, err)
	var httpRuns int
	route := hb.Route(httpbridge.RouteConfig{Scope: scope})
	srv := httptest.NewServer(route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpRuns++
		_, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO orders (item, quantity) VALUES ('http', 1)`)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	post := func(key string) int {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}

	// Kafka: the consumer runtime as kafkainbox runs it for each message.
	var kafkaRuns int
	p, err := consumer.New(consumer.Config{Ledger: e.ledger, Scope: scope, Source: kafkainbox.Source},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			kafkaRuns++
			_, err := tx.Exec(ctx, `INSERT INTO orders (item, quantity) VALUES ('kafka', 1)`)
			return err
		})
	require.NoError(t, err)
	consume := func(id string) consumer.Decision {
		return p.ProcessWithRetry(ctx, &consumer.Message{ID: id, Topic: "payments", Value: []byte(`{"amount":1}`)}, nil)
	}

	rpc := func(key string) (*testpb.Order, metadata.MD, error) {
		var hdr metadata.MD
		o, err := e.client.CreateOrder(withKey(ctx, key), &testpb.CreateOrderRequest{Item: "grpc", Quantity: 1}, grpc.Header(&hdr))
		return o, hdr, err
	}
	processedBy := func(err error, source string) {
		t.Helper()
		require.Equal(t, codes.AlreadyExists, status.Code(err), err)
		ei, ok := detail[*errdetails.ErrorInfo](err)
		require.True(t, ok)
		require.Equal(t, "ALREADY_PROCESSED", ei.GetReason())
		require.Equal(t, source, ei.GetMetadata()["source"])
	}

	// gRPC first.
	_, _, err = rpc("K1")
	require.NoError(t, err)
	// HTTP does not run it, and answers that another front processed it.
	require.Equal(t, http.StatusOK, post("K1"), "HTTP answers its default for a key another front ran")
	require.Equal(t, consumer.Ack, consume("K1").Action)

	// HTTP first.
	require.Equal(t, http.StatusCreated, post("K2"))
	_, hdr, err := rpc("K2")
	processedBy(err, "http")
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.Equal(t, consumer.Ack, consume("K2").Action)

	// Kafka first.
	require.Equal(t, consumer.Ack, consume("K3").Action)
	_, _, err = rpc("K3")
	processedBy(err, string(kafkainbox.Source))
	require.Equal(t, http.StatusOK, post("K3"), "HTTP answers its documented default for a consumer's key")

	// Held by another front (a lease, in flight) and failed there: not
	// answered as done.
	held := inbox.Request{Key: inbox.Key{Scope: scope, ID: "K4"}, Source: "other", Fingerprint: []byte("other-kind")}
	_, _, err = e.ledger.AcquireLease(ctx, held, time.Minute)
	require.NoError(t, err)
	require.Equal(t, http.StatusConflict, post("K4"), "HTTP: in flight elsewhere")
	_, _, err = rpc("K4")
	require.Equal(t, codes.Aborted, status.Code(err), "gRPC: in flight elsewhere: %v", err)
	failed := inbox.Request{Key: inbox.Key{Scope: scope, ID: "K5"}, Source: "other", Fingerprint: []byte("other-kind")}
	_, err = e.ledger.RecordFailure(ctx, failed, 3, errors.New("refused"))
	require.NoError(t, err)
	require.Equal(t, http.StatusUnprocessableEntity, post("K5"), "HTTP: failed elsewhere")
	_, _, err = rpc("K5")
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "gRPC: failed elsewhere: %v", err)

	require.Equal(t, 3, e.orders(t), "one effect per key")
	require.EqualValues(t, 1, e.svc.runs.Load())
	require.Equal(t, 1, httpRuns)
	require.Equal(t, 1, kafkaRuns)
	for _, k := range []string{"K1", "K2", "K3"} {
		_, _, err := rpc(k)
		if k == "K1" {
			require.NoError(t, err, "gRPC replays its own")
		} else {
			require.Equal(t, codes.AlreadyExists, status.Code(err), fmt.Sprint(k))
		}
	}
}

// One principal's key dedupes across the two fronts: both record it under
// inbox.PrincipalKeyID. Another principal's same key runs on its own.
func TestPrincipalKeyAcrossFronts(t *testing.T) {
	const scope = "payments"
	e := setup(t, envOpts{cfg: grpcbridge.Config{Principal: byUser, Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: scope}}}})
	ctx := ctxT(t)
	hb, err := httpbridge.New(httpbridge.Config{Ledger: e.ledger, Principal: func(r *http.Request) string { return r.Header.Get("X-User") }})
	require.NoError(t, err)
	var httpRuns int
	srv := httptest.NewServer(hb.Route(httpbridge.RouteConfig{Scope: scope})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpRuns++
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	post := func(key, user string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("X-User", user)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(body)
	}

	_, err = e.client.CreateOrder(metadata.AppendToOutgoingContext(withKey(ctx, "K"), "x-user", "alice"),
		&testpb.CreateOrderRequest{Item: "grpc", Quantity: 1})
	require.NoError(t, err)
	rec, err := e.ledger.Lookup(ctx, inbox.Key{Scope: scope, ID: inbox.PrincipalKeyID("K", "alice")})
	require.NoError(t, err)
	require.Equal(t, "alice", rec.Principal)
	require.Equal(t, grpcbridge.Source, rec.Source)

	code, body := post("K", "alice")
	require.Equal(t, http.StatusOK, code, "alice's key, run over gRPC, is not run again over HTTP")
	require.Contains(t, body, `"source":"grpc"`)
	require.Equal(t, 0, httpRuns)
	code, _ = post("K", "bob")
	require.Equal(t, http.StatusCreated, code, "bob's same key is his own")
	require.Equal(t, 1, httpRuns)
	require.EqualValues(t, 1, e.svc.runs.Load())
}
