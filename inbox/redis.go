package inbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/internal/ledgerkey"
)

// RedisConfig puts Redis in front of the ledger: a lock, so concurrent
// duplicates are turned away in one Redis round trip without taking a
// Postgres connection, and a replay cache, so a duplicate is answered in one
// Redis round trip. Postgres stays the arbiter: when Redis is down, slow or
// failing, every call goes on through Postgres alone (counted in
// Counters.RedisFallbacks and logged once per episode; the episode's end
// is counted in Counters.RedisRecoveries). Dedupe is never skipped.
//
// A cached entry goes a second before its row expires (a tenth of the TTL
// when that is shorter; the row's expiry is on the database's clock, the
// entry's TTL on this process's), and Redis
// must keep what it acknowledged: a failover to a replica that had not yet
// received Release's deletion, or a restart from a snapshot older than it,
// brings the old entry back until its TTL ends.
//
// The cache only ever holds what Postgres answered, and it is written only
// by a call that still holds the key's Redis lock, in the same Redis
// operation that checks the lock. Ledger.Release and Ledger.RecordFailure
// change the row in Postgres first and then delete both the cached result
// and the lock, so a call that read the old row before the change can no
// longer cache it: once Release has returned without error, no call that
// starts afterwards is answered from the old result. Release fails (and
// changes nothing) while Redis does not answer, and reports ErrCacheStale
// when the row changed but the cached entry could not be deleted.
//
// Tested on a real Redis Cluster of three masters: keys spread over every
// master, and with one master killed mid-run and restarted, calls went on
// through Postgres and no effect was doubled or lost. Tested behind
// Sentinel too (a failover client): with the master killed while handlers
// held keys whose locks the promoted replica had never received, their
// duplicates took the lock on the new master and Postgres turned them
// away.
type RedisConfig struct {
	// Client is a single node, Sentinel or Cluster client. Set its
	// ContextTimeoutEnabled option so that Timeout bounds socket reads.
	Client redis.UniversalClient
	// Prefix of every key. Default "justonce:", or "justonce:<schema>:"
	// with Config.Schema. Keys are
	// <prefix>{<hash>}:<scope>:<tenant>:<id>:lock|res, the hash tag keeping
	// a key's lock and cached result on one Cluster slot. Nothing else in
	// a key names the ledger: ledgers that share a Redis (in different
	// databases, or told apart by search_path rather than Config.Schema)
	// must each have their own Prefix, or one answers the other's keys
	// from its cache. Every process of one ledger must use the same
	// Prefix, or Release leaves the others' cached answers behind.
	Prefix string
	// Timeout of each Redis call. Default 50 ms.
	Timeout time.Duration
	// LockTTL is the lock's lifetime; it is extended every third of it
	// while the handler runs, and a crashed holder's lock lapses after it.
	// Default 10 s.
	LockTTL time.Duration
	// MaxCachedBytes: results whose encoding is larger are not cached
	// (Postgres serves them); nothing is truncated. Default 64 KiB.
	MaxCachedBytes int
}

func (c *RedisConfig) setDefaults() error {
	if c.Client == nil {
		return fmt.Errorf("%w: Redis.Client is nil", ErrConfig)
	}
	if c.Prefix == "" {
		c.Prefix = "justonce:"
	}
	if c.Timeout <= 0 {
		c.Timeout = 50 * time.Millisecond
	}
	if c.LockTTL <= 0 {
		c.LockTTL = 10 * time.Second
	}
	if c.MaxCachedBytes == 0 {
		c.MaxCachedBytes = 64 << 10
	}
	return nil
}

// acquireScript answers from the cache, or takes the lock, in one round
// trip: {1, value} cached; {2} locked by us; {3} someone else holds it.
var acquireScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v then return {1, v} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {3}`)

// finishScript stores the result (when given) and releases our lock, but
// only while the lock is still ours: Release deletes the lock after it
// changed the row, so a call that read the old row cannot cache it after
// the release. 1: done; 0: the lock was not ours any more, nothing written.
var finishScript = redis.NewScript(`
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
redis.call('DEL', KEYS[2])
return 1`)

// extendScript extends our lock; 0 when it is not ours any more.
var extendScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0`)

