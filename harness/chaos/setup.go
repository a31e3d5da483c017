package main

// Setup: the services a run uses (Postgres, Redis, NATS: a single server
// each, or one with a standby the run starts itself), the run's schema,
// the fault proxy in front of Postgres and Redis, and the worker processes.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/harness/svcenv"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// env is what a run set up: the services, the database, the worker
// processes and the fronts. The stages (fronts, faults, the schedule, the
// verdict) share it.
type env struct {
	o      options
	sum    *summary
	obs    *observations
	want   map[string]bool // transports asked for
	layout migrations.Layout
	h      *hops
	hopsOn bool

	tb      *testsvc.Program // owns the services with a standby (nil: none)
	svc     *services        // the services.sh Postgres and Kafka the run crashes (nil: none)
	brokers []string
	tmp     string

	pg          *pgSite
	schema      string
	admin       *pgxpool.Pool // direct, the server's default schema
	pool        *pgxpool.Pool // direct, the run's schema
	workerPG    string        // the workers' connection string: through the fault proxy, the run's schema
	workerRedis redisConf     // the workers' Redis: through the fault proxy

	redis    *redisSite
	rc       redis.UniversalClient // the harness's own, direct
	opLedger *inbox.Ledger         // the harness's own: operator releases, the janitor

	nats *natsSite
	nc   *nats.Conn

	nf *netFaults

	slots     []*slot
	common    []string // the flags every worker gets
	producers map[string]*producer
	resend    map[string]func(ctx context.Context, id string) error
	released  map[string]bool
	dlq       map[string]func(ctx context.Context) (map[string]bool, error)
	loads     map[string]*keyLoad // http, grpc: clients sending keys
	reqWG     sync.WaitGroup      // every client request in flight (HTTP, gRPC, the http>kafka pipeline)
	jan       *janitor

	stats    *soakStats // a soak run's measures (nil: a chaos run)
	keep     bool       // keep the schema: the run failed
	cleanups []func()
}

// onCleanup registers f to run at cleanup, last registered first.
func (e *env) onCleanup(f func()) { e.cleanups = append(e.cleanups, f) }

func (e *env) cleanup() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
	e.cleanups = nil
}

// pgSite is the Postgres the run's database lives on: the single server
// of services.sh, or a primary and a synchronous standby the run started.
type pgSite struct {
	conn  string   // direct connection string (URL, or multi-host keyword/value)
	nodes []string // host:port of each node, in the order conn lists them
	rs    *testsvc.PGReplicaSet
}

// via returns the connection string through addrs (one per node, in
// order) instead of the nodes, on schema.
func (p *pgSite) via(addrs []string, schema string) string {
	if p.rs == nil {
		return withPath(strings.Replace(p.conn, p.nodes[0], addrs[0], 1), schema)
	}
	return withPath(multiHost(addrs), schema)
}

// multiHost is a keyword/value connection string to every address, that
// connects to the one accepting writes.
func multiHost(addrs []string) string {
	hosts, ports := make([]string, len(addrs)), make([]string, len(addrs))
	for i, a := range addrs {
		hosts[i], ports[i], _ = strings.Cut(a, ":")
	}
	return fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable connect_timeout=2 target_session_attrs=read-write",
		strings.Join(hosts, ","), strings.Join(ports, ","))
}

// withPath adds search_path to a connection string (URL or keyword/value).
func withPath(u, schema string) string {
	if !strings.HasPrefix(u, "postgres://") && !strings.HasPrefix(u, "postgresql://") {
		return u + " search_path=" + schema
	}
	if strings.Contains(u, "?") {
		return u + "&search_path=" + schema
	}
	return u + "?search_path=" + schema
}

// redisSite is the ledgers' Redis: a private redis-server, or a master,
// a replica and three sentinels.
type redisSite struct {
	proc     *redisProc
	sentinel *testsvc.RedisSentinel
}

// nodes returns the data nodes' addresses.
func (r *redisSite) nodes() []string {
	if r.sentinel != nil {
		return []string{r.sentinel.Addr(0), r.sentinel.Addr(1)}
	}
	return []string{r.proc.addr}
}

// workerRedis returns the Redis a worker reaches through the proxies
// (one per data node, in the order of nodes).
func (r *redisSite) workerRedis(proxies []string) redisConf {
	if r.sentinel == nil {
		return redisConf{addr: proxies[0]}
	}
	via := map[string]string{}
	for i, n := range r.nodes() {
		via[n] = proxies[i]
	}
	return redisConf{sentinels: r.sentinel.Sentinels, via: via}
}

