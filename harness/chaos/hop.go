package main

// Two-hop pipelines: an event's effect happens one service further on,
// carried by the transactional outbox.
//
//	kafka>nats  Kafka → A (kafkainbox: inbox + outbox.Add of one NATS
//	            message per event) → relay → JetStream → B (natsinbox:
//	            inbox, one effect row per event)
//	http>kafka  HTTP clients retrying with an Idempotency-Key → A (the
//	            HTTP bridge; the handler adds one Kafka message; A runs a
//	            relay in-process too) → relay → Kafka → B (kafkainbox: inbox,
//	            one effect row per key)
//
// A, B and the relays are child processes like the consumers, SIGKILLed
// under the same fault matrix (and the relays on their own with
// -relay-kills). The verdict is on B's effects, keyed by the source event's
// ID: one effect per unique source ID, none lost, none doubled.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// The pipelines, as named in the summary and in effects.transport.
const (
	pipeKN = "kafka>nats"
	pipeHK = "http>kafka"
)

// Worker roles of the pipelines (worker -transport ...).
const (
	roleKNA   = "hop-kn-a" // kafkainbox consumer, adds a NATS message per event
	roleKNB   = "hop-kn-b" // natsinbox consumer, the effect
	roleHKA   = "hop-hk-a" // HTTP bridge, adds a Kafka message per key; runs a relay
	roleHKB   = "hop-hk-b" // kafkainbox consumer, the effect
	roleRelay = "relay"    // the outbox relay alone
)

const (
	hopSubject   = "chaos.hop"
	hopStream    = "CHAOSHOP"
	headerSource = "chaos-source"
	// headerRun names the run of A's handler that added the message: a
	// message of a run whose transaction rolled back must never be
	// published, so every message of one source carries one run.
	headerRun = "chaos-run"
)

// relayRole reports whether processes of role run a relay: -relay-kills
// picks among them.
func relayRole(role string) bool { return role == roleRelay || role == roleHKA }

// onceKind maps a permanent hostile kind to its intermittent twin: in a
// pipeline every source event must end with its effect at B, and A's
// transaction rolled back (swallowed error, deferred constraint at COMMIT,
// panic) must take its outbox message with it.
func onceKind(k hostileKind) hostileKind {
	switch k {
	case swallowAlways:
		return swallowOnce
	case deferredAlways:
		return deferredOnce
	case panicAlways:
		return panicOnce
	}
	return k
}

// hopArgs is one pipeline worker: its flags and what it opened.
type hopArgs struct {
	role, name     string
	brokers, topic string // source topic (kn-a), hop topic (hk-a publishes to it, hk-b reads it)
	natsURL        string
	listen         string // hk-a
	relay          bool   // run a relay in this process too
	batch, every   int
	slowFor        time.Duration
	relayBatch     int
	relayPoll      time.Duration
	kafkaPub       string // pubKafkaGo or pubFranzGo
	hostileInA     bool
	ledger         *inbox.Ledger
	pool           *pgxpool.Pool
	report         func(string)
	pc             consumer.Config
	errLog         *slog.Logger
	natsConn       *nats.Conn
	natsConnErr    error
	natsOnce       sync.Once
	relays         sync.WaitGroup
	outboxInitOnce sync.Once
	outboxInst     *outbox.Outbox
	outboxErr      error
	stats          *workerStats // a soak run's measures (nil: off)
}

func (a *hopArgs) nc() (*nats.Conn, error) {
	a.natsOnce.Do(func() {
		a.natsConn, a.natsConnErr = nats.Connect(a.natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
			nats.RetryOnFailedConnect(true))
	})
	return a.natsConn, a.natsConnErr
}

func (a *hopArgs) outbox() (*outbox.Outbox, error) {
	a.outboxInitOnce.Do(func() {
		a.outboxInst, a.outboxErr = outbox.New(a.pool, outbox.Config{Logger: a.errLog})
	})
	return a.outboxInst, a.outboxErr
}

