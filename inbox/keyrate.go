package inbox

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
)

// DefaultKeyRateWindow is KeyRate's window when it sets none.
const DefaultKeyRateWindow = time.Minute

// ErrKeyRate: a new key was refused because its tenant started its limit
// of new keys in the current window (KeyRate). The error is a
// *KeyRateError.
var ErrKeyRate = errors.New("justonce/inbox: new-key rate limit reached")

// KeyRate limits how many new keys each tenant starts per time window on a
// request front's route or method (httpbridge.RouteConfig.KeyRate,
// grpcbridge.MethodConfig.KeyRate): a DoS guard, as every new key costs a
// ledger row for its TTL. Windows are fixed (aligned on multiples of
// Window since the Unix epoch). A new key over the limit is refused (429
// with Retry-After, ResourceExhausted with RetryInfo) and leaves nothing
// behind: no ledger row, no count. A key the ledger knows (a replay, a
// request in flight) is never counted nor refused, and a new key whose
// operation does not commit (a 5xx, a panic) does not count either.
//
// The counts live in the ledger's Redis when it has one (one INCR with
// expiry per tenant and window, in one Lua call), and otherwise in
// Postgres (table key_rate, migration 3), where a key's transaction adds
// itself to the count with its commit.
type KeyRate struct {
	// Limit returns the tenant's limit of new keys per Window. 0 or less:
	// no limit for that tenant. Required.
	Limit func(tenant string) int64
	// Window is the length of one window, whole milliseconds. Default
	// DefaultKeyRateWindow (1 minute).
	Window time.Duration
	// Name names the count: the routes and methods whose KeyRate has the
	// same Name share one count per tenant. Default: the route's or
	// method's scope.
	Name string
}

// Validate reports whether the KeyRate is usable. Errors match ErrConfig.
func (r KeyRate) Validate() error {
	switch {
	case r.Limit == nil:
		return fmt.Errorf("%w: KeyRate.Limit is nil", ErrConfig)
	case r.Window < 0 || r.Window%time.Millisecond != 0:
		return fmt.Errorf("%w: KeyRate.Window must be whole milliseconds, not negative", ErrConfig)
	case len(r.Name) > MaxPartLen:
		return fmt.Errorf("%w: KeyRate.Name is longer than %d bytes", ErrConfig, MaxPartLen)
	}
	return nil
}

// KeyRateError says that a new key was refused by a KeyRate. It matches
// ErrKeyRate.
type KeyRateError struct {
	// Name is the count's name (KeyRate.Name, else the scope) and Tenant
	// the tenant whose count is at its limit.
	Name, Tenant string
	// Limit is the tenant's limit of new keys per Window.
	Limit int64
	// Window is the length of the count's windows.
	Window time.Duration
	// RetryAfter is how long until the window ends and new keys are
	// counted afresh.
	RetryAfter time.Duration
}

// Error says whose count refused the key and when its window ends.
func (e *KeyRateError) Error() string {
	return fmt.Sprintf("justonce/inbox: tenant %q started its %d new keys of %s under %q; the window ends in %s",
		e.Tenant, e.Limit, e.Window, e.Name, e.RetryAfter.Round(time.Millisecond))
}

// Is makes a *KeyRateError match ErrKeyRate.
func (e *KeyRateError) Is(target error) bool { return target == ErrKeyRate }

// NewKeyCount is one new key counted against a KeyRate by
// Ledger.CountNewKey.
type NewKeyCount struct {
	l            *Ledger
	name, tenant string
	limit        int64
	window       time.Duration
	start        time.Time // the window's
	redisKey     string    // set when Redis holds the count
	pgCounted    bool      // counted in Postgres outside any transaction
}

// keyRateScript counts a new key unless the window's count is at the
// limit, in one round trip: {1, count} counted, {0, ms until the count
// expires} refused.
var keyRateScript = redis.NewScript(`
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return {0, redis.call('PTTL', KEYS[1])} end
n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {1, n}`)