// client returns the harness's own client, direct.
func (r *redisSite) client() redis.UniversalClient {
	if r.sentinel != nil {
		return redis.NewFailoverClient(&redis.FailoverOptions{MasterName: testsvc.SentinelMasterName, SentinelAddrs: r.sentinel.Sentinels,
			ContextTimeoutEnabled: true, MaxRetries: 1,
			DialTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond})
	}
	return redis.NewClient(&redis.Options{Addr: r.proc.addr, ContextTimeoutEnabled: true, MaxRetries: 1,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond})
}

// natsSite is NATS: one embedded server, or a three-node JetStream
// cluster.
type natsSite struct {
	single  *natsServer
	cluster *testsvc.NATSCluster
}

func (n *natsSite) url() string {
	if n.cluster != nil {
		return n.cluster.ClientURLs()
	}
	return n.single.url()
}

// replicas is the streams' replica count.
func (n *natsSite) replicas() int {
	if n.cluster != nil {
		return testsvc.NATSClusterSize
	}
	return 1
}

// newEnv returns the run's env before anything started.
func newEnv(o options) *env {
	obs := &observations{counts: map[string]int{}}
	sum := &summary{produced: map[string]int{}, duplicates: map[string]int{}, unique: map[string]int{},
		hostile: map[string]map[hostileKind]int{}, effects: map[string]int{}, distinct: map[string]int{},
		faults: map[string]int{}, netKinds: map[string]int{}, down: map[string][]time.Duration{},
		deadLettered: map[string]int{}, obs: obs, killsBy: map[string]int{},
		hopLost: map[string]int{}, hopDoubled: map[string]int{}, hopLeaked: map[string]int{}, hopLedger: map[string][2]int{},
		asked: map[string]int{}, keys: map[string]*keyLoad{}, ha: map[string]bool{}}
	e := &env{o: o, sum: sum, obs: obs, want: map[string]bool{}, producers: map[string]*producer{},
		resend: map[string]func(context.Context, string) error{}, released: map[string]bool{},
		dlq: map[string]func(context.Context) (map[string]bool, error){}, loads: map[string]*keyLoad{}}
	for _, t := range strings.Split(o.transports, ",") {
		e.want[strings.TrimSpace(t)] = true
	}
	e.h = &hops{kn: o.twoHop > 0, hk: o.twoHopHTTPKeys > 0}
	e.hopsOn = e.h.kn || e.h.hk
	if !e.want["kafka"] && !e.want["franz"] && !e.hopsOn {
		e.o.kafkaCrashes = 0
	}
	if !e.want["nats"] && !e.h.kn {
		e.o.natsRestarts = 0
		e.o.natsLeaderKills = 0
	}
	if !e.hopsOn {
		e.o.relayKills = 0
	}
	for _, s := range []string{"postgres", "redis", "nats"} {
		sum.ha[s] = e.o.ha(s)
	}
	return e
}

// setupLayout reads -layout.
func (e *env) setupLayout() error {
	switch e.o.layout {
	case "plain", "":
		e.sum.layout = "plain (one table, the janitor deletes expired rows)"
	case "buckets", string(migrations.LayoutTimeBuckets):
		e.layout = migrations.LayoutTimeBuckets
		e.sum.bucketLayout = true
		e.sum.layout = fmt.Sprintf("time buckets (processed_events partitioned into buckets of %d key shards; each shard moves to a new bucket every %v; the janitor drops whole buckets)",
			migrations.DefaultShards, e.o.bucketWidth)
	default:
		return fmt.Errorf("-layout %q: plain or buckets", e.o.layout)
	}
	return nil
}