// The relays' Kafka publishers (-kafka-publisher).
const (
	pubKafkaGo = "kafka-go"
	pubFranzGo = "franz-go"
)

// kafkaPublisher returns the relay's Kafka publisher, of the client
// a.kafkaPub names, and a function closing what it opened.
func (a *hopArgs) kafkaPublisher() (outbox.Publisher, func(), error) {
	brokers := strings.Split(a.brokers, ",")
	switch a.kafkaPub {
	case pubKafkaGo, "":
		// The publisher sets acks, balancer and batching on the writer.
		w := &kafka.Writer{Addr: kafka.TCP(brokers...), WriteTimeout: 10 * time.Second, ReadTimeout: 10 * time.Second}
		p, err := kafkainbox.NewOutboxPublisher(w)
		if err != nil {
			_ = w.Close()
			return nil, nil, err
		}
		return p, func() { _ = w.Close() }, nil
	case pubFranzGo:
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ProduceRequestTimeout(10*time.Second))
		if err != nil {
			return nil, nil, err
		}
		p, err := franzinbox.NewOutboxPublisher(cl)
		if err != nil {
			cl.Close()
			return nil, nil, err
		}
		return p, cl.Close, nil
	}
	return nil, nil, fmt.Errorf("-kafka-publisher %q: want %s or %s", a.kafkaPub, pubKafkaGo, pubFranzGo)
}

// startRelay runs an outbox relay in this process until ctx ends.
func (a *hopArgs) startRelay(ctx context.Context) error {
	ob, err := a.outbox()
	if err != nil {
		return err
	}
	nc, err := a.nc()
	if err != nil {
		return err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	natsPub, err := natsinbox.NewOutboxPublisher(js)
	if err != nil {
		return err
	}
	kafkaPub, closeKafka, err := a.kafkaPublisher()
	if err != nil {
		return err
	}
	r, err := ob.Relay(outbox.RelayConfig{
		Publishers: map[outbox.Broker]outbox.Publisher{outbox.Kafka: kafkaPub, outbox.NATS: natsPub},
		BatchSize:  a.relayBatch, PollInterval: a.relayPoll, Logger: a.errLog,
		Hooks: outbox.RelayHooks{
			OnFailed: func(err *outbox.PublishError) {
				a.report("relay-failed")
				fmt.Fprintf(os.Stderr, "chaos %s: relay: refused for good: %v\n", a.name, err)
			},
			OnRetry: func(*outbox.PublishError) { a.report("relay-retry") },
		}})
	if err != nil {
		closeKafka()
		return err
	}
	a.relays.Add(1)
	go func() {
		defer a.relays.Done()
		defer closeKafka()
		a.report("relay-started")
		if err := r.Run(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "chaos %s: relay: %v\n", a.name, err)
		}
	}()
	return nil
}

// sourceOf is the source event's ID a pipeline message carries.
func sourceOf(m *consumer.Message) string {
	for _, h := range m.Headers {
		if h.Key == headerSource {
			return string(h.Value)
		}
	}
	return string(m.Value)
}

