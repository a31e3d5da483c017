package inbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// plainStore is the plain layout's store: processed_events is one table,
// and the janitor deletes expired rows in batches. Its own statements are
// here; the others are rowStore's.
type plainStore struct {
	*rowStore

	claimOneSQL, claimSQL, failSQL, purgeSQL string
	// The write-once path (see Ledger.Do): the claim takes the key's lock
	// and looks the key up; the row is written once, complete, with the
	// commit.
	plan                                      doPlan
	lockManySQL, lookupManySQL, insertManySQL string
}

func newPlainStore(rows *rowStore) *plainStore {
	s := &plainStore{rowStore: rows}
	r := rows.names

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
		response_code = NULL, response_headers = NULL, response_body = NULL, result_expires_at = NULL, error = NULL,
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
	ORDER BY u.ord`, `t.scope, t.tenant, t.event_id, `+rows.rawCols("t")) + `
)
SELECT u.ord, true, ` + rows.rawCols("ins") + `
	FROM u JOIN ins ON ins.scope = u.scope AND ins.tenant = u.tenant AND ins.event_id = u.event_id
UNION ALL
SELECT u.ord, false, ` + rows.cols("e") + `
	FROM u LEFT JOIN {T} e ON e.scope = u.scope AND e.tenant = u.tenant AND e.event_id = u.event_id
	WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.scope = u.scope AND ins.tenant = u.tenant AND ins.event_id = u.event_id)`)

	// Do's lock takes one key's advisory lock (without waiting) and
	// returns the transaction's time, which the row will carry. The key is
	// looked up by a separate statement after it: that statement's snapshot
	// is taken once the lock is held, so it sees every row committed by an
	// earlier holder of the lock.
	s.plan.lock = r.Replace(`SELECT pg_try_advisory_xact_lock($1::bigint # {OID}), now()`)
	s.plan.lookup = rows.lookupAtSQL
	// Do's insert writes a transactional-mode row, complete, under the
	// key's lock, for a key the lock holder found absent: a plain INSERT.
	// A conflict (a row written without the lock) fails it, and with it
	// the commit.
	s.plan.insert = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at,
		result_expires_at)
	VALUES ($1, $2, $3, 'done', $4, $5, $6, $7, $8, $9, $10, now(), clock_timestamp(),
		now() + $11::bigint * interval '1 microsecond', ` + resultClock(12) + `)`)

	// DoBatch's lock, look-up and INSERT: Do's for every key at once.
	s.lockManySQL = r.Replace(`SELECT array_agg(pg_try_advisory_xact_lock(u.k # {OID}) ORDER BY u.o), now()
		FROM unnest($1::bigint[]) WITH ORDINALITY AS u(k, o)`)
	// The look-up probes the primary key once per key: the probe is kept
	// apart (OFFSET 0) so that Postgres runs it as a nested loop whatever
	// it thinks of the table's size. A join it may flatten gets, from a
	// table that was small when the statement was first planned, a hash
	// join over a scan of the whole table, and keeps that plan as the
	// table grows.
	s.lookupManySQL = r.Replace(`SELECT u.ord, ` + rows.cols("e") + `
		FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(scope, tenant, event_id, ord)
		CROSS JOIN LATERAL (SELECT * FROM {T} e WHERE e.scope = u.scope AND e.tenant = u.tenant
			AND e.event_id = u.event_id OFFSET 0) e`)
	s.insertManySQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at,
		result_expires_at)
	SELECT u.scope, u.tenant, u.event_id, 'done', u.fingerprint, u.source, u.principal,
		u.code, u.header, u.body, u.duration_us, now(), clock_timestamp(), now() + u.ttl_us * interval '1 microsecond',
		CASE WHEN u.result_ttl_us > 0 THEN clock_timestamp() + u.result_ttl_us * interval '1 microsecond' END
	FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
		$7::integer[], $8::text[]::jsonb[], $9::bytea[], $10::bigint[], $11::bigint[], $12::bigint[])
		AS u(scope, tenant, event_id, fingerprint, source, principal, code, header, body, duration_us, ttl_us,
			result_ttl_us)`)

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
	return s
}