// setupServices finds the services of services.sh the run uses and, with
// crashes asked for, checks that they are the run's to crash; and starts
// the services with a standby the run asked for.
func (e *env) setupServices(ctx context.Context) error {
	var pgURL string
	if !e.o.ha("postgres") {
		if pgURL = svcenv.Get("JUSTONCE_TEST_POSTGRES_URL"); pgURL == "" {
			return errors.New("no Postgres: run `make services-up` or set JUSTONCE_TEST_POSTGRES_URL")
		}
	}
	e.brokers = strings.Split(svcenv.Get("JUSTONCE_TEST_KAFKA_BROKERS"), ",")
	if (e.want["kafka"] || e.want["franz"] || e.hopsOn) && e.brokers[0] == "" {
		return errors.New("no Kafka: run `make services-up` or set JUSTONCE_TEST_KAFKA_BROKERS")
	}
	pgCrash := e.o.pgCrashes > 0 && !e.o.ha("postgres")
	if pgCrash || e.o.kafkaCrashes > 0 {
		svc, err := newServices()
		if err != nil {
			return err
		}
		if pgCrash {
			cfg, err := pgxpool.ParseConfig(pgURL)
			if err != nil {
				return err
			}
			if err := svc.check("postgres", int(cfg.ConnConfig.Port)); err != nil {
				return fmt.Errorf("-pg-crashes: %w (or pass -pg-crashes 0)", err)
			}
		}
		if e.o.kafkaCrashes > 0 {
			_, port, _ := strings.Cut(e.brokers[0], ":")
			p, _ := strconv.Atoi(port)
			if err := svc.check("kafka", p); err != nil {
				return fmt.Errorf("-kafka-crashes: %w (or pass -kafka-crashes 0)", err)
			}
		}
		e.svc = svc
	}
	if e.o.ha("postgres") || e.o.ha("redis") || e.o.ha("nats") {
		e.tb = testsvc.NewProgram("chaos", errOut)
		e.onCleanup(e.tb.Close)
	}
	if e.o.ha("postgres") {
		t0 := time.Now()
		var rs *testsvc.PGReplicaSet
		if err := testsvc.Catch(func() {
			rs = testsvc.StartPostgresReplicaSet(e.tb, testsvc.PGReplicaSetConfig{Synchronous: true, MaxConnections: 400})
		}); err != nil {
			return fmt.Errorf("postgres replica set: %w", err)
		}
		fmt.Fprintf(errOut, "chaos: Postgres primary and synchronous standby on ports %d and %d (%s)\n", rs.Port(0), rs.Port(1), time.Since(t0).Round(time.Millisecond))
		nodes := []string{"127.0.0.1:" + strconv.Itoa(rs.Port(0)), "127.0.0.1:" + strconv.Itoa(rs.Port(1))}
		e.pg = &pgSite{conn: multiHost(nodes), nodes: nodes, rs: rs}
	} else {
		hp, err := hostPort(pgURL)
		if err != nil {
			return err
		}
		e.pg = &pgSite{conn: pgURL, nodes: []string{hp}}
	}
	return nil
}

// setupPostgres creates the run's schema, migrates it and adds what the
// hostile handlers need. The schema is dropped at the end unless the run
// failed.
func (e *env) setupPostgres(ctx context.Context) error {
	e.schema = "chaos_" + randHex(4)
	admin, err := pgxpool.New(ctx, e.pg.conn)
	if err != nil {
		return err
	}
	e.admin = admin
	e.onCleanup(admin.Close)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+e.schema); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	e.onCleanup(func() {
		if !e.keep {
			admin.Reset()
			_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+e.schema+" CASCADE")
		} else {
			fmt.Fprintf(errOut, "chaos: schema %s kept for inspection\n", e.schema)
		}
	})
	pool, err := pgxpool.New(ctx, withPath(e.pg.conn, e.schema))
	if err != nil {
		return err
	}
	e.pool = pool
	e.onCleanup(pool.Close)
	mc := migrations.Config{Schema: e.schema, Layout: e.layout}
	if e.layout == migrations.LayoutTimeBuckets {
		mc.BucketWidth = e.o.bucketWidth
	}
	if _, err := migrations.New(pool, mc).Up(ctx); err != nil {
		return err
	}
	_, err = pool.Exec(ctx, hostileSchema)
	return err
}

