package main

// The fronts: what produces the events (a Kafka topic per client, a
// JetStream stream, HTTP and gRPC clients sending keys) and the worker
// processes that consume or serve them.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// producer emits one transport's plan in chunks, and resends single
// events (after an operator released them).
type producer struct {
	mu      sync.Mutex // a soak's operator releases resend while the producer emits
	name    string
	ids     []string
	next    int
	emit    func(ctx context.Context, ids []string) error
	expect  map[string]hostileKind // unique ID -> kind
	closeFn func()
}

// emitRetry emits ids, retrying for up to 2 minutes while the broker is
// away (a retry may add duplicates; the verdict does not mind).
func emitRetry(ctx context.Context, p *producer, ids []string, retries *atomic.Int64) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		p.mu.Lock()
		err := p.emit(ctx, ids)
		p.mu.Unlock()
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		retries.Add(1)
		fmt.Fprintf(errOut, "chaos: produce %s: %v (retrying)\n", p.name, err)
		if err := consumer.Sleep(ctx, time.Second); err != nil {
			return err
		}
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

// classify records which of p's unique events are hostile, and of what
// kind.
func (e *env) classify(p *producer, unique int) {
	p.expect = make(map[string]hostileKind, unique)
	h := map[hostileKind]int{}
	for i := 0; i < unique; i++ {
		id := p.ids[0][:2] + strconv.Itoa(i)
		k := kindOf(id, e.o.hostileEvery)
		p.expect[id] = k
		if k != normal {
			h[k]++
		}
	}
	e.sum.hostile[p.name] = h
}

// addProducer registers p for the schedule and for operator resends.
func (e *env) addProducer(p *producer) {
	e.producers[p.name] = p
	e.resend[p.name] = func(ctx context.Context, id string) error {
		return emitRetry(ctx, p, []string{id}, &e.sum.producerRetries)
	}
}

// kafkaWriter is the producers' writer to topic.
func (e *env) kafkaWriter(topic string) *kafka.Writer {
	return &kafka.Writer{Addr: kafka.TCP(e.brokers...), Topic: topic, Balancer: &kafka.Hash{},
		BatchSize: 1000, BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll,
		WriteTimeout: 10 * time.Second, ReadTimeout: 10 * time.Second}
}

// kafkaEmit writes ids to w, each as its key, ID header and payload.
func kafkaEmit(w *kafka.Writer) func(ctx context.Context, ids []string) error {
	return func(ctx context.Context, ids []string) error {
		msgs := make([]kafka.Message, len(ids))
		for i, id := range ids {
			msgs[i] = kafkainbox.NewMessage(id, []byte(id), []byte(`{"id":"`+id+`"}`))
		}
		return w.WriteMessages(ctx, msgs...)
	}
}

// startKafka starts a Kafka front: a topic of its own with a dead-letter
// topic, its producer, and its consumer processes. transport is kafka
// (kafkainbox, on kafka-go) or franz (franzinbox, on franz-go); the IDs
// start with k- or f-.
func (e *env) startKafka(transport string) error {
	e.sum.transports = append(e.sum.transports, transport)
	topic := "chaos-" + randHex(4)
	prefix := "k-"
	if transport == "franz" {
		topic, prefix = "chaos-franz-"+randHex(4), "f-"
	}
	if err := kafkaadmin.CreateTopic(e.brokers[0], topic, 4); err != nil {
		return fmt.Errorf("kafka topic: %w", err)
	}
	dlq := topic + kafkainbox.DeadLetterSuffix
	if err := kafkaadmin.CreateTopic(e.brokers[0], dlq, 1); err != nil {
		return fmt.Errorf("kafka dead-letter topic: %w", err)
	}
	ids, dups := plan(prefix, e.o.events, e.o.dupPct)
	e.sum.produced[transport], e.sum.duplicates[transport], e.sum.unique[transport] = len(ids), dups, e.o.events
	w := e.kafkaWriter(topic)
	e.onCleanup(func() { w.Close() })
	p := &producer{name: transport, ids: ids, emit: kafkaEmit(w)}
	e.classify(p, e.o.events)
	e.addProducer(p)
	e.dlq[transport] = func(ctx context.Context) (map[string]bool, error) { return readKafkaDLQ(ctx, e.brokers, dlq) }
	e.startSlots(transport, append([]string{"-transport", transport, "-brokers", strings.Join(e.brokers, ","), "-topic", topic}, e.common...))
	return nil
}

