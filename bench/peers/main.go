// Command peers measures justonce's consumers beside what a user would use
// instead, on the same broker, the same Postgres and the same handler (one
// business row per event, 20 % duplicate deliveries), in two tables.
//
// Kafka:
//
//   - justonce: kafkainbox.Consumer (segmentio/kafka-go) with its defaults;
//   - justonce, franz-go: franzinbox.Consumer with its defaults;
//   - justonce, BatchSize 1: kafkainbox with batching off (one message, one
//     transaction), to show what batching brings;
//   - a hand-written inbox: INSERT the key as 'processing', run the
//     handler, UPDATE it to 'done', in one transaction, on a plain kafka-go
//     group reader;
//   - Watermill's Kafka subscriber with its Deduplicator middleware;
//   - Watermill's transactional PostgreSQL subscriber (the messages in a
//     Postgres table, the effect in the subscriber's transaction) with the
//     Deduplicator.
//
// NATS JetStream (an embedded server, or PEERS_NATS_URL):
//
//   - justonce, JetStream: natsinbox.Consumer with its defaults;
//   - the hand-written inbox on a JetStream pull consumer;
//   - Watermill's NATS subscriber in JetStream mode with the Deduplicator.
//
// Each peer consumes the same pre-produced stream in a child process. The
// throughput phase times the stream from the first effect to the last
// (database timestamps, so group joins are not counted), and counts what
// each event cost: round trips and statements to Postgres, the consumer's
// CPU time and its Postgres backends' (when Postgres runs on this
// machine); the crash phase SIGKILLs the child once mid-stream (after some
// but not all effects), restarts it, and counts the effects against the
// unique event IDs: lost = IDs without an effect, doubled = effects beyond
// one per ID; the failure phase makes the first attempt of one ID in 250
// fail.
//
//	go run . -events 20000
//
// Postgres and Kafka are found through JUSTONCE_TEST_POSTGRES_URL and
// JUSTONCE_TEST_KAFKA_BROKERS, or the repository's .services.env that
// `make services-up` writes. PEERS_EVENTS, PEERS_PARTITIONS and
// PEERS_ROUNDS set the defaults of -events, -partitions and -rounds.
// PEERS_PROFILE_DIR, when set, makes each throughput child write a CPU
// profile there (<peer>-<round>.pprof).
//
// Besides the tables it prints, a run writes its results, with a header
// that says where they come from (date, commit, machine, load average, Go,
// command and knobs), to docs/results/peers.md at the repository root; a
// run below the default -events or with a subset of the peers writes
// peers-draft.md there instead (ignored by git), marked as not meant to be
// read. -results (or PEERS_RESULTS) names another file.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/migrations"
)

type options struct {
	events     int
	dupPercent int
	partitions int
	rounds     int
	killAt     float64
	seed       uint64
	peers      []string
	timeout    time.Duration
	// faults: run the crash and failure phases after the throughput
	// rounds (-faults=false: throughput only, for profiling).
	faults bool
	keep   bool

	pgURL   string
	brokers []string
	natsURL string
}

func main() {
	log := func(err error) {
		fmt.Fprintln(os.Stderr, "peers:", err)
		os.Exit(1)
	}
	var o options
	var peerList string
	flag.IntVar(&o.events, "events", envInt("PEERS_EVENTS", defaultEvents), "events per peer and phase (duplicates included)")
	flag.IntVar(&o.dupPercent, "dup", 20, "percent of the events that are duplicates")
	flag.IntVar(&o.partitions, "partitions", envInt("PEERS_PARTITIONS", 4), "partitions of each Kafka topic")
	flag.IntVar(&o.rounds, "rounds", envInt("PEERS_ROUNDS", 1), "throughput rounds per peer (the median is reported)")
	flag.Float64Var(&o.killAt, "kill-at", 0.3, "SIGKILL the consumer once this fraction of the unique events has its effect")
	flag.Uint64Var(&o.seed, "seed", 1, "seed of the workload (the same stream for every peer)")
	flag.StringVar(&peerList, "peers", strings.Join(slugs(), ","), "peers to run")
	flag.DurationVar(&o.timeout, "timeout", 5*time.Minute, "longest wait of one phase of one peer")
	flag.BoolVar(&o.faults, "faults", true, "run the crash and failure phases (false: the throughput rounds only)")
	flag.BoolVar(&o.keep, "keep", false, "keep the schemas and topics")
	flag.Parse()
	if isChild() {
		if err := runChild(); err != nil {
			log(err)
		}
		return
	}
	var err error
	if o.pgURL, o.brokers, err = services(); err != nil {
		log(err)
	}
	o.peers = strings.Split(peerList, ",")
	if o.events < 100 || o.partitions < 1 || o.rounds < 1 || o.killAt <= 0 || o.killAt >= 1 || o.dupPercent < 0 || o.dupPercent > 50 {
		log(errors.New("need -events >= 100, -partitions >= 1, -rounds >= 1, 0 < -kill-at < 1, 0 <= -dup <= 50"))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		log(err)
	}
}

