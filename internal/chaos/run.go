package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/internal/kafkaadmin"
	"github.com/justonce/justonce/internal/svcenv"
	"github.com/justonce/justonce/migrations"
	kafkainbox "github.com/justonce/justonce/transports/kafka"
)

// summary is what the run did and found.
type summary struct {
	transports                                 []string
	produced, duplicates                       map[string]int
	unique                                     map[string]int
	effects, distinct                          map[string]int
	kills, crashes, redisOutages, pgTerminated int
	pgRounds                                   int
	httpRequests, httpFailed, httpMismatched   int
	ledgerRows                                 int
	took                                       time.Duration
	problems                                   []string
}

func (s *summary) violations() int { return len(s.problems) }

func (s *summary) print(w io.Writer) {
	fmt.Fprintf(w, "\n== justonce chaos summary (%s) ==\n", s.took.Round(time.Second))
	for _, t := range s.transports {
		fmt.Fprintf(w, "%-6s events produced %7d  duplicates %6d  unique %7d  effects %7d  distinct %7d  doubled %d  lost %d\n",
			t, s.produced[t], s.duplicates[t], s.unique[t], s.effects[t], s.distinct[t],
			s.effects[t]-s.distinct[t], s.unique[t]-s.distinct[t])
	}
	fmt.Fprintf(w, "faults: %d consumer processes SIGKILLed (+%d exited on their own), %d Redis outages, %d pg_terminate_backend rounds (%d connections)\n",
		s.kills, s.crashes, s.redisOutages, s.pgRounds, s.pgTerminated)
	if s.httpRequests > 0 {
		fmt.Fprintf(w, "http:   %d requests, %d without a 2xx in the end, %d keys answered with differing bodies\n",
			s.httpRequests, s.httpFailed, s.httpMismatched)
	}
	fmt.Fprintf(w, "ledger rows: %d\n", s.ledgerRows)
	fmt.Fprintf(w, "violations: %d\n", len(s.problems))
	for _, p := range s.problems {
		fmt.Fprintln(w, "  -", p)
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// redisProc is a private redis-server the run stops and starts.
type redisProc struct {
	addr, bin, dir string
	port           int
	cmd            *exec.Cmd
}

func (r *redisProc) start() error {
	r.cmd = exec.Command(r.bin, "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", r.dir)
	if err := r.cmd.Start(); err != nil {
		return err
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", r.addr, 100*time.Millisecond); err == nil {
			_ = c.Close()
			return nil
		}
	}
	return fmt.Errorf("redis-server on %s did not answer", r.addr)
}

func (r *redisProc) stop() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
		r.cmd = nil
	}
}

// slot supervises one consumer process: restarts it when it dies.
type slot struct {
	transport, name string
	args            []string
	mu              sync.Mutex
	cmd             *exec.Cmd
	killed          bool
	stopping        bool
	done            chan struct{}
}

func (s *slot) supervise(crashes *atomic.Int64) {
	defer close(s.done)
	for {
		cmd, err := self(append(s.args, "-name", s.name)...)
		if err == nil {
			err = cmd.Start()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos: start worker:", err)
			time.Sleep(200 * time.Millisecond)
			continue
		}
		s.mu.Lock()
		s.cmd, s.killed = cmd, false
		s.mu.Unlock()
		_ = cmd.Wait()
		s.mu.Lock()
		stopping, killed := s.stopping, s.killed
		s.mu.Unlock()
		if stopping {
			return
		}
		if !killed {
			crashes.Add(1)
			time.Sleep(200 * time.Millisecond)
		}
	}
}

func (s *slot) kill() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil || s.cmd.Process == nil || s.stopping {
		return false
	}
	s.killed = true
	return s.cmd.Process.Signal(syscall.SIGKILL) == nil
}

func (s *slot) stop() {
	s.mu.Lock()
	s.stopping = true
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
	}
	s.mu.Unlock()
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		s.mu.Lock()
		if s.cmd != nil && s.cmd.Process != nil {
			_ = s.cmd.Process.Kill()
		}
		s.mu.Unlock()
		<-s.done
	}
}

// plan returns the IDs to produce: every unique ID once, in order, and
// duplicates of earlier IDs inserted later, so that duplicates are dupPct
// percent of all.
func plan(prefix string, unique, dupPct int) (ids []string, dups int) {
	dups = unique * dupPct / (100 - dupPct)
	ids = make([]string, 0, unique+dups)
	for i := 0; i < unique; i++ {
		ids = append(ids, prefix+strconv.Itoa(i))
	}
	for d := 0; d < dups; d++ {
		// A duplicate of an ID at least one position earlier: a later offset.
		at := 1 + mrand.N(len(ids))
		earlier := mrand.N(min(at, unique))
		ids = append(ids, "")
		copy(ids[at+1:], ids[at:])
		ids[at] = prefix + strconv.Itoa(earlier)
	}
	return ids, dups
}

