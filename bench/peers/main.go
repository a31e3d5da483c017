// Command peers measures justonce's Kafka consumer beside what a user would
// use instead, on the same broker, the same Postgres and the same handler
// (one business row per event, 20 % duplicate deliveries):
//
//   - justonce: kafkainbox.Consumer with its defaults;
//   - a hand-written inbox: INSERT the key as 'processing', run the
//     handler, UPDATE it to 'done', in one transaction, on a plain kafka-go
//     group reader;
//   - Watermill's Kafka subscriber with its Deduplicator middleware;
//   - Watermill's transactional PostgreSQL subscriber (the messages in a
//     Postgres table, the effect in the subscriber's transaction) with the
//     Deduplicator.
//
// Each peer consumes the same pre-produced stream in a child process. The
// throughput phase times the stream from the first effect to the last
// (database timestamps, so group joins are not counted); the crash phase
// SIGKILLs the child once mid-stream (after some but not all effects),
// restarts it, and counts the effects against the unique event IDs: lost =
// IDs without an effect, doubled = effects beyond one per ID.
//
//	go run . -events 20000
//
// Postgres and Kafka are found through JUSTONCE_TEST_POSTGRES_URL and
// JUSTONCE_TEST_KAFKA_BROKERS, or the repository's .services.env that
// `make services-up` writes. PEERS_EVENTS, PEERS_PARTITIONS and
// PEERS_ROUNDS set the defaults of -events, -partitions and -rounds.
//
// Besides the table it prints, a run writes its results, with a header
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
	"text/tabwriter"
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
	keep       bool

	pgURL   string
	brokers []string
}

