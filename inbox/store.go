package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/justonce/justonce/internal/ledgerkey"
)

// pgStore holds every SQL statement of the ledger. The ledger logic speaks to
// it in verbs (claim, complete, renew, ...); another backend would implement
// the same verbs.
type pgStore struct {
	schema string
	table  string // quoted, schema-qualified when a schema is configured
	seq    string // quoted fencing sequence

	// The layout is detected at first use (detect); buckets is set for
	// the time-bucket layout, whose claim and failure statements differ.
	mu      sync.Mutex
	ready   atomic.Bool
	buckets bool
	shards  int           // time buckets: how many shards keys are spread over
	width   time.Duration // time buckets: how long a shard writes into one bucket
	maxTTL  time.Duration // time buckets: the longest TTL a row may have
	oid     string        // time buckets: the table's OID, shifted, for lock keys
	// time buckets: how long a view of the buckets is used, and how long
	// after its detach a bucket's table is dropped (see viewTimes)
	viewMaxAge, dropGrace time.Duration
	view                  atomic.Pointer[bucketView]

	claimSQL, claimOneSQL, lookupSQL, lookupAtSQL, completeSQL string
	renewSQL, leaseCompleteSQL, leaseFailSQL, leaseDelSQL      string
	releaseSQL, failSQL, purgeSQL, statsSQL, liveSQL           string
	releaseStuckSQL                                            string
	knownSQL                                                   string

	// The plain layout's write-once path (see Ledger.Do): the claim takes
	// the key's lock and looks the key up; the row is written once,
	// complete, with the commit.
	lockOneSQL, lockManySQL, lookupManySQL, insertDoneSQL, insertManySQL string
}

