package main

// The chaos run's schedule: a queue of faults, shuffled so that every kind
// lands mid-stream, injected one at a time between chunks of production,
// then until every event ran.

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"time"

	"github.com/justonce/justonce/consumer"
)

// schedule is the queue of faults still to inject.
type schedule struct {
	e         *env
	faults    map[string]fault
	queue     []string
	deferrals int // faults put back in the queue
}

// newSchedule queues every fault asked for, shuffled; the operator
// releases need failed keys and go in the second half.
func newSchedule(e *env) *schedule {
	s := &schedule{e: e, faults: e.faults()}
	o := e.o
	for _, k := range []struct {
		kind string
		n    int
	}{{fKill, o.kills}, {fRelayKill, o.relayKills}, {fRedis, o.redisOutages}, {fPgTerminate, o.pgTerminates},
		{fPgCrash, o.pgCrashes}, {fKafkaCrash, o.kafkaCrashes}, {fNatsRestart, o.natsRestarts}, {fNet, o.netFaults},
		{fPgFailover, o.pgFailovers}, {fRedisFailover, o.redisFailovers}, {fNatsLeader, o.natsLeaderKills},
		{fOverload, o.overloads}} {
		e.sum.asked[k.kind] = k.n
		for i := 0; i < k.n; i++ {
			s.queue = append(s.queue, k.kind)
		}
	}
	mrand.Shuffle(len(s.queue), func(i, j int) { s.queue[i], s.queue[j] = s.queue[j], s.queue[i] })
	e.sum.asked[fRelease] = o.releases
	for i := 0; i < o.releases; i++ {
		at := len(s.queue)/2 + mrand.N(len(s.queue)-len(s.queue)/2+1)
		s.queue = append(s.queue[:at], append([]string{fRelease}, s.queue[at:]...)...)
	}
	return s
}

// inject injects one fault of kind and heals it; false when it could not
// be injected now.
func (s *schedule) inject(ctx context.Context, kind string) (bool, error) {
	f := s.faults[kind]
	ok, err := f.inject(ctx)
	if err != nil || !ok {
		return ok, err
	}
	if err := f.heal(ctx); err != nil {
		return true, err
	}
	s.e.sum.faults[kind]++
	return true, nil
}

// tick injects the next fault of the queue; one that cannot be injected
// now goes back to its end.
func (s *schedule) tick(ctx context.Context) error {
	if len(s.queue) == 0 {
		return nil
	}
	kind := s.queue[0]
	s.queue = s.queue[1:]
	ok, err := s.inject(ctx, kind)
	if err != nil {
		return fmt.Errorf("%s: %w", kind, err)
	}
	if !ok {
		s.deferrals++
		if s.deferrals > 400 {
			return fmt.Errorf("%s could not be injected (%d tries)", kind, s.deferrals)
		}
		s.queue = append(s.queue, kind)
	}
	return nil
}

// produceWithFaults emits every producer's plan in chunks, a fault between
// two chunks.
func (s *schedule) produceWithFaults(ctx context.Context) error {
	e := s.e
	chunks := max(len(s.queue), 10)
	order := []string{"kafka", "franz", "nats", pipeKN, pipeHK}
	for c := 0; c < chunks; c++ {
		for _, name := range order {
			p := e.producers[name]
			if p == nil {
				continue
			}
			n := (len(p.ids) + chunks - 1) / chunks
			end := min(p.next+n, len(p.ids))
			if err := emitRetry(ctx, p, p.ids[p.next:end], &e.sum.producerRetries); err != nil {
				return fmt.Errorf("produce %s: %w", p.name, err)
			}
			p.next = end
		}
		if err := s.tick(ctx); err != nil {
			return err
		}
		if err := consumer.Sleep(ctx, e.o.killEvery); err != nil {
			return err
		}
	}
	return nil
}

// untilDone keeps injecting faults until the queue is empty and
// everything ran: each event that must run has its effect, each
// permanent hostile event that was not released is recorded failed.
func (s *schedule) untilDone(ctx context.Context) error {
	e := s.e
	httpDone := make(chan struct{})
	go func() { e.reqWG.Wait(); close(httpDone) }()
	for {
		complete, _ := e.complete(ctx, httpDone)
		if complete && len(s.queue) == 0 {
			return nil
		}
		if err := s.tick(ctx); err != nil {
			return err
		}
		if err := consumer.Sleep(ctx, e.o.killEvery); err != nil {
			_, state := e.complete(context.WithoutCancel(ctx), httpDone)
			return fmt.Errorf("gave up: %w; %s", err, state)
		}
	}
}

// complete reports whether every event that must run has its effect, every
// permanent hostile event not released is recorded failed and every client
// request was answered; and says how far the run got.
func (e *env) complete(ctx context.Context, requestsDone <-chan struct{}) (bool, string) {
	got, failed, err := e.progress(ctx)
	once, dead := e.expected()
	complete := err == nil && failed >= dead
	for _, t := range e.sum.transports {
		if got[t] < once[t] {
			complete = false
		}
	}
	select {
	case <-requestsDone:
	default:
		complete = false
	}
	return complete, fmt.Sprintf("distinct effects so far %v of %v; failed rows %d of %d", got, once, failed, dead)
}

// progress counts the distinct events with an effect, per transport, and
// the failed ledger rows.
func (e *env) progress(ctx context.Context) (map[string]int, int, error) {
	got := map[string]int{}
	rows, err := e.pool.Query(ctx, `SELECT transport, count(DISTINCT event_id) FROM effects GROUP BY transport`)
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
	err = e.pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE scope = $1 AND status = 'failed'`, scope).Scan(&failed)
	return got, failed, err
}

// expected is how many distinct events must have their effect, per
// transport, and how many must end recorded failed.
func (e *env) expected() (once map[string]int, dead int) {
	once = map[string]int{}
	for name, p := range e.producers {
		for id, k := range p.expect {
			if k.permanent() && !e.released[id] {
				dead++
			} else {
				once[name]++
			}
		}
	}
	for _, t := range []string{"http", "grpc", pipeHK} {
		once[t] = e.sum.unique[t]
	}
	return once, dead
}

// stopAll lets the last acks and commits land, then stops the workers
// cleanly and the janitor, and returns the database's time of the stop.
func (e *env) stopAll(ctx context.Context) (time.Time, error) {
	_ = consumer.Sleep(ctx, time.Second)
	e.stopSlots()
	e.jan.stop()
	var t time.Time
	err := e.pool.QueryRow(ctx, `SELECT now()`).Scan(&t)
	return t, err
}
