package grpcbridge_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

const (
	createOrder = "/justonce.grpctest.v1.Orders/CreateOrder"
	getOrder    = "/justonce.grpctest.v1.Orders/GetOrder"
)

// orders is the test service. CreateOrder inserts an order in the call's
// transaction (its own when the bridge gives none), sets header and
// trailer metadata, and obeys the request's test controls.
type orders struct {
	testpb.UnimplementedOrdersServer
	pool *pgxpool.Pool
	runs atomic.Int64
	// started, when set, receives once the handler is running; release,
	// when set, is waited on before the handler answers.
	started chan struct{}
	release chan struct{}
}

func (o *orders) CreateOrder(ctx context.Context, req *testpb.CreateOrderRequest) (*testpb.Order, error) {
	o.runs.Add(1)
	if o.started != nil {
		select {
		case o.started <- struct{}{}:
		default:
		}
	}
	if o.release != nil {
		<-o.release
	}
	if req.GetSleepMs() > 0 {
		time.Sleep(time.Duration(req.GetSleepMs()) * time.Millisecond)
	}
	if req.GetPanic() {
		panic("handler exploded")
	}
	tx := grpcbridge.Tx(ctx)
	var own pgx.Tx // without the bridge: a transaction of the handler's own
	if tx == nil {
		var err error
		if own, err = o.pool.Begin(ctx); err != nil {
			return nil, err
		}
		defer func() { _ = own.Rollback(context.WithoutCancel(ctx)) }()
		tx = own
	}
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO orders (item, quantity) VALUES ($1, $2) RETURNING id`,
		req.GetItem(), req.GetQuantity()).Scan(&id); err != nil {
		return nil, err
	}
	if req.GetFailCode() != 0 {
		st, _ := status.New(codes.Code(req.GetFailCode()), fmt.Sprintf("order %d refused", id)).
			WithDetails(&errdetails.ErrorInfo{Reason: "REFUSED", Domain: "test"})
		return nil, st.Err()
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-order", fmt.Sprint(id), "x-trace-bin", "\x00\x01\xff", "set-cookie", "session=s1"))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-done", "yes"))
	if own != nil {
		if err := own.Commit(ctx); err != nil {
			return nil, err
		}
	}
	return &testpb.Order{Id: id, Item: req.GetItem(), Quantity: req.GetQuantity(), Tags: req.GetTags(),
		Created: timestamppb.New(time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC))}, nil
}

// env is one test's world: a schema, a ledger, a bridge, a gRPC server on
// loopback TCP and a client connection to it.
type env struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
	bridge *grpcbridge.Bridge
	svc    *orders
	conn   *grpc.ClientConn
	client testpb.OrdersClient
	panics atomic.Int64
}

type envOpts struct {
	cfg     grpcbridge.Config
	ledger  inbox.Config  // the ledger's logger and Redis
	pool    *pgxpool.Pool // the ledger's pool; default the schema's own
	pg      *testsvc.PG
	client  []grpc.DialOption
	noBrige bool
}

func setup(t testing.TB, o envOpts) *env {
	t.Helper()
	e := &env{pg: o.pg}
	if e.pg == nil {
		e.pg = testsvc.Postgres(t, testsvc.MaxConns(16))
		e.pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity bigint NOT NULL)`)
	}
	pool := o.pool
	if pool == nil {
		pool = e.pg.Pool
	}
	var err error
	e.ledger, err = inbox.New(pool, o.ledger)
	require.NoError(t, err)
	e.svc = &orders{pool: pool}

	// A recovery interceptor outside the bridge, as a server would have.
	recovery := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if v := recover(); v != nil {
				e.panics.Add(1)
				err = status.Errorf(codes.Internal, "panic: %v", v)
			}
		}()
		return h(ctx, req)
	}
	chain := []grpc.UnaryServerInterceptor{recovery}
	if !o.noBrige {
		cfg := o.cfg
		cfg.Ledger = e.ledger
		if cfg.Methods == nil {
			cfg.Methods = map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders"}}
		}
		if cfg.RetryAfter == 0 {
			cfg.RetryAfter = 50 * time.Millisecond
		}
		e.bridge, err = grpcbridge.New(cfg)
		require.NoError(t, err)
		chain = append(chain, e.bridge.UnaryServerInterceptor())
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	testpb.RegisterOrdersServer(srv, e.svc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		wg.Wait()
	})
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, o.client...)
	e.conn, err = grpc.NewClient(ln.Addr().String(), opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.conn.Close() })
	e.client = testpb.NewOrdersClient(e.conn)
	return e
}

func (e *env) orders(t testing.TB) int {
	t.Helper()
	return e.pg.Count(t, `SELECT count(*) FROM orders`)
}

// withKey returns ctx with the key (and first_sent, when not zero) in
// the outgoing metadata.
func withKey(ctx context.Context, key string, firstSent ...time.Time) context.Context {
	ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", key)
	if len(firstSent) > 0 {
		ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-first-sent", firstSent[0].Format(time.RFC3339Nano))
	}
	return ctx
}

// reason returns the ErrorInfo reason of an error status.
func reason(err error) string {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}

func detail[T proto.Message](err error) (T, bool) {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if v, ok := d.(T); ok {
			return v, true
		}
	}
	var zero T
	return zero, false
}

// rawCodec hands the response's bytes over as they came on the wire.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (rawCodec) Unmarshal(data []byte, v any) error {
	p, ok := v.(*[]byte)
	if !ok {
		return errors.New("rawCodec: want *[]byte")
	}
	*p = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}