type redisFront struct {
	cfg   RedisConfig
	log   *slog.Logger
	stats *counters
	down  atomic.Bool

	logMu    sync.Mutex
	lastWarn time.Time // when the last episode's warning was logged
	warned   bool      // a warning is out with no recovery notice yet

	// Test hooks, nil in production: beforeFinish runs after Postgres
	// answered and before the cache write; afterChange runs after Release
	// or RecordFailure changed the row and before the cache is
	// invalidated.
	beforeFinish func(Key)
	afterChange  func(Key)
}

// episodeGap: failures within this long of the last warning belong to the
// same episode (a restart fails a few pooled connections after the first
// success).
const episodeGap = 30 * time.Second

func newRedisFront(cfg RedisConfig, log *slog.Logger, stats *counters) *redisFront {
	return &redisFront{cfg: cfg, log: log, stats: stats}
}

func (f *redisFront) keys(k Key) (res, lock string) {
	return ledgerkey.RedisKeys(f.cfg.Prefix, k.Scope, k.Tenant, k.ID)
}

// failed counts a Redis failure and logs the first of an episode.
func (f *redisFront) failed(op string, err error) {
	f.stats.redisFallbacks.Add(1)
	if !f.down.CompareAndSwap(false, true) {
		return
	}
	f.logMu.Lock()
	defer f.logMu.Unlock()
	if time.Since(f.lastWarn) > episodeGap {
		f.lastWarn = time.Now()
		f.warned = true
		f.log.Warn("justonce: Redis unavailable, continuing on Postgres alone", "op", op, "err", err)
	}
}

func (f *redisFront) ok() {
	if !f.down.CompareAndSwap(true, false) {
		return
	}
	f.stats.redisRecoveries.Add(1)
	f.logMu.Lock()
	defer f.logMu.Unlock()
	if f.warned {
		f.warned = false
		f.log.Info("justonce: Redis is back, fast path resumed")
	}
}

func (f *redisFront) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, f.cfg.Timeout)
}

type acquireState int

const (
	redisDown acquireState = iota
	redisHit
	redisLocked
	redisBusy
	redisCancelled
)

func (f *redisFront) acquire(ctx context.Context, k Key, token string) (acquireState, string) {
	res, lock := f.keys(k)
	cctx, cancel := f.call(ctx)
	defer cancel()
	v, err := acquireScript.Run(cctx, f.cfg.Client, []string{res, lock}, token, f.cfg.LockTTL.Milliseconds()).Slice()
	if ctx.Err() != nil {
		// The caller gave up: not a Redis failure, and no answer.
		return redisCancelled, ""
	}
	if err != nil || len(v) == 0 {
		if err == nil {
			err = fmt.Errorf("empty script reply")
		}
		f.failed("acquire", err)
		return redisDown, ""
	}
	f.ok()
	switch n, _ := v[0].(int64); n {
	case 1:
		s, _ := v[1].(string)
		return redisHit, s
	case 2:
		return redisLocked, ""
	default:
		return redisBusy, ""
	}
}

