package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// The same event published again after the stream's duplicate window, and
// published without Nats-Msg-Id (JetStream dedupe off; the ID in ce-id),
// is stored three times by JetStream and runs once.
func TestRepublishedEventRunsOnce(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("orders")
	const window = 200 * time.Millisecond
	stream := e.stream(t, subject, window)
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "billing", Processor: fx.processor("billing")}, fx.insert)
	require.NoError(t, err)
	run(t, c)

	const id = "order-1"
	first := e.publish(t, subject, id, []byte("v1"))
	require.False(t, first.Duplicate)
	testsvc.Eventually(t, 10*time.Second, func() bool { return len(fx.outcomesOf(id)) == 1 }, "first copy processed")

	// Inside the window JetStream drops the republish itself.
	require.True(t, e.publish(t, subject, id, []byte("v1")).Duplicate, "JetStream dedupes inside its window")
	// After the window it stores it: publish until the PubAck says stored
	// (each refused publish stores nothing).
	testsvc.Eventually(t, 5*time.Second, func() bool { return !e.publish(t, subject, id, []byte("v2")).Duplicate },
		"republish after the %s duplicate window is stored", window)
	// Without Nats-Msg-Id JetStream does not dedupe at all.
	require.False(t, e.publish(t, subject, "", []byte("v3"), "ce-id", id).Duplicate)

	testsvc.Eventually(t, 10*time.Second, func() bool { return len(fx.outcomesOf(id)) == 3 }, "three copies delivered")
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate, inbox.Duplicate}, fx.outcomesOf(id))
	s, err := e.js.Stream(context.Background(), stream)
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 3, info.State.Msgs, "JetStream stored three copies")
	require.EqualValues(t, 1, fx.runs.Load())
	require.Equal(t, 1, fx.effects(t, id))
	testsvc.Eventually(t, 10*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "billing")
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}, "every copy acked")
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: "billing", ID: id})
	require.NoError(t, err)
	require.Equal(t, Source, rec.Source)
}

// A handler slower than AckWait is kept with InProgress and runs once,
// delivered once. Without the heartbeat JetStream redelivers it to a second
// worker meanwhile; the ledger still runs it once.
func TestSlowHandlerInProgress(t *testing.T) {
	t.Parallel()
	for _, heartbeat := range []bool{true, false} {
		t.Run(fmt.Sprintf("heartbeat=%v", heartbeat), func(t *testing.T) {
			t.Parallel()
			e, fx := newEnv(t), newFixture(t)
			subject := testsvc.Unique("slow")
			stream := e.stream(t, subject, 0)
			const ackWait = time.Second
			// The scope is unique to the subtest: the ledger's per-key
			// advisory lock is database-wide, so the same key in another
			// test's schema would look in flight.
			cfg := Config{
				Conn: e.nc, Stream: stream, Durable: "slow", Processor: fx.processor(subject),
				AckWait: ackWait, Scheduling: consumer.Scheduling{Concurrency: 2},
			}
			if !heartbeat {
				cfg.Heartbeat = -1
			}
			c, err := New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if err := fx.insert(ctx, tx, m); err != nil {
					return err
				}
				time.Sleep(ackWait * 5 / 2) // the slow work, inside the transaction
				return nil
			})
			require.NoError(t, err)
			run(t, c)
			e.publish(t, subject, "slow-1", []byte("x"))
			testsvc.Eventually(t, 20*time.Second, func() bool {
				ci := e.consumerInfo(t, stream, "slow")
				return fx.effects(t, "slow-1") == 1 && ci.NumAckPending == 0 && ci.NumPending == 0
			}, "slow event committed and acked")
			require.EqualValues(t, 1, fx.runs.Load(), "ran once")
			if ci := e.consumerInfo(t, stream, "slow"); heartbeat {
				// A redelivery would have reached the idle second worker
				// and shown as an outcome.
				require.Equal(t, []inbox.Disposition{inbox.Executed}, fx.outcomesOf("slow-1"), "delivered once")
				require.Zero(t, ci.NumRedelivered)
			} else {
				outs := fx.outcomesOf("slow-1")
				require.Greater(t, len(outs), 1, "without InProgress JetStream redelivered it: %v", outs)
				var executed int
				for _, d := range outs {
					require.NotEqual(t, inbox.Mismatch, d)
					if d == inbox.Executed {
						executed++
					}
				}
				require.Equal(t, 1, executed, "the redeliveries were answered from the ledger (in flight, then duplicate)")
			}
		})
	}
}