func slugs() []string {
	var s []string
	for _, p := range peers {
		s = append(s, p.slug)
	}
	return s
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// services finds Postgres and Kafka: the environment, else the nearest
// .services.env up from the working directory.
func services() (pgURL string, brokers []string, err error) {
	pgURL, kafkaAddr := os.Getenv("JUSTONCE_TEST_POSTGRES_URL"), os.Getenv("JUSTONCE_TEST_KAFKA_BROKERS")
	if pgURL == "" || kafkaAddr == "" {
		dir, _ := os.Getwd()
		for ; ; dir = filepath.Dir(dir) {
			if f, err := os.Open(filepath.Join(dir, ".services.env")); err == nil {
				s := bufio.NewScanner(f)
				for s.Scan() {
					k, v, _ := strings.Cut(s.Text(), "=")
					switch {
					case k == "JUSTONCE_TEST_POSTGRES_URL" && pgURL == "":
						pgURL = v
					case k == "JUSTONCE_TEST_KAFKA_BROKERS" && kafkaAddr == "":
						kafkaAddr = v
					}
				}
				f.Close()
				break
			}
			if filepath.Dir(dir) == dir {
				break
			}
		}
	}
	if pgURL == "" || kafkaAddr == "" {
		return "", nil, errors.New("set JUSTONCE_TEST_POSTGRES_URL and JUSTONCE_TEST_KAFKA_BROKERS (`make services-up` starts both and writes .services.env)")
	}
	return pgURL, strings.Split(kafkaAddr, ","), nil
}

// poolConfig is the configuration of a pool on schema: its search_path,
// and its application name (the consumers' backends are found by it).
func poolConfig(pgURL, schema string, maxConns int32) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = schema
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	return cfg, nil
}

// A consumer process is this program (or its test binary) started with
// PEERS_CHILD naming the peer and PEERS_NAME its schema, topic and group.
func isChild() bool { return os.Getenv("PEERS_CHILD") != "" }

func runChild() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pgURL, brokers, err := services()
	if err != nil {
		return err
	}
	name := os.Getenv("PEERS_NAME")
	cfg, err := poolConfig(pgURL, name, 0)
	if err != nil {
		return err
	}
	finish, err := childInstruments(cfg)
	if err != nil {
		return err
	}
	defer finish()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	topic := strings.ReplaceAll(name, "_", "-")
	fail := &failOnce{on: os.Getenv("PEERS_FAIL") != "", failed: map[string]bool{}}
	return consume(ctx, childArgs{peer: os.Getenv("PEERS_CHILD"), topic: topic, group: topic, brokers: brokers,
		natsURL: os.Getenv("PEERS_NATS_URL"), pool: pool, fail: fail})
}

// lane is one peer's setup for one phase: its schema, topic (or stream)
// and group (or durable).
type lane struct {
	o      options
	p      peer
	name   string // schema, topic and group
	pool   *pgxpool.Pool
	unique int
	cmd    *exec.Cmd
	exited chan error
	env    []string // extra environment of the consumer
}

func newLane(ctx context.Context, o options, runID string, p peer, phase string, events []event, unique int) (*lane, error) {
	l := &lane{o: o, p: p, unique: unique}
	l.name = fmt.Sprintf("peers_%s_%s_%s", runID, p.slug, phase)
	admin, err := pgx.Connect(ctx, o.pgURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{l.name}.Sanitize()); err != nil {
		return nil, err
	}
	cfg, err := poolConfig(o.pgURL, l.name, 4)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "peers orchestrator"
	if l.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	if _, err := l.pool.Exec(ctx, `
		CREATE TABLE effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
		CREATE TABLE idempotency_keys (
			key          text PRIMARY KEY,
			status       text NOT NULL CHECK (status IN ('processing', 'done', 'failed')),
			created_at   timestamptz NOT NULL DEFAULT now(),
			completed_at timestamptz
		)`); err != nil {
		return nil, err
	}
	if _, err := migrations.New(l.pool, migrations.Config{Schema: l.name}).Up(ctx); err != nil {
		return nil, err
	}
	switch p.broker {
	case brokerSQL:
		return l, produceSQL(ctx, l.pool, l.topic(), events)
	case brokerNATS:
		return l, produceNATS(ctx, o.natsURL, l.topic(), events)
	}
	if err := createTopic(o.brokers, l.topic(), o.partitions); err != nil {
		return nil, err
	}
	return l, produceKafka(ctx, o.brokers, l.topic(), events)
}

