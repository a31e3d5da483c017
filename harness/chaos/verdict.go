package main

// The verdict: every event from the business table, the ledger, the
// dead-letter streams and the clients' answers; the janitor; the faults
// asked for.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// judge checks the run once every worker stopped; janitorStopped is the
// database's time when the janitor stopped.
func (e *env) judge(ctx context.Context, janitorStopped time.Time) error {
	verdict(ctx, e.sum, e.pool, e.producers, e.released, e.dlq)
	if e.hopsOn {
		e.h.finish(ctx)
		verdictHops(ctx, e.sum, e.pool, e.h)
	}
	if err := e.verdictJanitor(ctx, janitorStopped); err != nil {
		return err
	}
	e.verdictLoads()
	e.verdictFaults()
	return nil
}

// verdictJanitor checks what the janitor did: on the plain layout it
// purged rows, and left none that expired 5 s before it stopped; on time
// buckets it opened buckets and dropped nothing the verdict needs.
func (e *env) verdictJanitor(ctx context.Context, janitorStopped time.Time) error {
	sum := e.sum
	sum.janitorCreated = int(e.jan.created.Load())
	if !e.o.janitor {
		return nil
	}
	if e.layout == migrations.LayoutTimeBuckets {
		// A bucket is dropped once every row in it has expired: MaxTTL
		// after it closed, far after a run. The janitor runs (it opens
		// buckets, so that they turn over during the run) and must drop
		// nothing the verdict needs.
		var all int
		if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE scope = $1`, janitorScope).Scan(&all); err != nil {
			return err
		}
		sum.janitorGone = sum.janitorCreated - all
		if err := e.pool.QueryRow(ctx, `SELECT count(*) - $1::int FROM processed_events_buckets`, migrations.DefaultShards).Scan(&sum.bucketsOpened); err != nil {
			return err
		}
		if sum.bucketsOpened == 0 {
			sum.problem("janitor: no bucket opened during the run (-bucket-width %v)", e.o.bucketWidth)
		}
		return nil
	}
	var left, all int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE expires_at < $2::timestamptz - interval '5 seconds'), count(*)
		FROM processed_events WHERE scope = $1`, janitorScope, janitorStopped).Scan(&left, &all); err != nil {
		return err
	}
	sum.janitorLeft, sum.janitorGone = left, sum.janitorCreated-all
	if left > 0 {
		sum.problem("janitor: %d rows expired more than 5 s before it stopped are still there", left)
	}
	if sum.janitorGone <= 0 {
		sum.problem("janitor: purged nothing of %d short-TTL rows", sum.janitorCreated)
	}
	return nil
}

// verdictLoads checks the request fronts' clients: every request answered
// in the end, every client of a key the same answer.
func (e *env) verdictLoads() {
	sum := e.sum
	if l := e.loads["http"]; l != nil {
		sum.httpRequests, sum.httpFailed = int(l.requests.Load()), int(l.failed.Load())
		sum.httpMismatched = l.countMismatched()
		if sum.httpFailed > 0 {
			sum.problem("http: %d requests never got a 2xx", sum.httpFailed)
		}
		if sum.httpMismatched > 0 {
			sum.problem("http: %d keys got differing responses", sum.httpMismatched)
		}
	}
	if l := e.loads["grpc"]; l != nil {
		if n := l.failed.Load(); n > 0 {
			sum.problem("grpc: %d calls never got an OK", n)
		}
		if n := l.countMismatched(); n > 0 {
			sum.problem("grpc: %d keys got differing orders", n)
		}
	}
}

