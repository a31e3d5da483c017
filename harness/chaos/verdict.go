package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/harness/svcenv"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// Fault kinds, as counted in the summary.
const (
	fKill        = "consumer SIGKILL"
	fRedis       = "Redis outage"
	fPgTerminate = "pg_terminate_backend round"
	fPgCrash     = "Postgres SIGKILL+restart"
	fKafkaCrash  = "Kafka SIGKILL+restart"
	fNatsRestart = "NATS restart (file store)"
	fNet         = "network fault"
	fRelease     = "operator release+resend"
	fRelayKill   = "outbox relay SIGKILL"
)

var faultOrder = []string{fKill, fRelayKill, fRedis, fPgTerminate, fPgCrash, fKafkaCrash, fNatsRestart, fNet, fRelease}

const janitorScope = "chaos-janitor"

// summary is what the run did and found.
type summary struct {
	transports                               []string
	produced, duplicates, unique             map[string]int
	hostile                                  map[string]map[hostileKind]int
	effects, distinct                        map[string]int
	faults                                   map[string]int
	netKinds                                 map[string]int
	down                                     map[string][]time.Duration
	obs                                      *observations
	pgTerminated, producerRetries            int
	released, releaseFailed                  int
	httpRequests, httpFailed, httpMismatched int
	ledgerDone, ledgerFailed                 int
	deadLettered                             map[string]int
	janitorCreated, janitorLeft, janitorGone int
	natsSync                                 string
	layout                                   string
	bucketLayout                             bool
	bucketsOpened                            int
	killsBy                                  map[string]int // SIGKILLs by worker role
	hops                                     *hops
	hopLost, hopDoubled, hopLeaked           map[string]int
	hopLedger                                map[string][2]int // scope -> done, failed
	hopHTTPMismatched                        int
	relayKillsBusy                           int // relay kills while outbox rows were waiting
	relayKillRows                            int // outbox rows waiting at those kills
	took                                     time.Duration
	problems                                 []string
}

func (s *summary) violations() int { return len(s.problems) }

func (s *summary) problem(format string, args ...any) {
	s.problems = append(s.problems, fmt.Sprintf(format, args...))
}

