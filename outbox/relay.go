package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Relay defaults.
const (
	DefaultBatchSize      = 500
	DefaultPollInterval   = time.Second
	DefaultConcurrency    = 8
	DefaultPublishTimeout = 30 * time.Second
)

// dbTimeout bounds a batch's database steps, beside its PublishTimeout.
const dbTimeout = 30 * time.Second

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Publishers publish the messages of each broker: Publishers[Kafka]
	// those whose Broker is Kafka (kafkainbox.NewOutboxPublisher with
	// kafka-go, or franzinbox.NewOutboxPublisher with franz-go),
	// Publishers[NATS] those whose Broker is NATS
	// (natsinbox.NewOutboxPublisher). At least one. A relay reads only the
	// messages of the brokers it has a publisher for, and leaves the
	// others to relays that have one. The relay does not close them.
	Publishers map[Broker]Publisher
	// BatchSize is how many messages of one lane a relay publishes per
	// transaction. Default DefaultBatchSize.
	BatchSize int
	// PollInterval is how often the relay looks for messages when no
	// notification came. Default DefaultPollInterval.
	PollInterval time.Duration
	// Concurrency is how many lanes the relay publishes at once (each
	// holds a pool connection while it publishes). Default
	// DefaultConcurrency.
	Concurrency int
	// PublishTimeout bounds the publishing of one batch (the wait for the
	// broker's acks). Default DefaultPublishTimeout.
	PublishTimeout time.Duration
	// Backoff spaces the attempts at a lane whose broker failed for the
	// time being. Defaults as backoff.Backoff's.
	Backoff backoff.Backoff
	// Hooks are told what the relay did, for metrics. Any may be nil.
	Hooks RelayHooks
	// Logger; default the Outbox's.
	Logger *slog.Logger
}

// RelayHooks are told what a relay does. They are called from the
// relay's goroutines and must not block.
type RelayHooks struct {
	// OnPublished: n messages of the lane to broker were acked and
	// deleted.
	OnPublished func(broker Broker, lane, n int)
	// OnFailed: the broker refused a message for good; it is marked
	// failed (err.Permanent is true).
	OnFailed func(err *PublishError)
	// OnRetry: publishing failed for the time being; the message stays
	// pending and its lane is tried again after a backoff.
	OnRetry func(err *PublishError)
}

// Relay publishes the outbox's committed messages. Several relays (in one
// process or many) may run on one outbox: each lane is published by one
// relay at a time.
type Relay struct {
	o       *Outbox
	cfg     RelayConfig
	log     *slog.Logger
	brokers []string // the brokers it publishes to: it reads only their messages
	started atomic.Bool

	mu      sync.Mutex
	backoff map[int]laneBackoff
}

type laneBackoff struct {
	attempt int
	until   time.Time
}

// Relay returns a relay for the outbox. It refuses (inbox.ErrConfig) a
// configuration without a publisher, with a nil one, or with one for a
// broker other than Kafka and NATS.
func (o *Outbox) Relay(cfg RelayConfig) (*Relay, error) {
	if len(cfg.Publishers) == 0 {
		return nil, fmt.Errorf("%w: justonce/outbox: a relay needs a publisher (RelayConfig.Publishers)", inbox.ErrConfig)
	}
	var brokers []string
	for b, p := range cfg.Publishers {
		if b != Kafka && b != NATS {
			return nil, fmt.Errorf("%w: justonce/outbox: a publisher for the unknown broker %q", inbox.ErrConfig, b)
		}
		if p == nil {
			return nil, fmt.Errorf("%w: justonce/outbox: the %s publisher is nil", inbox.ErrConfig, b)
		}
		brokers = append(brokers, string(b))
	}
	slices.Sort(brokers)
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = DefaultPublishTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = o.log
	}
	cfg.Publishers = maps.Clone(cfg.Publishers)
	return &Relay{o: o, cfg: cfg, log: cfg.Logger, brokers: brokers, backoff: map[int]laneBackoff{}}, nil
}