// startNATS starts the NATS front: the stream and its dead-letter stream,
// the producer, and the consumer processes.
func (e *env) startNATS(ctx context.Context) error {
	e.sum.transports = append(e.sum.transports, "nats")
	// An ack lost with a node that was killed would leave its future
	// pending for good, and PublishAsyncComplete never done: time such
	// futures out, so that the emit's republish sends them again.
	js, err := jetstream.New(e.nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		return err
	}
	// A short duplicate window: republished IDs after it are stored
	// again, as they would be after the default 2 minutes.
	const window = 500 * time.Millisecond
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHAOS", Subjects: []string{"chaos.events"},
		Storage: jetstream.FileStorage, Duplicates: window, Replicas: e.nats.replicas()}); err != nil {
		return err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHAOSDLQ", Subjects: []string{"chaos.events.dlq"},
		Storage: jetstream.FileStorage, Replicas: e.nats.replicas()}); err != nil {
		return err
	}
	ids, dups := plan("n-", e.o.events, e.o.dupPct)
	e.sum.produced["nats"], e.sum.duplicates["nats"], e.sum.unique["nats"] = len(ids), dups, e.o.events
	lastSent := map[string]time.Time{}
	emit := func(ctx context.Context, ids []string) error {
		futures := make([]jetstream.PubAckFuture, 0, len(ids))
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
			f, err := js.PublishMsgAsync(m)
			if err != nil {
				return err
			}
			futures = append(futures, f)
			lastSent[id] = time.Now()
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(30 * time.Second):
			return errors.New("nats publish did not complete")
		}
		return republish(ctx, js, futures)
	}
	p := &producer{name: "nats", ids: ids, emit: emit}
	e.classify(p, e.o.events)
	e.addProducer(p)
	e.dlq["nats"] = func(ctx context.Context) (map[string]bool, error) { return readNatsDLQ(ctx, js, "CHAOSDLQ") }
	e.startSlots("nats", append([]string{"-transport", "nats", "-nats", e.nats.url(), "-stream", "CHAOS"}, e.common...))
	return nil
}

// republish sends again, one at a time until the stream acknowledges it,
// each message whose asynchronous publish failed (the stream's leader
// died, an election was under way): with its Nats-Msg-Id, so that the
// stream keeps one copy if the first publish was stored after all (within
// the duplicate window; after it, the copy is one more duplicate delivery,
// which the ledger answers).
func republish(ctx context.Context, js jetstream.JetStream, futures []jetstream.PubAckFuture) error {
	for _, f := range futures {
		select {
		case <-f.Ok():
			continue
		default:
		}
		sent := f.Msg()
		id := sent.Header.Get(jetstream.MsgIDHeader)
		for deadline := time.Now().Add(2 * time.Minute); ; {
			m := nats.NewMsg(sent.Subject)
			m.Header.Set(jetstream.MsgIDHeader, id)
			m.Data = sent.Data
			_, err := js.PublishMsg(ctx, m, jetstream.WithRetryAttempts(10), jetstream.WithRetryWait(200*time.Millisecond))
			if err == nil {
				break
			}
			if ctx.Err() != nil || time.Now().After(deadline) {
				return fmt.Errorf("nats publish %s: %w", id, err)
			}
			fmt.Fprintf(errOut, "chaos: nats publish %s: %v (retrying)\n", id, err)
		}
	}
	return nil
}

// keyLoad is clients sending keys to a request front (HTTP or gRPC):
// several clients per key at once, each retrying with the same key until
// it gets an answer. Every client of a key must get the same answer.
type keyLoad struct {
	name             string
	requests, failed atomic.Int64
	answers          sync.Map // key -> *sync.Map of the answers its clients got
	mismatched       int      // keys whose clients got differing answers (after the run)
	sem              chan struct{}
	// send sends one request of key, with its retries, and returns the
	// answer.
	send func(ctx context.Context, key string) (string, error)
	lat  *latencies // a soak run's: each answered request's time
}

