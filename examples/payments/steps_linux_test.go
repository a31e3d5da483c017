//go:build linux

package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// The steps proof's knobs, and the child's environment.
const (
	// EnvStepsPayments is how many payments each front gets (default 200:
	// 1,000 over the five fronts).
	envStepsPayments = "JUSTONCE_PAYMENTS_STEPS_PER_FRONT"
	// EnvStepsRounds is how many runs of the payment service are
	// SIGKILLed (default 14: each kill point twice, the fronts in turn;
	// 35 kills every front at every point).
	envStepsRounds = "JUSTONCE_PAYMENTS_STEPS_ROUNDS"

	envChild    = "JUSTONCE_PAYMENTS_STEPS_CHILD"
	envPG       = "JUSTONCE_PAYMENTS_STEPS_PG"
	envProvider = "JUSTONCE_PAYMENTS_STEPS_PROVIDER"
	envHTTP     = "JUSTONCE_PAYMENTS_STEPS_HTTP"
	envGRPC     = "JUSTONCE_PAYMENTS_STEPS_GRPC"
	envBrokers  = "JUSTONCE_PAYMENTS_STEPS_BROKERS"
	envTopics   = "JUSTONCE_PAYMENTS_STEPS_TOPICS" // kafka-go's,franz-go's
	envNATS     = "JUSTONCE_PAYMENTS_STEPS_NATS"
	envStream   = "JUSTONCE_PAYMENTS_STEPS_STREAM"
	envGroup    = "JUSTONCE_PAYMENTS_STEPS_GROUP"
	envKill     = "JUSTONCE_PAYMENTS_STEPS_KILL" // front/point/passage; empty: run until SIGTERM
)

const stepsLease = time.Second

var stepsFrontNames = []string{frontHTTP, frontGRPC, frontKafka, frontFranz, frontNATS}

func init() {
	child = func() (int, bool) {
		if os.Getenv(envChild) != "1" {
			return 0, false
		}
		if err := stepsChild(); err != nil {
			fmt.Fprintln(os.Stderr, "payment service:", err)
			return 1, true
		}
		return 0, true
	}
}

// stepsChild is the payment service, in the child process: it serves every
// front until SIGTERM, and SIGKILLs itself at the passage envKill names.
func stepsChild() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute) // never outlive the test
	defer cancel()
	cfg, err := pgxpool.ParseConfig(os.Getenv(envPG))
	if err != nil {
		return err
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ledger, err := inbox.New(pool, inbox.Config{LeaseDuration: stepsLease,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))})
	if err != nil {
		return err
	}
	var crash func(front, point string)
	if k := strings.Split(os.Getenv(envKill), "/"); len(k) == 3 {
		at, _ := strconv.ParseInt(k[2], 10, 64)
		var hits atomic.Int64
		crash = func(front, point string) {
			if front == k[0] && point == k[1] && hits.Add(1) == at {
				fmt.Fprintf(os.Stderr, "payment service: SIGKILL at %s %s (passage %d)\n", front, point, at)
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				time.Sleep(time.Minute)
			}
		}
	}
	nc, err := nats.Connect(os.Getenv(envNATS))
	if err != nil {
		return err
	}
	defer nc.Close()
	topics := strings.Split(os.Getenv(envTopics), ",")
	svc := newStepsPayments(os.Getenv(envProvider), crash)
	return svc.serve(ctx, ledger, stepsFronts{
		HTTPAddr: os.Getenv(envHTTP), GRPCAddr: os.Getenv(envGRPC),
		Brokers: strings.Split(os.Getenv(envBrokers), ","), KafkaTopic: topics[0], FranzTopic: topics[1],
		Group: os.Getenv(envGroup), NATS: nc, Stream: os.Getenv(envStream), LeaseDuration: stepsLease,
	})
}

func stepsPaymentID(front string, i int) string { return fmt.Sprintf("%s-%05d", front, i) }

// freeAddr returns a loopback address nothing listens on now.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

// envInt reads a positive integer knob.
func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err, name)
	require.Positive(t, n, name)
	return n
}

