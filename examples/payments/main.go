// Command payments is a payments service that takes the same "pay" command
// over HTTP (Idempotency-Key), gRPC, Kafka and NATS JetStream, all on one
// justonce ledger in one scope. It sends one payment through all four
// paths, several times each and partly at once, and shows that exactly one
// payment was made. The payment handler publishes PaymentCaptured through
// the transactional outbox, in the payment's transaction; a relay sends it
// to Kafka, where a second service, receipts, consumes it on its own
// ledger scope: one payment, one event, one receipt.
//
// The example also holds a payment in steps (package stepspay): an order
// row, a charge at a card provider (a separate HTTP service behind
// justonce's own HTTP bridge, which charges once per Idempotency-Key and
// counts its charges) and a receipt, served on every front. Its test,
// TestStepsKilledOnEveryFront, SIGKILLs that service between and inside
// the steps and checks that each payment was charged once.
//
//	make demo        # starts Postgres, Redis, Kafka; NATS is embedded here
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

const scope = "payments" // shared by the HTTP route, the gRPC method and both consumers

// paymentsService is demo.Payments, written by hand so that the demo needs
// no generated code: Pay takes the order ID and answers the payment ID, in
// the gRPC bridge's transaction.
var paymentsService = grpc.ServiceDesc{
	ServiceName: "demo.Payments",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Pay",
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			h := func(ctx context.Context, _ any) (any, error) {
				key, _ := grpcbridge.Key(ctx)
				id, err := srv.(*payments).pay(ctx, grpcbridge.Tx(ctx), key, "grpc")
				if err != nil {
					return nil, status.Error(codes.Unavailable, err.Error()) // released: rolled back, key free
				}
				return wrapperspb.String(id), nil
			}
			if icpt == nil {
				return h(ctx, in)
			}
			return icpt(ctx, in, &grpc.UnaryServerInfo{FullMethod: "/demo.Payments/Pay"}, h)
		},
	}},
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx); err != nil {
		log.Fatal(err)
	}
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// payments is the payment service: its outbox, and the topic its
// PaymentCaptured events go to.
type payments struct {
	events *outbox.Outbox
	topic  string
}

// pay is the business effect, the same for every path: one payment row,
// and its PaymentCaptured event in the outbox, in the same transaction.
// The event's ID is derived from the command's key, the same on every run.
func (p *payments) pay(ctx context.Context, tx pgx.Tx, key, via string) (string, error) {
	paymentID := "pay_" + randHex(6)
	if _, err := tx.Exec(ctx, `INSERT INTO payments (payment_id, idempotency_key, order_id, amount_cents, first_seen_via)
		VALUES ($1, $2, 'order-42', 1999, $3)`, paymentID, key, via); err != nil {
		return "", err
	}
	_, err := p.events.Add(ctx, tx, outbox.Message{Broker: outbox.Kafka, Topic: p.topic, Key: []byte("order-42"),
		Headers: []consumer.Header{{Key: "ce_type", Value: []byte("PaymentCaptured")}},
		Value:   []byte(fmt.Sprintf(`{"payment_id":%q,"order":"order-42","cents":1999}`, paymentID))})
	return paymentID, err
}