// setupRedis starts the run's Redis: private, so that stopping it
// disturbs nobody else.
func (e *env) setupRedis() error {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return errors.New("redis-server not found (apt-get install redis-server)")
	}
	tmp, err := os.MkdirTemp("", "justonce-chaos-")
	if err != nil {
		return err
	}
	e.tmp = tmp
	e.onCleanup(func() { os.RemoveAll(tmp) })
	if e.o.ha("redis") {
		var s *testsvc.RedisSentinel
		if err := testsvc.Catch(func() { s = testsvc.StartRedisSentinel(e.tb) }); err != nil {
			return fmt.Errorf("redis sentinel: %w", err)
		}
		fmt.Fprintf(errOut, "chaos: Redis master %s, replica %s, sentinels %s\n", s.Addr(0), s.Addr(1), strings.Join(s.Sentinels, ","))
		e.redis = &redisSite{sentinel: s}
		return nil
	}
	rp := &redisProc{bin: bin, dir: tmp, port: freePort()}
	rp.addr = "127.0.0.1:" + strconv.Itoa(rp.port)
	if err := rp.start(); err != nil {
		return err
	}
	e.onCleanup(rp.stop)
	e.redis = &redisSite{proc: rp}
	return nil
}

// setupProxy puts the fault proxy between the workers and Postgres and
// Redis, and opens the harness's own ledger (direct): operator releases
// and the janitor.
func (e *env) setupProxy() error {
	nf, err := newNetFaults(e.pg.nodes, e.redis.nodes())
	if err != nil {
		return err
	}
	e.nf = nf
	e.onCleanup(nf.close)
	e.workerPG = e.pg.via(listens(nf.pg), e.schema)
	e.rc = e.redis.client()
	e.onCleanup(func() { e.rc.Close() })
	if e.opLedger, err = inbox.New(e.pool, inbox.Config{Redis: &inbox.RedisConfig{Client: e.rc, Timeout: 300 * time.Millisecond}}); err != nil {
		return err
	}
	e.workerRedis = e.redis.workerRedis(listens(nf.redis))
	e.common = append([]string{"-pg", e.workerPG}, e.workerRedis.args()...)
	e.common = append(e.common, "-batch", strconv.Itoa(e.o.batch), "-hostile-every", strconv.Itoa(e.o.hostileEvery))
	if e.stats != nil {
		e.common = append(e.common, "-stats-every", e.stats.every.String())
	}
	e.onCleanup(e.stopSlots)
	return nil
}

// setupNATS starts NATS, one embedded server or a three-node cluster,
// and connects the producer to it.
func (e *env) setupNATS() error {
	ns := &natsServer{port: freePort(), dir: e.tmp + "/js", syncAlways: e.o.natsSyncAlways}
	e.nats = &natsSite{single: ns}
	e.sum.natsSync = "JetStream sync_interval default (2 min), graceful shutdown"
	if e.o.natsSyncAlways {
		e.sum.natsSync = "JetStream sync_always"
	}
	if !e.want["nats"] && !e.h.kn {
		return nil
	}
	if e.o.ha("nats") {
		var c *testsvc.NATSCluster
		if err := testsvc.Catch(func() { c = testsvc.StartNATSCluster(e.tb) }); err != nil {
			return fmt.Errorf("nats cluster: %w", err)
		}
		e.nats = &natsSite{cluster: c}
		fmt.Fprintf(errOut, "chaos: NATS JetStream cluster %s\n", c.ClientURLs())
	} else {
		if err := ns.start(); err != nil {
			return err
		}
		e.onCleanup(ns.shutdown)
	}
	nc, err := nats.Connect(e.nats.url(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return err
	}
	e.nc = nc
	e.onCleanup(nc.Close)
	return nil
}

// startSlot starts (and supervises) the i-th worker process of transport.
func (e *env) startSlot(transport string, i int, args []string) *slot {
	s := &slot{transport: transport, name: fmt.Sprintf("%s-%d", transport, i), args: args, done: make(chan struct{})}
	if e.stats != nil {
		s.stats = e.stats.process(s.name, transport)
	}
	e.slots = append(e.slots, s)
	go s.supervise(e.obs)
	return s
}

// startSlots starts o.workers processes of transport.
func (e *env) startSlots(transport string, args []string) {
	for i := 0; i < e.o.workers; i++ {
		e.startSlot(transport, i, args)
	}
}

// stopSlots stops every worker process (SIGTERM, then SIGKILL after 30 s).
func (e *env) stopSlots() {
	var wg sync.WaitGroup
	for _, s := range e.slots {
		wg.Add(1)
		go func() { defer wg.Done(); s.stop() }()
	}
	wg.Wait()
}

// hostPort returns the host:port of a postgres:// URL.
func hostPort(u string) (string, error) {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return "", err
	}
	return cfg.ConnConfig.Host + ":" + strconv.Itoa(int(cfg.ConnConfig.Port)), nil
}
