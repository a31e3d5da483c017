package outbox

import (
	"context"
	"fmt"
	"time"
)

// Stats is the state of the outbox table.
type Stats struct {
	// Pending messages wait for a relay.
	Pending int64
	// Failed messages were refused by their broker for good; Retry puts
	// them back, Purge deletes them.
	Failed int64
	// OldestPending is when the oldest pending message was added (zero
	// when none is pending); OldestPendingAge is its age at the query.
	OldestPending    time.Time
	OldestPendingAge time.Duration
	// OldestFailed is when the earliest of the failed messages' failures
	// happened (zero when none failed), the time Purge's OlderThan counts
	// from.
	OldestFailed time.Time
	// Lanes is how many lanes hold pending messages.
	Lanes int64
}

// Stats counts the outbox's pending and failed messages (a scan of each
// partial index).
func (o *Outbox) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	var oldestP, oldestF *time.Time
	var age *float64
	err := o.pool.QueryRow(ctx, `SELECT
    count(*) FILTER (WHERE status = 'pending'),
    count(*) FILTER (WHERE status = 'failed'),
    min(created_at) FILTER (WHERE status = 'pending'),
    extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8,
    min(coalesce(failed_at, created_at)) FILTER (WHERE status = 'failed'),
    count(DISTINCT lane) FILTER (WHERE status = 'pending')
FROM `+o.table).Scan(&s.Pending, &s.Failed, &oldestP, &age, &oldestF, &s.Lanes)
	if err != nil {
		return Stats{}, fmt.Errorf("justonce/outbox: stats: %w", err)
	}
	if oldestP != nil {
		s.OldestPending = *oldestP
	}
	if age != nil {
		s.OldestPendingAge = time.Duration(*age * float64(time.Second))
	}
	if oldestF != nil {
		s.OldestFailed = *oldestF
	}
	return s, nil
}

// Retry puts failed messages back in the queue (all of them when no ids
// are given) and wakes the relays. Each goes back to its place in its
// lane: before the lane's newer pending messages. It returns how many it
// put back.
func (o *Outbox) Retry(ctx context.Context, ids ...string) (int64, error) {
	q := `WITH r AS (UPDATE ` + o.table + ` SET status = 'pending', failed_at = NULL WHERE status = 'failed'`
	args := []any{o.channel}
	if len(ids) > 0 {
		q += ` AND id = ANY($2)`
		args = append(args, ids)
	}
	q += ` RETURNING 1) SELECT count(*), pg_notify($1, '') FROM r`
	var n int64
	var dummy any
	if err := o.pool.QueryRow(ctx, q, args...).Scan(&n, &dummy); err != nil {
		return 0, fmt.Errorf("justonce/outbox: retry: %w", err)
	}
	return n, nil
}

// PurgeOptions chooses the failed messages Purge deletes.
type PurgeOptions struct {
	// IDs limits the purge to these messages. Empty: every failed one.
	IDs []string
	// OlderThan limits the purge to messages that failed at least this
	// long ago. Zero: whenever they failed.
	OlderThan time.Duration
}

// Purge deletes failed messages (never pending ones: the relay deletes
// those once published) and returns how many.
func (o *Outbox) Purge(ctx context.Context, opts PurgeOptions) (int64, error) {
	q := `DELETE FROM ` + o.table + ` WHERE status = 'failed' AND failed_at <= now() - $1::interval`
	args := []any{opts.OlderThan}
	if len(opts.IDs) > 0 {
		q += ` AND id = ANY($2)`
		args = append(args, opts.IDs)
	}
	tag, err := o.pool.Exec(ctx, q, args...)
	if err != nil {
		return 0, fmt.Errorf("justonce/outbox: purge: %w", err)
	}
	return tag.RowsAffected(), nil
}

// FailedMessage is a message the broker refused for good.
type FailedMessage struct {
	ID        string
	Broker    Broker
	Topic     string
	Key       []byte
	Attempts  int
	Error     string
	CreatedAt time.Time
	FailedAt  time.Time
}

// Failed lists up to limit failed messages, oldest first (all when limit
// is 0 or less).
func (o *Outbox) Failed(ctx context.Context, limit int) ([]FailedMessage, error) {
	q := `SELECT id, broker, topic, key, attempts, coalesce(error, ''), created_at, coalesce(failed_at, created_at)
FROM ` + o.table + ` WHERE status = 'failed' ORDER BY seq`
	args := []any{}
	if limit > 0 {
		q += ` LIMIT $1`
		args = append(args, limit)
	}
	rows, err := o.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("justonce/outbox: failed: %w", err)
	}
	defer rows.Close()
	var out []FailedMessage
	for rows.Next() {
		var m FailedMessage
		var b string
		if err := rows.Scan(&m.ID, &b, &m.Topic, &m.Key, &m.Attempts, &m.Error, &m.CreatedAt, &m.FailedAt); err != nil {
			return nil, fmt.Errorf("justonce/outbox: failed: %w", err)
		}
		m.Broker = Broker(b)
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("justonce/outbox: failed: %w", err)
	}
	return out, nil
}
