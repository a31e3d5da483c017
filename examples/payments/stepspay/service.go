package stepspay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// Schema holds what the steps payment service writes: one order row
// and one receipt row per payment. Neither has a unique key, so a payment
// that ran a step twice would show as a second row.
const Schema = `CREATE TABLE IF NOT EXISTS step_orders (payment text NOT NULL, created_at timestamptz DEFAULT now());
	CREATE TABLE IF NOT EXISTS step_receipts (payment text NOT NULL, charge text NOT NULL, created_at timestamptz DEFAULT now())`

// Scope is the ledger scope of the steps payment service, on every
// front.
const Scope = "payments-steps"

// The fronts of the payment service.
const (
	FrontHTTP  = "http"
	FrontGRPC  = "grpc"
	FrontKafka = "kafka" // segmentio/kafka-go (kafkainbox)
	FrontFranz = "franz" // franz-go (franzinbox)
	FrontNATS  = "nats"  // NATS JetStream (natsinbox)
)

// AllFronts are the fronts the service serves, in the order Prove kills
// them.
var AllFronts = []string{FrontHTTP, FrontGRPC, FrontKafka, FrontFranz, FrontNATS}

// Service is the payment service in steps: a payment is an order
// row (a Postgres step), a charge at the provider (an outside step, whose
// key goes to the provider as its Idempotency-Key) and a receipt row (a
// Postgres step). The same handler serves every front.
type Service struct {
	provider string       // the provider's base URL
	client   *http.Client // to the provider, through httpretry
	// crash, when set, is called at each point between and inside the
	// steps (see Points), with the front that runs the payment.
	crash func(front, point string)
}

// Points are the points Service.pay passes, in order.
var Points = []string{
	"order-before-commit",   // inside the Postgres step, its row written, not committed
	"order-after-commit",    // the order recorded
	"charge-before-call",    // the outside step begun, the provider not called
	"charge-after-call",     // the provider charged, the step not recorded
	"charge-after-record",   // the charge recorded
	"receipt-before-commit", // inside the last step
	"receipt-after-commit",  // every step recorded, the payment not completed
}

// NewService returns the payment service, charging at the provider at
// the base URL provider; crash, when set, is called at each of Points.
func NewService(provider string, crash func(front, point string)) *Service {
	return &Service{provider: provider, crash: crash,
		client: &http.Client{Timeout: 10 * time.Second, Transport: &httpretry.Transport{}}}
}

// pay runs the payment s is for, and returns the provider's charge ID.
func (p *Service) pay(ctx context.Context, s *inbox.Steps, front string) ([]byte, error) {
	if s == nil {
		return nil, errors.New("payments: not run in steps")
	}
	id := s.Key().ID
	at := func(point string) {
		if p.crash != nil {
			p.crash(front, point)
		}
	}
	if _, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO step_orders (payment) VALUES ($1)`, id)
		if err == nil {
			at("order-before-commit")
		}
		return nil, err
	}); err != nil {
		return nil, err
	}
	at("order-after-commit")
	charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
		at("charge-before-call")
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.provider+"/charges", strings.NewReader(id))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Idempotency-Key", key) // inbox.StepKey(s.Key(), "charge"): the provider charges once
		resp, err := p.client.Do(req)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusCreated {
			err = fmt.Errorf("provider: %s %s", resp.Status, body)
		}
		if err != nil {
			return nil, err
		}
		at("charge-after-call")
		return body, nil
	})
	if err != nil {
		return nil, err
	}
	at("charge-after-record")
	if _, err := s.Tx(ctx, "receipt", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO step_receipts (payment, charge) VALUES ($1, $2)`, id, string(charge))
		if err == nil {
			at("receipt-before-commit")
		}
		return nil, err
	}); err != nil {
		return nil, err
	}
	at("receipt-after-commit")
	return charge, nil
}

