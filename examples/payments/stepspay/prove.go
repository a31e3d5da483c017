//go:build unix

package stepspay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// Config configures Prove.
type Config struct {
	// Pool is the database of the payments, the ledger and the provider,
	// in a migrated schema of its own. Required.
	Pool *pgxpool.Pool
	// PGURL connects the payment service to the same schema (search_path
	// set). Required.
	PGURL string
	// Brokers of Kafka, and NATSURL of a NATS server with JetStream.
	// Required.
	Brokers []string
	NATSURL string
	// Unique makes the names of the run's topics, stream and groups unique:
	// a random suffix. Required.
	Unique string
	// PerFront is how many payments each front gets; Rounds how many
	// runs of the payment service are SIGKILLed (the fronts and the
	// points in turn: len(Points) * len(AllFronts), 35, kills every front
	// at every point). Both at least 1.
	PerFront, Rounds int
	// Command returns the command that runs the payment service (a
	// program calling RunChild) with env added to its environment.
	// Required.
	Command func(env []string) *exec.Cmd
	// Logf, when set, is told each round's outcome.
	Logf func(format string, args ...any)
}

// Report is what a Prove run saw.
type Report struct {
	Payments int            // over every front
	Kills    []string       // "front point (passage n)", in order
	Requests int64          // charge requests the provider got
	Repeats  int64          // of them, repeats of a key it had charged
	Resumed  map[string]int // by front: payments resumed under a later lease
	Output   []string       // each run of the payment service's output
}