func (l *lane) topic() string { return strings.ReplaceAll(l.name, "_", "-") }

func (l *lane) start() error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	l.cmd = exec.Command(exe)
	l.cmd.Env = append(os.Environ(), "PEERS_CHILD="+l.p.slug, "PEERS_NAME="+l.name, "PEERS_NATS_URL="+l.o.natsURL,
		"JUSTONCE_TEST_POSTGRES_URL="+l.o.pgURL, "JUSTONCE_TEST_KAFKA_BROKERS="+strings.Join(l.o.brokers, ","))
	l.cmd.Env = append(l.cmd.Env, l.env...)
	l.cmd.Stdout, l.cmd.Stderr = os.Stderr, os.Stderr
	if err := l.cmd.Start(); err != nil {
		return err
	}
	l.exited = make(chan error, 1)
	go func(c *exec.Cmd, done chan error) { done <- c.Wait() }(l.cmd, l.exited)
	return nil
}

// kill SIGKILLs the consumer and waits for it to be gone.
func (l *lane) kill() {
	_ = l.cmd.Process.Kill()
	<-l.exited
}

// stop asks the consumer to stop (SIGTERM) and waits up to a minute.
func (l *lane) stop() error {
	_ = l.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-l.exited:
		return err
	case <-time.After(time.Minute):
		l.kill()
		return fmt.Errorf("%s: did not stop within a minute of SIGTERM; killed", l.p.name)
	}
}