func run(ctx context.Context) error {
	const schema = "justonce_demo"
	pgURL := env("JUSTONCE_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:55432/postgres?sslmode=disable")
	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx); err != nil {
		return fmt.Errorf("migrate (is Postgres up? `make services-up`): %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS payments (payment_id text PRIMARY KEY,
		idempotency_key text, order_id text, amount_cents int, first_seen_via text, created_at timestamptz DEFAULT now());
		CREATE TABLE IF NOT EXISTS receipts (receipt_id text PRIMARY KEY, payment_id text, event_id text,
		created_at timestamptz DEFAULT now())`); err != nil {
		return err
	}
	events, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	svc := &payments{events: events, topic: "payments-captured-" + randHex(4)}

	// One ledger, Redis in front.
	rdb := redis.NewClient(&redis.Options{Addr: env("JUSTONCE_TEST_REDIS_ADDR", "127.0.0.1:56379"), ContextTimeoutEnabled: true})
	defer rdb.Close()
	ledger, err := inbox.New(pool, inbox.Config{Schema: schema, Redis: &inbox.RedisConfig{Client: rdb, Prefix: "demo:"}})
	if err != nil {
		return err
	}

	key := "pay-order-42-" + randHex(4) // the payment command's ID everywhere
	var mu sync.Mutex
	logf := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	var answered atomic.Int64
	hooks := func(via string) consumer.Hooks {
		return consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
			answered.Add(1)
			logf("%-5s delivery of %s -> %s", via, inbox.Mask(m.ID), out.Disposition)
		}}
	}
	handler := func(via string) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			id, err := svc.pay(ctx, tx, m.ID, via)
			// Recorded, so an HTTP retry with this key replays it.
			consumer.SetResult(ctx, inbox.Result{Code: 201, Header: map[string][]string{"Content-Type": {"application/json"}},
				Body: []byte(fmt.Sprintf(`{"payment_id":%q,"via":%q}`, id, via))})
			return err
		}
	}

	// HTTP: POST /payments behind the Idempotency-Key bridge.
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		return err
	}
	route := bridge.Route(httpbridge.RouteConfig{Scope: scope, Required: true})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := httpbridge.Key(r.Context())
		id, err := svc.pay(r.Context(), httpbridge.Tx(r.Context()), key, "http")
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment_id":%q,"via":"http"}`, id)
	})))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()

	// gRPC: demo.Payments/Pay behind the gRPC bridge, in the same scope.
	gbridge, err := grpcbridge.New(grpcbridge.Config{Ledger: ledger,
		Methods: map[string]grpcbridge.MethodConfig{"/demo.Payments/Pay": {Scope: scope, Required: true}}})
	if err != nil {
		return err
	}
	gsrv := grpc.NewServer(grpc.UnaryInterceptor(gbridge.UnaryServerInterceptor()))
	gsrv.RegisterService(&paymentsService, svc)
	gln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = gsrv.Serve(gln) }()
	defer gsrv.Stop()
	gconn, err := grpc.NewClient(gln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
	if err != nil {
		return err
	}
	defer gconn.Close()

	// Kafka: a topic of the demo's own, a consumer group in the shared scope.
	brokers := []string{env("JUSTONCE_TEST_KAFKA_BROKERS", "127.0.0.1:59092")}
	topic := "payments-" + randHex(4)
	if err := createTopic(brokers[0], topic); err != nil {
		return fmt.Errorf("kafka (is it up? `make services-up`): %w", err)
	}
	if err := createTopic(brokers[0], svc.topic); err != nil {
		return err
	}
	kc, err := kafkainbox.New(kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: "payments-demo-" + randHex(3),
		Processor: consumer.Config{Ledger: ledger, Scope: scope, Hooks: hooks("kafka")}}, handler("kafka"))
	if err != nil {
		return err
	}

	// NATS: a real nats-server embedded here, a JetStream stream.
	dir, err := os.MkdirTemp("", "justonce-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return errors.New("nats-server not ready")
	}
	defer ns.Shutdown()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	// A short duplicate window, so republishes reach the consumer (as they
	// do after the default 2 minutes).
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "PAYMENTS", Subjects: []string{"payments"}, Duplicates: 100 * time.Millisecond}); err != nil {
		return err
	}
	natsC, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: "PAYMENTS", Durable: "payments",
		Processor: consumer.Config{Ledger: ledger, Scope: scope, Hooks: hooks("nats")}}, handler("nats"))
	if err != nil {
		return err
	}

	// The relay: publishes what the payment transactions added, once they
	// committed.
	relayW := &kafka.Writer{Addr: kafka.TCP(brokers...)}
	defer relayW.Close()
	kafkaPub, err := kafkainbox.NewOutboxPublisher(relayW)
	if err != nil {
		return err
	}
	relay, err := events.Relay(outbox.RelayConfig{
		Publishers:   map[outbox.Broker]outbox.Publisher{outbox.Kafka: kafkaPub},
		PollInterval: 100 * time.Millisecond,
	})
	if err != nil {
		return err
	}

	// Receipts: a second service, consuming PaymentCaptured from Kafka on
	// its own scope of the ledger, one receipt per event.
	var receipted atomic.Int64
	receipts, err := kafkainbox.New(kafkainbox.Config{Brokers: brokers, Topic: svc.topic, GroupID: "receipts-demo-" + randHex(3),
		Processor: consumer.Config{Ledger: ledger, Scope: "receipts", Hooks: consumer.Hooks{
			OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
				receipted.Add(1)
				logf("receipts delivery of PaymentCaptured %s -> %s", inbox.Mask(m.ID), out.Disposition)
			}}}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			var ev struct {
				PaymentID string `json:"payment_id"`
			}
			if err := json.Unmarshal(m.Value, &ev); err != nil {
				return consumer.Permanent(err)
			}
			_, err := tx.Exec(ctx, `INSERT INTO receipts (receipt_id, payment_id, event_id) VALUES ($1, $2, $3)`,
				"rcpt_"+randHex(6), ev.PaymentID, m.ID)
			return err
		})
	if err != nil {
		return err
	}

	runCtx, stopConsumers := context.WithCancel(ctx)
	defer stopConsumers()
	var wg sync.WaitGroup
	for _, c := range []interface{ Run(context.Context) error }{kc, natsC, relay, receipts} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.Run(runCtx); err != nil { // nil after a clean stop
				log.Print(err)
			}
		}()
	}

	fmt.Printf("one payment command, key %s, sent 3× over Kafka, 3× over NATS, 4× over HTTP (2 at once), 2× over gRPC\n\n", inbox.Mask(key))
	// 1. Kafka, three times (a producer retrying).
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll}
	defer w.Close()
	for i := 0; i < 3; i++ {
		m := kafkainbox.NewMessage(key, []byte("order-42"), []byte(`{"order":"order-42","cents":1999}`))
		m.Topic = topic
		if err := w.WriteMessages(ctx, m); err != nil {
			return err
		}
	}
	// 2. NATS, three times, past the stream's duplicate window.
	for i := 0; i < 3; i++ {
		m := nats.NewMsg("payments")
		m.Header.Set(jetstream.MsgIDHeader, key)
		m.Data = []byte(`{"order":"order-42","cents":1999}`)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			return err
		}
		time.Sleep(150 * time.Millisecond)
	}
	// 3. HTTP: two clients at once, then two retries.
	client := &http.Client{Transport: &httpretry.Transport{}}
	post := func(n int) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+ln.Addr().String()+"/payments",
			bytes.NewReader([]byte(`{"order":"order-42","cents":1999}`)))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			logf("http  request %d -> error %v", n, err)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		logf("http  request %d -> %d replayed=%q %s", n, resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), bytes.TrimSpace(body))
	}
	var hw sync.WaitGroup
	for i := 1; i <= 2; i++ {
		hw.Add(1)
		go func() { defer hw.Done(); post(i) }()
	}
	hw.Wait()
	post(3)
	post(4)
	// 4. gRPC, twice, with the same key in metadata.
	for i := 1; i <= 2; i++ {
		var hdr metadata.MD
		out := new(wrapperspb.StringValue)
		err := gconn.Invoke(metadata.AppendToOutgoingContext(ctx, "idempotency-key", key), "/demo.Payments/Pay",
			wrapperspb.String("order-42"), out, grpc.Header(&hdr))
		logf("grpc  call %d -> %s replayed=%q %s", i, status.Code(err), strings.Join(hdr.Get("idempotent-replayed"), ""), out.GetValue())
	}

	// Wait until all six broker deliveries were answered and receipts
	// answered the PaymentCaptured event.
	wait := func(receipts int64) error {
		for deadline := time.Now().Add(60 * time.Second); answered.Load() < 6 || receipted.Load() < receipts; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				return fmt.Errorf("only %d of 6 broker deliveries and %d of %d PaymentCaptured deliveries answered", answered.Load(), receipted.Load(), receipts)
			}
		}
		return nil
	}
	if err := wait(1); err != nil {
		stopConsumers()
		return err
	}
	// A relay that crashes after the broker acked and before it recorded
	// the message publishes it again: send the event once more, as such a
	// relay would. Receipts must not make a second receipt.
	ev, err := firstMessage(ctx, brokers, svc.topic)
	if err != nil {
		stopConsumers()
		return err
	}
	if err := w.WriteMessages(ctx, kafka.Message{Topic: svc.topic, Key: ev.Key, Value: ev.Value, Headers: ev.Headers}); err != nil {
		stopConsumers()
		return err
	}
	if err := wait(2); err != nil {
		stopConsumers()
		return err
	}
	stopConsumers()
	wg.Wait()

	var n int
	var via string
	if err := pool.QueryRow(ctx, `SELECT count(*), min(first_seen_via) FROM payments WHERE idempotency_key = $1`, key).Scan(&n, &via); err != nil {
		return err
	}
	rec, err := ledger.Lookup(ctx, inbox.Key{Scope: scope, ID: key})
	if err != nil {
		return err
	}
	var nReceipts int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM receipts r JOIN payments p USING (payment_id)
		WHERE p.idempotency_key = $1`, key).Scan(&nReceipts); err != nil {
		return err
	}
	published, err := topicLen(brokers[0], svc.topic)
	if err != nil {
		return err
	}
	fmt.Printf("\n12 deliveries over 4 paths -> %d payment (made via %s) -> 1 PaymentCaptured through the outbox, %d deliveries (one a republish) -> %d receipt; ledger: status=%s source=%s\n",
		n, via, published, nReceipts, rec.Status, rec.Source)
	if n != 1 || published != 2 || nReceipts != 1 {
		return fmt.Errorf("expected one payment, two deliveries of its event and one receipt, got %d, %d, %d", n, published, nReceipts)
	}
	return nil
}

// firstMessage reads the first message of the one-partition topic.
func firstMessage(ctx context.Context, brokers []string, topic string) (kafka.Message, error) {
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer r.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return r.ReadMessage(ctx)
}

// topicLen is how many messages the one-partition topic holds.
func topicLen(broker, topic string) (int64, error) {
	conn, err := kafka.DialLeader(context.Background(), "tcp", broker, topic, 0)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	first, last, err := conn.ReadOffsets()
	return last - first, err
}

// createTopic creates a one-partition topic through the cluster's
// controller (kafka-go's Conn.CreateTopics must talk to the controller).
func createTopic(broker, topic string) error {
	conn, err := kafka.Dial("tcp", broker)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		return err
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		return err
	}
	defer cc.Close()
	return cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: 1, ReplicationFactor: 1})
}