// Prove runs the payment service Rounds times, each run SIGKILLed at one
// of Points on one front, every payment delivered twice (two racing
// clients over HTTP and gRPC, two messages on Kafka and NATS), fresh
// payments with each run and earlier ones resuming; then once more to
// completion. It checks that every payment has one order row, one receipt
// naming its charge, and one charge at the provider with its step's key,
// that every delivery answered (HTTP, gRPC) or the ledger recorded (the
// consumers) that charge, and that the kills landed with work in flight:
// some charge was repeated with its key (made, then killed before its
// record) and some payment resumed under a later lease. It returns an
// error for the first check that fails.
func Prove(ctx context.Context, c Config) (rep Report, err error) {
	if c.Pool == nil || c.PGURL == "" || len(c.Brokers) == 0 || c.NATSURL == "" || c.Unique == "" || c.Command == nil ||
		c.PerFront < 1 || c.Rounds < 1 {
		return rep, errors.New("stepspay: Config is incomplete")
	}
	logf := c.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	perRound := max(1, c.PerFront/(c.Rounds+1))
	if _, err := c.Pool.Exec(ctx, Schema+";"+ProviderSchema); err != nil {
		return rep, err
	}

	// The provider, in this process: it outlives the payment service.
	pledger, err := inbox.New(c.Pool, inbox.Config{})
	if err != nil {
		return rep, err
	}
	prov := &Provider{}
	ph, err := prov.Handler(pledger)
	if err != nil {
		return rep, err
	}
	psrv := httptest.NewServer(ph)
	defer psrv.Close()

	topics := []string{"stepspay-kgo-" + c.Unique, "stepspay-franz-" + c.Unique}
	for _, tp := range topics {
		if err := kafkaadmin.CreateTopic(c.Brokers[0], tp, 3); err != nil {
			return rep, fmt.Errorf("stepspay: topic %s: %w", tp, err)
		}
	}
	kw := &kafka.Writer{Addr: kafka.TCP(c.Brokers...), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll}
	defer kw.Close()
	nc, err := nats.Connect(c.NATSURL)
	if err != nil {
		return rep, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return rep, err
	}
	stream := "STEPSPAY-" + c.Unique
	subject := "stepspay-" + c.Unique + ".pay"
	// A short duplicate window, so that a payment's second message is
	// stored (published once the window has passed).
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: 100 * time.Millisecond}); err != nil {
		return rep, err
	}
	httpAddr, err := freeAddr()
	if err != nil {
		return rep, err
	}
	grpcAddr, err := freeAddr()
	if err != nil {
		return rep, err
	}
	env := func(group, kill string) []string {
		return []string{envPG + "=" + c.PGURL, envProvider + "=" + psrv.URL, envHTTP + "=" + httpAddr, envGRPC + "=" + grpcAddr,
			envBrokers + "=" + strings.Join(c.Brokers, ","), envTopics + "=" + strings.Join(topics, ","),
			envNATS + "=" + c.NATSURL, envStream + "=" + stream, envGroup + "=" + group, envKill + "=" + kill}
	}

	// The clients: each HTTP and gRPC payment is sent twice, by two
	// clients racing, each retrying with the payment's key until the
	// payment service answers for good (across its restarts).
	hclient := &http.Client{Timeout: 10 * time.Second, Transport: &httpretry.Transport{}}
	gconn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
	if err != nil {
		return rep, err
	}
	defer gconn.Close()
	var answersMu sync.Mutex
	answers := map[string][]string{} // payment -> the charge IDs its deliveries got
	send := map[string]func(ctx context.Context, id string) (string, error){
		FrontHTTP: func(ctx context.Context, id string) (string, error) {
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
		FrontGRPC: func(ctx context.Context, id string) (string, error) {
			ctx = metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, id)
			out := new(wrapperspb.StringValue)
			if err := gconn.Invoke(ctx, PayMethod, wrapperspb.String(id), out); err != nil {
				return "", err
			}
			return out.GetValue(), nil
		},
	}
	var clients sync.WaitGroup
	defer clients.Wait()
	defer cancel() // before the clients are waited for
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
	publish := func(front string, ids []string) error {
		switch front {
		case FrontKafka, FrontFranz:
			topic := topics[0]
			if front == FrontFranz {
				topic = topics[1]
			}
			var msgs []kafka.Message
			for _, i := range rand.Perm(2 * len(ids)) {
				m := kafkainbox.NewMessage(ids[i/2], []byte(ids[i/2]), []byte(ids[i/2]))
				m.Topic = topic
				msgs = append(msgs, m)
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				err := kw.WriteMessages(ctx, msgs...)
				if !errors.Is(err, kafka.UnknownTopicOrPartition) || time.Now().After(deadline) {
					return err
				}
				time.Sleep(100 * time.Millisecond) // a topic just created: its metadata is on its way
			}
		case FrontNATS:
			for copy := range 2 {
				for _, id := range ids {
					for {
						ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: []byte(id), Header: nats.Header{"Nats-Msg-Id": {id}}})
						if err != nil {
							return err
						}
						if !ack.Duplicate || copy == 0 {
							break
						}
						time.Sleep(20 * time.Millisecond) // inside the duplicate window: wait it out
					}
				}
			}
		default:
			deliver(front, ids)
		}
		return nil
	}
	next := map[string]int{}
	feed := func(count int) error {
		for _, front := range AllFronts {
			var ids []string
			for range count {
				if next[front] < c.PerFront {
					ids = append(ids, PaymentID(front, next[front]))
					next[front]++
				}
			}
			if err := publish(front, ids); err != nil {
				return fmt.Errorf("stepspay: publish to %s: %w", front, err)
			}
		}
		return nil
	}

	var procs []*proc
	defer func() {
		for _, p := range procs {
			p.kill()
			rep.Output = append(rep.Output, p.out.String())
		}
	}()
	for i := range c.Rounds {
		front, point := AllFronts[i%len(AllFronts)], Points[i%len(Points)]
		passage := 1 + (3*i)%max(1, perRound/2)
		if err := feed(perRound); err != nil {
			return rep, err
		}
		p, err := start(c.Command(env(fmt.Sprintf("stepspay-%s-r%d", c.Unique, i), fmt.Sprintf("%s/%s/%d", front, point, passage))))
		if err != nil {
			return rep, err
		}
		procs = append(procs, p)
		began := time.Now()
		select {
		case <-p.done:
		case <-time.After(2 * time.Minute):
			return rep, fmt.Errorf("stepspay: round %d: the payment service did not die at %s %s (passage %d) within 2 minutes", i, front, point, passage)
		case <-ctx.Done():
			return rep, ctx.Err()
		}
		ws, _ := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
		if !ws.Signaled() || ws.Signal() != syscall.SIGKILL || !strings.Contains(p.out.String(), fmt.Sprintf("SIGKILL at %s %s", front, point)) {
			return rep, fmt.Errorf("stepspay: round %d: the payment service must be SIGKILLed at %s %s, but it ended: %v",
				i, front, point, p.cmd.ProcessState)
		}
		kill := fmt.Sprintf("%s %s (passage %d)", front, point, passage)
		rep.Kills = append(rep.Kills, kill)
		logf("round %d: SIGKILL at %s, after %s", i, kill, time.Since(began).Round(time.Millisecond))
	}

	// The last run: the rest of the payments, to completion.
	if err := feed(c.PerFront); err != nil {
		return rep, err
	}
	rep.Payments = c.PerFront * len(AllFronts)
	final, err := start(c.Command(env("stepspay-"+c.Unique+"-final", "")))
	if err != nil {
		return rep, err
	}
	procs = append(procs, final)
	began := time.Now()
	clientsDone := make(chan struct{})
	go func() {
		clients.Wait()
		close(clientsDone)
	}()
	select {
	case <-clientsDone:
	case <-ctx.Done():
		return rep, fmt.Errorf("stepspay: the HTTP and gRPC payments were not all answered: %w", ctx.Err())
	}
	for {
		var done int
		if err := c.Pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE scope = $1 AND status = 'done'`, Scope).Scan(&done); err != nil {
			return rep, err
		}
		if done == rep.Payments {
			break
		}
		select {
		case <-final.done:
			return rep, fmt.Errorf("stepspay: the last run ended with %d of %d payments done", done, rep.Payments)
		case <-ctx.Done():
			return rep, fmt.Errorf("stepspay: %d of %d payments done: %w", done, rep.Payments, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	logf("last run: every payment done after %s", time.Since(began).Round(time.Millisecond))
	_ = final.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-final.done:
		if !final.cmd.ProcessState.Success() {
			return rep, fmt.Errorf("stepspay: the last run's shutdown: %v", final.cmd.ProcessState)
		}
	case <-time.After(time.Minute):
		return rep, errors.New("stepspay: the last run did not stop within a minute of SIGTERM")
	}
	rep.Requests = prov.Requests.Load()
	rep.Repeats = rep.Requests - int64(rep.Payments)
	answersMu.Lock()
	defer answersMu.Unlock()
	rep.Resumed, err = check(ctx, c.Pool, pledger, c.PerFront, answers)
	if err != nil {
		return rep, err
	}
	switch {
	case rep.Repeats <= 0:
		return rep, errors.New("stepspay: no charge was repeated: the kills did not land between a charge and its record")
	case len(rep.Resumed) == 0:
		return rep, errors.New("stepspay: no payment resumed under a later lease: the kills did not land with work in flight")
	}
	return rep, nil
}

// check checks every payment: one order row, one receipt naming its
// charge, one charge with its step's key, the ledger's record and steps;
// it returns how many payments of each front resumed under a later lease.
func check(ctx context.Context, pool *pgxpool.Pool, ledger *inbox.Ledger, perFront int, answers map[string][]string) (map[string]int, error) {
	perPayment := func(sql string) (map[string]int, error) {
		rows, err := pool.Query(ctx, sql)
		if err != nil {
			return nil, err
		}
		got := map[string]int{}
		var id string
		var c int
		_, err = pgx.ForEachRow(rows, []any{&id, &c}, func() error { got[id] = c; return nil })
		return got, err
	}
	orders, err := perPayment(`SELECT payment, count(*) FROM step_orders GROUP BY payment`)
	if err != nil {
		return nil, err
	}
	receipts, err := perPayment(`SELECT payment, count(*) FROM step_receipts GROUP BY payment`)
	if err != nil {
		return nil, err
	}
	charges, err := perPayment(`SELECT idempotency_key, count(*) FROM provider_charges GROUP BY idempotency_key`)
	if err != nil {
		return nil, err
	}
	n := perFront * len(AllFronts)
	if len(orders) != n || len(receipts) != n || len(charges) != n {
		return nil, fmt.Errorf("stepspay: %d payments: %d with an order, %d with a receipt, %d keys charged", n, len(orders), len(receipts), len(charges))
	}
	resumed := map[string]int{}
	for _, front := range AllFronts {
		for i := range perFront {
			id := PaymentID(front, i)
			k := inbox.Key{Scope: Scope, ID: id}
			key := inbox.StepKey(k, "charge")
			if orders[id] != 1 || receipts[id] != 1 || charges[key] != 1 {
				return nil, fmt.Errorf("stepspay: %s: %d order rows, %d receipts, %d charges with its step's key", id, orders[id], receipts[id], charges[key])
			}
			var charge, receipt string
			if err := pool.QueryRow(ctx, `SELECT 'ch_' || lpad(charge_id::text, 6, '0') FROM provider_charges WHERE idempotency_key = $1`, key).Scan(&charge); err != nil {
				return nil, err
			}
			if err := pool.QueryRow(ctx, `SELECT charge FROM step_receipts WHERE payment = $1`, id).Scan(&receipt); err != nil {
				return nil, err
			}
			rec, err := ledger.Lookup(ctx, k)
			if err != nil {
				return nil, fmt.Errorf("stepspay: %s: %w", id, err)
			}
			steps, err := ledger.Steps(ctx, k)
			if err != nil {
				return nil, err
			}
			switch {
			case receipt != charge:
				return nil, fmt.Errorf("stepspay: %s: the receipt names %s, the provider charged %s", id, receipt, charge)
			case rec.Status != inbox.StatusDone:
				return nil, fmt.Errorf("stepspay: %s: the ledger says %s", id, rec.Status)
			case (front == FrontHTTP || front == FrontGRPC) && strings.Join(answers[id], ",") != charge+","+charge:
				return nil, fmt.Errorf("stepspay: %s: its deliveries got %v, the provider charged %s", id, answers[id], charge)
			case front != FrontHTTP && front != FrontGRPC && string(rec.Result.Body) != charge:
				return nil, fmt.Errorf("stepspay: %s: the ledger recorded %q, the provider charged %s", id, rec.Result.Body, charge)
			case len(steps) != 3:
				return nil, fmt.Errorf("stepspay: %s: %d steps recorded", id, len(steps))
			}
			if steps[0].Token != steps[2].Token {
				resumed[front]++
			}
		}
	}
	return resumed, nil
}

// PaymentID is the ID of payment i of front.
func PaymentID(front string, i int) string { return fmt.Sprintf("%s-%05d", front, i) }

// freeAddr returns a loopback address nothing listens on now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// proc is one run of the payment service.
type proc struct {
	cmd  *exec.Cmd
	out  buffer
	done chan struct{}
}

func start(cmd *exec.Cmd) (*proc, error) {
	p := &proc{cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("stepspay: start the payment service: %w", err)
	}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// kill ends the run if it still runs.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// buffer is a bytes.Buffer safe for a child's two writers and a reader.
type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
