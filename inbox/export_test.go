package inbox

import (
	"context"
	"strings"
	"time"
)

// JanitorLockSQL returns a statement taking the janitor's advisory lock, for
// tests.
func (l *Ledger) JanitorLockSQL() (string, int64) {
	return strings.NewReplacer("{T}", l.store.rows.table).Replace(
		`SELECT pg_advisory_xact_lock($1::bigint # (('{T}'::regclass)::oid::bigint << 32))`), l.store.rows.janitorLockKey()
}

// RedisKeys exposes the Redis key names of k to tests.
func (l *Ledger) RedisKeys(k Key) (res, lock string) { return l.fast.keys(k) }

// ViewDBTime returns the database time the ledger's bucket view was loaded
// at (zero without a view), and makes every claim from now on load the view
// again, for tests.
func (l *Ledger) ViewDBTime() time.Time {
	if !l.store.ready.Load() {
		return time.Time{}
	}
	s, ok := l.store.s.(*bucketStore)
	if !ok {
		return time.Time{}
	}
	s.viewMaxAge = 0
	if v := s.view.Load(); v != nil {
		return v.dbTime
	}
	return time.Time{}
}

// ShardOf exposes the key's shard on the time-bucket layout to tests.
func ShardOf(k Key, shards int) int { return shardOf(k, shards) }

// DropAtOnce makes the janitor of l, a time-bucket ledger, drop a detached
// bucket's table in the same pass, for tests that watch the drop.
func (l *Ledger) DropAtOnce(ctx context.Context) error {
	s, err := l.store.get(ctx, l.pool)
	if err != nil {
		return err
	}
	if b, ok := s.(*bucketStore); ok {
		b.dropGrace = 0
	}
	return nil
}

// RowColumns are the columns a look-up reads for a row (rowCols), in
// order, for tests.
func RowColumns() []string {
	var names []string
	for _, c := range strings.Split(rawRowCols, ",") {
		names = append(names, strings.TrimPrefix(strings.TrimSpace(c), "x."))
	}
	return names
}

// SetSavepointsOnly makes every DoEach run of l go on savepoints (on:
// true) or try the optimistic path first (false), for benchmarks.
func SetSavepointsOnly(l *Ledger, on bool) { l.savepointsOnly = on }

// OnStoreOpen makes f run as each caller starts finding out the ledger's
// layout (before its first use), for tests.
func (l *Ledger) OnStoreOpen(f func()) { l.store.onOpen = f }
