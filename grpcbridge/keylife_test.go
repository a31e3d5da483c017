package grpcbridge_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/promtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// ledgerConfig is a ledger's Config, with a Redis of the test's own when
// redisOn.
func ledgerConfig(t testing.TB, redisOn bool) inbox.Config {
	var lc inbox.Config
	if redisOn {
		c, prefix := testsvc.Redis(t)
		lc.Redis = &inbox.RedisConfig{Client: c, Prefix: prefix, Timeout: 2 * time.Second}
	}
	return lc
}

// requirePeer checks that a log line names the calling peer and its user
// agent.
func requirePeer(t testing.TB, line map[string]any) {
	t.Helper()
	require.Regexp(t, `^127\.0\.0\.1:\d+$`, line["client"])
	require.Contains(t, line["user_agent"], "grpc-go/")
}

// expiresTrailer reads the answer's idempotency-key-expires trailer.
func expiresTrailer(t testing.TB, trl metadata.MD) time.Time {
	t.Helper()
	v := trl.Get("idempotency-key-expires")
	require.Len(t, v, 1, "trailer %v", trl)
	at, err := time.Parse(time.RFC3339, v[0])
	require.NoError(t, err)
	return at
}

// TestExpiresTrailer: every answer about a recorded key, a success or an
// error, carries when the key expires, from the row's expiry rounded down;
// answers about no key, or a key left free, do not.
func TestExpiresTrailer(t *testing.T) {
	t.Parallel()
	for _, redisOn := range []bool{false, true} {
		t.Run(fmt.Sprint("redis=", redisOn), func(t *testing.T) {
			t.Parallel()
			lc := ledgerConfig(t, redisOn)
			e := setup(t, envOpts{ledger: lc, cfg: grpcbridge.Config{
				Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", TTL: 2 * time.Hour}}}})
			ctx := ctxT(t)
			req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
			var first, replay, reused metadata.MD
			_, err := e.client.CreateOrder(withKey(ctx, "exp-1"), req, grpc.Trailer(&first))
			require.NoError(t, err)
			rec, err := e.ledger.Lookup(ctx, inbox.Key{Scope: "orders", ID: "exp-1"})
			require.NoError(t, err)
			want := rec.ExpiresAt.UTC().Truncate(time.Second)
			require.Equal(t, want, expiresTrailer(t, first))
			require.Equal(t, []string{"yes"}, first.Get("x-done"), "the handler's trailer too")
			_, err = e.client.CreateOrder(withKey(ctx, "exp-1"), req, grpc.Trailer(&replay))
			require.NoError(t, err)
			require.Equal(t, want, expiresTrailer(t, replay))
			require.Equal(t, []string{"yes"}, replay.Get("x-done"))
			_, err = e.client.CreateOrder(withKey(ctx, "exp-1"), &testpb.CreateOrderRequest{Item: "pen"}, grpc.Trailer(&reused))
			require.Equal(t, codes.InvalidArgument, status.Code(err))
			require.Equal(t, want, expiresTrailer(t, reused), "an error answer carries it too")

			var free, bad metadata.MD
			_, err = e.client.CreateOrder(withKey(ctx, "exp-2"), &testpb.CreateOrderRequest{Item: "x", FailCode: int32(codes.Unavailable)}, grpc.Trailer(&free))
			require.Equal(t, codes.Unavailable, status.Code(err))
			require.Empty(t, free.Get("idempotency-key-expires"), "not stored: the key is free")
			_, err = e.client.CreateOrder(withKey(ctx, ""), req, grpc.Trailer(&bad))
			require.Equal(t, codes.InvalidArgument, status.Code(err))
			require.Empty(t, bad.Get("idempotency-key-expires"))
		})
	}
}

// TestInFlightExpiry: a call in flight is answered Aborted with a lower
// bound of the key's expiry: the first call claimed it at most
// HandlerTimeout ago.
func TestInFlightExpiry(t *testing.T) {
	t.Parallel()
	e := setup(t, envOpts{cfg: grpcbridge.Config{HandlerTimeout: 10 * time.Minute,
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", TTL: 2 * time.Hour}}}})
	e.svc.started, e.svc.release = make(chan struct{}, 1), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := e.client.CreateOrder(withKey(ctxT(t), "busy"), &testpb.CreateOrderRequest{Item: "a"})
		done <- err
	}()
	<-e.svc.started
	e.svc.started = nil
	var trl metadata.MD
	before := time.Now()
	_, err := e.client.CreateOrder(withKey(ctxT(t), "busy"), &testpb.CreateOrderRequest{Item: "a"}, grpc.Trailer(&trl))
	require.Equal(t, codes.Aborted, status.Code(err))
	got := expiresTrailer(t, trl)
	lower := before.Add(2*time.Hour - 10*time.Minute).Truncate(time.Second)
	require.False(t, got.Before(lower.Add(-time.Second)), "%s before %s", got, lower)
	require.False(t, got.After(time.Now().Add(2*time.Hour-10*time.Minute)))
	close(e.svc.release)
	require.NoError(t, <-done)
}

// TestMinTTL: a method whose TTL is under AEP-155's minimum lifetime (an
// hour by default, Config.MinTTL) is refused by New unless it allows a
// short TTL.
func TestMinTTL(t *testing.T) {
	t.Parallel()
	l := deadLedger(t)
	m := func(mc grpcbridge.MethodConfig) map[string]grpcbridge.MethodConfig {
		mc.Scope = "s"
		return map[string]grpcbridge.MethodConfig{createOrder: mc}
	}
	_, err := grpcbridge.New(grpcbridge.Config{Ledger: l, Methods: m(grpcbridge.MethodConfig{TTL: 30 * time.Minute})})
	require.ErrorIs(t, err, inbox.ErrConfig)
	require.Contains(t, err.Error(), "MinTTL")
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, Methods: m(grpcbridge.MethodConfig{TTL: 30 * time.Minute, AllowShortTTL: true})})
	require.NoError(t, err)
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, Methods: m(grpcbridge.MethodConfig{TTL: time.Hour})})
	require.NoError(t, err, "an hour is enough")
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, MinTTL: 48 * time.Hour, Methods: m(grpcbridge.MethodConfig{})})
	require.ErrorIs(t, err, inbox.ErrConfig, "the ledger's 24 h under a 48 h minimum")
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, MinTTL: 48 * time.Hour, Methods: m(grpcbridge.MethodConfig{Off: true})})
	require.NoError(t, err, "a method turned off is not checked")
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, Methods: m(grpcbridge.MethodConfig{TTL: time.Minute, AllowShortTTL: true})})
	require.ErrorIs(t, err, inbox.ErrConfig, "still over twice ClockSkew")
}