// one is one client of key.
func (l *keyLoad) one(ctx context.Context, key string) {
	l.requests.Add(1)
	t0 := time.Now()
	answer, err := l.send(ctx, key)
	if err != nil {
		l.failed.Add(1)
		return
	}
	l.lat.add(time.Since(t0))
	v, _ := l.answers.LoadOrStore(key, &sync.Map{})
	v.(*sync.Map).Store(answer, true)
}

// sendAll sends every key from clients clients at once, at most
// cap(l.sem) requests in flight, in a goroutine of its own; wg counts the
// requests.
func (l *keyLoad) sendAll(ctx context.Context, wg *sync.WaitGroup, keys []string, clients int) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for _, key := range keys {
			if ctx.Err() != nil {
				return
			}
			for c := 0; c < clients; c++ {
				l.sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() { <-l.sem }()
					l.one(ctx, key)
				}()
			}
		}
	}()
}

// producer returns the load as a producer of keys: emit sends each chunk
// of keys from clients clients at once without waiting for the answers
// (wg does), at most cap(l.sem) requests in flight.
func (l *keyLoad) producer(ctx context.Context, wg *sync.WaitGroup, prefix string, keys, clients int) *producer {
	p := &producer{name: l.name, expect: make(map[string]hostileKind, keys), closeFn: func() {}}
	for k := 0; k < keys; k++ {
		id := prefix + strconv.Itoa(k)
		p.ids = append(p.ids, id)
		p.expect[id] = normal
	}
	p.emit = func(_ context.Context, ids []string) error {
		for _, key := range ids {
			for c := 0; c < clients; c++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					l.sem <- struct{}{}
					defer func() { <-l.sem }()
					l.one(ctx, key)
				}()
			}
		}
		return nil
	}
	return p
}

// countMismatched sets l.mismatched: the keys whose clients got
// differing answers.
func (l *keyLoad) countMismatched() int {
	l.mismatched = 0
	l.answers.Range(func(_, v any) bool {
		n := 0
		v.(*sync.Map).Range(func(_, _ any) bool { n++; return true })
		if n > 1 {
			l.mismatched++
		}
		return true
	})
	return l.mismatched
}

// countShed counts the answers 503 overloaded (the bridge shed the
// attempt) its client gets, in n.
type countShed struct {
	rt http.RoundTripper
	n  *atomic.Int64
}

func (c countShed) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.rt.RoundTrip(r)
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		return resp, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(b))
	if bytes.Contains(b, []byte(httpbridge.ProblemOverloaded)) {
		c.n.Add(1)
	}
	return resp, err
}

// httpSend returns a keyLoad's send: POST path on base with the key, an
// httpretry client retrying up to attempts times; the answer is the body
// of a 2xx.
func httpSend(base http.RoundTripper, url string, attempts int, sent bool) func(ctx context.Context, key string) (string, error) {
	client := &http.Client{Timeout: 30 * time.Second, Transport: &httpretry.Transport{Base: base, MaxAttempts: attempts,
		Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}}}
	return func(ctx context.Context, key string) (string, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader([]byte(`{"key":"`+key+`"}`)))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		if sent {
			req.Header.Set(headerSentHTTP, strconv.FormatInt(time.Now().UnixNano(), 10))
		}
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			return "", fmt.Errorf("status %d", resp.StatusCode)
		}
		return string(b), nil
	}
}

// headerSentHTTP carries, in a soak run, when the http>kafka pipeline's
// client sent the request (Unix nanoseconds), for the pipeline's latency.
const headerSentHTTP = "Chaos-Sent"