// Run publishes until ctx ends, then finishes the batches in hand and
// returns nil. It wakes when a transaction that added messages commits
// (LISTEN on the outbox's channel, on a pool connection it holds) and
// polls every PollInterval besides. A second call returns
// consumer.ErrRunOnce.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return consumer.ErrRunOnce
	}
	wake := make(chan struct{}, 1)
	lctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.listen(lctx, wake)
	}()
	defer func() {
		cancel()
		wg.Wait()
	}()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for {
		if ctx.Err() != nil {
			return nil
		}
		worked, next, err := r.round(ctx)
		if err != nil && ctx.Err() == nil {
			r.log.WarnContext(ctx, "justonce/outbox: relay round failed", "err", err)
		}
		if worked {
			continue
		}
		wait := r.cfg.PollInterval
		if err != nil {
			wait = min(wait, time.Second)
		}
		if !next.IsZero() {
			wait = min(wait, max(time.Until(next), time.Millisecond))
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-timer.C:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// listen holds a LISTEN on the outbox's channel and signals wake on
// every notification, and after each (re)connection.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	attempt := 0
	for ctx.Err() == nil {
		err := func() error {
			conn, err := r.o.pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer func() {
				// The connection listens: close it rather than hand it back.
				_ = conn.Conn().Close(context.Background())
				conn.Release()
			}()
			if _, err := conn.Exec(ctx, `LISTEN `+pgx.Identifier{r.o.channel}.Sanitize()); err != nil {
				return err
			}
			attempt = 0
			signal() // what committed while nobody listened
			for {
				if _, err := conn.Conn().WaitForNotification(ctx); err != nil {
					return err
				}
				signal()
			}
		}()
		if ctx.Err() != nil {
			return
		}
		attempt++
		d := r.cfg.Backoff.Delay(attempt)
		r.log.WarnContext(ctx, "justonce/outbox: relay listener lost; polling meanwhile", "err", err, "retry_in", d)
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

// round publishes every lane that has pending messages and is not backing
// off, Concurrency lanes at a time. worked says it took any message: look
// again at once, for what committed meanwhile without a notification of
// its own (the trigger lets one committing transaction at a time
// notify). next is when the earliest backing off lane may be tried again.
func (r *Relay) round(ctx context.Context) (worked bool, next time.Time, err error) {
	lanes, err := r.pendingLanes(ctx)
	if err != nil {
		return false, time.Time{}, err
	}
	now := time.Now()
	todo := lanes[:0]
	r.mu.Lock()
	for _, l := range lanes {
		if b, ok := r.backoff[l]; ok && b.until.After(now) {
			if next.IsZero() || b.until.Before(next) {
				next = b.until
			}
			continue
		}
		todo = append(todo, l)
	}
	r.mu.Unlock()
	// Relays start from different lanes, so that they meet rarely.
	rand.Shuffle(len(todo), func(i, j int) { todo[i], todo[j] = todo[j], todo[i] })

	var (
		wg      sync.WaitGroup
		sem     = make(chan struct{}, r.cfg.Concurrency)
		mu      sync.Mutex
		firstEr error
		anyWork bool
	)
	for _, lane := range todo {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func(lane int) {
			defer func() { <-sem; wg.Done() }()
			w, err := r.drainLane(ctx, lane)
			mu.Lock()
			defer mu.Unlock()
			if err != nil && firstEr == nil {
				firstEr = err
			}
			if w {
				anyWork = true
			}
		}(lane)
	}
	wg.Wait()
	r.mu.Lock()
	for _, b := range r.backoff {
		if b.until.After(now) && (next.IsZero() || b.until.Before(next)) {
			next = b.until
		}
	}
	r.mu.Unlock()
	return anyWork, next, firstEr
}

// planIndexOnly steers the planner of the transaction's later statements
// to outbox_pending_idx (sequential and bitmap scans off): without it, a
// table whose statistics predate its backlog (a fresh table, or one
// analyzed while nearly empty) gets a bitmap scan of every pending row of
// a lane, sorted, for each batch, and of the whole table for each probe
// of pendingLanes (tens of milliseconds per round at 20,000 pending
// rows, the relay's time growing with the square of its backlog). The
// batch's record statements, planned under it too, go by primary key.
const planIndexOnly = `SELECT set_config('enable_seqscan', 'off', true) IS NOT NULL AND set_config('enable_bitmapscan', 'off', true) IS NOT NULL`

// pendingLanes lists the lanes with pending messages (a loose index scan
// of outbox_pending_idx: one probe per lane), in one round trip.
func (r *Relay) pendingLanes(ctx context.Context) ([]int, error) {
	t := r.o.table
	b := &pgx.Batch{}
	b.Queue(`BEGIN READ ONLY`)
	b.Queue(planIndexOnly)
	lanes := b.Queue(`WITH RECURSIVE l(lane) AS (
    (SELECT lane FROM `+t+` WHERE status = 'pending' AND broker = ANY($1) ORDER BY lane LIMIT 1)
    UNION ALL
    SELECT (SELECT o.lane FROM `+t+` o WHERE o.status = 'pending' AND o.broker = ANY($1) AND o.lane > l.lane ORDER BY o.lane LIMIT 1)
    FROM l WHERE l.lane IS NOT NULL
) SELECT lane FROM l WHERE lane IS NOT NULL`, r.brokers)
	b.Queue(`COMMIT`)
	var out []int
	lanes.Query(func(rows pgx.Rows) error {
		var err error
		out, err = pgx.CollectRows(rows, pgx.RowTo[int])
		return err
	})
	// A failure leaves the connection in the transaction: the pool
	// closes it rather than take it back.
	if err := r.o.pool.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("justonce/outbox: pending lanes: %w", err)
	}
	return out, nil
}

// drainLane publishes a lane's batches until it is empty, another relay
// holds it, its broker fails or ctx ends. worked says it took any message.
func (r *Relay) drainLane(ctx context.Context, lane int) (worked bool, err error) {
	for ctx.Err() == nil {
		n, full, err := r.batch(ctx, lane)
		if n > 0 {
			worked = true
		}
		if err != nil || !full {
			return worked, err
		}
	}
	return worked, nil
}

func (r *Relay) lockKey(lane int) string {
	return "justonce.outbox:" + r.o.schema + ":" + strconv.Itoa(lane)
}

// batch publishes one batch of the lane, in its own transaction holding
// the lane's advisory lock. n is how many rows it took, full whether it
// took BatchSize of them.
func (r *Relay) batch(ctx context.Context, lane int) (n int, full bool, err error) {
	// The batch in hand is finished even when ctx ends: a context of its
	// own, bounded by PublishTimeout.
	// The database steps get a deadline of their own, past the publish's:
	// a publish that timed out is still recorded (attempts, error, the
	// acked part deleted).
	base := context.WithoutCancel(ctx)
	bctx, cancel := context.WithTimeout(base, r.cfg.PublishTimeout+dbTimeout)
	defer cancel()
	conn, err := r.o.pool.Acquire(bctx)
	if err != nil {
		return 0, false, fmt.Errorf("justonce/outbox: acquire: %w", err)
	}
	defer conn.Release()
	// The transaction is opened by a statement of its own, sent with the
	// lock and the load: a batch costs three round trips (begin, lock and
	// load; record; commit) besides the publishing, where it cost five. A
	// batch left behind open (a failure, a lane another relay holds) is
	// rolled back here; a connection that cannot be is closed, and the
	// pool drops it.
	defer func() {
		if conn.Conn().IsClosed() || conn.Conn().PgConn().TxStatus() == 'I' {
			return
		}
		rctx, rcancel := context.WithTimeout(base, dbTimeout)
		defer rcancel()
		if _, err := conn.Exec(rctx, `ROLLBACK`); err != nil {
			_ = conn.Conn().Close(rctx)
		}
	}()
	var (
		locked bool
		msgs   []*pending
	)
	lb := &pgx.Batch{}
	lb.Queue(`BEGIN`)
	// The lock in a statement of its own: the load's snapshot then sees
	// every batch the previous holder committed. The batch's commit does
	// not wait for the WAL flush: a database crash may forget the last
	// deletions, and the relay publishes those messages again, the
	// duplicates a relay crash makes too. The load is sent with the lock,
	// and reads nothing when another relay holds the lane (the lock's
	// result is kept in a setting of the transaction).
	lb.Queue(`SELECT set_config('synchronous_commit', 'off', true) IS NOT NULL
	AND set_config('justonce.lane_locked', pg_try_advisory_xact_lock(hashtextextended($1, 0))::text, true)::bool`, r.lockKey(lane)).
		QueryRow(func(row pgx.Row) error { return row.Scan(&locked) })
	lb.Queue(planIndexOnly)
	lb.Queue(`SELECT seq, id, broker, topic, key, headers, value, partition FROM `+r.o.table+`
WHERE lane = $1 AND status = 'pending' AND broker = ANY($3) AND current_setting('justonce.lane_locked')::bool
ORDER BY seq LIMIT $2`, lane, r.cfg.BatchSize, r.brokers).
		Query(func(rows pgx.Rows) error {
			if !locked {
				return nil
			}
			var err error
			msgs, err = r.scanPending(rows)
			return err
		})
	if err := conn.SendBatch(bctx, lb).Close(); err != nil {
		return 0, false, fmt.Errorf("justonce/outbox: lock and load lane %d: %w", lane, migrationHint(err))
	}
	if !locked || len(msgs) == 0 {
		return 0, false, nil
	}
	// A lane is one (broker, topic, key) hash: the brokers of one lane
	// publish side by side, each its messages in order.
	pctx, pcancel := context.WithTimeout(base, r.cfg.PublishTimeout)
	defer pcancel()
	groups := make([][]*pending, len(r.brokers))
	for _, p := range msgs {
		groups[p.broker] = append(groups[p.broker], p)
	}
	var wg sync.WaitGroup
	for i, g := range groups {
		if len(g) == 0 {
			continue
		}
		b := Broker(r.brokers[i])
		if len(g) == len(msgs) { // one broker: no goroutine
			publish(pctx, r.cfg.Publishers[b], b, g)
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			publish(pctx, r.cfg.Publishers[b], b, g)
		}()
	}
	wg.Wait()

	var (
		done                []int64
		failSeq, retrySeq   []int64
		failErr, retryErr   []string
		published           = make([]int, len(r.brokers))
		firstTransient      *PublishError
		failedErrs, retries []*PublishError
	)
	for _, p := range msgs {
		if p.err == nil {
			done = append(done, p.seq)
			published[p.broker]++
			continue
		}
		pe := publishError(p, p.err)
		if pe.Permanent {
			failSeq = append(failSeq, p.seq)
			failErr = append(failErr, pe.Err.Error())
			failedErrs = append(failedErrs, pe)
		} else {
			retrySeq = append(retrySeq, p.seq)
			retryErr = append(retryErr, pe.Err.Error())
			retries = append(retries, pe)
			if firstTransient == nil {
				firstTransient = pe
			}
		}
	}
	b := &pgx.Batch{}
	if len(done) > 0 {
		b.Queue(`DELETE FROM `+r.o.table+` WHERE seq = ANY($1)`, done)
	}
	if len(failSeq) > 0 {
		b.Queue(`UPDATE `+r.o.table+` o SET status = 'failed', error = f.err, attempts = o.attempts + 1, failed_at = now()
FROM unnest($1::bigint[], $2::text[]) AS f(seq, err) WHERE o.seq = f.seq`, failSeq, failErr)
	}
	if len(retrySeq) > 0 {
		b.Queue(`UPDATE `+r.o.table+` o SET error = f.err, attempts = o.attempts + 1
FROM unnest($1::bigint[], $2::text[]) AS f(seq, err) WHERE o.seq = f.seq`, retrySeq, retryErr)
	}
	if err := conn.SendBatch(bctx, b).Close(); err != nil {
		return 0, false, fmt.Errorf("justonce/outbox: record batch: %w", err)
	}
	// The commit in a round trip of its own, once the deletions are done
	// (queued behind them, it would save a round trip; a relay that died
	// meanwhile would then still commit what it published).
	if ct, err := conn.Exec(bctx, `COMMIT`); err != nil || ct.String() != "COMMIT" {
		if err == nil {
			err = fmt.Errorf("rolled back (%s)", ct)
		}
		// Published, not recorded: the next holder of the lane publishes
		// them again (downstream dedupes on the ID).
		return 0, false, fmt.Errorf("justonce/outbox: commit batch: %w", err)
	}
	h := r.cfg.Hooks
	if h.OnPublished != nil {
		for i, n := range published {
			if n > 0 {
				h.OnPublished(Broker(r.brokers[i]), lane, n)
			}
		}
	}
	for _, pe := range failedErrs {
		r.log.ErrorContext(ctx, "justonce/outbox: message refused for good; marked failed", "id", pe.ID, "broker", pe.Broker, "topic", pe.Topic, "err", pe.Err)
		if h.OnFailed != nil {
			h.OnFailed(pe)
		}
	}
	for _, pe := range retries {
		if h.OnRetry != nil {
			h.OnRetry(pe)
		}
	}
	r.mu.Lock()
	if firstTransient != nil {
		b := r.backoff[lane]
		b.attempt++
		d := r.cfg.Backoff.Delay(b.attempt)
		b.until = time.Now().Add(d)
		r.backoff[lane] = b
		r.mu.Unlock()
		r.log.WarnContext(ctx, "justonce/outbox: publishing failed; retrying the lane", "lane", lane, "id", firstTransient.ID,
			"broker", firstTransient.Broker, "topic", firstTransient.Topic, "err", firstTransient.Err, "retry_in", d)
		return len(msgs), false, nil
	}
	delete(r.backoff, lane)
	r.mu.Unlock()
	return len(msgs), len(msgs) == r.cfg.BatchSize, nil
}

// scanPending reads the rows of the load: the lane's oldest pending
// messages, in order.
func (r *Relay) scanPending(rows pgx.Rows) ([]*pending, error) {
	defer rows.Close()
	var out []*pending
	var hs []header
	for rows.Next() {
		p := &pending{}
		m := &p.msg
		var hdr []byte
		var broker string
		if err := rows.Scan(&p.seq, &m.ID, &broker, &m.Topic, &m.Key, &hdr, &m.Value, &m.Partition); err != nil {
			return nil, fmt.Errorf("justonce/outbox: load: %w", err)
		}
		p.broker = slices.Index(r.brokers, broker)
		if p.broker < 0 { // the load reads only r.brokers'
			return nil, fmt.Errorf("justonce/outbox: load: message %s of broker %q", m.ID, broker)
		}
		m.Broker = Broker(broker)
		if len(hdr) > 0 {
			hs = hs[:0]
			if err := json.Unmarshal(hdr, &hs); err != nil {
				return nil, fmt.Errorf("justonce/outbox: message %s headers: %w", m.ID, err)
			}
			m.Headers = make([]consumer.Header, len(hs))
			for i, h := range hs {
				m.Headers[i] = consumer.Header(h)
			}
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("justonce/outbox: load: %w", err)
	}
	return out, nil
}

// migrationHint says what to do about err when it is Postgres' undefined
// column (SQLSTATE 42703): the outbox table is older than this build
// (migration version 5 added its partition column).
func migrationHint(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42703" {
		return fmt.Errorf("%w (the outbox table lacks a column this build reads: apply the migrations, justonce migrate up)", err)
	}
	return err
}