// verdictFaults checks that every fault asked for was injected, and that
// the reset-peer faults of a long enough run hit a COMMIT in flight.
func (e *env) verdictFaults() {
	sum, o := e.sum, e.o
	for _, f := range append(append(append([]string(nil), faultOrder...), haFaultOrder...), fOverload) {
		if sum.faults[f] < sum.asked[f] {
			sum.problem("only %d × %s injected, %d asked", sum.faults[f], f, sum.asked[f])
		}
	}
	if o.netFaults >= len(netFaultKinds) && o.events >= 20000 &&
		e.obs.get("retry:commit-unknown")+e.obs.get("dead-letter:commit-unknown") == 0 {
		sum.problem("no worker saw ErrCommitUnknown: the reset-peer faults did not hit a COMMIT in flight")
	}
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
		switch {
		case strings.HasPrefix(id, "n-"):
			name = "nats"
		case strings.HasPrefix(id, "f-"):
			name = "franz"
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
	dlqs map[string]func(context.Context) (map[string]bool, error)) {
	effects, status, err := readOutcomes(ctx, sum, pool)
	if err != nil {
		sum.problem("verdict: %v", err)
		return
	}
	dlq := map[string]map[string]bool{}
	for name, read := range dlqs {
		got, err := read(ctx)
		if err != nil {
			sum.problem("%s dead-letter stream: %v", name, err)
		}
		dlq[name] = got
	}
	for _, name := range []string{"kafka", "franz", "nats"} {
		if p := producers[name]; p != nil {
			judgeEvents(sum, name, p, effects, status, dlq[name], released)
		}
	}
	for _, name := range []string{"http", "grpc"} {
		if sum.unique[name] > 0 {
			if sum.effects[name] != sum.distinct[name] {
				sum.problem("%s: %d effects doubled", name, sum.effects[name]-sum.distinct[name])
			}
			if sum.distinct[name] != sum.unique[name] {
				sum.problem("%s: %d keys lost", name, sum.unique[name]-sum.distinct[name])
			}
		}
	}
}

// readOutcomes reads the effects of every event (and counts them per
// transport in sum) and the ledger's status of every event of the scope.
func readOutcomes(ctx context.Context, sum *summary, pool *pgxpool.Pool) (effects map[string]int, status map[string]string, err error) {
	effects, status = map[string]int{}, map[string]string{}
	rows, err := pool.Query(ctx, `SELECT event_id, transport, count(*) FROM effects GROUP BY event_id, transport`)
	if err != nil {
		return nil, nil, err
	}
	for rows.Next() {
		var id, t string
		var n int
		if err := rows.Scan(&id, &t, &n); err != nil {
			return nil, nil, err
		}
		effects[id] = n
		sum.effects[t] += n
		sum.distinct[t]++
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	rows, err = pool.Query(ctx, `SELECT event_id, status FROM processed_events WHERE scope = $1`, scope)
	if err != nil {
		return nil, nil, err
	}
	for rows.Next() {
		var id, st string
		if err := rows.Scan(&id, &st); err != nil {
			return nil, nil, err
		}
		status[id] = st
		switch st {
		case "done":
			sum.ledgerDone++
		case "failed":
			sum.ledgerFailed++
		}
	}
	return effects, status, rows.Err()
}

// judgeEvents checks each event of a consumer front: one effect and a
// done ledger row, or, for a permanent hostile event not released, no
// effect, a failed row and a dead letter.
func judgeEvents(sum *summary, name string, p *producer, effects map[string]int, status map[string]string, dlq, released map[string]bool) {
	bad := map[string][]string{}
	add := func(what, id string) { bad[what] = append(bad[what], id) }
	for id, k := range p.expect {
		n := effects[id]
		if k.permanent() && !released[id] {
			switch {
			case n > 0:
				add("permanent hostile event has an effect", id)
			case status[id] != "failed":
				add("permanent hostile event not recorded failed (ledger: "+orNone(status[id])+")", id)
			case !dlq[id]:
				add("permanent hostile event recorded failed but not in the dead-letter stream", id)
			}
			if dlq[id] {
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
			add(what+" lost", id)
		case n > 1:
			add(what+" doubled", id)
		case status[id] != "done":
			add(what+" has its effect but ledger says "+orNone(status[id]), id)
		}
		if dlq[id] && !released[id] {
			sum.deadLettered[name]++
			add(what+" dead-lettered although it ran", id)
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