// do runs pg behind the Redis lock and cache.
func (f *redisFront) do(ctx context.Context, l *Ledger, req Request, pg func() (Outcome, error)) (Outcome, error) {
	if err := ctx.Err(); err != nil {
		return Outcome{}, fmt.Errorf("justonce/inbox: %w", err)
	}
	token := newToken()
	state, cached := f.acquire(ctx, req.Key, token)
	switch state {
	case redisCancelled:
		// Redis may have taken the lock before the caller gave up: drop
		// it (only if it is ours), or a retry would be turned away as in
		// flight until it lapses.
		f.finish(ctx, req.Key, token, "", 0)
		return Outcome{}, fmt.Errorf("justonce/inbox: %w", ctx.Err())
	case redisHit:
		if out, ok := decodeCached(req, cached); ok {
			return out, nil
		}
		// An entry this build cannot read: ask Postgres.
		return pg()
	case redisBusy:
		return Outcome{Disposition: InFlight}, nil
	case redisDown:
		return pg()
	}

	stop := f.keepLock(ctx, req.Key, token)
	finished := false
	var out Outcome
	var err error
	defer func() {
		// Also when the handler panics: stop extending the lock and release
		// it, or every retry would be turned away as in flight.
		stop()
		if !finished {
			f.finish(ctx, req.Key, token, "", 0)
		}
	}()
	out, err = pg()
	stop()
	var value string
	var ttl time.Duration
	if err == nil && out.Record != nil && (out.Disposition == Executed || out.Disposition == Duplicate) {
		value, ttl = f.encode(out, l.resultTTL(req))
	}
	if f.beforeFinish != nil {
		f.beforeFinish(req.Key)
	}
	finished = true
	f.finish(ctx, req.Key, token, value, ttl)
	return out, err
}

// finish stores value (when given) and releases our lock.
func (f *redisFront) finish(ctx context.Context, k Key, token, value string, ttl time.Duration) {
	res, lock := f.keys(k)
	// Try twice: right after a Redis restart the first call may fail on a
	// stale pooled connection, and a lock left behind would turn duplicates
	// away as in flight until it lapses.
	for try := 0; try < 2; try++ {
		cctx, cancel := f.call(context.WithoutCancel(ctx))
		ferr := finishScript.Run(cctx, f.cfg.Client, []string{res, lock}, token, value, ttl.Milliseconds()).Err()
		cancel()
		if ferr == nil {
			f.ok()
			break
		}
		f.failed("finish", ferr)
	}
}

// keepLock extends the lock every third of its TTL until stop is called.
func (f *redisFront) keepLock(ctx context.Context, k Key, token string) (stop func()) {
	_, lock := f.keys(k)
	var mu sync.Mutex
	stopped := false
	var t *time.Timer
	every := f.cfg.LockTTL / 3
	tick := func() {
		cctx, cancel := f.call(context.WithoutCancel(ctx))
		err := extendScript.Run(cctx, f.cfg.Client, []string{lock}, token, f.cfg.LockTTL.Milliseconds()).Err()
		cancel()
		if err != nil {
			f.failed("extend", err)
		}
		mu.Lock()
		if !stopped {
			t.Reset(every)
		}
		mu.Unlock()
	}
	mu.Lock()
	t = time.AfterFunc(every, tick)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		t.Stop()
		mu.Unlock()
	}
}

// Release and RecordFailure against a concurrent fast-path call (one that
// holds the key's Redis lock, read the row in Postgres and is about to
// cache what it read). The writer changes the row in Postgres (P), then
// deletes the cached result and the lock in one Redis command (R). The
// call reads the row (r) and then, in one script, writes the cache only if
// its lock is still there (w). Every order:
//
//   - r before P, w before R: the old result is cached, and R deletes it.
//   - r before P, w after R: the lock is gone, so w writes nothing.
//   - r after P: the call read the new state, and caching it is correct.
//
// A call that takes the lock after R reads Postgres after P. A lock that
// lapsed and was taken by another call has another token: w writes nothing
// either. A call that was answered from the cache before R may return the
// old result while Release runs; no call that starts after Release returned
// can. Redis is checked before P (ping), so that a Redis that does not
// answer fails the release before anything changed; R is retried a few
// times, and when it still fails the error is ErrCacheStale: the row did
// change, and the old entry may be served until its TTL ends.