// effectHandler is B's business handler: one effect row per run, keyed by
// the source event, with the message ID B's ledger deduplicated on.
func effectHandler(pipe string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, transport, msg_id) VALUES ($1, $2, $3)`, sourceOf(m), pipe, m.ID)
		return err
	}
}

// headerSent carries, in a soak run, when the pipeline's source event was
// sent (Unix nanoseconds): B measures the pipeline's latency from it.
const headerSent = "chaos-sent"

// sentHeaders returns A's headers of an outbox message: the source, the
// run of A's handler, and (in a soak run) when the source was sent.
func (a *hopArgs) sentHeaders(source string, sent time.Time) []consumer.Header {
	hs := []consumer.Header{{Key: headerSource, Value: []byte(source)}, {Key: headerRun, Value: []byte(randHex(8))}}
	if a.stats != nil && !sent.IsZero() {
		hs = append(hs, consumer.Header{Key: headerSent, Value: []byte(strconv.FormatInt(sent.UnixNano(), 10))})
	}
	return hs
}

// hopWorker runs one pipeline role until ctx ends.
func hopWorker(ctx context.Context, a *hopArgs) int {
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", a.role, err)
		return 1
	}
	pc := a.pc
	pc.Scope = "chaos-" + a.role[len("hop-"):]
	if a.role == roleKNB || a.role == roleHKB {
		pc.Hooks.OnOutcome = a.bOutcome(pc.Hooks.OnOutcome)
	}
	relayCtx, stopRelays := context.WithCancel(context.WithoutCancel(ctx))
	defer func() { stopRelays(); a.relays.Wait() }()
	if a.relay || a.role == roleRelay {
		if err := a.startRelay(relayCtx); err != nil {
			return fail(err)
		}
	}
	var run func(context.Context) error
	var err error
	switch a.role {
	case roleRelay:
		run = func(ctx context.Context) error { <-ctx.Done(); return nil }
	case roleKNA:
		run, err = a.knA(pc)
	case roleKNB:
		run, err = a.knB(pc)
	case roleHKB:
		var c *kafkainbox.Consumer
		c, err = kafkainbox.New(kafkainbox.Config{Brokers: strings.Split(a.brokers, ","), Topic: a.topic, GroupID: "chaos-" + a.topic,
			Processor: pc, Scheduling: consumer.Scheduling{BatchSize: a.batch}, CommitInterval: 200 * time.Millisecond}, effectHandler(pipeHK))
		if err == nil {
			run = c.Run
		}
	case roleHKA:
		run, err = a.hkA(pc)
	default:
		err = fmt.Errorf("unknown role %q", a.role)
	}
	if err != nil {
		return fail(err)
	}
	if err := run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// bOutcome wraps B's OnOutcome: B reports the deliveries its ledger
// answered as duplicates (relay republishes after a kill and redeliveries
// after B's own) and, in a soak run, the pipeline's latency of each effect.
func (a *hopArgs) bOutcome(outcome func(*consumer.Message, inbox.Outcome, time.Duration)) func(*consumer.Message, inbox.Outcome, time.Duration) {
	pipe := pipeKN
	if a.role == roleHKB {
		pipe = pipeHK
	}
	return func(m *consumer.Message, out inbox.Outcome, d time.Duration) {
		outcome(m, out, d)
		switch out.Disposition {
		case inbox.Duplicate:
			a.report("hop-duplicate:" + a.role)
		case inbox.Executed:
			if a.stats == nil {
				return
			}
			for _, h := range m.Headers {
				if h.Key == headerSent {
					if ns, err := strconv.ParseInt(string(h.Value), 10, 64); err == nil {
						a.stats.observe(pipe, time.Since(time.Unix(0, ns)))
					}
				}
			}
		}
	}
}

// knA is the kafka>nats pipeline's A: a kafkainbox consumer whose handler
// adds one NATS message per event to the outbox (and misbehaves as the
// intermittent hostile kinds do).
func (a *hopArgs) knA(pc consumer.Config) (func(context.Context) error, error) {
	ob, err := a.outbox()
	if err != nil {
		return nil, err
	}
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		// The key spreads the messages over the outbox's lanes, so
		// that the relays publish side by side.
		if _, err := ob.Add(ctx, tx, outbox.Message{Broker: outbox.NATS, Topic: hopSubject, Key: []byte(m.ID), Value: []byte(m.ID),
			Headers: a.sentHeaders(m.ID, m.Time)}); err != nil {
			return err
		}
		if !a.hostileInA {
			return nil
		}
		return misbehave(ctx, tx, m, onceKind(kindOf(m.ID, a.every)), a.slowFor, func(s string) { a.report("hostile:" + s) })
	}
	c, err := kafkainbox.New(kafkainbox.Config{Brokers: strings.Split(a.brokers, ","), Topic: a.topic, GroupID: "chaos-" + a.topic,
		Processor: pc, Scheduling: consumer.Scheduling{BatchSize: a.batch}, CommitInterval: 200 * time.Millisecond}, h)
	if err != nil {
		return nil, err
	}
	return c.Run, nil
}

// knB is the kafka>nats pipeline's B: a natsinbox consumer, one effect per
// event.
func (a *hopArgs) knB(pc consumer.Config) (func(context.Context) error, error) {
	nc, err := a.nc()
	if err != nil {
		return nil, err
	}
	c, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: hopStream, Durable: "chaos-hop",
		Processor: pc, AckWait: 5 * time.Second, Scheduling: consumer.Scheduling{BatchSize: a.batch}}, effectHandler(pipeKN))
	if err != nil {
		return nil, err
	}
	return c.Run, nil
}

// hkA is the http>kafka pipeline's A: the HTTP bridge, whose handler adds
// one Kafka message per key to the outbox.
func (a *hopArgs) hkA(pc consumer.Config) (func(context.Context) error, error) {
	ob, err := a.outbox()
	if err != nil {
		return nil, err
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: a.ledger})
	if err != nil {
		return nil, err
	}
	route := bridge.Route(httpbridge.RouteConfig{Scope: pc.Scope, Required: true})
	mux := http.NewServeMux()
	first := sync.Once{}
	mux.Handle("POST /order", route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := httpbridge.Key(r.Context())
		var sent time.Time
		if ns, err := strconv.ParseInt(r.Header.Get(headerSentHTTP), 10, 64); err == nil {
			sent = time.Unix(0, ns)
		}
		if _, err := ob.Add(r.Context(), httpbridge.Tx(r.Context()), outbox.Message{Broker: outbox.Kafka, Topic: a.topic,
			Key: []byte(key), Value: []byte(key), Headers: a.sentHeaders(key, sent)}); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		first.Do(func() { a.report("first-effect") })
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		// A body unique to this execution: every client of a key must see it.
		fmt.Fprintf(w, `{"key":%q,"order":"ord_%s"}`, key, randHex(6))
	})))
	ln, err := listenRetry(a.listen)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	return func(ctx context.Context) error {
		go func() {
			<-ctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}, nil
}

// hops is the parent's side of the pipelines.
type hops struct {
	kn, hk          bool
	srcTopic, topic string // kafka>nats source topic; http>kafka hop topic
	js              jetstream.JetStream
	brokers         []string
	ob              *outbox.Outbox
	load            *keyLoad // the http>kafka pipeline's clients
	published       map[string]int64
	stats           string
	statsErr        error
	pending, failed int64
	runs            map[string]map[string]map[string]bool // pipe -> source -> A's runs seen on the hop
	readErr         error
}

// startHops starts the two-hop pipelines: their topics and stream, A, B
// and the relay processes, and the producers of their sources.
func (e *env) startHops(ctx context.Context) error {
	h := e.h
	e.sum.hops = h
	h.brokers = e.brokers
	var err error
	if h.ob, err = outbox.New(e.pool, outbox.Config{}); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if h.hk {
		if err := e.hkTopic(); err != nil {
			return err
		}
	}
	if h.kn {
		p, err := e.knSource(ctx)
		if err != nil {
			return err
		}
		e.producers[pipeKN] = p
		e.onCleanup(p.closeFn)
	}
	hopCommon := append([]string{"-brokers", strings.Join(e.brokers, ","), "-nats", e.nats.url(), "-kafka-publisher", e.o.kafkaPub}, e.common...)
	var hopAddrs []string
	for i := 0; i < e.o.hopWorkers; i++ {
		if h.kn {
			e.startSlot(roleKNA, i, append([]string{"-transport", roleKNA, "-topic", h.srcTopic}, hopCommon...))
			e.startSlot(roleKNB, i, append([]string{"-transport", roleKNB}, hopCommon...))
		}
		if h.hk {
			addr := "127.0.0.1:" + strconv.Itoa(freePort())
			hopAddrs = append(hopAddrs, addr)
			e.startSlot(roleHKA, i, append([]string{"-transport", roleHKA, "-topic", h.topic, "-listen", addr, "-relay"}, hopCommon...))
			e.startSlot(roleHKB, i, append([]string{"-transport", roleHKB, "-topic", h.topic}, hopCommon...))
		}
	}
	for i := 0; i < e.o.relays; i++ {
		e.startSlot(roleRelay, i, append([]string{"-transport", roleRelay}, hopCommon...))
	}
	if h.hk {
		// Each chunk of keys is sent, as the production goes on, from
		// several clients at once, each attempt to one of A's processes at
		// random (a killed one refuses; the retry goes elsewhere or to its
		// successor).
		h.load = &keyLoad{name: pipeHK, sem: make(chan struct{}, 16),
			send: httpSend(countShed{rt: &rotate{addrs: hopAddrs, rt: http.DefaultTransport}, n: &e.sum.shed}, "http://a/order", 200, e.stats != nil)}
		e.producers[pipeHK] = h.load.producer(ctx, &e.reqWG, "y-", e.o.twoHopHTTPKeys, e.o.httpClients)
	}
	return nil
}

// hkTopic creates the http>kafka pipeline's hop topic.
func (e *env) hkTopic() error {
	h, o, sum := e.h, e.o, e.sum
	h.topic = "chaos-hk-" + randHex(4)
	if err := kafkaadmin.CreateTopic(h.brokers[0], h.topic, 4); err != nil {
		return fmt.Errorf("kafka hop topic: %w", err)
	}
	sum.transports = append(sum.transports, pipeHK)
	sum.unique[pipeHK] = o.twoHopHTTPKeys
	sum.produced[pipeHK] = o.twoHopHTTPKeys * o.httpClients
	sum.duplicates[pipeHK] = o.twoHopHTTPKeys * (o.httpClients - 1)
	return nil
}

// knSource creates the kafka>nats pipeline's hop stream and source topic,
// and returns the source's producer.
func (e *env) knSource(ctx context.Context) (*producer, error) {
	h, o, sum := e.h, e.o, e.sum
	js, err := jetstream.New(e.nc)
	if err != nil {
		return nil, err
	}
	h.js = js
	// The relay's Nats-Msg-Id is deduplicated within the window; a short
	// one lets republishes after a relay kill through to B's ledger.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: hopStream, Subjects: []string{hopSubject},
		Storage: jetstream.FileStorage, Duplicates: 100 * time.Millisecond, Replicas: e.nats.replicas()}); err != nil {
		return nil, err
	}
	h.srcTopic = "chaos-kn-" + randHex(4)
	if err := kafkaadmin.CreateTopic(h.brokers[0], h.srcTopic, 4); err != nil {
		return nil, fmt.Errorf("kafka source topic: %w", err)
	}
	sum.transports = append(sum.transports, pipeKN)
	ids, dups := plan("x-", o.twoHop, o.dupPct)
	sum.produced[pipeKN], sum.duplicates[pipeKN], sum.unique[pipeKN] = len(ids), dups, o.twoHop
	w := e.kafkaWriter(h.srcTopic)
	p := &producer{name: pipeKN, ids: ids, closeFn: func() { _ = w.Close() }, emit: kafkaEmit(w)}
	// Every source event must end with one effect at B (A's hostile kinds
	// are the intermittent ones).
	p.expect = make(map[string]hostileKind, o.twoHop)
	hk := map[hostileKind]int{}
	for i := 0; i < o.twoHop; i++ {
		id := "x-" + strconv.Itoa(i)
		p.expect[id] = normal
		if k := onceKind(kindOf(id, o.hostileEvery)); k != normal && o.hostileEvery > 0 {
			hk[k]++
		}
	}
	sum.hostile[pipeKN] = hk
	return p, nil
}

// finish reads what the brokers hold after the run: every message the
// relays published on each hop (more than the unique count: republishes),
// and for each source the runs of A's handler its messages came from.
func (h *hops) finish(ctx context.Context) {
	h.published = map[string]int64{}
	h.runs = map[string]map[string]map[string]bool{pipeKN: {}, pipeHK: {}}
	note := func(pipe, src, run string) {
		if h.runs[pipe][src] == nil {
			h.runs[pipe][src] = map[string]bool{}
		}
		h.runs[pipe][src][run] = true
		h.published[pipe]++
	}
	if h.kn && h.js != nil {
		// The JetStream cluster may still be electing a leader after the
		// last fault ("no responders"): read the stream again, from the
		// start, until it answers or the deadline passes.
		deadline := time.Now().Add(time.Minute)
		for {
			err := readStream(ctx, h.js, hopStream, func(src, run string) { note(pipeKN, src, run) })
			if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
				h.readErr = errors.Join(h.readErr, err)
				break
			}
			fmt.Fprintf(errOut, "chaos: reading the hop's stream: %v (retrying)\n", err)
			h.runs[pipeKN], h.published[pipeKN] = map[string]map[string]bool{}, 0
			if consumer.Sleep(ctx, time.Second) != nil {
				break
			}
		}
	}
	if h.hk {
		h.readErr = errors.Join(h.readErr, readTopic(ctx, h.brokers, h.topic, 4, func(src, run string) { note(pipeHK, src, run) }))
	}
	if h.ob != nil {
		st, err := h.ob.Stats(ctx)
		h.stats, h.statsErr = fmt.Sprintf("%d pending, %d failed", st.Pending, st.Failed), err
		h.pending, h.failed = st.Pending, st.Failed
	}
}

// readTopic calls f with the source and run headers of every message in
// the topic's partitions.
func readTopic(ctx context.Context, brokers []string, topic string, partitions int, f func(src, run string)) error {
	for p := 0; p < partitions; p++ {
		conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, p)
		if err != nil {
			return err
		}
		first, last, err := conn.ReadOffsets()
		_ = conn.Close()
		if err != nil {
			return err
		}
		if last <= first {
			continue
		}
		err = func() error {
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxWait: 500 * time.Millisecond})
			defer r.Close()
			if err := r.SetOffset(first); err != nil {
				return err
			}
			rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			defer cancel()
			for {
				m, err := r.ReadMessage(rctx)
				if err != nil {
					return fmt.Errorf("read %s/%d to offset %d: %w", topic, p, last, err)
				}
				var src, run string
				for _, h := range m.Headers {
					switch h.Key {
					case headerSource:
						src = string(h.Value)
					case headerRun:
						run = string(h.Value)
					}
				}
				f(src, run)
				if m.Offset >= last-1 {
					return nil
				}
			}
		}()
		if err != nil {
			return err
		}
	}
	return nil
}

// readStream calls f with the source and run headers of every message in
// the stream.
func readStream(ctx context.Context, js jetstream.JetStream, stream string, f func(src, run string)) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	for n := uint64(0); n < info.State.Msgs; {
		batch, err := c.FetchNoWait(500)
		if err != nil {
			return err
		}
		got := 0
		for m := range batch.Messages() {
			f(m.Headers().Get(headerSource), m.Headers().Get(headerRun))
			got++
		}
		if err := batch.Error(); err != nil {
			return err
		}
		if got == 0 {
			if err := consumer.Sleep(ctx, 50*time.Millisecond); err != nil {
				return err
			}
		}
		n += uint64(got)
	}
	return nil
}

// verdictHops checks B's effects of each pipeline (verdictPipe), the
// outbox at the end, and the http>kafka pipeline's clients.
func verdictHops(ctx context.Context, sum *summary, pool *pgxpool.Pool, h *hops) {
	for _, pipe := range []string{pipeKN, pipeHK} {
		if (pipe == pipeKN && h.kn) || (pipe == pipeHK && h.hk) {
			verdictPipe(ctx, sum, pool, h, pipe)
		}
	}
	if h.readErr != nil {
		sum.problem("reading the hops' messages: %v", h.readErr)
	}
	if h.statsErr != nil {
		sum.problem("outbox stats: %v", h.statsErr)
	} else if h.pending > 0 || h.failed > 0 {
		sum.problem("outbox: %d messages still pending, %d failed at the end", h.pending, h.failed)
	}
	if n := sum.obs.get("relay-failed"); n > 0 {
		sum.problem("outbox: relays refused %d messages for good", n)
	}
	for _, side := range []string{"kn-a", "kn-b", "hk-a", "hk-b"} {
		var done, failed int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'failed')
			FROM processed_events WHERE scope = $1`, "chaos-"+side).Scan(&done, &failed); err != nil {
			sum.problem("ledger %s: %v", side, err)
			continue
		}
		sum.hopLedger["chaos-"+side] = [2]int{done, failed}
	}
	if h.hk {
		n := h.load.countMismatched()
		sum.hopHTTPMismatched = n
		if f := h.load.failed.Load(); f > 0 {
			sum.problem("%s: %d requests never got a 2xx", pipeHK, f)
		}
		if n > 0 {
			sum.problem("%s: %d keys got differing responses", pipeHK, n)
		}
	}
}