func (s *summary) print(w io.Writer) {
	fmt.Fprintf(w, "\n== justonce chaos summary (%s) ==\n", s.took.Round(time.Second))
	fmt.Fprintf(w, "ledger layout: %s\n", s.layout)
	for _, t := range s.transports {
		fmt.Fprintf(w, "%-6s events produced %7d  duplicates %6d  unique %7d  effects %7d  distinct %7d\n",
			t, s.produced[t], s.duplicates[t], s.unique[t], s.effects[t], s.distinct[t])
		if h := s.hostile[t]; len(h) > 0 {
			var parts []string
			for k := hostileKind(1); k < numKinds; k++ {
				parts = append(parts, fmt.Sprintf("%s %d", k, h[k]))
			}
			fmt.Fprintf(w, "       hostile events: %s; dead-lettered %d\n", strings.Join(parts, ", "), s.deadLettered[t])
		}
	}
	fmt.Fprintf(w, "faults injected:\n")
	for _, f := range faultOrder {
		extra := ""
		switch f {
		case fKill:
			extra = fmt.Sprintf(" (+%d workers exited on their own)", s.obs.crashes)
			if len(s.killsBy) > 0 {
				var ks []string
				for _, r := range []string{"kafka", "nats", roleKNA, roleKNB, roleHKA, roleHKB, roleRelay} {
					if n := s.killsBy[r]; n > 0 {
						ks = append(ks, fmt.Sprintf("%s %d", r, n))
					}
				}
				extra += " [" + strings.Join(ks, ", ") + "]"
			}
		case fPgTerminate:
			extra = fmt.Sprintf(" (%d connections)", s.pgTerminated)
		case fNet:
			var ks []string
			for _, k := range netFaultKinds {
				ks = append(ks, fmt.Sprintf("%s %d", k, s.netKinds[k]))
			}
			extra = " (" + strings.Join(ks, ", ") + ")"
		case fNatsRestart:
			extra = " (" + s.natsSync + ")"
		case fRelayKill:
			extra = fmt.Sprintf(" (after a stall of every relay; %d with outbox rows in hand, %d rows in all)", s.relayKillsBusy, s.relayKillRows)
		case fRelease:
			extra = fmt.Sprintf(" (%d keys released and resent, %d release calls failed)", s.released, s.releaseFailed)
		}
		if d := s.down[f]; len(d) > 0 {
			extra += fmt.Sprintf(" down for %s", durations(d))
		}
		fmt.Fprintf(w, "  %-28s %4d%s\n", f, s.faults[f], extra)
	}
	fmt.Fprintf(w, "  hostile handler runs        swallowed error %d, deferred constraint %d, panic %d, slower than the lock TTL %d\n",
		s.obs.get("hostile:swallow"), s.obs.get("hostile:deferred"), s.obs.get("hostile:panic"), s.obs.get("hostile:slow"))
	if s.bucketLayout {
		fmt.Fprintf(w, "  janitor                     %d short-TTL rows written, %d gone (time buckets: a bucket is dropped MaxTTL after it closed, not within a run); %d buckets opened during the run\n",
			s.janitorCreated, s.janitorGone, s.bucketsOpened)
	} else {
		fmt.Fprintf(w, "  janitor                     %d short-TTL rows written, %d purged, %d expired rows left behind\n",
			s.janitorCreated, s.janitorGone, s.janitorLeft)
	}
	fmt.Fprintf(w, "workers saw: ErrCommitUnknown %d, ErrRolledBack %d, deferred FK at COMMIT %d, panics %d, other transient %d, other %d; dead letters %d\n",
		s.obs.get("retry:commit-unknown")+s.obs.get("dead-letter:commit-unknown"),
		s.obs.get("retry:rolled-back")+s.obs.get("dead-letter:rolled-back"),
		s.obs.get("retry:deferred-fk-error")+s.obs.get("dead-letter:deferred-fk-error"),
		s.obs.get("retry:panic-error")+s.obs.get("dead-letter:panic-error"),
		s.obs.get("retry:transient"), s.obs.get("retry:other")+s.obs.get("dead-letter:other")+s.obs.get("dead-letter:transient"),
		s.countPrefix("dead-letter:"))
	fmt.Fprintf(w, "  retries after a failed dead-letter publish %d\n", s.obs.get("retry:dead-letter-publish"))
	n, of, p50, pmax := s.obs.restartStats()
	fmt.Fprintf(w, "consumer restart to first effect: p50 %s, max %s (%d of %d restarts had an effect before the next kill or the end)\n",
		p50.Round(time.Millisecond), pmax.Round(time.Millisecond), n, of)
	fmt.Fprintf(w, "producer retries after a broker fault: %d\n", s.producerRetries)
	if s.httpRequests > 0 {
		fmt.Fprintf(w, "http:   %d requests, %d without a 2xx in the end, %d keys answered with differing bodies\n",
			s.httpRequests, s.httpFailed, s.httpMismatched)
	}
	fmt.Fprintf(w, "ledger rows: %d done, %d failed\n", s.ledgerDone, s.ledgerFailed)
	if h := s.hops; h != nil {
		for _, pipe := range []string{pipeKN, pipeHK} {
			if (pipe == pipeKN && !h.kn) || (pipe == pipeHK && !h.hk) {
				continue
			}
			a, b := "chaos-kn-a", "chaos-kn-b"
			if pipe == pipeHK {
				a, b = "chaos-hk-a", "chaos-hk-b"
			}
			fmt.Fprintf(w, "two-hop %s: %d unique source IDs -> B effects %d, distinct %d: lost %d, doubled %d; ledger A %d done, B %d done\n"+
				"       the hop holds %d messages (%d republished), %d sources with a rolled-back run's message; B answered %d deliveries as duplicates\n",
				pipe, s.unique[pipe], s.effects[pipe], s.distinct[pipe], s.hopLost[pipe], s.hopDoubled[pipe],
				s.hopLedger[a][0], s.hopLedger[b][0], h.published[pipe], h.published[pipe]-int64(s.unique[pipe]), s.hopLeaked[pipe],
				s.obs.get("hop-duplicate:"+map[string]string{pipeKN: roleKNB, pipeHK: roleHKB}[pipe]))
		}
		if h.hk {
			fmt.Fprintf(w, "two-hop http: %d requests, %d without a 2xx in the end, %d keys answered with differing bodies\n",
				h.httpRequests.Load(), h.httpFailed.Load(), s.hopHTTPMismatched)
		}
		fmt.Fprintf(w, "outbox relays: started %d times, %d publish attempts failed for the time being (retried), %d messages refused for good; outbox at the end: %s",
			s.obs.get("relay-started"), s.obs.get("relay-retry"), s.obs.get("relay-failed"), h.stats)
		if h.statsErr != nil {
			fmt.Fprintf(w, " (error: %v)", h.statsErr)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "violations: %d\n", len(s.problems))
	for _, p := range s.problems {
		fmt.Fprintln(w, "  -", p)
	}
}

func (s *summary) countPrefix(prefix string) int {
	s.obs.mu.Lock()
	defer s.obs.mu.Unlock()
	n := 0
	for k, v := range s.obs.counts {
		if strings.HasPrefix(k, prefix) {
			n += v
		}
	}
	return n
}

func durations(d []time.Duration) string {
	var parts []string
	for _, x := range d {
		parts = append(parts, x.Round(100*time.Millisecond).String())
	}
	return strings.Join(parts, ", ")
}

// producer emits one transport's plan in chunks, and resends single
// events (after an operator released them).
type producer struct {
	name    string
	ids     []string
	next    int
	emit    func(ctx context.Context, ids []string) error
	expect  map[string]hostileKind // unique ID -> kind
	closeFn func()
}

// emitRetry emits ids, retrying for up to 2 minutes while the broker is
// away (a retry may add duplicates; the verdict does not mind).
func emitRetry(ctx context.Context, p *producer, ids []string, retries *int) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := p.emit(ctx, ids)
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		*retries++
		fmt.Fprintf(os.Stderr, "chaos: produce %s: %v (retrying)\n", p.name, err)
		if err := consumer.Sleep(ctx, time.Second); err != nil {
			return err
		}
	}
}