// stepsProc is one run of the payment service.
type stepsProc struct {
	cmd  *exec.Cmd
	out  testsvc.LogBuffer
	done chan struct{}
}

func startSteps(t *testing.T, env []string) *stepsProc {
	p := &stepsProc{done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0], "-test.run=^$")
	p.cmd.Env = append(append(os.Environ(), envChild+"=1"), env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, p.cmd.Start())
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

// The payment service, serving payments over HTTP, gRPC, Kafka (kafka-go
// and franz-go) and NATS JetStream, all in steps, is SIGKILLed at every
// point between and inside the steps of a payment (before the provider
// call, after it but before its recovery point, after it, and around the
// Postgres steps), the fronts in turn, with every payment delivered twice
// (two racing clients, or two messages) and earlier payments resuming
// where the kills left them; then it runs to completion. Each payment
// must have one order row, one receipt, and one charge at the provider,
// whose charge ID both of its deliveries got (HTTP, gRPC) or the ledger
// recorded (the consumers). The provider is a separate HTTP service behind
// justonce's own HTTP bridge, charging once per Idempotency-Key; a kill
// after a charge and before its record makes the next attempt charge
// again with the same key, which the provider deduplicates: the test
// fails unless that happened, and unless payments resumed under a later
// lease, so that the kills must land with work in flight.
func TestStepsKilledOnEveryFront(t *testing.T) {
	perFront := envInt(t, envStepsPayments, 200)
	rounds := envInt(t, envStepsRounds, 14)
	perRound := max(1, perFront/(rounds+1))

	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	pg.Exec(t, stepsSchema)
	pg.Exec(t, providerSchema)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	// The provider, in the test process: it outlives the payment service.
	pledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	prov := &provider{}
	ph, err := prov.handler(pledger)
	require.NoError(t, err)
	psrv := httptest.NewServer(ph)
	t.Cleanup(psrv.Close)

	brokers := testsvc.KafkaBrokers(t)
	topics := []string{testsvc.Unique("steps-kgo"), testsvc.Unique("steps-franz")}
	for _, tp := range topics {
		require.NoError(t, kafkaadmin.CreateTopic(brokers[0], tp, 3))
	}
	kw := &kafka.Writer{Addr: kafka.TCP(brokers...), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll, AllowAutoTopicCreation: false}
	t.Cleanup(func() { _ = kw.Close() })
	natsURL := testsvc.NATSURL(t)
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream := testsvc.Unique("STEPS")
	subject := strings.ToLower(stream) + ".pay"
	// A short duplicate window, so that a payment's second message is
	// stored (published once the window has passed).
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: 100 * time.Millisecond})
	require.NoError(t, err)

	httpAddr, grpcAddr := freeAddr(t), freeAddr(t)
	env := func(group, kill string) []string {
		return []string{envPG + "=" + pg.URL, envProvider + "=" + psrv.URL, envHTTP + "=" + httpAddr, envGRPC + "=" + grpcAddr,
			envBrokers + "=" + strings.Join(brokers, ","), envTopics + "=" + strings.Join(topics, ","),
			envNATS + "=" + natsURL, envStream + "=" + stream, envGroup + "=" + group, envKill + "=" + kill}
	}

	// The clients: each HTTP and gRPC payment is sent twice, by two
	// clients racing, each retrying with the payment's key until the
	// payment service answers for good (across its restarts).
	hclient := &http.Client{Timeout: 10 * time.Second, Transport: &httpretry.Transport{}}
	gconn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
	require.NoError(t, err)
	t.Cleanup(func() { _ = gconn.Close() })
	var answersMu sync.Mutex
	answers := map[string][]string{} // payment -> the charge IDs its deliveries got
	send := map[string]func(ctx context.Context, id string) (string, error){
		frontHTTP: func(ctx context.Context, id string) (string, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+httpAddr+"/pay", strings.NewReader(id))
			req.Header.Set("Idempotency-Key", id)
			resp, err := hclient.Do(req)
			if err != nil {
				return "", err
			}
			defer resp.Body.Close()
			var b bytes.Buffer
			_, _ = b.ReadFrom(resp.Body)
			if resp.StatusCode != http.StatusCreated {
				return "", fmt.Errorf("%s: %s", resp.Status, b.String())
			}
			return b.String(), nil
		},
		frontGRPC: func(ctx context.Context, id string) (string, error) {
			ctx = metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, id)
			out := new(wrapperspb.StringValue)
			if err := gconn.Invoke(ctx, stepsPayMethod, wrapperspb.String(id), out); err != nil {
				return "", err
			}
			return out.GetValue(), nil
		},
	}
	var clients sync.WaitGroup
	deliver := func(front string, ids []string) {
		for _, id := range append(append([]string{}, ids...), ids...) {
			clients.Add(1)
			go func() {
				defer clients.Done()
				for ctx.Err() == nil {
					cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
					charge, err := send[front](cctx, id)
					ccancel()
					if err == nil {
						answersMu.Lock()
						answers[id] = append(answers[id], charge)
						answersMu.Unlock()
						return
					}
					time.Sleep(20 * time.Millisecond) // the service is down or the key in flight: again, same key
				}
			}()
		}
	}
	publish := func(front string, ids []string) {
		switch front {
		case frontKafka, frontFranz:
			topic := topics[0]
			if front == frontFranz {
				topic = topics[1]
			}
			var msgs []kafka.Message
			for _, i := range rand.Perm(2 * len(ids)) {
				m := kafkainbox.NewMessage(ids[i/2], []byte(ids[i/2]), []byte(ids[i/2]))
				m.Topic = topic
				msgs = append(msgs, m)
			}
			require.NoError(t, kw.WriteMessages(ctx, msgs...))
		case frontNATS:
			for copy := range 2 {
				for _, id := range ids {
					for {
						ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: []byte(id), Header: nats.Header{"Nats-Msg-Id": {id}}})
						require.NoError(t, err)
						if !ack.Duplicate || copy == 0 {
							break
						}
						require.NoError(t, ctx.Err(), "publishing the second message of %s", id)
						time.Sleep(20 * time.Millisecond) // inside the duplicate window: wait it out
					}
				}
			}
		default:
			deliver(front, ids)
		}
	}
	next := map[string]int{}
	feed := func(count int) {
		for _, front := range stepsFrontNames {
			var ids []string
			for range count {
				if next[front] < perFront {
					ids = append(ids, stepsPaymentID(front, next[front]))
					next[front]++
				}
			}
			publish(front, ids)
		}
	}

	var procs []*stepsProc
	t.Cleanup(func() {
		if t.Failed() {
			for i, p := range procs {
				t.Logf("payment service run %d output:\n%s", i, p.out.String())
			}
		}
	})
	for i := range rounds {
		front, point := stepsFrontNames[i%len(stepsFrontNames)], stepsPoints[i%len(stepsPoints)]
		passage := 1 + (3*i)%max(1, perRound/2)
		feed(perRound)
		p := startSteps(t, env(fmt.Sprintf("steps-%s-r%d", stream, i), fmt.Sprintf("%s/%s/%d", front, point, passage)))
		procs = append(procs, p)
		start := time.Now()
		select {
		case <-p.done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("round %d: the payment service did not die at %s %s (passage %d) within 2 minutes", i, front, point, passage)
		}
		ws, _ := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
		require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "round %d: the payment service must be SIGKILLed at %s %s: %v",
			i, front, point, p.cmd.ProcessState)
		require.Contains(t, p.out.String(), fmt.Sprintf("SIGKILL at %s %s", front, point))
		t.Logf("round %d: SIGKILL at %s %s, passage %d, after %s", i, front, point, passage, time.Since(start).Round(time.Millisecond))
	}

	// The last run: the rest of the payments, to completion.
	feed(perFront)
	n := perFront * len(stepsFrontNames)
	final := startSteps(t, env("steps-"+stream+"-final", ""))
	procs = append(procs, final)
	start := time.Now()
	clientsDone := make(chan struct{})
	go func() {
		clients.Wait()
		close(clientsDone)
	}()
	select {
	case <-clientsDone:
	case <-ctx.Done():
		t.Fatal("the HTTP and gRPC payments were not all answered")
	}
	for {
		done := pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = $1 AND status = 'done'`, stepsScope)
		if done == n {
			break
		}
		require.NoError(t, ctx.Err(), "payments done: %d of %d", done, n)
		select {
		case <-final.done:
			t.Fatalf("the last run ended with %d of %d payments done", done, n)
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Logf("last run: every payment done after %s", time.Since(start).Round(time.Millisecond))
	require.NoError(t, final.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-final.done:
		require.True(t, final.cmd.ProcessState.Success(), "the last run's shutdown: %v", final.cmd.ProcessState)
	case <-time.After(time.Minute):
		t.Fatal("the last run did not stop within a minute of SIGTERM")
	}

	// Every payment: one order row, one receipt, one charge.
	perPayment := func(sql string) map[string]int {
		rows, err := pg.Pool.Query(context.Background(), sql)
		require.NoError(t, err)
		got := map[string]int{}
		var id string
		var c int
		_, err = pgx.ForEachRow(rows, []any{&id, &c}, func() error { got[id] = c; return nil })
		require.NoError(t, err)
		return got
	}
	orders := perPayment(`SELECT payment, count(*) FROM step_orders GROUP BY payment`)
	receipts := perPayment(`SELECT payment, count(*) FROM step_receipts GROUP BY payment`)
	charges := perPayment(`SELECT idempotency_key, count(*) FROM provider_charges GROUP BY idempotency_key`)
	require.Len(t, orders, n, "payments with an order")
	require.Len(t, receipts, n, "payments with a receipt")
	require.Len(t, charges, n, "keys charged")
	require.Equal(t, n, pg.Count(t, `SELECT count(*) FROM provider_charges`), "charges")
	resumed := map[string]int{}
	answersMu.Lock()
	defer answersMu.Unlock()
	for _, front := range stepsFrontNames {
		for i := range perFront {
			id := stepsPaymentID(front, i)
			k := inbox.Key{Scope: stepsScope, ID: id}
			require.Equal(t, 1, orders[id], "%s: order rows", id)
			require.Equal(t, 1, receipts[id], "%s: receipts", id)
			require.Equal(t, 1, charges[inbox.StepKey(k, "charge")], "%s: charges with its step's key", id)
			var charge string
			require.NoError(t, pg.Pool.QueryRow(context.Background(),
				`SELECT 'ch_' || lpad(charge_id::text, 6, '0') FROM provider_charges WHERE idempotency_key = $1`, inbox.StepKey(k, "charge")).Scan(&charge))
			var receipt string
			require.NoError(t, pg.Pool.QueryRow(context.Background(), `SELECT charge FROM step_receipts WHERE payment = $1`, id).Scan(&receipt))
			require.Equal(t, charge, receipt, "%s: the receipt names the charge", id)
			rec, err := pledger.Lookup(context.Background(), k)
			require.NoError(t, err)
			require.Equal(t, inbox.StatusDone, rec.Status, id)
			switch front {
			case frontHTTP, frontGRPC:
				require.Equal(t, []string{charge, charge}, answers[id], "%s: both deliveries answered with the charge", id)
			default:
				require.Equal(t, charge, string(rec.Result.Body), "%s: the recorded result", id)
			}
			steps, err := pledger.Steps(context.Background(), k)
			require.NoError(t, err)
			require.Len(t, steps, 3, id)
			if steps[0].Token != steps[2].Token {
				resumed[front]++
			}
		}
	}
	repeats := int(prov.requests.Load()) - n
	t.Logf("%d payments (%d a front) over %d kills: %d order rows, %d receipts, %d charges; the provider got %d charge requests, "+
		"%d of them repeats of a key it had charged (deduplicated by its bridge); payments resumed under a later lease: %v",
		n, perFront, rounds, len(orders), len(receipts), n, prov.requests.Load(), repeats, resumed)
	require.Positive(t, repeats, "a charge made and not recorded before a kill is made again, with its key")
	require.NotEmpty(t, resumed, "payments resumed after a kill")
}