// verdictPipe checks B's effects of one pipeline: one per unique source
// ID, with one message ID, and every message on the hop from one run of A.
func verdictPipe(ctx context.Context, sum *summary, pool *pgxpool.Pool, h *hops, pipe string) {
	prefix := "x-"
	if pipe == pipeHK {
		prefix = "y-"
	}
	rows, err := pool.Query(ctx, `SELECT event_id, count(*), count(DISTINCT msg_id) FROM effects WHERE transport = $1 GROUP BY event_id`, pipe)
	if err != nil {
		sum.problem("%s verdict: %v", pipe, err)
		return
	}
	seen := map[string]bool{}
	var doubled, multiMsg, stray []string
	err = func() error {
		defer rows.Close()
		for rows.Next() {
			var id string
			var n, msgs int
			if err := rows.Scan(&id, &n, &msgs); err != nil {
				return err
			}
			seen[id] = true
			if n > 1 {
				doubled = append(doubled, id)
			}
			if msgs > 1 {
				multiMsg = append(multiMsg, id)
			}
			if i, err := strconv.Atoi(strings.TrimPrefix(id, prefix)); err != nil || !strings.HasPrefix(id, prefix) || i >= sum.unique[pipe] {
				stray = append(stray, id)
			}
		}
		return rows.Err()
	}()
	if err != nil {
		sum.problem("%s verdict: %v", pipe, err)
		return
	}
	var lost []string
	for i := 0; i < sum.unique[pipe]; i++ {
		if id := prefix + strconv.Itoa(i); !seen[id] {
			lost = append(lost, id)
		}
	}
	sum.hopLost[pipe], sum.hopDoubled[pipe] = len(lost), len(doubled)
	report := func(what string, ids []string) {
		if len(ids) > 0 {
			sum.problem("%s: %d × %s at B, e.g. %s", pipe, len(ids), what, strings.Join(ids[:min(5, len(ids))], " "))
		}
	}
	var leaked []string
	for src, runs := range h.runs[pipe] {
		if len(runs) > 1 {
			leaked = append(leaked, src)
		}
	}
	sort.Strings(leaked)
	sum.hopLeaked[pipe] = len(leaked)
	report("source event's messages came from more than one run of A (a rolled-back run's message was published)", leaked)
	report("source event lost", lost)
	report("source event doubled", doubled)
	report("source event reached B as more than one message ID", multiMsg)
	report("effect of an event never produced", stray)
}