// querier is what pgx.Tx, *pgx.Conn and *pgxpool.Pool have in common.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func newPGStore(schema string) *pgStore {
	ident := func(name string) string {
		if schema == "" {
			return pgx.Identifier{name}.Sanitize()
		}
		return pgx.Identifier{schema, name}.Sanitize()
	}
	s := &pgStore{schema: schema, table: ident("processed_events"), seq: ident("processed_events_fencing_seq")}
	// {OID} mixes the table's identity into advisory lock keys, so that
	// ledgers in different schemas of one database never contend.
	oid := "(('" + strings.ReplaceAll(s.table, "'", "''") + "'::regclass)::oid::bigint << 32)"
	r := strings.NewReplacer("{T}", s.table, "{SEQ}", s.seq, "{OID}", oid)

	// recordCols lists a row's columns under an alias, in scanRecord order.
	cols := func(a string) string { return strings.ReplaceAll(lookupCols, "x.", a+".") }

	// The claim inserts the row, or takes over a row whose retention
	// expired or (lease mode) whose lease expired with the same
	// fingerprint. A per-key advisory try-lock makes a concurrent claimer
	// answer at once instead of waiting on the unique index. Lease mode
	// ($9 > 0) writes status processing with a lease and a fencing token
	// from the sequence; transactional mode writes done (the row becomes
	// visible only at commit, with the effect).
	insert := func(source, returning string) string {
		return r.Replace(`INSERT INTO {T} AS t (scope, tenant, event_id, status, fingerprint, source, principal,
		lease_owner, lease_until, fencing_token, attempts, created_at, completed_at, expires_at)
	` + source + `
	ON CONFLICT (scope, tenant, event_id) DO UPDATE SET
		status = EXCLUDED.status, fingerprint = EXCLUDED.fingerprint, source = EXCLUDED.source,
		principal = EXCLUDED.principal, lease_owner = EXCLUDED.lease_owner,
		lease_until = EXCLUDED.lease_until, fencing_token = EXCLUDED.fencing_token,
		attempts = CASE WHEN t.expires_at <= now() THEN 1 ELSE t.attempts + 1 END,
		response_code = NULL, response_headers = NULL, response_body = NULL, error = NULL,
		duration_us = NULL, created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at,
		expires_at = EXCLUDED.expires_at
	WHERE t.expires_at <= now()
		OR (t.status = 'processing' AND t.lease_until <= now()
			AND (EXCLUDED.fingerprint IS NULL OR t.fingerprint IS NULL OR t.fingerprint = EXCLUDED.fingerprint))
	RETURNING ` + returning)
	}
	// A claim returns only what the request does not already say.
	const claimedCols = `t.fencing_token, t.attempts, t.created_at, t.expires_at, t.lease_until`
	modeCols := `CASE WHEN $9::bigint > 0 THEN 'processing' ELSE 'done' END`
	leaseCols := `CASE WHEN $9::bigint > 0 THEN $10::text END,
		CASE WHEN $9::bigint > 0 THEN now() + $9::bigint * interval '1 microsecond' END,
		CASE WHEN $9::bigint > 0 THEN nextval('{SEQ}') ELSE 0 END,
		1, now(),
		CASE WHEN $9::bigint > 0 THEN NULL ELSE now() END`

	// claimOneSQL: one key, scalar parameters; a plain INSERT that plans in
	// microseconds. It returns the claimed row, or nothing (then look up).
	s.claimOneSQL = insert(`SELECT $1::text, $2::text, $3::text, `+modeCols+`, $4::bytea, $5::text, $6::text,
		`+leaseCols+`, now() + $7::bigint * interval '1 microsecond'
	WHERE pg_try_advisory_xact_lock($8::bigint # {OID})`, claimedCols)

	// claimSQL: a whole batch in one statement (array parameters). It
	// returns, per input ordinal, the claimed row or the existing one (NULL
	// columns when none is visible).
	s.claimSQL = r.Replace(`
WITH u AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::bigint[], $8::bigint[])
		WITH ORDINALITY AS u(scope, tenant, event_id, fingerprint, source, principal, ttl_us, lock_key, ord)
), ins AS (
	` + insert(`SELECT u.scope, u.tenant, u.event_id, `+modeCols+`, u.fingerprint, u.source, u.principal,
		`+leaseCols+`, now() + u.ttl_us * interval '1 microsecond'
	FROM u
	WHERE pg_try_advisory_xact_lock(u.lock_key # {OID})
	ORDER BY u.ord`, `t.scope, t.tenant, t.event_id, `+cols("t")) + `
)
SELECT u.ord, true, ` + cols("ins") + `
	FROM u JOIN ins ON ins.scope = u.scope AND ins.tenant = u.tenant AND ins.event_id = u.event_id
UNION ALL
SELECT u.ord, false, ` + cols("e") + `
	FROM u LEFT JOIN {T} e ON e.scope = u.scope AND e.tenant = u.tenant AND e.event_id = u.event_id
	WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.scope = u.scope AND ins.tenant = u.tenant AND ins.event_id = u.event_id)`)

	// lockOneSQL takes one key's advisory lock (without waiting) and
	// returns the transaction's time, which the row will carry. The key is
	// looked up by a separate statement after it: that statement's snapshot
	// is taken once the lock is held, so it sees every row committed by an
	// earlier holder of the lock.
	s.lockOneSQL = r.Replace(`SELECT pg_try_advisory_xact_lock($1::bigint # {OID}), now()`)
	s.lockManySQL = r.Replace(`SELECT array_agg(pg_try_advisory_xact_lock(u.k # {OID}) ORDER BY u.o), now()
		FROM unnest($1::bigint[]) WITH ORDINALITY AS u(k, o)`)
	s.lookupManySQL = r.Replace(`SELECT u.ord, ` + cols("e") + `
		FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(scope, tenant, event_id, ord)
		JOIN {T} e ON e.scope = u.scope AND e.tenant = u.tenant AND e.event_id = u.event_id`)
	// insertDoneSQL writes a transactional-mode row, complete, under the
	// key's lock, for a key the lock holder found absent: a plain INSERT
	// (Do's on the plain layout; the time-bucket layout's name the bucket,
	// see shardStatements).
	// A conflict (a row written without the lock) fails it, and with it
	// the commit.
	s.insertDoneSQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at)
	VALUES ($1, $2, $3, 'done', $4, $5, $6, $7, $8, $9, $10, now(), clock_timestamp(),
		now() + $11::bigint * interval '1 microsecond')`)
	s.insertManySQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at)
	SELECT u.scope, u.tenant, u.event_id, 'done', u.fingerprint, u.source, u.principal,
		u.code, u.header, u.body, u.duration_us, now(), clock_timestamp(), now() + u.ttl_us * interval '1 microsecond'
	FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
		$7::integer[], $8::text[]::jsonb[], $9::bytea[], $10::bigint[], $11::bigint[])
		AS u(scope, tenant, event_id, fingerprint, source, principal, code, header, body, duration_us, ttl_us)`)

	s.lookupSQL = r.Replace(`SELECT ` + cols("e") + ` FROM {T} e WHERE e.scope = $1 AND e.tenant = $2 AND e.event_id = $3`)
	// lookupAtSQL is Do's look-up: rowCols only, read with recordScan's
	// destAt and recordAt, which tell liveness from the transaction's
	// now() that Do's lock statement returned. Sixteen columns are what
	// pgx describes in a buffer of the connection's own: a wider result
	// allocates its description anew, and it stays on the heap while the
	// handler runs.
	s.lookupAtSQL = r.Replace(`SELECT ` + strings.ReplaceAll(rowCols, "x.", "e.") +
		` FROM {T} e WHERE e.scope = $1 AND e.tenant = $2 AND e.event_id = $3`)

	s.completeSQL = r.Replace(`UPDATE {T} SET response_code = $4, response_headers = $5, response_body = $6,
		completed_at = clock_timestamp(), duration_us = $7
		WHERE scope = $1 AND tenant = $2 AND event_id = $3`)

	s.renewSQL = r.Replace(`UPDATE {T} SET lease_until = now() + $5::bigint * interval '1 microsecond'
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseCompleteSQL = r.Replace(`UPDATE {T} SET status = 'done', response_code = $5, response_headers = $6,
		response_body = $7, duration_us = $8, completed_at = now(), lease_until = NULL
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseFailSQL = r.Replace(`UPDATE {T} SET status = 'failed', error = $5, duration_us = $6,
		completed_at = now(), lease_until = NULL
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.leaseDelSQL = r.Replace(`DELETE FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3 AND fencing_token = $4 AND status = 'processing'`)

	s.releaseSQL = r.Replace(`DELETE FROM {T} WHERE scope = $1 AND tenant = $2 AND event_id = $3`)

	// releaseStuckSQL deletes the row unless it is done and unexpired, or
	// processing under a lease that still runs (whatever its expiry, as
	// the janitor keeps it), and says whether a row was there (the outer
	// query sees the table as before the DELETE).
	s.releaseStuckSQL = r.Replace(`WITH d AS (DELETE FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3
			AND (status <> 'done' OR expires_at <= now())
			AND NOT (status = 'processing' AND lease_until > now())
		RETURNING 1)
	SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM {T}
		WHERE scope = $1 AND tenant = $2 AND event_id = $3)`)

	// failSQL records a dead-lettered event as failed, unless it is done.
	s.failSQL = r.Replace(`INSERT INTO {T} AS t (scope, tenant, event_id, status, fingerprint, source, principal,
		attempts, error, completed_at, expires_at)
	VALUES ($1, $2, $3, 'failed', $4, $5, $6, $7, $8, now(), now() + $9::bigint * interval '1 microsecond')
	ON CONFLICT (scope, tenant, event_id) DO UPDATE SET status = 'failed', error = EXCLUDED.error,
		attempts = EXCLUDED.attempts, completed_at = now(), lease_until = NULL, expires_at = EXCLUDED.expires_at
	WHERE t.status <> 'done' OR t.expires_at <= now()`)

	// purgeSQL deletes one batch of expired rows if this instance holds the
	// janitor lock; rows locked by others are skipped. No ORDER BY: the
	// BRIN index yields expired rows in table order, and sorting every
	// expired row for each small batch would cost more than it saves.
	s.purgeSQL = r.Replace(`
WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1::bigint # {OID}) AS ok),
d AS (
	DELETE FROM {T} WHERE ctid = ANY(ARRAY(
		SELECT ctid FROM {T}
		WHERE (SELECT ok FROM l) AND expires_at <= now()
			AND (status <> 'processing' OR lease_until IS NULL OR lease_until <= now())
		LIMIT $2
		FOR UPDATE SKIP LOCKED))
	RETURNING 1
)
SELECT (SELECT ok FROM l), count(*) FROM d`)

	// knownSQL: which of a list of keys have a live row, and in what state.
	s.knownSQL = r.Replace(`SELECT u.ord, e.status FROM unnest($1::text[], $2::text[], $3::text[])
		WITH ORDINALITY AS u(scope, tenant, event_id, ord)
		JOIN {T} e ON e.scope = u.scope AND e.tenant = u.tenant AND e.event_id = u.event_id
		WHERE e.expires_at > now()`)

	s.liveSQL = r.Replace(`SELECT count(*) FROM {T} WHERE scope = $1 AND tenant = $2 AND expires_at > now()`)

	s.statsSQL = r.Replace(`SELECT scope, status, count(*), min(lease_until) FILTER (WHERE status = 'processing')
		FROM {T} WHERE expires_at > now() GROUP BY scope, status ORDER BY scope, status`)
	return s
}

// lockKey is the advisory lock a claim takes for a key.
func lockKey(k Key) int64 { return ledgerkey.Hash(k.Scope, k.Tenant, k.ID) }

// janitorLockKey is the advisory lock (mixed with the table's OID in SQL)
// that lets one janitor run at a time per table.
func (s *pgStore) janitorLockKey() int64 {
	h := fnv.New64a()
	h.Write([]byte("justonce.janitor:" + s.table))
	return int64(h.Sum64())
}

// claimRow is one row of the claim statement's answer.
type claimRow struct {
	ord     int64
	claimed bool
	rec     *Record // nil when no row is visible
	live    bool    // retention not expired
	leased  bool    // lease still running
}

// claim runs the claim statement on q for reqs (keys already validated and
// unique), returning one claimRow per request in order.
// claimOne claims one key on q: the claimed row, or (not claimed) the
// existing row found by a second statement.
func (s *pgStore) claimOne(ctx context.Context, q querier, req Request, ttl time.Duration, lease time.Duration, owner string) (claimRow, error) {
	if err := s.detect(ctx, q); err != nil {
		return claimRow{}, err
	}
	var c claimedScan
	err := q.QueryRow(ctx, s.claimOneSQL, claimOneArgs(req, ttl, lease, owner)...).Scan(c.dest()...)
	if err == nil {
		return claimRow{claimed: true, rec: c.record(req, lease, owner), live: true, leased: lease > 0}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return claimRow{}, err
	}
	rec, live, err := s.lookup(ctx, q, req.Key)
	return claimRow{rec: rec, live: live}, err
}

func claimOneArgs(r Request, ttl time.Duration, lease time.Duration, owner string) []any {
	return []any{r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
		ttl.Microseconds(), lockKey(r.Key), lease.Microseconds(), owner}
}

func (s *pgStore) collectClaim(rows pgx.Rows, reqs []Request) ([]claimRow, error) {
	defer rows.Close()
	out := make([]claimRow, len(reqs))
	for rows.Next() {
		var cr claimRow
		var sc recordScan
		dest := append([]any{&cr.ord, &cr.claimed}, sc.dest()...)
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		i := int(cr.ord) - 1
		if i < 0 || i >= len(reqs) {
			return nil, fmt.Errorf("claim returned ordinal %d of %d", cr.ord, len(reqs))
		}
		cr.rec, cr.live, cr.leased = sc.record(reqs[i].Key)
		out[i] = cr
	}
	return out, rows.Err()
}

// claimedScan receives the columns a claim returns.
type claimedScan struct {
	token            int64
	attempts         int32
	created, expires time.Time
	leaseUntil       *time.Time
}

func (c *claimedScan) dest() []any {
	return []any{&c.token, &c.attempts, &c.created, &c.expires, &c.leaseUntil}
}

// record builds the claimed row from the request and the returned columns.
func (c *claimedScan) record(req Request, lease time.Duration, owner string) *Record {
	rec := &Record{
		Key: req.Key, Status: StatusDone, Fingerprint: req.Fingerprint, Source: req.Source,
		Principal: req.Principal, FencingToken: c.token, Attempts: int(c.attempts),
		CreatedAt: c.created, CompletedAt: c.created, ExpiresAt: c.expires,
	}
	if lease > 0 {
		rec.Status, rec.CompletedAt, rec.LeaseOwner, rec.LeaseUntil = StatusProcessing, time.Time{}, owner, derefTime(c.leaseUntil)
	}
	return rec
}

// recordScan receives a row's columns, every one nullable.
type recordScan struct {
	status, source, principal, leaseOwner, errText *string
	fingerprint, body                              []byte
	leaseUntil, createdAt, completedAt, expiresAt  *time.Time
	token, durationUS                              *int64
	attempts, code                                 *int32
	header                                         map[string][]string
	live, leaseLive                                *bool
}

func (r *recordScan) dest() []any {
	return []any{&r.status, &r.fingerprint, &r.source, &r.principal, &r.leaseOwner, &r.leaseUntil,
		&r.token, &r.attempts, &r.code, &r.header, &r.body, &r.errText,
		&r.durationUS, &r.createdAt, &r.completedAt, &r.expiresAt, &r.live, &r.leaseLive}
}

// destAt is dest for a look-up of rowCols only (see recordAt).
func (r *recordScan) destAt() []any { return r.dest()[:16] }

// recordAt is record for a row read with destAt in a transaction whose
// now() is now: the row is live while it expires after now, and its lease
// while that ends after now, as lookupCols' comparisons tell.
func (r *recordScan) recordAt(k Key, now time.Time) (rec *Record, live, leased bool) {
	rec, _, _ = r.record(k)
	if rec == nil {
		return nil, false, false
	}
	return rec, r.expiresAt != nil && r.expiresAt.After(now), r.leaseUntil != nil && r.leaseUntil.After(now)
}

// record builds the Record, or nil when the row was absent.
func (r *recordScan) record(k Key) (rec *Record, live, leased bool) {
	if r.status == nil {
		return nil, false, false
	}
	rec = &Record{
		Key:          k,
		Status:       Status(*r.status),
		Fingerprint:  r.fingerprint,
		Source:       Source(deref(r.source)),
		Principal:    deref(r.principal),
		LeaseOwner:   deref(r.leaseOwner),
		LeaseUntil:   derefTime(r.leaseUntil),
		FencingToken: deref(r.token),
		Attempts:     int(deref(r.attempts)),
		Result:       Result{Code: int(deref(r.code)), Header: r.header, Body: r.body},
		Error:        deref(r.errText),
		Duration:     time.Duration(deref(r.durationUS)) * time.Microsecond,
		CreatedAt:    derefTime(r.createdAt),
		CompletedAt:  derefTime(r.completedAt),
		ExpiresAt:    derefTime(r.expiresAt),
	}
	return rec, deref(r.live), deref(r.leaseLive)
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func derefTime(p *time.Time) time.Time { return deref(p) }

// lookup returns the row for k whatever its expiry (nil when absent), and
// whether it is live.
func (s *pgStore) lookup(ctx context.Context, q querier, k Key) (*Record, bool, error) {
	var sc recordScan
	err := q.QueryRow(ctx, s.lookupSQL, k.Scope, k.Tenant, k.ID).Scan(sc.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	rec, live, _ := sc.record(k)
	return rec, live, nil
}

// queueComplete adds the statement that stores a transactional-mode result.
func (s *pgStore) queueComplete(b *pgx.Batch, k Key, res Result, d time.Duration) {
	b.Queue(s.completeSQL, k.Scope, k.Tenant, k.ID, nullCode(res.Code), nullHeader(res.Header), res.Body, d.Microseconds())
}

func (s *pgStore) complete(ctx context.Context, q querier, k Key, res Result, d time.Duration) error {
	_, err := q.Exec(ctx, s.completeSQL, k.Scope, k.Tenant, k.ID, nullCode(res.Code), nullHeader(res.Header), res.Body, d.Microseconds())
	return err
}

func (s *pgStore) renew(ctx context.Context, q querier, k Key, token int64, lease time.Duration) (bool, error) {
	tag, err := q.Exec(ctx, s.renewSQL, k.Scope, k.Tenant, k.ID, token, lease.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *pgStore) leaseComplete(ctx context.Context, q querier, k Key, token int64, res Result, d time.Duration) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseCompleteSQL, k.Scope, k.Tenant, k.ID, token, nullCode(res.Code), nullHeader(res.Header), res.Body, d.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *pgStore) leaseFail(ctx context.Context, q querier, k Key, token int64, msg string, d time.Duration) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseFailSQL, k.Scope, k.Tenant, k.ID, token, msg, d.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (s *pgStore) leaseRelease(ctx context.Context, q querier, k Key, token int64) (bool, error) {
	tag, err := q.Exec(ctx, s.leaseDelSQL, k.Scope, k.Tenant, k.ID, token)
	return tag.RowsAffected() == 1, err
}

func (s *pgStore) release(ctx context.Context, q querier, k Key) (ok bool, err error) {
	err = retryMoved(func() error {
		tag, err := q.Exec(ctx, s.releaseSQL, k.Scope, k.Tenant, k.ID)
		ok = tag.RowsAffected() == 1
		return err
	})
	return ok, err
}

// releaseStuck deletes k's row if it is stuck; live reports a row that
// was not (done, or under a lease that still runs).
func (s *pgStore) releaseStuck(ctx context.Context, q querier, k Key) (deleted, live bool, err error) {
	err = retryMoved(func() error {
		return q.QueryRow(ctx, s.releaseStuckSQL, k.Scope, k.Tenant, k.ID).Scan(&deleted, &live)
	})
	return deleted, live && !deleted, err
}

// retryMoved runs a statement outside a transaction again when Postgres
// refused it because the row it waited for was moved to another partition
// (SQLSTATE 40001: on the time-bucket layout, a takeover moves a row to a
// newer bucket). Run again, it finds the row where it went.
func retryMoved(f func() error) error {
	var err error
	for range 3 {
		var pgErr *pgconn.PgError
		if err = f(); !errors.As(err, &pgErr) || pgErr.Code != "40001" {
			return err
		}
	}
	return err
}

func (s *pgStore) fail(ctx context.Context, q querier, r Request, attempts int, msg string, ttl time.Duration) (bool, error) {
	if err := s.detect(ctx, q); err != nil {
		return false, err
	}
	if s.buckets {
		var ok bool
		err := q.QueryRow(ctx, s.failSQL, r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
			attempts, msg, ttl.Microseconds(), lockKey(r.Key)).Scan(&ok)
		return ok, err
	}
	tag, err := q.Exec(ctx, s.failSQL, r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal, attempts, msg, ttl.Microseconds())
	return tag.RowsAffected() == 1, err
}

// purge deletes up to limit expired rows; locked is false when another
// janitor holds the lock.
func (s *pgStore) purge(ctx context.Context, q querier, limit int) (n int64, locked bool, err error) {
	err = q.QueryRow(ctx, s.purgeSQL, s.janitorLockKey(), limit).Scan(&locked, &n)
	return n, locked, err
}

// ScopeStats is one line of Ledger.Stats: live rows of one scope and status.
type ScopeStats struct {
	Scope  string
	Status Status
	Rows   int64
	// OldestLease is the earliest lease_until among processing rows (zero
	// when none): a lease far in the past is a stuck key.
	OldestLease time.Time
}

func (s *pgStore) stats(ctx context.Context, q querier) ([]ScopeStats, error) {
	rows, err := q.Query(ctx, s.statsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (ScopeStats, error) {
		var st ScopeStats
		var status string
		var oldest *time.Time
		err := row.Scan(&st.Scope, &status, &st.Rows, &oldest)
		st.Status = Status(status)
		st.OldestLease = derefTime(oldest)
		return st, err
	})
}

func nullCode(c int) *int32 {
	if c == 0 {
		return nil
	}
	v := int32(c)
	return &v
}

func nullHeader(h map[string][]string) any {
	if len(h) == 0 {
		return nil
	}
	return h
}

func (s *pgStore) live(ctx context.Context, q querier, scope, tenant string) (n int64, err error) {
	err = q.QueryRow(ctx, s.liveSQL, scope, tenant).Scan(&n)
	return n, err
}

func (s *pgStore) known(ctx context.Context, q querier, keys []Key) ([]Status, error) {
	scopes, tenants, ids := make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		scopes[i], tenants[i], ids[i] = k.Scope, k.Tenant, k.ID
	}
	rows, err := q.Query(ctx, s.knownSQL, scopes, tenants, ids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := make([]Status, len(keys))
	for rows.Next() {
		var ord int64
		var st string
		if err := rows.Scan(&ord, &st); err != nil {
			return nil, err
		}
		if ord >= 1 && int(ord) <= len(keys) {
			out[ord-1] = Status(st)
		}
	}
	return out, rows.Err()
}

// claimInSavepoint claims one key inside a savepoint of the caller's
// transaction, in one round trip. When the key is not claimed the
// savepoint is rolled back, which also releases the key's advisory lock,
// and the row is looked up.
func (s *pgStore) claimInSavepoint(ctx context.Context, tx pgx.Tx, req Request, ttl time.Duration) (claimRow, error) {
	if err := s.detect(ctx, tx); err != nil {
		return claimRow{}, err
	}
	return s.claimInSavepointOnce(ctx, tx, req, ttl, false)
}

// claimInSavepointOnce is claimInSavepoint; refreshed says the
// transaction's partition list was just brought up to date (it is, at most
// once per claim).
func (s *pgStore) claimInSavepointOnce(ctx context.Context, tx pgx.Tx, req Request, ttl time.Duration, refreshed bool) (claimRow, error) {
	var c claimedScan
	claimed := false
	b := &pgx.Batch{}
	b.Queue("SAVEPOINT justonce_claim")
	b.Queue(s.claimOneSQL, claimOneArgs(req, ttl, 0, "")...).QueryRow(func(row pgx.Row) error {
		err := row.Scan(c.dest()...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		claimed = err == nil
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		if !s.buckets || !isNoPartition(err) || refreshed {
			return claimRow{}, err
		}
		// A bucket opened since this transaction took the ledger's locks:
		// bring its list of partitions up to date and claim again.
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT justonce_claim; RELEASE SAVEPOINT justonce_claim"); err != nil {
			return claimRow{}, err
		}
		if err := s.refreshPartitions(ctx, tx, req.Key); err != nil {
			return claimRow{}, err
		}
		return s.claimInSavepointOnce(ctx, tx, req, ttl, true)
	}
	if claimed {
		if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT justonce_claim"); err != nil {
			return claimRow{}, err
		}
		return claimRow{claimed: true, rec: c.record(req, 0, ""), live: true}, nil
	}
	var ls recordScan
	found := false
	b = &pgx.Batch{}
	b.Queue("ROLLBACK TO SAVEPOINT justonce_claim")
	b.Queue("RELEASE SAVEPOINT justonce_claim")
	queueLookup(b, s.lookupSQL, req.Key, ls.dest(), &found)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return claimRow{}, err
	}
	if !found {
		return claimRow{}, nil
	}
	rec, live, _ := ls.record(req.Key)
	return claimRow{rec: rec, live: live}, nil
}

// queueLookup queues on b sql, a look-up of k by its scope, tenant and ID;
// once the batch has run, found says whether k has a row, scanned into
// dest.
func queueLookup(b *pgx.Batch, sql string, k Key, dest []any, found *bool) {
	b.Queue(sql, k.Scope, k.Tenant, k.ID).QueryRow(func(row pgx.Row) error {
		err := row.Scan(dest...)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		*found = err == nil
		return err
	})
}

// takeover reports whether a claim may take over the existing row rec:
// its retention expired, or (lease mode) its lease lapsed and the
// fingerprints agree. The claim statements test the same in SQL.
func takeover(rec *Record, live, leased bool, fp []byte) bool {
	if !live {
		return true
	}
	return rec.Status == StatusProcessing && !rec.LeaseUntil.IsZero() && !leased &&
		(fp == nil || rec.Fingerprint == nil || string(fp) == string(rec.Fingerprint))
}

// queueInsertDone adds sql, the statement that writes a claimed key's row
// (shardSQL.insert), complete, with the commit (the write-once path).
func (s *pgStore) queueInsertDone(b *pgx.Batch, sql string, r Request, ttl time.Duration, res Result, d time.Duration) {
	b.Queue(sql, r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
		nullCode(res.Code), nullHeader(res.Header), res.Body, d.Microseconds(), ttl.Microseconds())
}

// insertManyArgs are insertManySQL's arguments for the requests reqs[i]
// of idx with their results (nil: none) and run time each.
func insertManyArgs(reqs []Request, idx []int, results []Result, ttl func(Request) time.Duration, d time.Duration) ([]any, error) {
	n := len(idx)
	scopes, tenants, ids := make([]string, n), make([]string, n), make([]string, n)
	fps, bodies := make([][]byte, n), make([][]byte, n)
	sources, principals := make([]string, n), make([]string, n)
	codes, headers := make([]*int32, n), make([]*string, n)
	durs, ttls := make([]int64, n), make([]int64, n)
	for j, i := range idx {
		r := reqs[i]
		scopes[j], tenants[j], ids[j] = r.Scope, r.Tenant, r.ID
		fps[j], sources[j], principals[j] = r.Fingerprint, string(r.Source), r.Principal
		durs[j], ttls[j] = d.Microseconds(), ttl(r).Microseconds()
		if results == nil {
			continue
		}
		res := results[j]
		codes[j], bodies[j] = nullCode(res.Code), res.Body
		if len(res.Header) > 0 {
			h, err := json.Marshal(res.Header)
			if err != nil {
				return nil, err
			}
			hs := string(h)
			headers[j] = &hs
		}
	}
	return []any{scopes, tenants, ids, fps, sources, principals, codes, headers, bodies, durs, ttls}, nil
}

// isKeyConflict reports whether err is the ledger's primary key refusing a
// row: a row for the key was written by someone who did not hold the key's
// lock (or is not visible to a REPEATABLE READ snapshot).
func isKeyConflict(err error) bool {
	// processed_events_pkey; processed_events_bucket_pkey on the
	// time-bucket layout, reported with its bucket's own index name.
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" &&
		strings.HasPrefix(pgErr.ConstraintName, "processed_events") && strings.HasSuffix(pgErr.ConstraintName, "pkey")
}

// rowCols are the columns of a row named x that recordScan reads.
const rowCols = `x.status, x.fingerprint, x.source, x.principal, x.lease_owner, x.lease_until,
		x.fencing_token, x.attempts, x.response_code, x.response_headers, x.response_body, x.error,
		x.duration_us, x.created_at, x.completed_at, x.expires_at`

// lookupCols are the columns a look-up returns for recordScan: rowCols,
// and whether the row and its lease are live at now().
const lookupCols = rowCols + `, x.expires_at > now(), x.lease_until > now()`

// collectClaimLookup reads lookupManySQL's rows: the existing row of each
// request that has one (claimed is left false).
func (s *pgStore) collectClaimLookup(rows pgx.Rows, reqs []Request) ([]claimRow, error) {
	defer rows.Close()
	out := make([]claimRow, len(reqs))
	for rows.Next() {
		var cr claimRow
		var sc recordScan
		dest := append([]any{&cr.ord}, sc.dest()...)
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		i := int(cr.ord) - 1
		if i < 0 || i >= len(reqs) {
			return nil, fmt.Errorf("look-up returned ordinal %d of %d", cr.ord, len(reqs))
		}
		cr.rec, cr.live, cr.leased = sc.record(reqs[i].Key)
		out[i] = cr
	}
	return out, rows.Err()
}
