package grpcbridge_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/grpctest/testpb"
)

// BenchmarkUnary measures, in one run and over real gRPC on loopback TCP
// and real Postgres, the three costs the ratios compare:
//
//   - first: a keyed call with a new key (claim, handler, store, commit);
//   - replay: the same key again (one ledger read, no handler);
//   - plain: the same handler without the interceptor, in a transaction
//     of its own.
//
// It reports ns per call of each and the ratios replay/first and
// first/plain. It sizes its own work (2,000 rounds per iteration, 100 with
// JUSTONCE_BENCH_SMALL=1), whatever -benchtime says; each round makes one
// call of each kind, so the ratios come from the same conditions.
func BenchmarkUnary(b *testing.B) {
	withBridge := setup(b, envOpts{})
	without := setup(b, envOpts{pg: withBridge.pg, noBrige: true})
	ctx := context.Background()
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	rounds := 2000
	if os.Getenv("JUSTONCE_BENCH_SMALL") != "" {
		rounds = 100
	}
	var first, replay, plain time.Duration
	b.ResetTimer()
	for i := 0; i < b.N*rounds; i++ {
		kctx := withKey(ctx, fmt.Sprintf("bench-%d-%d", b.N, i))
		t0 := time.Now()
		_, err := withBridge.client.CreateOrder(kctx, req)
		t1 := time.Now()
		require.NoError(b, err)
		_, err = withBridge.client.CreateOrder(kctx, req)
		t2 := time.Now()
		require.NoError(b, err)
		_, err = without.client.CreateOrder(ctx, req)
		t3 := time.Now()
		require.NoError(b, err)
		first += t1.Sub(t0)
		replay += t2.Sub(t1)
		plain += t3.Sub(t2)
	}
	n := float64(b.N * rounds)
	b.ReportMetric(float64(first.Nanoseconds())/n, "first-ns/call")
	b.ReportMetric(float64(replay.Nanoseconds())/n, "replay-ns/call")
	b.ReportMetric(float64(plain.Nanoseconds())/n, "plain-ns/call")
	b.ReportMetric(float64(replay)/float64(first), "replay/first")
	b.ReportMetric(float64(first)/float64(plain), "first/plain")
}