func deadLedger(t testing.TB) *inbox.Ledger {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	return l
}

// TestKeyReusedNamesDifferences: IDEMPOTENCY_KEY_REUSED names the fields
// and metadata that differ (ErrorInfo metadata, BadRequest violations, the
// log), never their values.
func TestKeyReusedNamesDifferences(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	e := setup(t, envOpts{ledger: inbox.Config{Logger: l.Logger()}, cfg: grpcbridge.Config{
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", FingerprintMetadata: []string{"api-version"}}}}})
	ctx := metadata.AppendToOutgoingContext(withKey(ctxT(t), "d-1"), "api-version", "1")
	_, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book", Quantity: 1, Tags: []string{"gift"}})
	require.NoError(t, err)
	ctx = metadata.AppendToOutgoingContext(withKey(ctxT(t), "d-1"), "api-version", "2")
	_, err = e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book", Quantity: 7, Tags: []string{"secret-tag"}})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "IDEMPOTENCY_KEY_REUSED", reason(err))
	want := []string{"message:/quantity", "message:/tags/0", "metadata:api-version"}
	ei, _ := detail[*errdetails.ErrorInfo](err)
	require.Equal(t, strings.Join(want, ","), ei.GetMetadata()["differences"])
	br, _ := detail[*errdetails.BadRequest](err)
	var fields []string
	for _, v := range br.GetFieldViolations() {
		fields = append(fields, v.GetField())
	}
	require.Equal(t, append([]string{"idempotency-key"}, want...), fields)
	require.Contains(t, status.Convert(err).Message(), "message:/quantity, message:/tags/0, metadata:api-version")
	line := l.One(t, "key reused with another request")
	require.Equal(t, "INFO", line["level"])
	require.Equal(t, []any{"message:/quantity", "message:/tags/0", "metadata:api-version"}, line["differences"])
	requirePeer(t, line)
	require.NotContains(t, l.String(), "secret-tag")
	require.NotContains(t, err.Error(), "secret-tag")
}

// TestPlainFingerprintsStillMatch: keys stored with plain fingerprints, as
// releases before detailed ones stored them, replay to the same call.
func TestPlainFingerprintsStillMatch(t *testing.T) {
	t.Parallel()
	old := setup(t, envOpts{cfg: grpcbridge.Config{LegacyFingerprints: true}})
	cur := setup(t, envOpts{pg: old.pg})
	ctx := ctxT(t)
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	first, err := old.client.CreateOrder(withKey(ctx, "p-1"), req)
	require.NoError(t, err)
	var hdr metadata.MD
	again, err := cur.client.CreateOrder(withKey(ctx, "p-1"), req, grpc.Header(&hdr))
	require.NoError(t, err)
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.Equal(t, first.GetId(), again.GetId())
	_, err = cur.client.CreateOrder(withKey(ctx, "p-1"), &testpb.CreateOrderRequest{Item: "pen"})
	require.Equal(t, "IDEMPOTENCY_KEY_REUSED", reason(err))
	ei, _ := detail[*errdetails.ErrorInfo](err)
	require.Empty(t, ei.GetMetadata()["differences"], "a plain fingerprint names nothing")
	require.Equal(t, 1, old.orders(t))
}

// TestKeyValidatorAndMaxKeyLen: a method's own key rule refuses with its
// message (IDEMPOTENCY_KEY_INVALID), logged at WARN with the key masked
// and the peer; keys may be limited to 128 bytes, per method or for all.
func TestKeyValidatorAndMaxKeyLen(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	format := regexp.MustCompile(`^[a-z0-9_]+:[a-z.]+:[a-z0-9_]+:\d{13}$`)
	e := setup(t, envOpts{ledger: inbox.Config{Logger: l.Logger()}, cfg: grpcbridge.Config{MaxKeyLen: 200,
		Methods: map[string]grpcbridge.MethodConfig{
			createOrder: {Scope: "orders", MaxKeyLen: 128, KeyValidator: func(key string) error {
				if !format.MatchString(key) {
					return errors.New("the key must be {user}:{operation}:{resource}:{timestamp in ms}")
				}
				return nil
			}},
			getOrder: {Scope: "reads"},
		}}})
	ctx := ctxT(t)
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	_, err := e.client.CreateOrder(withKey(ctx, "usr_abc123:booking.create:res_xyz:1704067200000"), req)
	require.NoError(t, err)
	_, err = e.client.CreateOrder(withKey(ctx, "usr_abc123-booking-create"), req)
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "IDEMPOTENCY_KEY_INVALID", reason(err))
	require.Equal(t, "the key must be {user}:{operation}:{resource}:{timestamp in ms}", status.Convert(err).Message())
	br, _ := detail[*errdetails.BadRequest](err)
	require.Equal(t, "idempotency-key", br.GetFieldViolations()[0].GetField())
	line := l.One(t, "invalid key")
	require.Equal(t, "WARN", line["level"])
	require.Equal(t, "usr_****eate", line["key"])
	requirePeer(t, line)

	long := "u:booking.create:" + strings.Repeat("r", 98) + ":1704067200000"
	require.Len(t, long, 129)
	_, err = e.client.CreateOrder(withKey(ctx, long), req)
	require.Contains(t, status.Convert(err).Message(), "the limit is 128")
	_, err = e.client.CreateOrder(withKey(ctx, "u:booking.create:"+strings.Repeat("r", 97)+":1704067200000"), req)
	require.NoError(t, err, "128 bytes")

	// GetOrder takes Config.MaxKeyLen.
	_, err = e.client.GetOrder(withKey(ctx, strings.Repeat("k", 201)), &testpb.Order{Id: 1})
	require.Equal(t, "IDEMPOTENCY_KEY_INVALID", reason(err))
}

// TestLogLevels: a missing key on a Required method is logged at WARN, a
// replay at INFO, with the peer's address and user agent, the key masked.
func TestLogLevels(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	e := setup(t, envOpts{ledger: inbox.Config{Logger: l.Logger()}, cfg: grpcbridge.Config{
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", Required: true}}}})
	ctx := ctxT(t)
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	_, err := e.client.CreateOrder(ctx, req)
	require.Equal(t, "IDEMPOTENCY_KEY_MISSING", reason(err))
	line := l.One(t, "missing key")
	require.Equal(t, "WARN", line["level"])
	requirePeer(t, line)
	const key = "550e8400-e29b-41d4-a716-446655440000"
	for range 2 {
		_, err = e.client.CreateOrder(withKey(ctx, key), req)
		require.NoError(t, err)
	}
	line = l.One(t, "justonce/grpcbridge: replay")
	require.Equal(t, "INFO", line["level"])
	require.Equal(t, "orders//550e****0000", line["key"])
	requirePeer(t, line)
	require.NotContains(t, l.String(), key)
}

// TestKeyRateLimit: 20 new keys of one tenant at once against a limit of 5
// per window: 5 run, 15 get ResourceExhausted (KEY_RATE_EXCEEDED) with a
// RetryInfo delay and leave nothing behind; the 5 replay as usual. On
// Postgres alone handlers that passed the count's check together were
// refused at their commit (more than 5 ran); with Redis only 5 ran.
func TestKeyRateLimit(t *testing.T) {
	t.Parallel()
	for _, redisOn := range []bool{false, true} {
		t.Run(fmt.Sprint("redis=", redisOn), func(t *testing.T) {
			t.Parallel()
			lc := ledgerConfig(t, redisOn)
			const n, limit = 20, 5
			e := setup(t, envOpts{ledger: lc, cfg: grpcbridge.Config{
				Tenant: func(ctx context.Context) string {
					md, _ := metadata.FromIncomingContext(ctx)
					return strings.Join(md.Get("x-tenant"), "")
				},
				Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", KeyRate: &inbox.KeyRate{
					Limit: func(tenant string) int64 { return map[string]int64{"acme": limit}[tenant] }, Window: time.Hour}}}}})
			tenant := func(key, t string) context.Context {
				return metadata.AppendToOutgoingContext(withKey(context.Background(), key), "x-tenant", t)
			}
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[i] = e.client.CreateOrder(tenant(fmt.Sprintf("rate-%d", i), "acme"),
						&testpb.CreateOrderRequest{Item: "x", Quantity: 1, SleepMs: 500})
				}()
			}
			wg.Wait()
			var ok []int
			for i, err := range errs {
				if err == nil {
					ok = append(ok, i)
					continue
				}
				require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
				require.Equal(t, "KEY_RATE_EXCEEDED", reason(err))
				ri, found := detail[*errdetails.RetryInfo](err)
				require.True(t, found)
				require.Positive(t, ri.GetRetryDelay().AsDuration())
			}
			require.Len(t, ok, limit)
			require.Equal(t, limit, e.orders(t))
			require.Equal(t, limit, e.pg.Count(t, `SELECT count(*) FROM processed_events`), "a refused key leaves no row")
			if redisOn {
				require.EqualValues(t, limit, e.svc.runs.Load())
			} else {
				require.Greater(t, e.svc.runs.Load(), int64(limit), "refused at commit after running: contention")
			}
			var hdr metadata.MD
			for _, i := range ok {
				_, err := e.client.CreateOrder(tenant(fmt.Sprintf("rate-%d", i), "acme"),
					&testpb.CreateOrderRequest{Item: "x", Quantity: 1, SleepMs: 500}, grpc.Header(&hdr))
				require.NoError(t, err, "replays are never limited")
				require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
			}
			_, err := e.client.CreateOrder(tenant("rate-late", "acme"), &testpb.CreateOrderRequest{Item: "x"})
			require.Equal(t, codes.ResourceExhausted, status.Code(err))
			_, err = e.client.CreateOrder(tenant("rate-other", "globex"), &testpb.CreateOrderRequest{Item: "x"})
			require.NoError(t, err)
		})
	}
}

