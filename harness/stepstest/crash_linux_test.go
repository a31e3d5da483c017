//go:build linux

package stepstest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// The payment service's environment.
const (
	envChild    = "JUSTONCE_STEPSTEST_CHILD"
	envPG       = "JUSTONCE_STEPSTEST_PG"
	envProvider = "JUSTONCE_STEPSTEST_PROVIDER"
	envPayments = "JUSTONCE_STEPSTEST_PAYMENTS" // payments 0 to N-1
	envPoint    = "JUSTONCE_STEPSTEST_POINT"    // where to die; empty: run to the end
	envKillAt   = "JUSTONCE_STEPSTEST_KILL_AT"  // at the n-th time a handler gets there
)

// The points the payment service is SIGKILLed at: around and inside each
// step.
var killPoints = []string{
	"order-before-commit",   // inside the Postgres step, its row written, not committed
	"order-after-commit",    // the step recorded
	"charge-before-call",    // the outside step begun, the provider not called
	"charge-after-call",     // the provider charged, the step not recorded
	"charge-after-record",   // the charge recorded
	"receipt-before-commit", // inside the last step
	"receipt-after-commit",  // every step recorded, the key not completed
}

const (
	scope     = "payments"
	leaseTime = time.Second
	workers   = 12
)

func init() {
	child = func() (int, bool) {
		if os.Getenv(envChild) != "1" {
			return 0, false
		}
		if err := paymentService(); err != nil {
			fmt.Fprintln(os.Stderr, "payment service:", err)
			return 1, true
		}
		return 0, true
	}
}

func paymentID(i int) string { return fmt.Sprintf("pay-%04d", i) }

// summary is what a payment service that ran to its end prints.
type summary struct {
	Counters   inbox.Counters
	Executed   int64
	Duplicates int64
	Retries    int64
}

// paymentService is the child process: it delivers each payment twice, the
// two deliveries racing, until every payment is done, and dies at
// envPoint's envKillAt-th passage.
func paymentService() error {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Second) // never outlive the test
	defer cancel()
	cfg, err := pgxpool.ParseConfig(os.Getenv(envPG))
	if err != nil {
		return err
	}
	cfg.MaxConns = workers + 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ledger, err := inbox.New(pool, inbox.Config{
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(os.Getenv(envPayments))
	if err != nil {
		return err
	}
	point := os.Getenv(envPoint)
	killAt, _ := strconv.ParseInt(os.Getenv(envKillAt), 10, 64)
	var hits atomic.Int64
	kill := func(p string) {
		if p == point && hits.Add(1) == killAt {
			fmt.Fprintf(os.Stderr, "payment service: SIGKILL at %s (passage %d)\n", p, killAt)
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Minute)
		}
	}
	provider := os.Getenv(envProvider)
	client := &http.Client{Timeout: 5 * time.Second}

	deliveries := make(chan int, 2*n)
	for _, i := range rand.Perm(2 * n) {
		deliveries <- i / 2
	}
	close(deliveries)
	var sum summary
	var executed, duplicates, retries atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range deliveries {
				id := paymentID(i)
				req := inbox.Request{Key: inbox.Key{Scope: scope, ID: id}, Fingerprint: []byte(id), LockWait: 2 * time.Second}
				for {
					out, err := ledger.DoSteps(ctx, req, leaseTime, pay(id, client, provider, kill))
					if err == nil && out.Disposition == inbox.Executed {
						executed.Add(1)
						break
					}
					if err == nil && out.Disposition == inbox.Duplicate {
						duplicates.Add(1)
						break
					}
					if ctx.Err() != nil {
						errs <- fmt.Errorf("payment %s not done: %v (last: %v)", id, ctx.Err(), err)
						return
					}
					retries.Add(1)
					time.Sleep(20 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	sum.Counters, sum.Executed, sum.Duplicates, sum.Retries = ledger.Counters(), executed.Load(), duplicates.Load(), retries.Load()
	b, err := json.Marshal(sum)
	if err != nil {
		return err
	}
	fmt.Printf("summary %s\n", b)
	return nil
}

// pay is the payment handler: the order row, the charge at the provider
// (its key: the step's), the receipt row. kill marks the points.
func pay(id string, client *http.Client, provider string, kill func(string)) inbox.StepsFunc {
	return func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		if _, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO orders (payment) VALUES ($1)`, id)
			if err == nil {
				kill("order-before-commit")
			}
			return []byte(id), err
		}); err != nil {
			return inbox.Result{}, err
		}
		kill("order-after-commit")
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			kill("charge-before-call")
			r, err := http.NewRequestWithContext(ctx, http.MethodPost, provider+"/charge", strings.NewReader(id))
			if err != nil {
				return nil, err
			}
			r.Header.Set("Idempotency-Key", key)
			resp, err := client.Do(r)
			if err != nil {
				return nil, err
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != http.StatusOK {
				return nil, fmt.Errorf("provider: %d %s %v", resp.StatusCode, body, err)
			}
			kill("charge-after-call")
			return body, nil
		})
		if err != nil {
			return inbox.Result{}, err
		}
		kill("charge-after-record")
		if _, err := s.Tx(ctx, "receipt", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO receipts (payment, charge) VALUES ($1, $2)`, id, string(charge))
			if err == nil {
				kill("receipt-before-commit")
			}
			return nil, err
		}); err != nil {
			return inbox.Result{}, err
		}
		kill("receipt-after-commit")
		return inbox.Result{Code: 201, Body: charge}, nil
	}
}