// keyRateUndoScript takes a count back while the window's key exists.
var keyRateUndoScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('DECR', KEYS[1]) end
return 0`)

// keyRateConstraint is the CHECK of the key_rate table.
const keyRateConstraint = "key_rate_limit"

// CountNewKey counts one new key of tenant against rate, under the count
// name (the route's or method's KeyRate.Name, else its scope). Call it
// once a key is known to be new: inside the handler Do runs (tx is the
// transaction Do gave it, ctx the handler's context), or after
// AcquireLease claimed the key (tx nil). A key over the limit is a
// *KeyRateError (ErrKeyRate) and is not counted; the caller then refuses
// it, leaving nothing behind (the handler returns an error, so that Do
// rolls back; a lease is abandoned).
//
// With the ledger's Redis, the count is taken there at once, and
// NewKeyCount.Undo takes it back when the key's operation does not
// commit. Without Redis (or while Redis fails), inside a transaction the
// count is checked now and written with the transaction's commit (a key
// that would go over the limit at commit, because keys of the same tenant
// committed meanwhile, makes the commit fail: see NewKeyCount.Refused),
// so that only committed keys count; outside one it is written at once.
//
// A limit of 0 or less for the tenant counts nothing.
func (l *Ledger) CountNewKey(ctx context.Context, tx pgx.Tx, rate KeyRate, name, tenant string) (*NewKeyCount, error) {
	if rate.Name != "" {
		name = rate.Name
	}
	c := &NewKeyCount{l: l, name: name, tenant: tenant, window: rate.Window}
	if c.window <= 0 {
		c.window = DefaultKeyRateWindow
	}
	if rate.Limit != nil {
		c.limit = rate.Limit(tenant)
	}
	if c.limit <= 0 {
		return c, nil
	}
	now := time.Now()
	ms := c.window.Milliseconds()
	idx := now.UnixMilli() / ms
	c.start = time.UnixMilli(idx * ms)
	if l.fast != nil {
		counted, err := c.countRedis(ctx, idx, now)
		if err == nil {
			l.fast.ok()
			return counted, nil
		}
		var kre *KeyRateError
		if errors.As(err, &kre) {
			l.fast.ok()
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("justonce/inbox: count a new key: %w", ctx.Err())
		}
		l.fast.failed("key rate", err)
	}
	if tx != nil {
		return c.countInTx(ctx, tx, now)
	}
	return c.countNow(ctx, now)
}

func (c *NewKeyCount) countRedis(ctx context.Context, idx int64, now time.Time) (*NewKeyCount, error) {
	f := c.l.fast
	key := f.cfg.Prefix + "rate:" + url.QueryEscape(c.name) + ":" + url.QueryEscape(c.tenant) + ":" + strconv.FormatInt(idx, 10)
	// The count outlives its window by a second, for clocks a little
	// behind.
	ttl := c.start.Add(c.window).Sub(now) + time.Second
	rctx, cancel := f.call(ctx)
	defer cancel()
	res, err := keyRateScript.Run(rctx, f.cfg.Client, []string{key}, c.limit, ttl.Milliseconds()).Int64Slice()
	if err != nil {
		return nil, err
	}
	if len(res) != 2 {
		return nil, fmt.Errorf("justonce/inbox: key rate script answered %v", res)
	}
	if res[0] == 0 {
		return nil, c.refused(now, c.start.Add(c.window))
	}
	c.redisKey = key
	return c, nil
}

// countInTx checks the count and queues the key's increment with the
// transaction's commit.
func (c *NewKeyCount) countInTx(ctx context.Context, tx pgx.Tx, now time.Time) (*NewKeyCount, error) {
	table := c.l.keyRateTable()
	var start time.Time
	var keys int64
	err := tx.QueryRow(ctx, replaceTable(keyRatePeekSQL, table), c.name, c.tenant).Scan(&start, &keys)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return nil, storeErr("key rate", err)
	case !start.Before(c.start) && keys >= c.limit:
		return nil, c.refused(now, start.Add(c.window))
	}
	sql := replaceTable(keyRateCountSQL, table)
	args := []any{c.name, c.tenant, c.start, c.limit}
	if AtCommit(ctx, tx, sql, args...) {
		return c, nil
	}
	// Not the transaction Do gave a handler: count now, in a savepoint,
	// so that a refusal leaves the transaction usable.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, storeErr("key rate", err)
	}
	if _, err := sp.Exec(ctx, sql, args...); err != nil {
		_ = sp.Rollback(ctx)
		if c.isOver(err) {
			return nil, c.refused(now, c.start.Add(c.window))
		}
		return nil, storeErr("key rate", err)
	}
	if err := sp.Commit(ctx); err != nil {
		return nil, storeErr("key rate", err)
	}
	return c, nil
}

// countNow counts the key at once, in a statement of its own.
func (c *NewKeyCount) countNow(ctx context.Context, now time.Time) (*NewKeyCount, error) {
	_, err := c.l.pool.Exec(ctx, replaceTable(keyRateCountSQL, c.l.keyRateTable()), c.name, c.tenant, c.start, c.limit)
	switch {
	case c.isOver(err):
		return nil, c.refused(now, c.start.Add(c.window))
	case err != nil:
		return nil, storeErr("key rate", err)
	}
	c.pgCounted = true
	return c, nil
}

// Undo takes the count back, for a key whose operation did not commit
// after all (its handler failed, its lease was abandoned). Counts written
// with a transaction's commit need none: they went with the rollback. It
// is best effort: a count it cannot take back stays until its window
// ends. Undo on nil does nothing.
func (c *NewKeyCount) Undo(ctx context.Context) {
	if c == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	switch {
	case c.redisKey != "":
		f := c.l.fast
		rctx, rcancel := f.call(ctx)
		defer rcancel()
		if err := keyRateUndoScript.Run(rctx, f.cfg.Client, []string{c.redisKey}).Err(); err != nil {
			f.failed("key rate undo", err)
		}
		c.redisKey = ""
	case c.pgCounted:
		_, _ = c.l.pool.Exec(ctx, replaceTable(keyRateUndoSQL, c.l.keyRateTable()), c.name, c.tenant, c.start)
		c.pgCounted = false
	}
}

// Refused reports whether err, the error of the transaction in which the
// key was counted (Do's), says that the count refused the key at commit:
// keys of the same tenant committed while its handler ran, and this one
// would have gone over the limit. The transaction rolled back whole.
func (c *NewKeyCount) Refused(err error) (*KeyRateError, bool) {
	if c == nil || err == nil || !c.isOver(err) {
		return nil, false
	}
	now := time.Now()
	ms := c.window.Milliseconds()
	end := time.UnixMilli((now.UnixMilli()/ms + 1) * ms)
	return c.refused(now, end), true
}

func (c *NewKeyCount) isOver(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514" && pgErr.ConstraintName == keyRateConstraint
}

func (c *NewKeyCount) refused(now, end time.Time) *KeyRateError {
	return &KeyRateError{Name: c.name, Tenant: c.tenant, Limit: c.limit, Window: c.window, RetryAfter: max(end.Sub(now), time.Millisecond)}
}

// keyRateTable is the quoted key_rate table of the ledger's schema.
func (l *Ledger) keyRateTable() string {
	if l.cfg.Schema == "" {
		return pgx.Identifier{"key_rate"}.Sanitize()
	}
	return pgx.Identifier{l.cfg.Schema, "key_rate"}.Sanitize()
}

func replaceTable(sql, table string) string { return strings.ReplaceAll(sql, "{T}", table) }
