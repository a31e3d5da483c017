package inbox

// SetRedisHooks installs test hooks on the Redis front: beforeFinish runs
// after Postgres answered a fast-path call and before its cache write;
// afterChange runs after Release or RecordFailure changed the row and
// before the cache is invalidated. Set them before any concurrent use.
func (l *Ledger) SetRedisHooks(beforeFinish, afterChange func(Key)) {
	l.fast.beforeFinish = beforeFinish
	l.fast.afterChange = afterChange
}