// provider is the payment provider: one charge per idempotency key; a
// repeated key gets the first charge back.
type provider struct {
	mu       sync.Mutex
	charges  map[string]string // key -> charge ID
	payments map[string]string // key -> payment
	requests int
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	body, err := io.ReadAll(r.Body)
	if key == "" || err != nil || r.URL.Path != "/charge" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.requests++
	if _, ok := p.charges[key]; !ok {
		p.charges[key] = fmt.Sprintf("ch_%06d", len(p.charges)+1)
		p.payments[key] = string(body)
	}
	_, _ = io.WriteString(w, p.charges[key])
}

// round is one run of the payment service.
type round struct {
	point string
	out   bytes.Buffer
	took  time.Duration
}

// run starts the payment service for payments 0 to n-1, to die at point's
// killAt-th passage (point empty: to run to its end), and waits for it.
func (rd *round) run(t *testing.T, pg *testsvc.PG, provider string, n int, killAt int) *os.ProcessState {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=1", envPG+"="+pg.URL, envProvider+"="+provider,
		envPayments+"="+strconv.Itoa(n), envPoint+"="+rd.point, envKillAt+"="+strconv.Itoa(killAt))
	cmd.Stdout, cmd.Stderr = &rd.out, &rd.out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("the payment service (point %q) did not end within 2 minutes:\n%s", rd.point, rd.out.String())
	}
	rd.took = time.Since(start)
	return cmd.ProcessState
}