func (l *lane) counts(ctx context.Context) (total, distinct int, err error) {
	err = l.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effects`).Scan(&total, &distinct)
	return total, distinct, err
}

// waitFor looks at the effects every so often until cond holds, the
// child exits, or the phase's deadline passes.
func (l *lane) waitFor(ctx context.Context, what string, every time.Duration, cond func(total, distinct int) bool) error {
	deadline := time.Now().Add(l.o.timeout)
	for {
		total, distinct, err := l.counts(ctx)
		if err != nil {
			return err
		}
		if cond(total, distinct) {
			return nil
		}
		select {
		case err := <-l.exited:
			l.exited <- err
			return fmt.Errorf("%s: consumer exited (%v) before %s (%d effects, %d IDs)", l.p.name, err, what, total, distinct)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no %s after %v (%d effects, %d of %d IDs)", l.p.name, what, l.o.timeout, total, distinct, l.unique)
		}
	}
}

// settle waits until every ID has an effect and the count has not moved
// for two seconds (redeliveries after a restart come first in each
// partition, so by then they ran), or until all but at most missing IDs
// have one and the count has not moved for ten seconds. It gives up at the
// deadline: what is missing then is lost.
func (l *lane) settle(ctx context.Context, missing int) (total, distinct int, err error) {
	deadline := time.Now().Add(l.o.timeout)
	last, since := -1, time.Now()
	for {
		if total, distinct, err = l.counts(ctx); err != nil {
			return 0, 0, err
		}
		if total != last {
			last, since = total, time.Now()
		}
		if distinct == l.unique && time.Since(since) >= 2*time.Second {
			return total, distinct, nil
		}
		if distinct >= l.unique-missing && time.Since(since) >= 10*time.Second {
			return total, distinct, nil
		}
		if time.Now().After(deadline) {
			return total, distinct, nil
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (l *lane) cleanUp(ctx context.Context) {
	if l.pool != nil {
		l.pool.Close()
	}
	if l.o.keep {
		return
	}
	if admin, err := pgx.Connect(ctx, l.o.pgURL); err == nil {
		_, _ = admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{l.name}.Sanitize()+" CASCADE")
		_ = admin.Close(ctx)
	}
	switch l.p.broker {
	case brokerKafka:
		if conn, err := kafka.Dial("tcp", l.o.brokers[0]); err == nil {
			_ = conn.DeleteTopics(l.topic())
			_ = conn.Close()
		}
	case brokerNATS:
		deleteStream(ctx, l.o.natsURL, l.topic())
	}
}

// throughput runs one peer over the whole stream and returns events/s over
// the span from its first effect to its last, and what the events cost.
func throughput(ctx context.Context, o options, runID string, round int, p peer, events []event, unique int) (float64, cost, error) {
	var c cost
	l, err := newLane(ctx, o, runID, p, "t"+strconv.Itoa(round), events, unique)
	if l != nil {
		defer l.cleanUp(context.WithoutCancel(ctx))
	}
	if err != nil {
		return 0, c, err
	}
	stats, err := os.CreateTemp("", "peers-stats-")
	if err != nil {
		return 0, c, err
	}
	stats.Close()
	defer os.Remove(stats.Name())
	l.env = append(l.env, "PEERS_STATS="+stats.Name())
	if dir := os.Getenv("PEERS_PROFILE_DIR"); dir != "" {
		l.env = append(l.env, "PEERS_CPUPROFILE="+filepath.Join(dir, fmt.Sprintf("%s-%d.pprof", p.slug, round+1)))
	}
	walStart, walErr := walLSN(ctx, l.pool)
	if err := l.start(); err != nil {
		return 0, c, err
	}
	err = l.waitFor(ctx, "effect for every ID", 50*time.Millisecond, func(_, distinct int) bool { return distinct == unique })
	if err == nil {
		// What the run cost up to its last effect, before the consumer
		// stops.
		c.clientCPU, _ = procCPU(l.cmd.Process.Pid)
		c.serverCPU, c.serverSeen = backendsCPU(ctx, l.pool, l.name)
		if walEnd, err := walLSN(ctx, l.pool); err == nil && walErr == nil {
			c.walBytes = walEnd - walStart
		}
	}
	stopErr := l.stop()
	if err != nil {
		return 0, c, err
	}
	if stopErr != nil {
		fmt.Fprintln(os.Stderr, "peers:", stopErr)
	}
	if b, err := os.ReadFile(stats.Name()); err == nil && len(b) > 0 {
		if err := json.Unmarshal(b, &c.child); err != nil {
			return 0, c, fmt.Errorf("%s: stats: %w", p.name, err)
		}
	}
	var span float64
	var total int
	if err := l.pool.QueryRow(ctx, `SELECT count(*), extract(epoch FROM max(at) - min(at))::float8 FROM effects`).Scan(&total, &span); err != nil {
		return 0, c, err
	}
	if total != unique {
		return 0, c, fmt.Errorf("%s: %d effects for %d IDs in a run without faults", p.name, total, unique)
	}
	return float64(len(events)) / span, c, nil
}

// walLSN is the server's current WAL position, in bytes.
func walLSN(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn() - '0/0'::pg_lsn`).Scan(&n)
	return n, err
}

// crashResult is what one SIGKILL did to one peer.
type crashResult struct {
	atKill          int // effects when the consumer was killed
	atRisk          int // deliveries after the restart of IDs that had their effect
	lost, doubled   int
	total, distinct int
}

func (r crashResult) riskText() string {
	return fmt.Sprintf("%d deliveries after the restart of IDs already done", r.atRisk)
}