func run(ctx context.Context, o options) (sum *summary, err error) {
	start := time.Now()
	obs := &observations{counts: map[string]int{}}
	sum = &summary{produced: map[string]int{}, duplicates: map[string]int{}, unique: map[string]int{},
		hostile: map[string]map[hostileKind]int{}, effects: map[string]int{}, distinct: map[string]int{},
		faults: map[string]int{}, netKinds: map[string]int{}, down: map[string][]time.Duration{},
		deadLettered: map[string]int{}, obs: obs, killsBy: map[string]int{},
		hopLost: map[string]int{}, hopDoubled: map[string]int{}, hopLeaked: map[string]int{}, hopLedger: map[string][2]int{}}
	defer func() { sum.took = time.Since(start) }()
	want := map[string]bool{}
	for _, t := range strings.Split(o.transports, ",") {
		want[strings.TrimSpace(t)] = true
	}
	h := &hops{kn: o.twoHop > 0, hk: o.twoHopHTTPKeys > 0}
	hopsOn := h.kn || h.hk
	if !want["kafka"] && !hopsOn {
		o.kafkaCrashes = 0
	}
	if !want["nats"] && !h.kn {
		o.natsRestarts = 0
	}
	if !hopsOn {
		o.relayKills = 0
	}
	var layout migrations.Layout
	switch o.layout {
	case "plain", "":
		sum.layout = "plain (one table, the janitor deletes expired rows)"
	case "buckets", string(migrations.LayoutTimeBuckets):
		layout = migrations.LayoutTimeBuckets
		sum.bucketLayout = true
		sum.layout = fmt.Sprintf("time buckets (processed_events partitioned into buckets of %d key shards; each shard moves to a new bucket every %v; the janitor drops whole buckets)",
			migrations.DefaultShards, o.bucketWidth)
	default:
		return sum, fmt.Errorf("-layout %q: plain or buckets", o.layout)
	}

	pgURL := svcenv.Get("JUSTONCE_TEST_POSTGRES_URL")
	if pgURL == "" {
		return sum, errors.New("no Postgres: run `make services-up` or set JUSTONCE_TEST_POSTGRES_URL")
	}
	brokers := strings.Split(svcenv.Get("JUSTONCE_TEST_KAFKA_BROKERS"), ",")
	if (want["kafka"] || hopsOn) && brokers[0] == "" {
		return sum, errors.New("no Kafka: run `make services-up` or set JUSTONCE_TEST_KAFKA_BROKERS")
	}
	var svc *services
	if o.pgCrashes > 0 || o.kafkaCrashes > 0 {
		if svc, err = newServices(); err != nil {
			return sum, err
		}
		if o.pgCrashes > 0 {
			cfg, err := pgxpool.ParseConfig(pgURL)
			if err != nil {
				return sum, err
			}
			if err := svc.check("postgres", int(cfg.ConnConfig.Port)); err != nil {
				return sum, fmt.Errorf("-pg-crashes: %w (or pass -pg-crashes 0)", err)
			}
		}
		if o.kafkaCrashes > 0 {
			_, port, _ := strings.Cut(brokers[0], ":")
			p, _ := strconv.Atoi(port)
			if err := svc.check("kafka", p); err != nil {
				return sum, fmt.Errorf("-kafka-crashes: %w (or pass -kafka-crashes 0)", err)
			}
		}
	}

	if svc != nil {
		defer func() {
			if uerr := svc.ensureUp(ctx); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}()
	}

	// Postgres: a schema of the run's own.
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
			admin.Reset()
			_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		} else {
			fmt.Fprintf(os.Stderr, "chaos: schema %s kept for inspection\n", schema)
		}
	}()
	withPath := func(u string) string {
		if strings.Contains(u, "?") {
			return u + "&search_path=" + schema
		}
		return u + "?search_path=" + schema
	}
	runURL := withPath(pgURL)
	pool, err := pgxpool.New(ctx, runURL)
	if err != nil {
		return sum, err
	}
	defer pool.Close()
	mc := migrations.Config{Schema: schema, Layout: layout}
	if layout == migrations.LayoutTimeBuckets {
		mc.BucketWidth = o.bucketWidth
	}
	if _, err := migrations.New(pool, mc).Up(ctx); err != nil {
		return sum, err
	}
	if _, err := pool.Exec(ctx, hostileSchema); err != nil {
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

	// The fault proxy: consumers and the HTTP server reach Postgres and
	// Redis through it.
	pgHostPort, err := hostPort(pgURL)
	if err != nil {
		return sum, err
	}
	nf, err := newNetFaults(pgHostPort, rp.addr)
	if err != nil {
		return sum, err
	}
	defer nf.close()
	proxiedURL := withPath(strings.Replace(pgURL, pgHostPort, nf.pg.Listen, 1))
	proxiedRedis := nf.redis.Listen

	// The harness's own ledger (direct): operator releases and the janitor.
	rc := redis.NewClient(&redis.Options{Addr: rp.addr, ContextTimeoutEnabled: true, MaxRetries: 1,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond})
	defer rc.Close()
	opLedger, err := inbox.New(pool, inbox.Config{Redis: &inbox.RedisConfig{Client: rc, Timeout: 300 * time.Millisecond}})
	if err != nil {
		return sum, err
	}

	var slots []*slot
	startSlot := func(transport string, i int, args []string) {
		s := &slot{transport: transport, name: fmt.Sprintf("%s-%d", transport, i), args: args, done: make(chan struct{})}
		slots = append(slots, s)
		go s.supervise(obs)
	}
	startSlots := func(transport string, args []string) {
		for i := 0; i < o.workers; i++ {
			startSlot(transport, i, args)
		}
	}
	stopSlots := func() {
		var wg sync.WaitGroup
		for _, s := range slots {
			wg.Add(1)
			go func() { defer wg.Done(); s.stop() }()
		}
		wg.Wait()
	}
	defer stopSlots()
	common := []string{"-pg", proxiedURL, "-redis", proxiedRedis, "-batch", strconv.Itoa(o.batch),
		"-hostile-every", strconv.Itoa(o.hostileEvery)}

	producers := map[string]*producer{}
	resend := map[string]func(ctx context.Context, id string) error{}
	classify := func(p *producer, unique int) {
		p.expect = make(map[string]hostileKind, unique)
		h := map[hostileKind]int{}
		for i := 0; i < unique; i++ {
			id := p.ids[0][:2] + strconv.Itoa(i)
			k := kindOf(id, o.hostileEvery)
			p.expect[id] = k
			if k != normal {
				h[k]++
			}
		}
		sum.hostile[p.name] = h
	}
	var dlqKafka func(ctx context.Context) (map[string]bool, error)
	var dlqNats func(ctx context.Context) (map[string]bool, error)

	if want["kafka"] {
		sum.transports = append(sum.transports, "kafka")
		topic := "chaos-" + randHex(4)
		if err := kafkaadmin.CreateTopic(brokers[0], topic, 4); err != nil {
			return sum, fmt.Errorf("kafka topic: %w", err)
		}
		dlq := topic + kafkainbox.DeadLetterSuffix
		if err := kafkaadmin.CreateTopic(brokers[0], dlq, 1); err != nil {
			return sum, fmt.Errorf("kafka dead-letter topic: %w", err)
		}
		ids, dups := plan("k-", o.events, o.dupPct)
		sum.produced["kafka"], sum.duplicates["kafka"], sum.unique["kafka"] = len(ids), dups, o.events
		w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
			BatchSize: 1000, BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll,
			WriteTimeout: 10 * time.Second, ReadTimeout: 10 * time.Second}
		defer w.Close()
		emit := func(ctx context.Context, ids []string) error {
			msgs := make([]kafka.Message, len(ids))
			for i, id := range ids {
				msgs[i] = kafkainbox.NewMessage(id, []byte(id), []byte(`{"id":"`+id+`"}`))
			}
			return w.WriteMessages(ctx, msgs...)
		}
		p := &producer{name: "kafka", ids: ids, emit: emit}
		classify(p, o.events)
		producers["kafka"] = p
		resend["kafka"] = func(ctx context.Context, id string) error {
			return emitRetry(ctx, p, []string{id}, &sum.producerRetries)
		}
		dlqKafka = func(ctx context.Context) (map[string]bool, error) { return readKafkaDLQ(ctx, brokers, dlq) }
		startSlots("kafka", append([]string{"-transport", "kafka", "-brokers", strings.Join(brokers, ","), "-topic", topic}, common...))
	}

	ns := &natsServer{port: freePort(), dir: filepath.Join(tmp, "js"), syncAlways: o.natsSyncAlways}
	sum.natsSync = "JetStream sync_interval default (2 min), graceful shutdown"
	if o.natsSyncAlways {
		sum.natsSync = "JetStream sync_always"
	}
	var nc *nats.Conn
	if want["nats"] || h.kn {
		if err := ns.start(); err != nil {
			return sum, err
		}
		defer ns.shutdown()
		if nc, err = nats.Connect(ns.url(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond)); err != nil {
			return sum, err
		}
		defer nc.Close()
	}
	if want["nats"] {
		sum.transports = append(sum.transports, "nats")
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
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHAOSDLQ", Subjects: []string{"chaos.events.dlq"},
			Storage: jetstream.FileStorage}); err != nil {
			return sum, err
		}
		ids, dups := plan("n-", o.events, o.dupPct)
		sum.produced["nats"], sum.duplicates["nats"], sum.unique["nats"] = len(ids), dups, o.events
		lastSent := map[string]time.Time{}
		emit := func(ctx context.Context, ids []string) error {
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
		}
		p := &producer{name: "nats", ids: ids, emit: emit}
		classify(p, o.events)
		producers["nats"] = p
		resend["nats"] = func(ctx context.Context, id string) error {
			return emitRetry(ctx, p, []string{id}, &sum.producerRetries)
		}
		dlqNats = func(ctx context.Context) (map[string]bool, error) { return readNatsDLQ(ctx, js, "CHAOSDLQ") }
		startSlots("nats", append([]string{"-transport", "nats", "-nats", ns.url(), "-stream", "CHAOS"}, common...))
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
		srv, err := httpServer(ctx, proxiedURL, proxiedRedis)
		if err != nil {
			return sum, err
		}
		defer srv.Close()
		client := &http.Client{Timeout: 30 * time.Second, Transport: &httpretry.Transport{MaxAttempts: 100, Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}}}
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

	// The two-hop pipelines.
	var hopAddrs []string
	if hopsOn {
		sum.hops = h
		h.brokers = brokers
		if h.ob, err = outbox.New(pool, outbox.Config{}); err != nil {
			return sum, fmt.Errorf("outbox: %w", err)
		}
		p, err := setupHops(ctx, o, h, sum, nc)
		if err != nil {
			return sum, err
		}
		if p != nil {
			producers[pipeKN] = p
			defer p.closeFn()
		}
		hopCommon := append([]string{"-brokers", strings.Join(brokers, ","), "-nats", ns.url(), "-kafka-publisher", o.kafkaPub}, common...)
		for i := 0; i < o.hopWorkers; i++ {
			if h.kn {
				startSlot(roleKNA, i, append([]string{"-transport", roleKNA, "-topic", h.srcTopic}, hopCommon...))
				startSlot(roleKNB, i, append([]string{"-transport", roleKNB}, hopCommon...))
			}
			if h.hk {
				addr := "127.0.0.1:" + strconv.Itoa(freePort())
				hopAddrs = append(hopAddrs, addr)
				startSlot(roleHKA, i, append([]string{"-transport", roleHKA, "-topic", h.topic, "-listen", addr, "-relay"}, hopCommon...))
				startSlot(roleHKB, i, append([]string{"-transport", roleHKB, "-topic", h.topic}, hopCommon...))
			}
		}
		for i := 0; i < o.relays; i++ {
			startSlot(roleRelay, i, append([]string{"-transport", roleRelay}, hopCommon...))
		}
		if h.hk {
			producers[pipeHK] = h.httpProducer(ctx, &httpWG, hopAddrs, o.twoHopHTTPKeys, o.httpClients)
		}
	}

	// The janitor: short-lived rows of another scope written and purged
	// during the run, next to the rows that must stay.
	jctx, jcancel := context.WithCancel(ctx)
	var jwg sync.WaitGroup
	var janitorCreated atomic.Int64
	if o.janitor {
		jwg.Add(2)
		go func() {
			defer jwg.Done()
			_ = opLedger.RunJanitor(jctx, inbox.JanitorConfig{Interval: 500 * time.Millisecond, BatchSize: 100})
		}()
		go func() {
			defer jwg.Done()
			for i := 0; jctx.Err() == nil; i++ {
				req := inbox.Request{Key: inbox.Key{Scope: janitorScope, ID: "j-" + strconv.Itoa(i)}, TTL: time.Second}
				_, err := opLedger.Do(jctx, req, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
				if err == nil {
					janitorCreated.Add(1)
				} else if jctx.Err() == nil && !inbox.IsTransient(err) {
					fmt.Fprintln(os.Stderr, "chaos: janitor rows:", err)
				}
				_ = consumer.Sleep(jctx, 100*time.Millisecond)
			}
		}()
	}
	defer func() { jcancel(); jwg.Wait() }()

	// The fault queue, shuffled so that every kind lands mid-stream.
	var queue []string
	add := func(kind string, n int) {
		for i := 0; i < n; i++ {
			queue = append(queue, kind)
		}
	}
	add(fKill, o.kills)
	add(fRelayKill, o.relayKills)
	add(fRedis, o.redisOutages)
	add(fPgTerminate, o.pgTerminates)
	add(fPgCrash, o.pgCrashes)
	add(fKafkaCrash, o.kafkaCrashes)
	add(fNatsRestart, o.natsRestarts)
	add(fNet, o.netFaults)
	mrand.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	// Operator releases need failed keys: they go in the second half.
	for i := 0; i < o.releases; i++ {
		at := len(queue)/2 + mrand.N(len(queue)-len(queue)/2+1)
		queue = append(queue[:at], append([]string{fRelease}, queue[at:]...)...)
	}

	released := map[string]bool{}
	netTurn := 0
	relayIdle := 0 // relay kills put off because the outbox was empty
	deferrals := 0
	// fault injects one fault; false means it could not be done now and
	// goes back in the queue.
	fault := func(kind string) (bool, error) {
		switch kind {
		case fKill:
			if len(slots) == 0 {
				return true, nil
			}
			s := slots[mrand.N(len(slots))]
			if !s.kill() {
				return false, nil
			}
			sum.killsBy[s.transport]++
		case fRelayKill:
			var rs []*slot
			for _, s := range slots {
				if relayRole(s.transport) {
					rs = append(rs, s)
				}
			}
			if len(rs) == 0 {
				return true, nil
			}
			// Kill a relay while it has work in hand: every relay stalls
			// (SIGSTOP) while A goes on adding messages, then resumes, and
			// one of them is SIGKILLed a moment into the backlog (or into
			// the batch it was stopped in).
			for _, s := range rs {
				s.signal(syscall.SIGSTOP)
			}
			_ = consumer.Sleep(ctx, o.killEvery)
			for _, s := range rs {
				s.signal(syscall.SIGCONT)
			}
			time.Sleep(time.Duration(mrand.N(100)) * time.Millisecond)
			var waiting int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&waiting); err != nil || waiting == 0 {
				if relayIdle++; relayIdle < 20 {
					return false, nil
				}
			}
			s := rs[mrand.N(len(rs))]
			if !s.kill() {
				return false, nil
			}
			relayIdle = 0
			if waiting > 0 {
				sum.relayKillsBusy++
				sum.relayKillRows += waiting
			}
			sum.killsBy[s.transport]++
		case fRedis:
			rp.stop()
			_ = consumer.Sleep(ctx, o.killEvery)
			if err := rp.start(); err != nil {
				return true, fmt.Errorf("redis restart: %w", err)
			}
		case fPgTerminate:
			var n int
			if err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE application_name LIKE 'chaos-%' AND pid <> pg_backend_pid()`).Scan(&n); err != nil {
				return false, nil
			}
			sum.pgTerminated += n
		case fPgCrash, fKafkaCrash:
			name := "postgres"
			if kind == fKafkaCrash {
				name = "kafka"
			}
			fmt.Fprintf(os.Stderr, "chaos: SIGKILL %s\n", name)
			d, err := svc.crash(ctx, name)
			sum.down[kind] = append(sum.down[kind], d)
			if err != nil {
				return true, err
			}
			if kind == fPgCrash {
				admin.Reset()
				pool.Reset()
			}
		case fNatsRestart:
			t0 := time.Now()
			if err := ns.restart(o.killEvery); err != nil {
				return true, fmt.Errorf("nats restart: %w", err)
			}
			sum.down[kind] = append(sum.down[kind], time.Since(t0))
		case fNet:
			k := netFaultKinds[netTurn%len(netFaultKinds)]
			netTurn++
			if err := nf.inject(ctx, k); err != nil {
				return true, err
			}
			sum.netKinds[k]++
		case fRelease:
			n, err := operatorRelease(ctx, pool, opLedger, producers, resend, released, o.hostileEvery, 3)
			sum.released += n
			if err != nil {
				sum.releaseFailed++
				fmt.Fprintln(os.Stderr, "chaos: release:", err)
			}
			if n == 0 {
				return false, nil
			}
		}
		return true, nil
	}
	tick := func() error {
		if len(queue) == 0 {
			return nil
		}
		kind := queue[0]
		queue = queue[1:]
		ok, err := fault(kind)
		if err != nil {
			return fmt.Errorf("%s: %w", kind, err)
		}
		if ok {
			sum.faults[kind]++
		} else {
			deferrals++
			if deferrals > 400 {
				return fmt.Errorf("%s could not be injected (%d tries)", kind, deferrals)
			}
			queue = append(queue, kind)
		}
		return nil
	}

	// Production, interleaved with faults.
	chunks := max(len(queue), 10)
	order := []string{"kafka", "nats", pipeKN, pipeHK}
	for c := 0; c < chunks; c++ {
		for _, name := range order {
			p := producers[name]
			if p == nil {
				continue
			}
			n := (len(p.ids) + chunks - 1) / chunks
			end := min(p.next+n, len(p.ids))
			if err := emitRetry(ctx, p, p.ids[p.next:end], &sum.producerRetries); err != nil {
				return sum, fmt.Errorf("produce %s: %w", p.name, err)
			}
			p.next = end
		}
		if err := tick(); err != nil {
			return sum, err
		}
		if err := consumer.Sleep(ctx, o.killEvery); err != nil {
			return sum, err
		}
	}

	// Keep injecting faults until the queue is empty and everything ran:
	// each event that must run has its effect, each permanent hostile
	// event that was not released is recorded failed.
	progress := func() (map[string]int, int, error) {
		got := map[string]int{}
		rows, err := pool.Query(ctx, `SELECT transport, count(DISTINCT event_id) FROM effects GROUP BY transport`)
		if err != nil {
			return nil, 0, err
		}
		for rows.Next() {
			var t string
			var n int
			if err := rows.Scan(&t, &n); err != nil {
				return nil, 0, err
			}
			got[t] = n
		}
		if err := rows.Err(); err != nil {
			return nil, 0, err
		}
		var failed int
		err = pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE scope = $1 AND status = 'failed'`, scope).Scan(&failed)
		return got, failed, err
	}
	expected := func() (once map[string]int, dead int) {
		once = map[string]int{}
		for name, p := range producers {
			for id, k := range p.expect {
				if k.permanent() && !released[id] {
					dead++
				} else {
					once[name]++
				}
			}
		}
		once["http"] = sum.unique["http"]
		once[pipeHK] = sum.unique[pipeHK]
		return once, dead
	}
	httpDone := make(chan struct{})
	go func() { httpWG.Wait(); close(httpDone) }()
	for {
		got, failed, err := progress()
		once, dead := expected()
		complete := err == nil && failed >= dead
		for _, t := range sum.transports {
			if got[t] < once[t] {
				complete = false
			}
		}
		select {
		case <-httpDone:
		default:
			complete = false
		}
		if complete && len(queue) == 0 {
			break
		}
		if err := tick(); err != nil {
			return sum, err
		}
		if err := consumer.Sleep(ctx, o.killEvery); err != nil {
			got, failed, _ := progress()
			return sum, fmt.Errorf("gave up: %w; distinct effects so far %v of %v; failed rows %d of %d", err, got, once, failed, dead)
		}
	}
	// Let the last acks and commits land, then stop the workers cleanly.
	_ = consumer.Sleep(ctx, time.Second)
	stopSlots()
	jcancel()
	jwg.Wait()
	// The janitor's verdict is as of its stop: the checks below take
	// a while (reading the hops), and rows keep expiring meanwhile.
	var janitorStopped time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&janitorStopped); err != nil {
		return sum, err
	}

	verdict(ctx, sum, pool, producers, released, dlqKafka, dlqNats)
	if hopsOn {
		h.finish(ctx)
		verdictHops(ctx, sum, pool, h)
	}
	sum.janitorCreated = int(janitorCreated.Load())
	if o.janitor && layout == migrations.LayoutTimeBuckets {
		// A bucket is dropped once every row in it has expired: MaxTTL
		// after it closed, far after a run. The janitor runs (it opens
		// buckets, so that they turn over during the run) and must drop
		// nothing the verdict needs.
		var all int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE scope = $1`, janitorScope).Scan(&all); err != nil {
			return sum, err
		}
		sum.janitorGone = sum.janitorCreated - all
		if err := pool.QueryRow(ctx, `SELECT count(*) - $1::int FROM processed_events_buckets`, migrations.DefaultShards).Scan(&sum.bucketsOpened); err != nil {
			return sum, err
		}
		if sum.bucketsOpened == 0 {
			sum.problem("janitor: no bucket opened during the run (-bucket-width %v)", o.bucketWidth)
		}
	} else if o.janitor {
		var left, all int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE expires_at < $2::timestamptz - interval '5 seconds'), count(*)
			FROM processed_events WHERE scope = $1`, janitorScope, janitorStopped).Scan(&left, &all); err != nil {
			return sum, err
		}
		sum.janitorLeft, sum.janitorGone = left, sum.janitorCreated-all
		if left > 0 {
			sum.problem("janitor: %d rows expired more than 5 s before it stopped are still there", left)
		}
		if sum.janitorGone <= 0 {
			sum.problem("janitor: purged nothing of %d short-TTL rows", sum.janitorCreated)
		}
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
		sum.problem("http: %d requests never got a 2xx", sum.httpFailed)
	}
	if sum.httpMismatched > 0 {
		sum.problem("http: %d keys got differing responses", sum.httpMismatched)
	}
	asked := map[string]int{fKill: o.kills, fRelayKill: o.relayKills, fRedis: o.redisOutages, fPgTerminate: o.pgTerminates, fPgCrash: o.pgCrashes,
		fKafkaCrash: o.kafkaCrashes, fNatsRestart: o.natsRestarts, fNet: o.netFaults, fRelease: o.releases}
	for _, f := range faultOrder {
		if sum.faults[f] < asked[f] {
			sum.problem("only %d × %s injected, %d asked", sum.faults[f], f, asked[f])
		}
	}
	if o.netFaults >= len(netFaultKinds) && o.events >= 20000 && obs.get("retry:commit-unknown")+obs.get("dead-letter:commit-unknown") == 0 {
		sum.problem("no worker saw ErrCommitUnknown: the reset-peer faults did not hit a COMMIT in flight")
	}
	return sum, nil
}

