package inbox

import (
	"context"
	"errors"
	"strings"
)

// JanitorLockSQL returns a statement taking the janitor's advisory lock, for
// tests.
func (l *Ledger) JanitorLockSQL() (string, int64) {
	return strings.NewReplacer("{T}", l.store.table).Replace(
		`SELECT pg_advisory_xact_lock($1::bigint # (('{T}'::regclass)::oid::bigint << 32))`), l.store.janitorLockKey()
}

// RedisKeys exposes the Redis key names of k to tests.
func (l *Ledger) RedisKeys(k Key) (res, lock string) { return l.fast.keys(k) }

// ProbeOnly makes the write-once claim of l, a time-bucket ledger, look
// keys up in the named bucket tables only (one primary-key probe each, in
// one statement) and write rows straight into insertInto. It is not a safe
// ledger (rows in the other buckets are not seen): it exists so that a
// benchmark can measure what a claim costs per bucket it probes.
func (l *Ledger) ProbeOnly(ctx context.Context, tables []string, insertInto string) error {
	s := l.store
	if err := s.detect(ctx, l.pool); err != nil {
		return err
	}
	if !s.buckets {
		return errors.New("ProbeOnly: not a time-bucket ledger")
	}
	parts := make([]string, len(tables))
	for i, t := range tables {
		parts[i] = strings.ReplaceAll(s.lookupSQL, s.table, s.ident(t))
	}
	s.lookupSQL = strings.Join(parts, " UNION ALL ")
	s.insertDoneSQL = strings.Replace(s.insertDoneSQL, "INSERT INTO "+s.table, "INSERT INTO "+s.ident(insertInto), 1)
	return nil
}