// One scope shared by a Kafka consumer (simulated: a consumer.Processor
// with Source kafka on the same ledger and scope) and a NATS consumer: an
// event delivered on both runs once, whichever comes first.
func TestScopeSharedWithKafka(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("pay")
	stream := e.stream(t, subject, 0)
	const scope = "payments"
	kcfg := fx.processor(scope)
	kcfg.Source = inbox.Source("kafka")
	kafka, err := consumer.New(kcfg, fx.insert)
	require.NoError(t, err)
	fromKafka := func(id string) consumer.Decision {
		return kafka.ProcessWithRetry(context.Background(), &consumer.Message{
			Topic: "payments", Key: []byte(id), Value: []byte(id),
			Headers: []consumer.Header{{Key: "ce_id", Value: []byte(id)}},
		}, nil)
	}
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "payments-nats",
		Processor: fx.processor(scope), Scheduling: consumer.Scheduling{Concurrency: 2}}, fx.insert)
	require.NoError(t, err)
	run(t, c)
	id := func(i int) string { return "pay-" + strconv.Itoa(i) }

	// Kafka first, then NATS.
	for i := 0; i < 10; i++ {
		require.Equal(t, inbox.Executed, fromKafka(id(i)).Outcome.Disposition)
		e.publish(t, subject, id(i), []byte(id(i)))
	}
	// NATS first, then Kafka.
	for i := 10; i < 20; i++ {
		e.publish(t, subject, id(i), []byte(id(i)))
	}
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = ANY($1)`, []string{id(10), id(19)}) == 2
	}, "NATS ran its first ones")
	testsvc.Eventually(t, 10*time.Second, func() bool { return fx.pg.Count(t, `SELECT count(*) FROM effects`) == 20 }, "NATS ran 10..19")
	for i := 10; i < 20; i++ {
		d := fromKafka(id(i))
		require.Equal(t, consumer.Ack, d.Action)
		require.Equal(t, inbox.Duplicate, d.Outcome.Disposition, id(i))
	}
	// Both at once.
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Go(func() {
			for i := 20 + w; i < 80; i += 4 {
				require.Equal(t, consumer.Ack, fromKafka(id(i)).Action)
			}
		})
	}
	for i := 20; i < 80; i++ {
		e.publish(t, subject, id(i), []byte(id(i)))
	}
	wg.Wait()
	testsvc.Eventually(t, 20*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "payments-nats")
		return ci.NumAckPending == 0 && ci.NumPending == 0 && fx.count(inbox.Executed)+fx.count(inbox.Duplicate) == 160
	}, "NATS acked everything")

	require.EqualValues(t, 80, fx.runs.Load(), "each event ran once across Kafka and NATS")
	require.Equal(t, 80, fx.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 80, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Equal(t, 10, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = ANY($1) AND source = 'kafka'`,
		[]string{id(0), id(1), id(2), id(3), id(4), id(5), id(6), id(7), id(8), id(9)}))
	require.Equal(t, 10, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = ANY($1) AND source = 'nats'`,
		[]string{id(10), id(11), id(12), id(13), id(14), id(15), id(16), id(17), id(18), id(19)}))
	for i := 0; i < 10; i++ {
		require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate}, fx.outcomesOf(id(i)), id(i))
	}
}

// While another consumer of the scope (here the simulated Kafka side) holds
// an event in its transaction, the NATS delivery of the same event waits in
// place, InProgress, instead of being Nak'ed: no redelivery, and the
// attempt number stays 1. When the holder commits it is a duplicate.
func TestInFlightElsewhereWaitsInPlace(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("held")
	stream := e.stream(t, subject, 0)
	scope := "held-" + subject
	var attempts []int // under fx.mu
	pcfg := fx.processor(scope)
	pcfg.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
		fx.mu.Lock()
		defer fx.mu.Unlock()
		attempts = append(attempts, m.Attempt)
		fx.outcomes[m.ID] = append(fx.outcomes[m.ID], out.Disposition)
	}
	const ackWait = time.Second
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "held", Processor: pcfg, AckWait: ackWait}, fx.insert)
	require.NoError(t, err)
	run(t, c)

	holding, release := make(chan struct{}), make(chan struct{})
	held := make(chan inbox.Outcome)
	go func() {
		out, err := fx.ledger.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: scope, ID: "evt"}, Source: inbox.Source("kafka")},
			func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				close(holding)
				<-release
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id) VALUES ('evt')`)
				return inbox.Result{}, err
			})
		if err != nil {
			t.Error(err)
		}
		held <- out
	}()
	<-holding
	e.publish(t, subject, "evt", nil)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		fx.mu.Lock()
		defer fx.mu.Unlock()
		return len(fx.outcomes["evt"]) >= 3
	}, "NATS found the event in flight a few times")
	// The holder keeps it longer than AckWait (the scenario, not a wait
	// for a condition): the heartbeat keeps the waiting message.
	time.Sleep(3 * ackWait / 2)
	close(release)
	require.Equal(t, inbox.Executed, (<-held).Disposition)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "held")
		outs := fx.outcomesOf("evt")
		return ci.NumAckPending == 0 && ci.NumPending == 0 && len(outs) > 0 && outs[len(outs)-1] == inbox.Duplicate
	}, "duplicate acked after the holder committed")
	for _, d := range fx.outcomesOf("evt") {
		require.Contains(t, []inbox.Disposition{inbox.InFlight, inbox.Duplicate}, d)
	}
	fx.mu.Lock()
	defer fx.mu.Unlock()
	for _, a := range attempts {
		require.Equal(t, 1, a, "waiting in place is not a redelivery")
	}
	require.EqualValues(t, 0, fx.runs.Load())
	require.Equal(t, 1, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'evt'`))
}

// A poison message is retried in place (one JetStream delivery, Attempt
// counting its handler failures), then dead-lettered with its headers and
// Term'ed, while the rest flows; a Permanent error dead-letters at once.
func TestPoisonDeadLetteredAfterDeliveries(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("poison")
	stream := e.stream(t, subject, 0)
	var delivered []uint64 // JetStream delivery count of each poison run, under fx.mu
	c, err := New(Config{
		Conn: e.nc, Stream: stream, Durable: "p", Processor: fx.processor("p"), Scheduling: consumer.Scheduling{Concurrency: 2},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		switch m.ID {
		case "poison":
			fx.mu.Lock()
			delivered = append(delivered, numDelivered(m))
			fx.mu.Unlock()
			return errors.New("cannot parse\r\npayload")
		case "schema":
			return consumer.Permanent(errors.New("unknown schema"))
		}
		return fx.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	var poisonSeq uint64
	for i := 0; i < 30; i++ {
		if i == 10 {
			poisonSeq = e.publish(t, subject, "poison", []byte("bad"), "X-Trace", "t-1").Sequence
		}
		if i == 20 {
			e.publish(t, subject, "schema", []byte("bad2"))
		}
		e.publish(t, subject, "ok-"+strconv.Itoa(i), []byte("ok"))
	}
	run(t, c)
	testsvc.Eventually(t, 20*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects`) == 30 && len(e.deadLetters(t, subject)) == 2
	}, "good ones run, two dead letters")
	testsvc.Eventually(t, 10*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "p")
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}, "everything acked or terminated")

	dls := e.deadLetters(t, subject)
	byID := map[string]*jetstream.RawStreamMsg{}
	for _, m := range dls {
		byID[m.Header.Get(consumer.HeaderDLID)] = m
	}
	p := byID["poison"]
	require.NotNil(t, p)
	require.Equal(t, subject+DeadLetterSuffix, p.Subject)
	require.Equal(t, "bad", string(p.Data))
	require.Equal(t, "cannot parse  payload", p.Header.Get(consumer.HeaderDLError), "one line")
	require.Equal(t, "3", p.Header.Get(consumer.HeaderDLAttempts))
	require.Equal(t, subject, p.Header.Get(consumer.HeaderDLOrigin))
	require.Equal(t, strconv.FormatUint(poisonSeq, 10), p.Header.Get(consumer.HeaderDLOffset), "stream sequence")
	require.Equal(t, "p", p.Header.Get(consumer.HeaderDLScope))
	require.Equal(t, "t-1", p.Header.Get("X-Trace"), "original headers kept")
	require.Equal(t, fmt.Sprintf("justonce-dlq:%s:%d:p", stream, poisonSeq), p.Header.Get(jetstream.MsgIDHeader),
		"per stream, sequence and scope")
	s := byID["schema"]
	require.NotNil(t, s)
	require.Equal(t, "1", s.Header.Get(consumer.HeaderDLAttempts), "permanent: at once")

	fx.mu.Lock()
	require.Equal(t, []int{1, 2, 3}, fx.attempts["poison"], "Attempt counts the handler's failures")
	require.Equal(t, []uint64{1, 1, 1}, delivered, "retried in place: one delivery")
	fx.mu.Unlock()
	require.Equal(t, 2, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed'`))
	require.Equal(t, 30, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`))
}

// Shutdown drains: the handler in flight finishes and is acked before Run
// returns; what was pulled but not started is Nak'ed, so a new consumer
// gets it at once rather than after AckWait.
func TestShutdownDrains(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("drain")
	stream := e.stream(t, subject, 0)
	entered, release := make(chan struct{}), make(chan struct{})
	cfg := Config{
		Conn: e.nc, Stream: stream, Durable: "d", Processor: fx.processor("d"),
		AckWait: time.Minute, // a message left unacked would not come back within the test
	}
	for i := 0; i < 5; i++ {
		e.publish(t, subject, "m-"+strconv.Itoa(i), nil)
	}
	e.publish(t, subject, "hold", nil)
	for i := 5; i < 10; i++ {
		e.publish(t, subject, "m-"+strconv.Itoa(i), nil)
	}
	c, err := New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "hold" {
			close(entered)
			<-release
		}
		return fx.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	<-entered
	cancel()
	select {
	case err := <-done:
		t.Fatalf("Run returned while a handler was in flight: %v", err)
	default:
	}
	close(release)
	require.NoError(t, <-done, "a clean stop returns nil")
	require.Equal(t, 1, fx.effects(t, "hold"), "in-flight handler finished and committed")
	require.Equal(t, 6, fx.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Len(t, fx.outcomesOf("hold"), 1)

	// The rest comes to the next consumer now, not after the minute of
	// AckWait; nothing runs twice.
	c2, err := New(cfg, fx.insert)
	require.NoError(t, err)
	run(t, c2)
	testsvc.Eventually(t, 15*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "d")
		return fx.pg.Count(t, `SELECT count(*) FROM effects`) == 11 && ci.NumAckPending == 0 && ci.NumPending == 0
	}, "the rest processed promptly by the next consumer")
	require.Equal(t, 11, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Len(t, fx.outcomesOf("hold"), 1, "the acked message did not come back")
}

// Core NATS: a queue group shares the subject, duplicates run once, a
// failing message is retried in place and dead-lettered, and shutdown
// handles what was received.
func TestCoreQueueGroup(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("core")
	dlSub, err := e.nc.SubscribeSync(subject + DeadLetterSuffix)
	require.NoError(t, err)
	var mu sync.Mutex
	byMember := map[string]int{}
	var ready sync.WaitGroup
	member := func(name string) *Consumer {
		nc := connect(t, e.url)
		ready.Add(1)
		c, err := New(Config{
			ready: ready.Done,
			Conn:  nc, Subject: subject, Queue: "workers", Processor: fx.processor("core-" + subject), Scheduling: consumer.Scheduling{Concurrency: 2},
		}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if m.ID == "poison" {
				return errors.New("boom")
			}
			mu.Lock()
			byMember[name]++
			mu.Unlock()
			return fx.insert(ctx, tx, m)
		})
		require.NoError(t, err)
		return c
	}
	stopA := run(t, member("a"))
	stopB := run(t, member("b"))
	ready.Wait() // both members subscribed

	pub := func(id string) {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = []byte(id)
		require.NoError(t, e.nc.PublishMsg(m))
	}
	for i := 0; i < 100; i++ {
		pub("c-" + strconv.Itoa(i))
	}
	pub("poison")
	for i := 0; i < 100; i += 5 {
		pub("c-" + strconv.Itoa(i)) // publisher retries
	}
	require.NoError(t, e.nc.Flush())
	dl, err := dlSub.NextMsg(20 * time.Second)
	require.NoError(t, err)
	testsvc.Eventually(t, 20*time.Second, func() bool {
		return fx.count(inbox.Executed)+fx.count(inbox.Duplicate) == 120
	}, "all deliveries answered")
	stopA()
	stopB()
	require.EqualValues(t, 100, fx.runs.Load())
	require.Equal(t, 100, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Equal(t, 100, fx.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, "poison", dl.Header.Get(consumer.HeaderDLID))
	require.Equal(t, "3", dl.Header.Get(consumer.HeaderDLAttempts))
	require.Equal(t, subject, dl.Header.Get(consumer.HeaderDLOrigin))
	fx.mu.Lock()
	require.Equal(t, []int{1, 2, 3}, fx.attempts["poison"], "retried in place")
	fx.mu.Unlock()
	mu.Lock()
	require.Positive(t, byMember["a"])
	require.Positive(t, byMember["b"])
	mu.Unlock()
}

// On shutdown a core subscriber handles the messages it received but had
// not started: core NATS would not send them again.
func TestCoreDrainHandlesReceived(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("cored")
	ready := make(chan struct{})
	c, err := New(Config{Conn: connect(t, e.url), Subject: subject, Processor: fx.processor("cd"),
		ready: func() { close(ready) }}, fx.insert)
	require.NoError(t, err)
	stop := run(t, c)
	<-ready
	for i := 0; i < 200; i++ {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, "d-"+strconv.Itoa(i))
		require.NoError(t, e.nc.PublishMsg(m))
	}
	require.NoError(t, e.nc.Flush())
	stop()
	require.Equal(t, 200, fx.pg.Count(t, `SELECT count(*) FROM effects`), "every received message handled before Run returned")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	nc := &nats.Conn{}
	h := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	ledger := &inbox.Ledger{}
	ok := Config{Conn: nc, Processor: consumer.Config{Ledger: ledger}, Stream: "S", Durable: "d"}
	require.NoError(t, ok.Validate())
	core := Config{Conn: nc, Processor: consumer.Config{Ledger: ledger}, Subject: "a.b", Queue: "q"}
	require.NoError(t, core.Validate())

	for name, mut := range map[string]func(*Config){
		"no conn":         func(c *Config) { c.Conn = nil },
		"no ledger":       func(c *Config) { c.Processor.Ledger = nil },
		"no durable":      func(c *Config) { c.Durable = "" },
		"dotted durable":  func(c *Config) { c.Durable = "a.b" },
		"both modes":      func(c *Config) { c.Subject = "x" },
		"neither":         func(c *Config) { c.Stream, c.Durable = "", "" },
		"queue on js":     func(c *Config) { c.Queue = "q" },
		"bad filter":      func(c *Config) { c.FilterSubjects = []string{"a.>.b"} },
		"wildcard dlq":    func(c *Config) { c.DeadLetterSubject = "dlq.*" },
		"heartbeat>=wait": func(c *Config) { c.AckWait, c.Heartbeat = time.Second, time.Second },
		"negative batch":  func(c *Config) { c.BatchSize = -1 },
	} {
		c := ok
		mut(&c)
		require.ErrorIs(t, c.Validate(), inbox.ErrConfig, name)
	}
	_, err := New(ok, nil)
	require.ErrorIs(t, err, inbox.ErrConfig, "no handler")
	_, err = New(ok, h)
	require.NoError(t, err)
	bad := core
	bad.BatchSize = 10
	require.ErrorIs(t, bad.Validate(), inbox.ErrConfig, "batch on core")
	bad = core
	bad.Subject = "a..b"
	require.ErrorIs(t, bad.Validate(), inbox.ErrConfig, "bad subject")

	d := ok.withDefaults()
	require.Equal(t, "d", d.Processor.Scope, "scope defaults to the durable")
	require.Equal(t, Source, d.Processor.Source)
	require.Equal(t, "q", core.withDefaults().Processor.Scope, "core: the queue group")
}

func TestSubjectsCollide(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{"a.b", "a.b", true}, {"a.b", "a.c", false}, {"a.*", "a.b", true}, {"a.*", "a.b.c", false},
		{"a.>", "a.b.c", true}, {"a.>", "a", false}, {"*.dlq", "a.b.dlq", false}, {"a.*.dlq", "a.>", true},
		{"orders.created.dlq", "orders.*", false}, {"orders.*.dlq", "orders.*", false},
	} {
		require.Equal(t, tc.want, subjectsCollide(tc.a, tc.b), "%s vs %s", tc.a, tc.b)
		require.Equal(t, tc.want, subjectsCollide(tc.b, tc.a), "%s vs %s", tc.b, tc.a)
	}
}

// Run refuses setups that would consume their own dead letters, and a
// bound durable whose MaxDeliver would stop redelivery before the
// dead-letter.
func TestRunRefusesUnsafeSetups(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	ctx := context.Background()
	base := testsvc.Unique("wide")
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: "W-" + base, Subjects: []string{base + ".>"}})
	require.NoError(t, err)
	newC := func(cfg Config) error {
		cfg.Conn, cfg.Processor = e.nc, fx.processor("x")
		c, err := New(cfg, fx.insert)
		require.NoError(t, err)
		return c.Run(ctx)
	}
	err = newC(Config{Stream: "W-" + base, Durable: "w"})
	require.ErrorIs(t, err, inbox.ErrConfig)
	require.Contains(t, err.Error(), "would be consumed by this consumer")
	err = newC(Config{Subject: base + ".>"})
	require.ErrorIs(t, err, inbox.ErrConfig)
	err = newC(Config{Stream: "W-" + base, Durable: "w", DeadLetterSubject: base + ".dead"})
	require.ErrorIs(t, err, inbox.ErrConfig, "a fixed dead-letter subject inside the filter")

	_, err = e.js.CreateOrUpdateConsumer(ctx, "W-"+base, jetstream.ConsumerConfig{
		Durable: "managed", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 2, FilterSubject: base + ".in",
	})
	require.NoError(t, err)
	err = newC(Config{Stream: "W-" + base, Durable: "managed", Bind: true, DeadLetterSubject: "elsewhere"})
	require.ErrorIs(t, err, inbox.ErrConfig)
	require.Contains(t, err.Error(), "MaxDeliver 2")
	err = newC(Config{Stream: "W-" + base, Durable: "missing", Bind: true, DeadLetterSubject: "elsewhere"})
	require.ErrorIs(t, err, jetstream.ErrConsumerNotFound)
}

// Batch mode with two fetch loops and confirmed acks: every event once,
// every message acked.
func TestBatchConcurrentDoubleAck(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("batch")
	stream := e.stream(t, subject, 0)
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "b", Processor: fx.processor("b-" + subject),
		Scheduling: consumer.Scheduling{BatchSize: 10, Concurrency: 2}, DoubleAck: true, FetchWait: 200 * time.Millisecond}, fx.insert)
	require.NoError(t, err)
	for i := 0; i < 200; i++ {
		e.publish(t, subject, "b-"+strconv.Itoa(i), nil)
	}
	for i := 0; i < 200; i += 5 {
		e.publish(t, subject, "", nil, "ce-id", "b-"+strconv.Itoa(i)) // same events again
	}
	run(t, c)
	testsvc.Eventually(t, 30*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "b")
		return ci.NumAckPending == 0 && ci.NumPending == 0 && ci.Delivered.Stream == 240
	}, "all 240 messages acked")
	require.EqualValues(t, 200, fx.runs.Load())
	require.Equal(t, 200, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Equal(t, 200, fx.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 40, fx.count(inbox.Duplicate))
}
