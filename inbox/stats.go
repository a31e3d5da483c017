package inbox

import "sync/atomic"

// Counters are the ledger's running totals since New. Read them with
// Ledger.Counters; the metrics package exports them to Prometheus.
type Counters struct {
	Executed       uint64 // handlers run and committed
	Duplicates     uint64 // duplicates answered (from Postgres or Redis)
	CacheHits      uint64 // duplicates answered from the Redis replay cache
	InFlight       uint64 // calls answered InFlight
	Mismatches     uint64 // same key, other fingerprint
	Errors         uint64 // calls that returned an error (handler or store)
	RedisFallbacks uint64 // Redis calls that failed or timed out; Postgres carried on alone
	// RedisRecoveries counts the ends of fallback episodes: a Redis call
	// answered after one or more had failed (after a Sentinel failover,
	// the first call the new master answers): the fast path is back.
	RedisRecoveries uint64
	LeasesLost      uint64 // leases found taken over or released when renewing, completing or recording a step
	// Overloaded counts calls that gave up waiting for a connection
	// (Request.AcquireWait ran out with the pool fully in use): shed,
	// nothing ran. They are counted in Errors too.
	Overloaded uint64

	// Steps (DoSteps) this process ran and recorded, by kind: Postgres
	// steps (Steps.Tx), outside calls (Steps.Call) and compensations.
	StepsTx, StepsCall, StepsCompensate uint64
	// StepsResumed counts steps skipped because they were recorded
	// already: an attempt resuming after an earlier one failed, crashed or
	// lost its lease (compensations resumed included).
	StepsResumed uint64
}

type counters struct {
	executed, duplicates, cacheHits, inFlight, mismatches, errors, redisFallbacks, redisRecoveries, leasesLost, overloaded atomic.Uint64

	stepsTx, stepsCall, stepsCompensate, stepsResumed atomic.Uint64
}

// Counters returns a snapshot of the running totals.
func (l *Ledger) Counters() Counters {
	c := &l.stats
	return Counters{
		Executed: c.executed.Load(), Duplicates: c.duplicates.Load(), CacheHits: c.cacheHits.Load(),
		InFlight: c.inFlight.Load(), Mismatches: c.mismatches.Load(), Errors: c.errors.Load(),
		RedisFallbacks: c.redisFallbacks.Load(), RedisRecoveries: c.redisRecoveries.Load(), LeasesLost: c.leasesLost.Load(),
		Overloaded: c.overloaded.Load(),
		StepsTx:    c.stepsTx.Load(), StepsCall: c.stepsCall.Load(), StepsCompensate: c.stepsCompensate.Load(),
		StepsResumed: c.stepsResumed.Load(),
	}
}

func (l *Ledger) observe(_ Request, out Outcome, err error) {
	c := &l.stats
	if err != nil {
		c.errors.Add(1)
		return
	}
	switch out.Disposition {
	case Executed:
		c.executed.Add(1)
	case Duplicate:
		c.duplicates.Add(1)
		if out.Cached {
			c.cacheHits.Add(1)
		}
	case InFlight:
		c.inFlight.Add(1)
	case Mismatch:
		c.mismatches.Add(1)
	}
}