// ping checks that Redis answers for k's slot before the row is changed.
func (f *redisFront) ping(ctx context.Context, k Key) error {
	res, _ := f.keys(k)
	cctx, cancel := f.call(ctx)
	defer cancel()
	err := f.cfg.Client.PTTL(cctx, res).Err()
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// invalidateTries bounds the retries of a cache invalidation.
const invalidateTries = 3

// invalidate drops k's cached result and its lock, retrying a few times. It
// runs after the row changed, so the caller's cancellation does not stop
// it.
func (f *redisFront) invalidate(ctx context.Context, k Key) error {
	res, lock := f.keys(k)
	ctx = context.WithoutCancel(ctx)
	var err error
	for try := 0; try < invalidateTries; try++ {
		if try > 0 {
			time.Sleep(time.Duration(try*try) * 20 * time.Millisecond)
		}
		cctx, cancel := f.call(ctx)
		err = f.cfg.Client.Del(cctx, res, lock).Err()
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}

// cacheEntry is a cached row, enough to answer a duplicate.
type cacheEntry struct {
	V  int                 `json:"v"`
	S  Status              `json:"s"`
	F  []byte              `json:"f,omitempty"`
	C  int                 `json:"c,omitempty"`
	H  map[string][]string `json:"h,omitempty"`
	B  []byte              `json:"b,omitempty"`
	E  string              `json:"e,omitempty"`
	Sr Source              `json:"sr,omitempty"`
	Cr int64               `json:"cr"`
	X  int64               `json:"x"`
}

const cacheVersion = 1

// cacheMargin is how long before its row expires a cached entry goes (a
// tenth of the row's TTL when that is shorter).
const cacheMargin = time.Second

func (f *redisFront) encode(out Outcome, resultTTL time.Duration) (string, time.Duration) {
	rec := out.Record
	// ExpiresAt is on the database's clock, the TTL counted on this one:
	// the entry goes a margin before the row expires, so that a clock up
	// to that far behind the database's does not keep answering for an
	// expired row.
	ttl := time.Until(rec.ExpiresAt) - min(cacheMargin, rec.ExpiresAt.Sub(rec.CreatedAt)/10)
	if resultTTL > 0 && !out.Result.IsZero() {
		// A result with a clock of its own (Request.ResultTTL) is cached
		// until a margin before that clock, counted from the row's
		// creation (its completion is later): Postgres answers after it.
		ttl = min(ttl, time.Until(rec.CreatedAt.Add(resultTTL))-min(cacheMargin, resultTTL/10))
	}
	if ttl <= 0 || rec.Status == StatusProcessing || rec.ResultGone {
		return "", 0
	}
	b, err := json.Marshal(cacheEntry{V: cacheVersion, S: rec.Status, F: rec.Fingerprint, C: out.Result.Code,
		H: out.Result.Header, B: out.Result.Body, E: rec.Error, Sr: rec.Source,
		Cr: rec.CreatedAt.UnixMicro(), X: rec.ExpiresAt.UnixMicro()})
	if err != nil || len(b) > f.cfg.MaxCachedBytes {
		return "", 0
	}
	return string(b), ttl
}

func decodeCached(req Request, s string) (Outcome, bool) {
	var e cacheEntry
	if err := json.Unmarshal([]byte(s), &e); err != nil || e.V != cacheVersion {
		return Outcome{}, false
	}
	res := Result{Code: e.C, Header: e.H, Body: e.B}
	rec := &Record{Key: req.Key, Status: e.S, Fingerprint: e.F, Source: e.Sr, Result: res, Error: e.E,
		CreatedAt: time.UnixMicro(e.Cr), ExpiresAt: time.UnixMicro(e.X)}
	if !time.Now().Before(rec.ExpiresAt) {
		return Outcome{}, false
	}
	if fingerprintDiffers(req.Fingerprint, e.F) {
		return Outcome{Disposition: Mismatch, Record: rec, Cached: true}, true
	}
	return Outcome{Disposition: Duplicate, Record: rec, Result: res, Cached: true}, true
}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