// TestObserveMode: an observe-mode method blocks nothing: a call the
// bridge would refuse, a duplicate, a mismatch all reach the handler as
// they came, without the bridge's transaction or a replay; the metric and
// the log say what enforcing would have done.
func TestObserveMode(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	bc := metrics.NewBridgeCollector()
	reg := prometheus.NewRegistry()
	reg.MustRegister(bc)
	e := setup(t, envOpts{ledger: inbox.Config{Logger: l.Logger()}, cfg: grpcbridge.Config{OnObserve: bc.Observer("grpc"),
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders", Required: true, Observe: true}}}})
	count := func(would string) float64 {
		return promtest.CounterValue(t, reg, "justonce_bridge_observed_total", map[string]string{"front": "grpc", "route": createOrder, "would": would})
	}
	ctx := ctxT(t)
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}

	var hdr, trl metadata.MD
	o, err := e.client.CreateOrder(ctx, req, grpc.Header(&hdr))
	require.NoError(t, err, "no key on a required method: runs")
	require.NotZero(t, o.GetId())
	require.Equal(t, 1.0, count("would_refuse_missing_key"))
	line := l.One(t, "observe mode: missing key")
	require.Equal(t, "WARN", line["level"])
	require.Equal(t, createOrder, line["method"])
	requirePeer(t, line)
	_, err = e.client.CreateOrder(withKey(ctx, "k", time.Now().Add(time.Hour)), req)
	require.NoError(t, err, "first_sent in the future: runs")
	require.Equal(t, 1.0, count("would_refuse_invalid_key"))

	_, err = e.client.CreateOrder(withKey(ctx, "obs-1"), req)
	require.NoError(t, err)
	require.Equal(t, 1.0, count("would_run"))
	again, err := e.client.CreateOrder(withKey(ctx, "obs-1"), req, grpc.Header(&hdr), grpc.Trailer(&trl))
	require.NoError(t, err)
	require.Empty(t, hdr.Get("idempotent-replayed"), "not a replay")
	require.Empty(t, trl.Get("idempotency-key-expires"))
	require.Equal(t, []string{"yes"}, trl.Get("x-done"), "the handler's metadata as it set it")
	require.Equal(t, 1.0, count("would_replay"))
	require.Equal(t, "INFO", l.One(t, "observe mode: duplicate")["level"])
	_, err = e.client.CreateOrder(withKey(ctx, "obs-1"), &testpb.CreateOrderRequest{Item: "pen", Quantity: 1})
	require.NoError(t, err)
	require.Equal(t, 1.0, count("would_mismatch"))
	require.Equal(t, []any{"message:/item"}, l.One(t, "observe mode: key reused")["differences"])
	require.Equal(t, 5, e.orders(t), "every call ran")
	require.EqualValues(t, 5, e.svc.runs.Load())
	require.Greater(t, again.GetId(), int64(0))
	require.Equal(t, 1, e.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'orders~observe'`))
}