func main() {
	log := func(err error) {
		fmt.Fprintln(os.Stderr, "peers:", err)
		os.Exit(1)
	}
	var o options
	var peers string
	flag.IntVar(&o.events, "events", envInt("PEERS_EVENTS", defaultEvents), "events per peer and phase (duplicates included)")
	flag.IntVar(&o.dupPercent, "dup", 20, "percent of the events that are duplicates")
	flag.IntVar(&o.partitions, "partitions", envInt("PEERS_PARTITIONS", 4), "partitions of each Kafka topic")
	flag.IntVar(&o.rounds, "rounds", envInt("PEERS_ROUNDS", 1), "throughput rounds per peer (the median is reported)")
	flag.Float64Var(&o.killAt, "kill-at", 0.3, "SIGKILL the consumer once this fraction of the unique events has its effect")
	flag.Uint64Var(&o.seed, "seed", 1, "seed of the workload (the same stream for every peer)")
	flag.StringVar(&peers, "peers", strings.Join(slugs(), ","), "peers to run")
	flag.DurationVar(&o.timeout, "timeout", 5*time.Minute, "longest wait of one phase of one peer")
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
	o.peers = strings.Split(peers, ",")
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
	for _, p := range peerNames {
		s = append(s, peerSlug[p])
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

func openPool(ctx context.Context, pgURL, schema string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	return pgxpool.NewWithConfig(ctx, cfg)
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
	pool, err := openPool(ctx, pgURL, name, 0)
	if err != nil {
		return err
	}
	defer pool.Close()
	topic := strings.ReplaceAll(name, "_", "-")
	fail := &failOnce{on: os.Getenv("PEERS_FAIL") != "", failed: map[string]bool{}}
	return consume(ctx, childArgs{peer: os.Getenv("PEERS_CHILD"), topic: topic, group: topic, brokers: brokers, pool: pool, fail: fail})
}

// lane is one peer's setup for one phase: its schema, topic and group.
type lane struct {
	o          options
	peer, slug string
	name       string // schema, topic and group
	pool       *pgxpool.Pool
	unique     int
	cmd        *exec.Cmd
	exited     chan error
	env        []string // extra environment of the consumer
}

func newLane(ctx context.Context, o options, runID, peer, phase string, events []event, unique int) (*lane, error) {
	l := &lane{o: o, peer: peer, slug: peerSlug[peer], unique: unique}
	l.name = fmt.Sprintf("peers_%s_%s_%s", runID, l.slug, phase)
	admin, err := pgx.Connect(ctx, o.pgURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{l.name}.Sanitize()); err != nil {
		return nil, err
	}
	if l.pool, err = openPool(ctx, o.pgURL, l.name, 4); err != nil {
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
	if l.slug == "watermillsql" {
		return l, produceSQL(ctx, l.pool, l.topic(), events)
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
	l.cmd.Env = append(os.Environ(), "PEERS_CHILD="+l.slug, "PEERS_NAME="+l.name,
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
		return fmt.Errorf("%s: did not stop within a minute of SIGTERM; killed", l.peer)
	}
}

func (l *lane) counts(ctx context.Context) (total, distinct int, err error) {
	err = l.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effects`).Scan(&total, &distinct)
	return total, distinct, err
}

// waitFor polls the effects until cond holds, the child exits, or the
// phase's deadline passes.
func (l *lane) waitFor(ctx context.Context, what string, cond func(total, distinct int) bool) error {
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
			return fmt.Errorf("%s: consumer exited (%v) before %s (%d effects, %d IDs)", l.peer, err, what, total, distinct)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no %s after %v (%d effects, %d of %d IDs)", l.peer, what, l.o.timeout, total, distinct, l.unique)
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
	if l.slug != "watermillsql" {
		if conn, err := kafka.Dial("tcp", l.o.brokers[0]); err == nil {
			_ = conn.DeleteTopics(l.topic())
			_ = conn.Close()
		}
	}
}

// throughput runs one peer over the whole stream and returns events/s over
// the span from its first effect to its last.
func throughput(ctx context.Context, o options, runID string, round int, peer string, events []event, unique int) (float64, error) {
	l, err := newLane(ctx, o, runID, peer, "t"+strconv.Itoa(round), events, unique)
	if l != nil {
		defer l.cleanUp(context.WithoutCancel(ctx))
	}
	if err != nil {
		return 0, err
	}
	if err := l.start(); err != nil {
		return 0, err
	}
	err = l.waitFor(ctx, "effect for every ID", func(_, distinct int) bool { return distinct == unique })
	stopErr := l.stop()
	if err != nil {
		return 0, err
	}
	if stopErr != nil {
		fmt.Fprintln(os.Stderr, "peers:", stopErr)
	}
	var span float64
	var total int
	if err := l.pool.QueryRow(ctx, `SELECT count(*), extract(epoch FROM max(at) - min(at))::float8 FROM effects`).Scan(&total, &span); err != nil {
		return 0, err
	}
	if total != unique {
		return 0, fmt.Errorf("%s: %d effects for %d IDs in a run without faults", peer, total, unique)
	}
	return float64(len(events)) / span, nil
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
func crash(ctx context.Context, o options, runID, peer string, events []event, unique int) (crashResult, error) {
	var r crashResult
	l, err := newLane(ctx, o, runID, peer, "k", events, unique)
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
	if err := l.waitFor(ctx, fmt.Sprintf("%d effects", threshold), func(total, _ int) bool { return total >= threshold }); err != nil {
		l.kill()
		return r, err
	}
	l.kill()
	if r.atKill, _, err = l.counts(ctx); err != nil {
		return r, err
	}
	// Work was in flight: the stream was neither untouched nor finished.
	if r.atKill == 0 || r.atKill >= unique {
		return r, fmt.Errorf("%s: killed with %d of %d effects: not mid-stream", peer, r.atKill, unique)
	}
	if l.slug == "watermillsql" {
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
		if r.atRisk, err = atRisk(ctx, o.brokers, l.topic(), o.partitions, events, done); err != nil {
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
func failure(ctx context.Context, o options, runID, peer string, events []event, unique int) (lost, doubled, failed int, err error) {
	failed = countFailing(events)
	l, err := newLane(ctx, o, runID, peer, "f", events, unique)
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

// result is one peer's line of the table.
type result struct {
	peer  string
	rates []float64 // events/s, one per round
	crash crashResult
	// failure phase: IDs without an effect, effects beyond one per ID
	failLost, failDoubled int
}

// measure runs the throughput rounds, then the crash phase, of each peer.
func measure(ctx context.Context, o options) ([]result, int, error) {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	runID := hex.EncodeToString(b)
	events, unique := workload(o.events, o.dupPercent, o.seed)
	var res []result
	for _, p := range peerNames {
		if slices.Contains(o.peers, peerSlug[p]) {
			res = append(res, result{peer: p})
		}
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
			rate, err := throughput(ctx, o, runID, round, res[i].peer, events, unique)
			if err != nil {
				return nil, 0, fmt.Errorf("throughput: %w", err)
			}
			fmt.Fprintf(os.Stderr, "peers: round %d %-26s %8.0f events/s\n", round+1, res[i].peer, rate)
			res[i].rates = append(res[i].rates, rate)
		}
	}
	for i := range res {
		r, err := crash(ctx, o, runID, res[i].peer, events, unique)
		if err != nil {
			return nil, 0, fmt.Errorf("crash: %w", err)
		}
		fmt.Fprintf(os.Stderr, "peers: crash %-26s SIGKILLed at %d of %d effects, %s; after the restart %d effects for %d IDs\n",
			res[i].peer, r.atKill, unique, r.riskText(), r.total, r.distinct)
		res[i].crash = r
	}
	for i := range res {
		lost, doubled, failed, err := failure(ctx, o, runID, res[i].peer, events, unique)
		if err != nil {
			return nil, 0, fmt.Errorf("failure: %w", err)
		}
		fmt.Fprintf(os.Stderr, "peers: failure %-26s %d IDs failed their first attempt: %d lost, %d doubled\n", res[i].peer, failed, lost, doubled)
		res[i].failLost, res[i].failDoubled = lost, doubled
	}
	return res, unique, nil
}

// mayDouble says which peers may double an effect after a crash: those
// whose dedupe lives in the consumer's memory.
var mayDouble = map[string]string{
	peerWatermill:   "Deduplicator's memory is per process: a restart forgets it, and offsets are committed after the effect (every 1 s)",
	peerWatermillSQ: "offsets commit with the effect, but duplicates of events from before the restart are not in the new process's Deduplicator",
}

// mayLose says which peers may lose an effect when a handler fails once:
// those whose dedupe records the ID before the handler runs.
var mayLose = map[string]string{
	peerWatermill:   "the Deduplicator records the ID before the handler runs: the redelivery of a failed message is dropped as a duplicate",
	peerWatermillSQ: "the same Deduplicator: a nacked message comes again and is dropped",
}

// check returns an error when a peer lost an effect, or one that must not
// double doubled one.
func check(res []result) error {
	var errs []error
	for _, r := range res {
		if r.crash.lost > 0 {
			errs = append(errs, fmt.Errorf("%s lost %d effects", r.peer, r.crash.lost))
		}
		if _, ok := mayDouble[r.peer]; !ok && r.crash.doubled > 0 {
			errs = append(errs, fmt.Errorf("%s doubled %d effects", r.peer, r.crash.doubled))
		}
		if _, ok := mayLose[r.peer]; !ok && r.failLost > 0 {
			errs = append(errs, fmt.Errorf("%s lost %d effects of handlers that failed once", r.peer, r.failLost))
		}
		if r.failDoubled > 0 {
			errs = append(errs, fmt.Errorf("%s doubled %d effects of handlers that failed once", r.peer, r.failDoubled))
		}
	}
	return errors.Join(errs...)
}

func run(ctx context.Context, o options) error {
	if !slices.Contains(o.peers, peerSlug[peerJustonce]) {
		return errors.New("-peers must include justonce: the ratios are against it")
	}
	header, resultsFile := beginResults(o)
	res, unique, err := measure(ctx, o)
	if err != nil {
		return err
	}
	base := median(res[0].rates)
	events, _ := workload(o.events, o.dupPercent, o.seed)
	fmt.Printf("\n%d events per peer (%d unique IDs, %d %% duplicates), %d Kafka partitions, one business row per event; median of %d round(s)\n",
		o.events, unique, o.dupPercent, o.partitions, o.rounds)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "peer\tevents/s\trounds' range\tvs justonce\tSIGKILLed at\tdone, read again\tlost\tdoubled\tlost after 1 failure")
	for _, r := range res {
		rate := median(r.rates)
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f–%.0f\t%.2f×\t%d/%d effects\t%d\t%d\t%d\t%d/%d\n", r.peer, rate, slices.Min(r.rates), slices.Max(r.rates), rate/base, r.crash.atKill, unique, r.crash.atRisk, r.crash.lost, r.crash.doubled, r.failLost, countFailing(events))
	}
	_ = tw.Flush()
	fmt.Println("SIGKILLed at: effects when the consumer was killed. done, read again: deliveries to the restarted consumer")
	fmt.Println("(past the committed offsets) of IDs that had their effect: redeliveries and later duplicates.")
	fmt.Println("lost after 1 failure: a run without a crash in which one ID in 250 fails its first attempt (then succeeds)")
	for _, r := range res[1:] {
		fmt.Printf("justonce / %s: %.2f×\n", r.peer, base/median(r.rates))
	}
	for _, r := range res {
		if why, ok := mayDouble[r.peer]; ok {
			fmt.Printf("%s may double: %s\n", r.peer, why)
		}
		if why, ok := mayLose[r.peer]; ok {
			fmt.Printf("%s may lose: %s\n", r.peer, why)
		}
	}
	checkErr := check(res)
	return errors.Join(checkErr, writeResults(header, resultsFile, o, res, unique, checkErr))
}