// The payment service is SIGKILLed at every point between and inside the
// steps of its payments, with duplicate deliveries racing and payments of
// earlier rounds still resuming, then run to completion: each payment has
// its order row once, its receipt once, and one charge at the provider,
// whose charge ID the ledger replays to duplicates. The provider sees some
// keys twice (a charge made and not recorded before a kill is made again
// with the same key): those repeats are counted and reported, and all of
// them are deduplicated.
func TestKilledPaymentsChargeOnce(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.MaxConns(4))
	pg.Exec(t, `CREATE TABLE orders (payment text NOT NULL)`) // no unique key: a second row would show
	pg.Exec(t, `CREATE TABLE receipts (payment text NOT NULL, charge text NOT NULL)`)
	prov := &provider{charges: map[string]string{}, payments: map[string]string{}}
	srv := httptest.NewServer(prov)
	t.Cleanup(srv.Close)

	// Two passes over the kill points; each round brings fresh payments
	// and delivers the earlier ones again (they resume where the kills
	// left them).
	const passes, perRound = 2, 30
	n := 0
	var rounds []*round
	t.Cleanup(func() {
		if t.Failed() {
			for _, rd := range rounds {
				t.Logf("payment service (point %q) output:\n%s", rd.point, rd.out.String())
			}
		}
	})
	for i := range passes * len(killPoints) {
		point := killPoints[i%len(killPoints)]
		n += perRound
		rd := &round{point: point}
		rounds = append(rounds, rd)
		killAt := 3 + (5*i)%25 // a different passage each time, with other payments at every stage
		st := rd.run(t, pg, srv.URL, n, killAt)
		ws, ok := st.Sys().(syscall.WaitStatus)
		require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL,
			"round %d: the payment service must die at %s (passage %d), but it ended: %v\n%s", i, point, killAt, st, rd.out.String())
		require.Contains(t, rd.out.String(), "SIGKILL at "+point)
		t.Logf("round %d: SIGKILL at %s, passage %d, after %s (payments 0-%d delivered)", i, point, killAt, rd.took.Round(time.Millisecond), n-1)
	}
	// The last run delivers every payment again, to completion.
	final := &round{}
	rounds = append(rounds, final)
	st := final.run(t, pg, srv.URL, n, 0)
	require.True(t, st.Success(), "the last run: %v\n%s", st, final.out.String())
	var sum summary
	line := final.out.String()[strings.LastIndex(final.out.String(), "summary ")+len("summary "):]
	require.NoError(t, json.Unmarshal([]byte(strings.TrimSpace(strings.SplitN(line, "\n", 2)[0])), &sum))
	t.Logf("last run: %d executed, %d duplicates, %d retries, steps tx %d, call %d, resumed %d, in %s",
		sum.Executed, sum.Duplicates, sum.Retries, sum.Counters.StepsTx, sum.Counters.StepsCall,
		sum.Counters.StepsResumed, final.took.Round(time.Millisecond))

	ctx := context.Background()
	perPayment := func(table string) map[string]int {
		rows, err := pg.Pool.Query(ctx, `SELECT payment, count(*) FROM `+table+` GROUP BY payment`)
		require.NoError(t, err)
		got := map[string]int{}
		var id string
		var c int
		_, err = pgx.ForEachRow(rows, []any{&id, &c}, func() error { got[id] = c; return nil })
		require.NoError(t, err)
		return got
	}
	orders, receipts := perPayment("orders"), perPayment("receipts")
	require.Len(t, orders, n, "every payment has its order")
	require.Len(t, receipts, n, "every payment has its receipt")

	prov.mu.Lock()
	defer prov.mu.Unlock()
	require.Len(t, prov.charges, n, "one charge per payment")
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	resumedAcrossLeases := 0
	for i := range n {
		id := paymentID(i)
		require.Equal(t, 1, orders[id], "%s: order rows", id)
		require.Equal(t, 1, receipts[id], "%s: receipt rows", id)
		k := inbox.Key{Scope: scope, ID: id}
		key := inbox.StepKey(k, "charge")
		charge, ok := prov.charges[key]
		require.True(t, ok, "%s: charged with its step's key", id)
		require.Equal(t, id, prov.payments[key])

		// The ledger replays the charge to a duplicate, and holds the
		// steps recorded, the charge's output being the provider's.
		out, err := l.DoSteps(ctx, inbox.Request{Key: k, Fingerprint: []byte(id)}, 0, func(context.Context, *inbox.Steps) (inbox.Result, error) {
			return inbox.Result{}, errors.New("a done payment must not run")
		})
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition, id)
		require.Equal(t, charge, string(out.Result.Body), id)
		steps, err := l.Steps(ctx, k)
		require.NoError(t, err)
		require.Len(t, steps, 3, id)
		require.Equal(t, charge, string(steps[1].Output), id)
		if steps[0].Token != steps[2].Token {
			resumedAcrossLeases++
		}
	}
	var receiptCharges int
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM receipts r WHERE r.charge LIKE 'ch_%'`).Scan(&receiptCharges))
	require.Equal(t, n, receiptCharges)
	repeats := prov.requests - len(prov.charges)
	t.Logf("%d payments over %d kills: %d order rows, %d receipts, %d charges; the provider got %d charge requests, "+
		"%d of them repeats of a key it had charged (deduplicated); %d payments resumed by a later lease",
		n, passes*len(killPoints), len(orders), len(receipts), len(prov.charges), prov.requests, repeats, resumedAcrossLeases)
	require.Positive(t, repeats, "a charge made and not recorded before a kill is made again, with its key")
	require.Positive(t, resumedAcrossLeases, "payments resumed after a kill")
}
