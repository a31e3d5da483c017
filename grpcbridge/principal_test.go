package grpcbridge_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/inbox"
)

// byUser takes the principal from the x-user metadata ("" when absent).
func byUser(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get("x-user"); len(v) == 1 {
		return v[0]
	}
	return ""
}

// With Config.Principal set, a method that isolates principals (the
// default) takes keys of at most 231 bytes on every call, also one whose
// principal is "" and whose ledger ID is therefore the plain key: the
// limit is the method's, the same for every caller and every attempt. A
// method with PrincipalShared, or a bridge without Config.Principal, takes
// 255.
func TestPrincipalKeyLimit(t *testing.T) {
	e := setup(t, envOpts{cfg: grpcbridge.Config{Principal: byUser, Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders"}}}})
	ctx := ctxT(t)
	as := func(user string) context.Context {
		if user == "" {
			return ctx
		}
		return metadata.AppendToOutgoingContext(ctx, "x-user", user)
	}
	create := func(env *env, user, key string) error {
		_, err := env.client.CreateOrder(withKey(as(user), key), &testpb.CreateOrderRequest{Item: "book", Quantity: 1})
		return err
	}
	refused := func(err error) {
		t.Helper()
		require.Equal(t, codes.InvalidArgument, status.Code(err), err)
		require.Equal(t, "IDEMPOTENCY_KEY_INVALID", reason(err))
		require.Contains(t, status.Convert(err).Message(), "the limit is 231")
	}
	for _, user := range []string{"", "alice"} {
		refused(create(e, user, strings.Repeat("a", 232)))
		refused(create(e, user, strings.Repeat("a", 255)))
		require.NoError(t, create(e, user, strings.Repeat("a", 231)), "principal %q", user)
	}
	for id, principal := range map[string]string{
		strings.Repeat("a", 231):                                "",
		inbox.PrincipalKeyID(strings.Repeat("a", 231), "alice"): "alice",
	} {
		rec, err := e.ledger.Lookup(ctx, inbox.Key{Scope: "orders", ID: id})
		require.NoError(t, err, "row of principal %q", principal)
		require.Equal(t, principal, rec.Principal)
	}
	require.Len(t, inbox.PrincipalKeyID(strings.Repeat("a", 231), "alice"), inbox.MaxPartLen)
	require.EqualValues(t, 2, e.svc.runs.Load())

	shared := setup(t, envOpts{pg: e.pg, cfg: grpcbridge.Config{Principal: byUser, Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "shared", PrincipalKeys: inbox.PrincipalShared}}}})
	require.NoError(t, create(shared, "alice", strings.Repeat("s", 255)))
	require.Equal(t, codes.InvalidArgument, status.Code(create(shared, "alice", strings.Repeat("s", 256))))

	anonymous := setup(t, envOpts{pg: e.pg, cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "anonymous"}}}})
	require.NoError(t, create(anonymous, "", strings.Repeat("n", 255)))
}