// crash runs one peer, SIGKILLs it once mid-stream, restarts it, and counts.
func crash(ctx context.Context, o options, runID string, p peer, events []event, unique int) (crashResult, error) {
	var r crashResult
	l, err := newLane(ctx, o, runID, p, "k", events, unique)
	if l != nil {
		defer l.cleanUp(context.WithoutCancel(ctx))
	}
	if err != nil {
		return r, err
	}
	if err := l.start(); err != nil {
		return r, err
	}
	threshold := int(o.killAt * float64(unique))
	// Looked at often: a fast consumer of a small stream must not finish
	// it between two looks.
	if err := l.waitFor(ctx, fmt.Sprintf("%d effects", threshold), 2*time.Millisecond, func(total, _ int) bool { return total >= threshold }); err != nil {
		l.kill()
		return r, err
	}
	l.kill()
	if r.atKill, _, err = l.counts(ctx); err != nil {
		return r, err
	}
	// Work was in flight: the stream was neither untouched nor finished.
	if r.atKill == 0 || r.atKill >= unique {
		return r, fmt.Errorf("%s: killed with %d of %d effects: not mid-stream", p.name, r.atKill, unique)
	}
	if p.broker == brokerSQL {
		// The messages past the group's acked (transaction ID, offset) whose
		// ID has an effect.
		q := fmt.Sprintf(`SELECT count(*) FROM %s m
			LEFT JOIN %s o ON o.consumer_group = $1
			WHERE (o.consumer_group IS NULL OR (m.transaction_id, m."offset") > (o.last_processed_transaction_id, o.offset_acked))
			  AND EXISTS (SELECT 1 FROM effects e WHERE e.event_id = m.uuid)`,
			pgx.Identifier{"watermill_" + l.topic()}.Sanitize(), pgx.Identifier{"watermill_offsets_" + l.topic()}.Sanitize())
		if err := l.pool.QueryRow(ctx, q, l.topic()).Scan(&r.atRisk); err != nil {
			return r, fmt.Errorf("count watermill-sql deliveries past the acked offset: %w", err)
		}
	} else {
		done := map[string]bool{}
		rows, err := l.pool.Query(ctx, `SELECT DISTINCT event_id FROM effects`)
		if err != nil {
			return r, err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return r, err
		}
		for _, id := range ids {
			done[id] = true
		}
		if p.broker == brokerNATS {
			r.atRisk, err = atRiskNATS(ctx, o.natsURL, l.topic(), l.topic(), events, done)
		} else {
			r.atRisk, err = atRisk(ctx, o.brokers, l.topic(), o.partitions, events, done)
		}
		if err != nil {
			return r, err
		}
	}
	if err := l.start(); err != nil {
		return r, err
	}
	r.total, r.distinct, err = l.settle(ctx, 0)
	if stopErr := l.stop(); stopErr != nil {
		fmt.Fprintln(os.Stderr, "peers:", stopErr)
	}
	if err != nil {
		return r, err
	}
	r.lost, r.doubled = unique-r.distinct, r.total-r.distinct
	return r, nil
}

// failure runs one peer over the stream with the first attempt of one ID in
// 250 failing (failing), and returns how many IDs lost their effect and how
// many effects doubled.
func failure(ctx context.Context, o options, runID string, p peer, events []event, unique int) (lost, doubled, failed int, err error) {
	failed = countFailing(events)
	l, err := newLane(ctx, o, runID, p, "f", events, unique)
	if l != nil {
		defer l.cleanUp(context.WithoutCancel(ctx))
	}
	if err != nil {
		return 0, 0, failed, err
	}
	l.env = []string{"PEERS_FAIL=1"}
	if err := l.start(); err != nil {
		return 0, 0, failed, err
	}
	total, distinct, err := l.settle(ctx, failed)
	if stopErr := l.stop(); stopErr != nil {
		fmt.Fprintln(os.Stderr, "peers:", stopErr)
	}
	return unique - distinct, total - distinct, failed, err
}