// startHTTP starts the HTTP front: a real server on loopback (this
// process's own in a chaos run; worker processes in a soak run, so that
// their heap is measured apart), clients retrying with the same key.
func (e *env) startHTTP(ctx context.Context) error {
	e.sum.transports = append(e.sum.transports, "http")
	e.sum.unique["http"] = e.o.httpKeys
	e.sum.produced["http"] = e.o.httpKeys * e.o.httpClients
	e.sum.duplicates["http"] = e.o.httpKeys * (e.o.httpClients - 1)
	l := &keyLoad{name: "http", sem: make(chan struct{}, 24)}
	e.loads["http"] = l
	if e.stats == nil {
		srv, err := httpServer(ctx, e.workerPG, e.workerRedis, "http", "127.0.0.1:0")
		if err != nil {
			return err
		}
		e.onCleanup(srv.Close)
		l.send = httpSend(countShed{rt: http.DefaultTransport, n: &e.sum.shed}, srv.URL+"/pay", 100, false)
		var keys []string
		for k := 0; k < e.o.httpKeys; k++ {
			keys = append(keys, "h-"+strconv.Itoa(k))
		}
		l.sendAll(ctx, &e.reqWG, keys, e.o.httpClients)
		return nil
	}
	l.lat = e.stats.front("http")
	var addrs []string
	for i := 0; i < e.o.workers; i++ {
		addr := "127.0.0.1:" + strconv.Itoa(freePort())
		addrs = append(addrs, addr)
		e.startSlot("http", i, append([]string{"-transport", "http", "-listen", addr}, e.common...))
	}
	l.send = httpSend(countShed{rt: &rotate{addrs: addrs, rt: http.DefaultTransport}, n: &e.sum.shed}, "http://h/pay", 200, false)
	p := l.producer(ctx, &e.reqWG, "h-", e.o.httpKeys, e.o.httpClients)
	e.producers["http"] = p
	return nil
}

// closer is a server and what closes it.
type closer struct {
	URL   string
	close func()
}

func (c *closer) Close() { c.close() }

// httpServer serves POST /pay through the bridge on listen, on a ledger
// of its own (whose connections are terminated with the workers').
func httpServer(ctx context.Context, pgURL string, rc redisConf, name, listen string) (*closer, error) {
	l, closeLedger, err := newLedger(ctx, pgURL, rc, name)
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
	ln, err := listenRetry(listen)
	if err != nil {
		closeLedger()
		return nil, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &closer{URL: "http://" + ln.Addr().String(), close: func() {
		_ = srv.Close()
		closeLedger()
	}}, nil
}

// rotate sends each attempt to one of addrs at random.
type rotate struct {
	addrs []string
	rt    http.RoundTripper
}

func (r *rotate) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.URL.Host = r.addrs[mrand.N(len(r.addrs))]
	req.Host = req.URL.Host
	return r.rt.RoundTrip(req)
}

// listenRetry listens on addr, trying again for a few seconds while the
// port is still held (a killed predecessor's socket).
func listenRetry(addr string) (net.Listener, error) {
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var ln net.Listener
		if ln, err = net.Listen("tcp", addr); err == nil {
			return ln, nil
		}
	}
	return nil, err
}

// janitor writes short-lived rows of another scope during the run, next
// to the rows that must stay, and runs the janitor that purges them.
type janitor struct {
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	created atomic.Int64
}

// startJanitor starts the janitor and its rows (with -janitor).
func (e *env) startJanitor(ctx context.Context) {
	jctx, cancel := context.WithCancel(ctx)
	j := &janitor{cancel: cancel}
	e.jan = j
	if e.o.janitor {
		j.wg.Add(2)
		go func() {
			defer j.wg.Done()
			_ = e.opLedger.RunJanitor(jctx, inbox.JanitorConfig{Interval: 500 * time.Millisecond, BatchSize: 100})
		}()
		go func() {
			defer j.wg.Done()
			for i := 0; jctx.Err() == nil; i++ {
				req := inbox.Request{Key: inbox.Key{Scope: janitorScope, ID: "j-" + strconv.Itoa(i)}, TTL: time.Second}
				_, err := e.opLedger.Do(jctx, req, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
				if err == nil {
					j.created.Add(1)
				} else if jctx.Err() == nil && !inbox.IsTransient(err) {
					fmt.Fprintln(errOut, "chaos: janitor rows:", err)
				}
				_ = consumer.Sleep(jctx, 100*time.Millisecond)
			}
		}()
	}
	e.onCleanup(j.stop)
}

// stop stops the janitor and waits for it.
func (j *janitor) stop() {
	j.cancel()
	j.wg.Wait()
}
