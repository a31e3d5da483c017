package inbox

// JanitorLockKey exposes the janitor's advisory lock key to tests.
func (l *Ledger) JanitorLockKey() int64 { return l.store.janitorLockKey() }

// RedisKeys exposes the Redis key names of k to tests.
func (l *Ledger) RedisKeys(k Key) (res, lock string) { return l.fast.keys(k) }