// countFailing is the number of distinct IDs that fail once.
func countFailing(events []event) int {
	seen := map[string]bool{}
	for _, e := range events {
		if failing(e.ID) {
			seen[e.ID] = true
		}
	}
	return len(seen)
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// result is one peer's line of the tables.
type result struct {
	peer  peer
	rates []float64 // events/s, one per round
	costs []cost    // one per round
	crash crashResult
	// failure phase: IDs without an effect, effects beyond one per ID
	failLost, failDoubled int
}

// selected returns the peers o names, in the order of the tables.
func selected(o options) []peer {
	var ps []peer
	for _, p := range peers {
		if slices.Contains(o.peers, p.slug) {
			ps = append(ps, p)
		}
	}
	return ps
}

// checkSelection refuses names that are no peer's, and a table without
// its first peer (justonce's front), against which its ratios are taken.
func checkSelection(o options) error {
	for _, s := range o.peers {
		if _, ok := peerNamed(s); !ok {
			return fmt.Errorf("-peers: unknown peer %q (known: %s)", s, strings.Join(slugs(), ","))
		}
	}
	ps := selected(o)
	for _, p := range ps {
		if base := tableBase(p.table); !slices.ContainsFunc(ps, func(q peer) bool { return q.slug == base.slug }) {
			return fmt.Errorf("-peers must include %s: the %s table's ratios are against it", base.slug, p.table)
		}
	}
	return nil
}

// tableBase is the first peer of table: justonce's front for its broker.
func tableBase(table string) peer {
	for _, p := range peers {
		if p.table == table {
			return p
		}
	}
	panic("no peer in table " + table)
}

// measure runs the throughput rounds, then the crash phase, then the
// failure phase, of each peer.
func measure(ctx context.Context, o options) ([]result, int, error) {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	runID := hex.EncodeToString(b)
	events, unique := workload(o.events, o.dupPercent, o.seed)
	var res []result
	for _, p := range selected(o) {
		res = append(res, result{peer: p})
	}
	fmt.Fprintf(os.Stderr, "peers: %d events (%d unique IDs, %d %% duplicates), %d partitions, %d round(s), run %s\n",
		len(events), unique, o.dupPercent, o.partitions, o.rounds, runID)
	for round := range o.rounds {
		order := make([]int, len(res))
		for i := range order {
			order[i] = i
			if round%2 == 1 {
				order[i] = len(res) - 1 - i // alternate who runs first on a busy machine
			}
		}
		for _, i := range order {
			rate, c, err := throughput(ctx, o, runID, round, res[i].peer, events, unique)
			if err != nil {
				return nil, 0, fmt.Errorf("throughput: %w", err)
			}
			pe := c.per(len(events))
			fmt.Fprintf(os.Stderr, "peers: round %d %-30s %8.0f events/s; per event: %.2f round trips, %.2f statements, client %.0f µs, server %.0f µs, WAL %.0f B (server-wide)\n",
				round+1, res[i].peer.name, rate, pe.roundTrips, pe.statements, pe.clientUS, pe.serverUS, pe.walBytes)
			res[i].rates = append(res[i].rates, rate)
			res[i].costs = append(res[i].costs, c)
		}
	}
	if !o.faults {
		return res, unique, nil
	}
	for i := range res {
		r, err := crash(ctx, o, runID, res[i].peer, events, unique)
		if err != nil {
			return nil, 0, fmt.Errorf("crash: %w", err)
		}
		fmt.Fprintf(os.Stderr, "peers: crash %-30s SIGKILLed at %d of %d effects, %s; after the restart %d effects for %d IDs\n",
			res[i].peer.name, r.atKill, unique, r.riskText(), r.total, r.distinct)
		res[i].crash = r
	}
	for i := range res {
		lost, doubled, failed, err := failure(ctx, o, runID, res[i].peer, events, unique)
		if err != nil {
			return nil, 0, fmt.Errorf("failure: %w", err)
		}
		fmt.Fprintf(os.Stderr, "peers: failure %-30s %d IDs failed their first attempt: %d lost, %d doubled\n", res[i].peer.name, failed, lost, doubled)
		res[i].failLost, res[i].failDoubled = lost, doubled
	}
	return res, unique, nil
}

// check returns an error when a peer lost an effect to the crash, doubled
// one after a failure, or, claiming exactly once, lost or doubled one
// anywhere.
func check(res []result) error {
	var errs []error
	for _, r := range res {
		if r.crash.lost > 0 {
			errs = append(errs, fmt.Errorf("%s lost %d effects", r.peer.name, r.crash.lost))
		}
		if r.peer.mayDouble == "" && r.crash.doubled > 0 {
			errs = append(errs, fmt.Errorf("%s doubled %d effects", r.peer.name, r.crash.doubled))
		}
		if r.peer.mayLose == "" && r.failLost > 0 {
			errs = append(errs, fmt.Errorf("%s lost %d effects of handlers that failed once", r.peer.name, r.failLost))
		}
		if r.failDoubled > 0 {
			errs = append(errs, fmt.Errorf("%s doubled %d effects of handlers that failed once", r.peer.name, r.failDoubled))
		}
	}
	return errors.Join(errs...)
}

func run(ctx context.Context, o options) error {
	if err := checkSelection(o); err != nil {
		return err
	}
	if slices.ContainsFunc(selected(o), func(p peer) bool { return p.broker == brokerNATS }) && o.natsURL == "" {
		url, stop, err := startNATS()
		if err != nil {
			return err
		}
		defer stop()
		o.natsURL = url
	}
	header, resultsFile := beginResults(o)
	res, unique, err := measure(ctx, o)
	if err != nil {
		return err
	}
	checkErr := check(res)
	fmt.Println()
	for _, t := range resultsTables(o, res, unique, checkErr) {
		_ = t.Markdown(os.Stdout)
	}
	return errors.Join(checkErr, writeResults(header, resultsFile, o, res, unique, checkErr))
}