// checkTTL: the plain layout keeps a row as long as it is asked to.
func (s *plainStore) checkTTL(time.Duration) error { return nil }

// planDo: the same statements for every key.
func (s *plainStore) planDo(context.Context, querier, Key) (doPlan, error) { return s.plan, nil }

func (s *plainStore) queueClaim(b *pgx.Batch, p doPlan, k Key, c *doClaim) {
	c.readCommitted, c.fresh = true, true
	b.Queue(p.lock, lockKey(k)).QueryRow(func(row pgx.Row) error { return row.Scan(&c.locked, &c.now) })
	queueLookup(b, p.lookup, k, c.row.destAt(), &c.found)
}

// planStale: a plan never goes stale.
func (s *plainStore) planStale(error) bool { return false }

func (s *plainStore) forgetPlans() {}

func (s *plainStore) takeOver(ctx context.Context, q querier, p claimParams) (claimedScan, error) {
	return takeOverWith(ctx, q, s.claimOneSQL, p)
}

func (s *plainStore) queueLockMany(b *pgx.Batch, reqs []Request, a *lockManyAnswer) {
	queueLockManyWith(b, s.lockManySQL, s.lookupManySQL, reqs, a)
}

func (s *plainStore) takeOverMany(ctx context.Context, conn *pgx.Conn, reqs []Request, ttl func(Request) time.Duration) ([]claimRow, error) {
	return takeOverManyWith(ctx, conn, s.claimSQL, reqs, ttl)
}

func (s *plainStore) insertMany(p insertManyParams) (queuedStmt, error) {
	return insertManyWith(s.insertManySQL, p)
}

// claimsRunUpFront: a run's keys are locked and looked up together, and
// their rows written by one INSERT with the commit, as DoBatch's.
func (s *plainStore) claimsRunUpFront() bool { return true }

// claimInRun: the claim statement in the round trip b opens; a key not
// claimed then frees its lock and reads its row, in a second.
func (s *plainStore) claimInRun(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, p claimParams, c *claimedScan) (claimRow, error) {
	claimed := false
	queueClaimOne(b, s.claimOneSQL, p, c, &claimed)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return claimRow{}, storeErr("claim", err)
	}
	if claimed {
		return claimRow{claimed: true}, nil
	}
	var ls recordScan
	found := false
	b = &pgx.Batch{}
	b.Queue(sqlEachRollback)
	b.Queue(sqlEachRelease)
	queueLookup(b, s.lookupSQL, p.req.Key, ls.dest(), &found)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return claimRow{}, storeErr("lookup", err)
	}
	var cr claimRow
	if found {
		cr.rec, cr.live, _ = ls.record(p.req.Key)
	}
	return cr, nil
}

func (s *plainStore) claimInSavepoint(ctx context.Context, tx pgx.Tx, p claimParams) (claimRow, error) {
	return s.claimInSavepointWith(ctx, tx, s.claimOneSQL, p, nil)
}

func (s *plainStore) claimLease(ctx context.Context, q querier, p claimParams) (claimRow, error) {
	return s.claimOne(ctx, q, s.claimOneSQL, p)
}

func (s *plainStore) claimLeaseSteps(ctx context.Context, q querier, p claimParams) (claimRow, bool, error) {
	return s.claimOneSteps(ctx, q, s.claimOneSQL, p)
}

func (s *plainStore) recordFailure(ctx context.Context, q querier, p failParams) (bool, error) {
	r := p.req
	tag, err := q.Exec(ctx, s.failSQL, r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
		p.attempts, p.errText, p.ttl.Microseconds())
	return tag.RowsAffected() == 1, err
}

// purge deletes up to limit expired rows; more while a batch was full.
func (s *plainStore) purge(ctx context.Context, pool *pgxpool.Pool, limit int) (n int64, more, locked bool, err error) {
	err = pool.QueryRow(ctx, s.purgeSQL, s.janitorLockKey(), limit).Scan(&locked, &n)
	return n, n >= int64(limit), locked, err
}