// hostPort returns the host:port of a postgres:// URL.
func hostPort(u string) (string, error) {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return "", err
	}
	return cfg.ConnConfig.Host + ":" + strconv.Itoa(int(cfg.ConnConfig.Port)), nil
}

// operatorRelease is what an operator does after fixing a handler: for up
// to n permanent hostile events recorded failed, mark them repaired (the
// fixed handler now succeeds), Release their keys and resend them. Each
// must then end with exactly one effect.
func operatorRelease(ctx context.Context, pool *pgxpool.Pool, l *inbox.Ledger, producers map[string]*producer,
	resend map[string]func(context.Context, string) error, released map[string]bool, every, n int) (int, error) {
	rows, err := pool.Query(ctx, `SELECT event_id FROM processed_events WHERE scope = $1 AND status = 'failed' LIMIT 500`, scope)
	if err != nil {
		return 0, err
	}
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return 0, err
		}
		if !released[id] && kindOf(id, every).permanent() {
			ids = append(ids, id)
		}
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	done := 0
	for _, id := range ids {
		if done == n {
			break
		}
		name := "kafka"
		if strings.HasPrefix(id, "n-") {
			name = "nats"
		}
		if producers[name] == nil {
			continue
		}
		if _, err := pool.Exec(ctx, `INSERT INTO repaired (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, id); err != nil {
			return done, err
		}
		k := inbox.Key{Scope: scope, ID: id}
		if _, err := l.Release(ctx, k); err != nil {
			// Released or not? Ask the ledger: a key still there is still
			// failed, and stays expected dead-lettered.
			if _, lerr := l.Lookup(ctx, k); !errors.Is(lerr, inbox.ErrNotFound) {
				return done, err
			}
		}
		released[id] = true
		if err := resend[name](ctx, id); err != nil {
			return done, fmt.Errorf("resend %s: %w", id, err)
		}
		done++
	}
	return done, nil
}

// verdict checks every event from the business table, the ledger and the
// dead-letter streams.
func verdict(ctx context.Context, sum *summary, pool *pgxpool.Pool, producers map[string]*producer, released map[string]bool,
	dlqKafka, dlqNats func(context.Context) (map[string]bool, error)) {
	effects := map[string]int{}
	status := map[string]string{}
	err := func() error {
		rows, err := pool.Query(ctx, `SELECT event_id, transport, count(*) FROM effects GROUP BY event_id, transport`)
		if err != nil {
			return err
		}
		for rows.Next() {
			var id, t string
			var n int
			if err := rows.Scan(&id, &t, &n); err != nil {
				return err
			}
			effects[id] = n
			sum.effects[t] += n
			sum.distinct[t]++
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows, err = pool.Query(ctx, `SELECT event_id, status FROM processed_events WHERE scope = $1`, scope)
		if err != nil {
			return err
		}
		for rows.Next() {
			var id, st string
			if err := rows.Scan(&id, &st); err != nil {
				return err
			}
			status[id] = st
			switch st {
			case "done":
				sum.ledgerDone++
			case "failed":
				sum.ledgerFailed++
			}
		}
		return rows.Err()
	}()
	if err != nil {
		sum.problem("verdict: %v", err)
		return
	}
	dlq := map[string]map[string]bool{}
	for name, read := range map[string]func(context.Context) (map[string]bool, error){"kafka": dlqKafka, "nats": dlqNats} {
		if read == nil {
			continue
		}
		got, err := read(ctx)
		if err != nil {
			sum.problem("%s dead-letter stream: %v", name, err)
		}
		dlq[name] = got
	}
	for _, name := range []string{"kafka", "nats"} {
		p := producers[name]
		if p == nil {
			continue
		}
		bad := map[string][]string{}
		for id, k := range p.expect {
			n := effects[id]
			if k.permanent() && !released[id] {
				switch {
				case n > 0:
					bad["permanent hostile event has an effect"] = append(bad["permanent hostile event has an effect"], id)
				case status[id] != "failed":
					bad["permanent hostile event not recorded failed (ledger: "+orNone(status[id])+")"] = append(bad["permanent hostile event not recorded failed (ledger: "+orNone(status[id])+")"], id)
				case !dlq[name][id]:
					bad["permanent hostile event recorded failed but not in the dead-letter stream"] = append(bad["permanent hostile event recorded failed but not in the dead-letter stream"], id)
				}
				if dlq[name][id] {
					sum.deadLettered[name]++
				}
				continue
			}
			what := k.String()
			if released[id] {
				what += " (released and resent)"
			}
			switch {
			case n == 0:
				bad[what+" lost"] = append(bad[what+" lost"], id)
			case n > 1:
				bad[what+" doubled"] = append(bad[what+" doubled"], id)
			case status[id] != "done":
				bad[what+" has its effect but ledger says "+orNone(status[id])] = append(bad[what+" has its effect but ledger says "+orNone(status[id])], id)
			}
			if dlq[name][id] && !released[id] {
				sum.deadLettered[name]++
				bad[what+" dead-lettered although it ran"] = append(bad[what+" dead-lettered although it ran"], id)
			}
		}
		var keys []string
		for k := range bad {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			ids := bad[k]
			sort.Strings(ids)
			sum.problem("%s: %d × %s, e.g. %s", name, len(ids), k, strings.Join(ids[:min(5, len(ids))], " "))
		}
	}
	if sum.unique["http"] > 0 {
		if sum.effects["http"] != sum.distinct["http"] {
			sum.problem("http: %d effects doubled", sum.effects["http"]-sum.distinct["http"])
		}
		if sum.distinct["http"] != sum.unique["http"] {
			sum.problem("http: %d keys lost", sum.unique["http"]-sum.distinct["http"])
		}
	}
}

func orNone(s string) string {
	if s == "" {
		return "no row"
	}
	return s
}

// readKafkaDLQ returns the event IDs in the dead-letter topic.
func readKafkaDLQ(ctx context.Context, brokers []string, topic string) (map[string]bool, error) {
	out := map[string]bool{}
	conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, 0)
	if err != nil {
		return out, err
	}
	last, err := conn.ReadLastOffset()
	_ = conn.Close()
	if err != nil || last == 0 {
		return out, err
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: 0, MaxWait: 500 * time.Millisecond})
	defer r.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			return out, fmt.Errorf("read to offset %d: %w", last, err)
		}
		for _, h := range m.Headers {
			if h.Key == consumer.HeaderDLID {
				out[string(h.Value)] = true
			}
		}
		if m.Offset >= last-1 {
			return out, nil
		}
	}
}

// readNatsDLQ returns the event IDs in the dead-letter stream.
func readNatsDLQ(ctx context.Context, js jetstream.JetStream, stream string) (map[string]bool, error) {
	out := map[string]bool{}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return out, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return out, err
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			return out, err
		}
		if id := m.Header.Get(consumer.HeaderDLID); id != "" {
			out[id] = true
		}
	}
	return out, nil
}
