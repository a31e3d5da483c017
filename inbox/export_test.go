package inbox

// JanitorLockKey exposes the janitor's advisory lock key to tests.
func (l *Ledger) JanitorLockKey() int64 { return l.store.janitorLockKey() }