func run(ctx context.Context, o options) (sum *summary, err error) {
	start := time.Now()
	sum = &summary{produced: map[string]int{}, duplicates: map[string]int{}, unique: map[string]int{},
		effects: map[string]int{}, distinct: map[string]int{}}
	defer func() { sum.took = time.Since(start) }()
	want := map[string]bool{}
	for _, t := range strings.Split(o.transports, ",") {
		want[strings.TrimSpace(t)] = true
	}

	// Postgres: a schema of the run's own.
	pgURL := svcenv.Get("JUSTONCE_TEST_POSTGRES_URL")
	if pgURL == "" {
		return sum, errors.New("no Postgres: run `make services-up` or set JUSTONCE_TEST_POSTGRES_URL")
	}
	schema := "chaos_" + randHex(4)
	admin, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		return sum, err
	}
	defer admin.Close()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return sum, fmt.Errorf("postgres: %w", err)
	}
	defer func() {
		if err == nil && sum.violations() == 0 {
			_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		} else {
			fmt.Fprintf(os.Stderr, "chaos: schema %s kept for inspection\n", schema)
		}
	}()
	runURL := pgURL + "&search_path=" + schema
	if !strings.Contains(pgURL, "?") {
		runURL = pgURL + "?search_path=" + schema
	}
	pool, err := pgxpool.New(ctx, runURL)
	if err != nil {
		return sum, err
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx); err != nil {
		return sum, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, transport text NOT NULL, n bigserial)`); err != nil {
		return sum, err
	}

	// Redis: private, so that stopping it disturbs nobody else.
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return sum, errors.New("redis-server not found (apt-get install redis-server)")
	}
	tmp, err := os.MkdirTemp("", "justonce-chaos-")
	if err != nil {
		return sum, err
	}
	defer os.RemoveAll(tmp)
	rp := &redisProc{bin: bin, dir: tmp, port: freePort()}
	rp.addr = "127.0.0.1:" + strconv.Itoa(rp.port)
	if err := rp.start(); err != nil {
		return sum, err
	}
	defer rp.stop()

	var slots []*slot
	var crashes atomic.Int64
	startSlots := func(transport string, args []string) {
		for i := 0; i < o.workers; i++ {
			s := &slot{transport: transport, name: fmt.Sprintf("%s-%d", transport, i), args: args, done: make(chan struct{})}
			slots = append(slots, s)
			go s.supervise(&crashes)
		}
	}
	defer func() {
		for _, s := range slots {
			s.stop()
		}
	}()

	// Producers: each emits its plan in chunks, one chunk per fault tick,
	// so that faults land in the middle of the stream.
	type producer struct {
		name string
		ids  []string
		next int
		emit func(ctx context.Context, ids []string) error
	}
	var producers []*producer
	chunks := max(o.kills, 10)

	if want["kafka"] {
		sum.transports = append(sum.transports, "kafka")
		brokers := strings.Split(svcenv.Get("JUSTONCE_TEST_KAFKA_BROKERS"), ",")
		if brokers[0] == "" {
			return sum, errors.New("no Kafka: run `make services-up` or set JUSTONCE_TEST_KAFKA_BROKERS")
		}
		topic := "chaos-" + randHex(4)
		if err := kafkaadmin.CreateTopic(brokers[0], topic, 4); err != nil {
			return sum, fmt.Errorf("kafka topic: %w", err)
		}
		ids, dups := plan("k-", o.events, o.dupPct)
		sum.produced["kafka"], sum.duplicates["kafka"], sum.unique["kafka"] = len(ids), dups, o.events
		w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
			BatchSize: 1000, BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll}
		defer w.Close()
		producers = append(producers, &producer{name: "kafka", ids: ids, emit: func(ctx context.Context, ids []string) error {
			msgs := make([]kafka.Message, len(ids))
			for i, id := range ids {
				msgs[i] = kafkainbox.NewMessage(id, []byte(id), []byte(`{"id":"`+id+`"}`))
			}
			return w.WriteMessages(ctx, msgs...)
		}})
		startSlots("kafka", []string{"-transport", "kafka", "-pg", runURL, "-redis", rp.addr,
			"-brokers", strings.Join(brokers, ","), "-topic", topic, "-batch", strconv.Itoa(o.batch)})
	}

	if want["nats"] {
		sum.transports = append(sum.transports, "nats")
		ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
			StoreDir: filepath.Join(tmp, "js"), NoLog: true, NoSigs: true})
		if err != nil {
			return sum, err
		}
		go ns.Start()
		if !ns.ReadyForConnections(10 * time.Second) {
			return sum, errors.New("embedded nats-server not ready")
		}
		defer ns.Shutdown()
		nc, err := nats.Connect(ns.ClientURL())
		if err != nil {
			return sum, err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return sum, err
		}
		// A short duplicate window: republished IDs after it are stored
		// again, as they would be after the default 2 minutes.
		const window = 500 * time.Millisecond
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHAOS", Subjects: []string{"chaos.events"},
			Storage: jetstream.FileStorage, Duplicates: window}); err != nil {
			return sum, err
		}
		ids, dups := plan("n-", o.events, o.dupPct)
		sum.produced["nats"], sum.duplicates["nats"], sum.unique["nats"] = len(ids), dups, o.events
		lastSent := map[string]time.Time{}
		producers = append(producers, &producer{name: "nats", ids: ids, emit: func(ctx context.Context, ids []string) error {
			for _, id := range ids {
				// A duplicate inside the window would be dropped by the
				// server: wait it out, so every duplicate is delivered.
				if t, ok := lastSent[id]; ok {
					if d := window + 50*time.Millisecond - time.Since(t); d > 0 {
						time.Sleep(d)
					}
				}
				m := nats.NewMsg("chaos.events")
				m.Header.Set(jetstream.MsgIDHeader, id)
				m.Data = []byte(`{"id":"` + id + `"}`)
				if _, err := js.PublishMsgAsync(m); err != nil {
					return err
				}
				lastSent[id] = time.Now()
			}
			select {
			case <-js.PublishAsyncComplete():
				return nil
			case <-time.After(30 * time.Second):
				return errors.New("nats publish did not complete")
			}
		}})
		startSlots("nats", []string{"-transport", "nats", "-pg", runURL, "-redis", rp.addr,
			"-nats", ns.ClientURL(), "-stream", "CHAOS", "-batch", strconv.Itoa(o.batch)})
	}

	// HTTP: a real server on loopback, clients retrying with the same key.
	var httpWG sync.WaitGroup
	var httpRequests, httpFailed atomic.Int64
	bodies := sync.Map{} // key -> []string
	if want["http"] {
		sum.transports = append(sum.transports, "http")
		sum.unique["http"] = o.httpKeys
		sum.produced["http"] = o.httpKeys * o.httpClients
		sum.duplicates["http"] = o.httpKeys * (o.httpClients - 1)
		srv, err := httpServer(ctx, runURL, rp.addr)
		if err != nil {
			return sum, err
		}
		defer srv.Close()
		client := &http.Client{Timeout: 30 * time.Second, Transport: &httpbridge.Transport{MaxAttempts: 50, BaseDelay: 20 * time.Millisecond, MaxDelay: 500 * time.Millisecond}}
		sem := make(chan struct{}, 24)
		httpWG.Add(1)
		go func() {
			defer httpWG.Done()
			for k := 0; k < o.httpKeys && ctx.Err() == nil; k++ {
				key := "h-" + strconv.Itoa(k)
				for c := 0; c < o.httpClients; c++ {
					sem <- struct{}{}
					httpWG.Add(1)
					go func() {
						defer httpWG.Done()
						defer func() { <-sem }()
						httpRequests.Add(1)
						req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", bytes.NewReader([]byte(`{"key":"`+key+`"}`)))
						req.Header.Set("Idempotency-Key", key)
						req.Header.Set("Content-Type", "application/json")
						resp, err := client.Do(req)
						if err != nil {
							httpFailed.Add(1)
							return
						}
						b, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						if resp.StatusCode/100 != 2 {
							httpFailed.Add(1)
							return
						}
						v, _ := bodies.LoadOrStore(key, &sync.Map{})
						v.(*sync.Map).Store(string(b), true)
					}()
				}
			}
		}()
	}

	// Faults, interleaved with production.
	pgAdmin := admin
	tick := 0
	fault := func() {
		tick++
		switch {
		case tick%7 == 3 && sum.redisOutages < o.redisOutages*3:
			rp.stop()
			sum.redisOutages++
			time.Sleep(o.killEvery)
			if err := rp.start(); err != nil {
				fmt.Fprintln(os.Stderr, "chaos: redis restart:", err)
			}
		case tick%5 == 2:
			var n int
			if err := pgAdmin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE application_name LIKE 'chaos-%' AND pid <> pg_backend_pid()`).Scan(&n); err == nil {
				sum.pgRounds++
				sum.pgTerminated += n
			}
		default:
			if len(slots) > 0 && slots[mrand.N(len(slots))].kill() {
				sum.kills++
			}
		}
	}
	for c := 0; c < chunks; c++ {
		for _, p := range producers {
			n := (len(p.ids) + chunks - 1) / chunks
			end := min(p.next+n, len(p.ids))
			if err := p.emit(ctx, p.ids[p.next:end]); err != nil {
				return sum, fmt.Errorf("produce %s: %w", p.name, err)
			}
			p.next = end
		}
		fault()
		if err := sleep(ctx, o.killEvery); err != nil {
			return sum, err
		}
	}

	// Keep injecting faults until the minimums are met and everything ran.
	count := func() (map[string]int, error) {
		rows, err := pool.Query(ctx, `SELECT transport, count(DISTINCT event_id) FROM effects GROUP BY transport`)
		if err != nil {
			return nil, err
		}
		out := map[string]int{}
		for rows.Next() {
			var t string
			var n int
			if err := rows.Scan(&t, &n); err != nil {
				return nil, err
			}
			out[t] = n
		}
		return out, rows.Err()
	}
	httpDone := make(chan struct{})
	go func() { httpWG.Wait(); close(httpDone) }()
	for {
		got, err := count()
		complete := err == nil
		for _, t := range sum.transports {
			if got[t] < sum.unique[t] {
				complete = false
			}
		}
		select {
		case <-httpDone:
		default:
			complete = false
		}
		faultsDone := sum.kills >= o.kills && sum.redisOutages >= o.redisOutages && sum.pgRounds >= o.pgTerminates
		if complete && faultsDone {
			break
		}
		if !faultsDone {
			fault()
		}
		if err := sleep(ctx, o.killEvery); err != nil {
			got, _ := count()
			return sum, fmt.Errorf("gave up: %w; distinct effects so far %v of %v", err, got, sum.unique)
		}
	}
	// Let the last acks and commits land, then stop the workers cleanly.
	_ = sleep(ctx, time.Second)
	for _, s := range slots {
		s.stop()
	}
	sum.crashes = int(crashes.Load())

	// The verdict, from the business table and the ledger.
	rows, err := pool.Query(ctx, `SELECT transport, count(*), count(DISTINCT event_id) FROM effects GROUP BY transport`)
	if err != nil {
		return sum, err
	}
	for rows.Next() {
		var t string
		var n, d int
		if err := rows.Scan(&t, &n, &d); err != nil {
			return sum, err
		}
		sum.effects[t], sum.distinct[t] = n, d
	}
	if err := rows.Err(); err != nil {
		return sum, err
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE status = 'done'`).Scan(&sum.ledgerRows); err != nil {
		return sum, err
	}
	total := 0
	for _, t := range sum.transports {
		total += sum.unique[t]
		if sum.effects[t] != sum.distinct[t] {
			sum.problems = append(sum.problems, fmt.Sprintf("%s: %d effects doubled", t, sum.effects[t]-sum.distinct[t]))
		}
		if sum.distinct[t] != sum.unique[t] {
			sum.problems = append(sum.problems, fmt.Sprintf("%s: %d events lost", t, sum.unique[t]-sum.distinct[t]))
		}
	}
	if sum.ledgerRows != total {
		sum.problems = append(sum.problems, fmt.Sprintf("ledger holds %d done rows for %d unique events", sum.ledgerRows, total))
	}
	sum.httpRequests, sum.httpFailed = int(httpRequests.Load()), int(httpFailed.Load())
	bodies.Range(func(_, v any) bool {
		n := 0
		v.(*sync.Map).Range(func(_, _ any) bool { n++; return true })
		if n > 1 {
			sum.httpMismatched++
		}
		return true
	})
	if sum.httpFailed > 0 {
		sum.problems = append(sum.problems, fmt.Sprintf("http: %d requests never got a 2xx", sum.httpFailed))
	}
	if sum.httpMismatched > 0 {
		sum.problems = append(sum.problems, fmt.Sprintf("http: %d keys got differing responses", sum.httpMismatched))
	}
	if sum.kills < o.kills {
		sum.problems = append(sum.problems, fmt.Sprintf("only %d kills injected, %d asked", sum.kills, o.kills))
	}
	return sum, nil
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// httpServer serves POST /pay through the bridge, on its own pool (whose
// connections are terminated with the workers').
type closer struct {
	URL   string
	close func()
}

func (c *closer) Close() { c.close() }

func httpServer(ctx context.Context, pgURL, redisAddr string) (*closer, error) {
	l, closeLedger, err := newLedger(ctx, pgURL, redisAddr, "http")
	if err != nil {
		return nil, err
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: l})
	if err != nil {
		return nil, err
	}
	route := bridge.Route(httpbridge.RouteConfig{Scope: scope, Required: true})
	mux := http.NewServeMux()
	mux.Handle("POST /pay", route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := httpbridge.Key(r.Context())
		if _, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (event_id, transport) VALUES ($1, 'http')`, key); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		// A body unique to this execution: every client of a key must see it.
		fmt.Fprintf(w, `{"key":%q,"payment":"pay_%s"}`, key, randHex(6))
	})))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &closer{URL: "http://" + ln.Addr().String(), close: func() {
		_ = srv.Close()
		closeLedger()
	}}, nil
}