// paymentsService is demo.StepsPayments: Pay takes the payment ID and
// answers the charge ID.
var paymentsService = grpc.ServiceDesc{
	ServiceName: "demo.StepsPayments",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Pay",
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			h := func(ctx context.Context, _ any) (any, error) {
				charge, err := srv.(*Service).pay(ctx, grpcbridge.Steps(ctx), FrontGRPC)
				if err != nil {
					return nil, status.Error(codes.Unavailable, err.Error()) // not stored: the steps recorded stay
				}
				return wrapperspb.String(string(charge)), nil
			}
			if icpt == nil {
				return h(ctx, in)
			}
			return icpt(ctx, in, &grpc.UnaryServerInfo{FullMethod: PayMethod}, h)
		},
	}},
}

// PayMethod is the gRPC method of a payment: its request and answer are
// google.protobuf.StringValue, the payment ID and the charge ID.
const PayMethod = "/demo.StepsPayments/Pay"

// Fronts says where the steps payment service takes payments.
type Fronts struct {
	HTTPAddr, GRPCAddr     string // listen addresses
	Brokers                []string
	KafkaTopic, FranzTopic string
	Group                  string // names the Kafka consumer groups (Group-kgo, Group-franz) and the JetStream durable
	NATS                   *nats.Conn
	Stream                 string
	LeaseDuration          time.Duration // of the bridges' steps (the consumers': the ledger's)
}

// Serve runs the service on every front until ctx ends: POST /pay over HTTP
// (the Idempotency-Key is the payment ID), demo.StepsPayments/Pay over
// gRPC, and the payment IDs consumed from Kafka (kafka-go and franz-go)
// and NATS JetStream, all in steps, in one ledger scope.
func (p *Service) Serve(ctx context.Context, ledger *inbox.Ledger, f Fronts) error {
	hb, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /pay", hb.Route(httpbridge.RouteConfig{Scope: Scope, Required: true, Steps: true, LeaseDuration: f.LeaseDuration})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			charge, err := p.pay(r.Context(), httpbridge.Steps(r.Context()), FrontHTTP)
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable) // not stored: the steps recorded stay
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(charge)
		})))
	hln, err := net.Listen("tcp", f.HTTPAddr)
	if err != nil {
		return err
	}
	hsrv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hsrv.Serve(hln) }()
	defer hsrv.Close()

	gb, err := grpcbridge.New(grpcbridge.Config{Ledger: ledger, Methods: map[string]grpcbridge.MethodConfig{
		PayMethod: {Scope: Scope, Required: true, Steps: true, LeaseDuration: f.LeaseDuration}}})
	if err != nil {
		return err
	}
	gsrv := grpc.NewServer(grpc.UnaryInterceptor(gb.UnaryServerInterceptor()))
	gsrv.RegisterService(&paymentsService, p)
	gln, err := net.Listen("tcp", f.GRPCAddr)
	if err != nil {
		return err
	}
	go func() { _ = gsrv.Serve(gln) }()
	defer gsrv.Stop()

	handler := func(front string) consumer.Handler {
		return func(ctx context.Context, _ pgx.Tx, m *consumer.Message) error {
			charge, err := p.pay(ctx, consumer.Steps(ctx), front)
			consumer.SetResult(ctx, inbox.Result{Code: 201, Body: charge})
			return err
		}
	}
	// Retried until done: a payment is never dead-lettered here (that
	// would refund its charge).
	pc := consumer.Config{Ledger: ledger, Scope: Scope, Steps: true, MaxAttempts: 1 << 20,
		Backoff: backoff.Backoff{Initial: 10 * time.Millisecond, Max: 200 * time.Millisecond}}
	kc, err := kafkainbox.New(kafkainbox.Config{Brokers: f.Brokers, Topic: f.KafkaTopic, GroupID: f.Group + "-kgo", Processor: pc}, handler(FrontKafka))
	if err != nil {
		return err
	}
	fc, err := franzinbox.New(franzinbox.Config{Brokers: f.Brokers, Topics: []string{f.FranzTopic}, GroupID: f.Group + "-franz", Processor: pc}, handler(FrontFranz))
	if err != nil {
		return err
	}
	nc, err := natsinbox.New(natsinbox.Config{Conn: f.NATS, Stream: f.Stream, Durable: f.Group, AckWait: 5 * time.Second, Processor: pc}, handler(FrontNATS))
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for _, c := range []interface{ Run(context.Context) error }{kc, fc, nc} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.Run(ctx); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}
