package inbox

import (
	"context"
	"crypto/md5"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The time-bucket layout (migrations.LayoutTimeBuckets): processed_events is
// partitioned into buckets, each holding keys of one shard (a hash of the
// key). A shard writes into its newest bucket; the janitor opens a shard's
// next bucket every width, at staggered times, and drops a bucket once
// every row in it has expired. Do claims as on the plain layout (the key's
// advisory lock, then a look-up in a statement of its own, then the row
// written with the commit), but its look-up names the buckets of the key's
// shard only, from a view of the buckets the ledger keeps: normally two.
// DoBatch probes each key's shard's buckets as the bucket list stands in
// its own snapshot; the other claims and failures go through the SQL
// functions the migration creates. docs/RETENTION.md has the
// reasoning. Every statement of the layout's own is in this file
// (bucketStore); the others are rowStore's (store.go).

// bucketView is the ledger's view of the buckets: for each shard, the
// statements of Do's claim (its doPlan), which name that shard's buckets.
// It may be stale; a stale view never lets a claim through: a bucket opened since
// makes the claim's first statement answer "stale" (and the row's INSERT
// fail, SQLSTATE JO001, if it opened while the handler ran), and the claim
// is made again with a fresh view. A bucket detached or dropped since is
// pruned from the look-up like any bucket with no partition: its rows had
// all expired.
type bucketView struct {
	loaded time.Time // local clock
	// dbTime is the database's clock when the view was loaded: the
	// statement's time, not the transaction's (a DoEach run loads views
	// inside its transaction, which may have started long before).
	dbTime time.Time
	shards []doPlan
}

// A view is used for at most viewMaxAge (an eighth of the bucket width,
// between 1 and 30 s) before it is loaded again: a stale view is caught
// anyway (see bucketView); this bounds how long a view may still name a
// detached bucket, whose table the janitor drops dropGrace after the
// detach.
func viewTimes(width time.Duration) (viewMaxAge, dropGrace time.Duration) {
	viewMaxAge = min(max(width/8, time.Second), 30*time.Second)
	return viewMaxAge, viewMaxAge + 2*time.Second
}

// bucketStore is the time-bucket layout's store. Its own statements, its
// view of the buckets and its janitor are here; the other statements are
// rowStore's: by key, Postgres routes them to the row's bucket.
type bucketStore struct {
	*rowStore

	shards int           // how many shards keys are spread over
	width  time.Duration // how long a shard writes into one bucket
	maxTTL time.Duration // the longest TTL a row may have
	// how long a view of the buckets is used, and how long after its
	// detach a bucket's table is dropped (see viewTimes)
	viewMaxAge, dropGrace time.Duration
	view                  atomic.Pointer[bucketView]

	claimOneSQL, claimSQL, failSQL            string
	lockManySQL, lookupManySQL, insertManySQL string
}

// openBucketStore reads the layout's settings and builds its statements.
func openBucketStore(ctx context.Context, q querier, rows *rowStore) (*bucketStore, error) {
	var width, maxTTL int64
	var shards int
	var encoding string
	if err := q.QueryRow(ctx, `SELECT extract(epoch FROM width)::bigint, extract(epoch FROM max_ttl)::bigint, shards,
			current_setting('server_encoding') FROM `+
		rows.ident("processed_events_layout")).Scan(&width, &maxTTL, &shards, &encoding); err != nil {
		return nil, err
	}
	// The ledger computes a key's shard from its UTF-8 bytes, as
	// processed_events_shard does from the database's: they agree only
	// when the database stores text as those bytes.
	if encoding != "UTF8" && encoding != "SQL_ASCII" {
		return nil, fmt.Errorf("the time-bucket layout needs a UTF8 database, not %s", encoding)
	}
	return newBucketStore(rows, time.Duration(width)*time.Second, time.Duration(maxTTL)*time.Second, shards), nil
}

func newBucketStore(rows *rowStore, width, maxTTL time.Duration, shards int) *bucketStore {
	s := &bucketStore{rowStore: rows, shards: shards, width: width, maxTTL: maxTTL}
	s.viewMaxAge, s.dropGrace = viewTimes(width)
	r := strings.NewReplacer("{T}", s.table, "{OID}", s.oid, "{CLAIM}", s.ident("processed_events_claim"),
		"{FAIL}", s.ident("processed_events_fail"),
		"{BUCKETS}", s.ident("processed_events_buckets"),
		// The layout's failure function, called where it raises: past its
		// TTL check, it takes a (blocking) advisory lock, then refuses any
		// transaction stricter than READ COMMITTED.
		"{REFUSE_RR}", s.ident("processed_events_fail")+"('', '', '', NULL, '', '', 0, '', 0, 0)")

	// The write-once path's statements. In READ COMMITTED the look-up's
	// snapshot is taken after the lock is ours, so it sees every row an
	// earlier holder committed, whatever its bucket; in a stricter
	// isolation level it would not, and the lock statement refuses
	// (SQLSTATE 0A000), by calling the layout's failure function, which
	// raises it. A TTL past MaxTTL is refused before the claim (checkTTL).
	// Do's statements, per shard, are built with the view
	// (shardStatements); these serve DoBatch, which goes through the
	// partitioned table without a view, reading the bucket list with the
	// snapshot of its look-up, and writes into each key's newest bucket as
	// the INSERT sees the bucket list. Both take each key's shard from the
	// ledger, which computes it as processed_events_shard does.
	const readCommitted = `current_setting('transaction_isolation') = 'read committed'`
	s.lockManySQL = r.Replace(`SELECT array_agg(pg_try_advisory_xact_lock(u.k # {OID}) ORDER BY u.o), now()
		FROM unnest($1::bigint[]) WITH ORDINALITY AS u(k, o)
		WHERE CASE WHEN ` + readCommitted + ` THEN true ELSE {REFUSE_RR} END`)
	s.insertManySQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at,
		result_expires_at, bucket)
	SELECT u.scope, u.tenant, u.event_id, 'done', u.fingerprint, u.source, u.principal,
		u.code, u.header, u.body, u.duration_us, now(), clock_timestamp(),
		now() + u.ttl_us * interval '1 microsecond',
		CASE WHEN u.result_ttl_us > 0 THEN clock_timestamp() + u.result_ttl_us * interval '1 microsecond' END, n.id
	FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
		$7::integer[], $8::text[]::jsonb[], $9::bytea[], $10::bigint[], $11::bigint[], $12::bigint[], $13::integer[])
		AS u(scope, tenant, event_id, fingerprint, source, principal, code, header, body, duration_us, ttl_us,
			result_ttl_us, shard)
	LEFT JOIN (SELECT b.shard, max(b.id) AS id FROM {BUCKETS} b GROUP BY b.shard) n ON n.shard = u.shard`)

	// DoBatch's look-up, with each key's shard ($4, computed by the
	// ledger): the keys joined with the bucket list (read once, with the
	// statement's snapshot, taken after the locks, so it lists every
	// bucket a row committed before could be in), then for each key and
	// bucket of its shard a probe of that bucket alone. The subqueries are
	// kept apart (OFFSET 0) so that Postgres runs the probes as a nested
	// loop and prunes the partitions at run time: each key costs one index
	// probe per bucket of its shard, not one per bucket of the table.
	s.lookupManySQL = r.Replace(`SELECT u.ord, ` + strings.ReplaceAll(lookupCols, "x.", "e.") + `
		FROM (SELECT u.*, b.id FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[])
				WITH ORDINALITY AS u(scope, tenant, event_id, shard, ord)
			JOIN {BUCKETS} b ON b.shard = u.shard OFFSET 0) u
		CROSS JOIN LATERAL (SELECT * FROM {T} e WHERE e.scope = u.scope AND e.tenant = u.tenant
			AND e.event_id = u.event_id AND e.bucket = u.id OFFSET 0) e`)

	// Leases, takeovers, DoTx and failures go through the layout's SQL
	// functions (migrations.LayoutTimeBuckets creates them), which take
	// the key's lock and look in every bucket of its shard.
	const out = `o_status, o_fingerprint, o_source, o_principal, o_lease_owner, o_lease_until, o_fencing_token,
		o_attempts, o_response_code, o_response_headers, o_response_body, o_error, o_duration_us,
		o_created_at, o_completed_at, o_expires_at, o_live, o_leased`
	s.claimOneSQL = r.Replace(`SELECT o_fencing_token, o_attempts, o_created_at, o_expires_at, o_lease_until
		FROM {CLAIM}($1::text, $2::text, $3::text, $4::bytea, $5::text, $6::text, $7::bigint,
			$8::bigint # {OID}, $9::bigint, $10::text, false)
		WHERE o_claimed`)
	// The claim function answers a row it did not claim with its result as
	// stored; a result past its own clock (migration 6) is masked here, as
	// rowCols masks it: the function predates the clock.
	masked := strings.NewReplacer(
		"o_response_code,", "CASE WHEN g.gone THEN "+strconv.Itoa(resultGoneCode)+" ELSE o_response_code END,",
		"o_response_headers,", "CASE WHEN g.gone THEN NULL ELSE o_response_headers END,",
		"o_response_body,", "CASE WHEN g.gone THEN NULL ELSE o_response_body END,").Replace(out)
	s.claimSQL = r.Replace(`SELECT u.ord, f.o_claimed, ` + masked + `
		FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::bigint[], $8::bigint[])
			WITH ORDINALITY AS u(scope, tenant, event_id, fingerprint, source, principal, ttl_us, lock_key, ord)
		CROSS JOIN LATERAL {CLAIM}(u.scope, u.tenant, u.event_id, u.fingerprint, u.source, u.principal,
			u.ttl_us, u.lock_key # {OID}, $9::bigint, $10::text, true) AS f
		LEFT JOIN LATERAL (SELECT true AS gone FROM {T} e WHERE NOT f.o_claimed AND e.scope = u.scope
			AND e.tenant = u.tenant AND e.event_id = u.event_id AND e.result_expires_at <= now() LIMIT 1) g ON true`)
	s.failSQL = r.Replace(`SELECT {FAIL}($1::text, $2::text, $3::text, $4::bytea, $5::text, $6::text,
		$7::integer, $8::text, $9::bigint, $10::bigint # {OID})`)
	return s
}

func (s *bucketStore) takeOver(ctx context.Context, q querier, p claimParams) (claimedScan, error) {
	return takeOverWith(ctx, q, s.claimOneSQL, p)
}

// queueLockMany: the look-up probes each key's shard only.
func (s *bucketStore) queueLockMany(b *pgx.Batch, reqs []Request, a *lockManyAnswer) {
	queueLockManyWith(b, s.lockManySQL, s.lookupManySQL, reqs, a, s.shardsOf(reqs, nil))
}

func (s *bucketStore) takeOverMany(ctx context.Context, conn *pgx.Conn, reqs []Request, ttl func(Request) time.Duration) ([]claimRow, error) {
	return takeOverManyWith(ctx, conn, s.claimSQL, reqs, ttl)
}

// insertMany: each row goes into its shard's newest bucket.
func (s *bucketStore) insertMany(p insertManyParams) (queuedStmt, error) {
	return insertManyWith(s.insertManySQL, p, s.shardsOf(p.reqs, p.idx))
}

// shardsOf is the shard of each of reqs[i] for i in idx (nil: every one).
func (s *bucketStore) shardsOf(reqs []Request, idx []int) []int32 {
	if idx == nil {
		shards := make([]int32, len(reqs))
		for i, r := range reqs {
			shards[i] = int32(shardOf(r.Key, s.shards))
		}
		return shards
	}
	shards := make([]int32, len(idx))
	for j, i := range idx {
		shards[j] = int32(shardOf(reqs[i].Key, s.shards))
	}
	return shards
}

// claimInSavepoint: a bucket opened since the caller's transaction took
// the ledger's locks is brought into its list of partitions, and the key
// claimed again.
func (s *bucketStore) claimInSavepoint(ctx context.Context, tx pgx.Tx, p claimParams) (claimRow, error) {
	return s.claimInSavepointWith(ctx, tx, s.claimOneSQL, p, s.refreshPartitions)
}

func (s *bucketStore) claimLease(ctx context.Context, q querier, p claimParams) (claimRow, error) {
	return s.claimOne(ctx, q, s.claimOneSQL, p)
}

func (s *bucketStore) claimLeaseSteps(ctx context.Context, q querier, p claimParams) (claimRow, bool, error) {
	return s.claimOneSteps(ctx, q, s.claimOneSQL, p)
}

func (s *bucketStore) recordFailure(ctx context.Context, q querier, p failParams) (bool, error) {
	r := p.req
	var ok bool
	err := q.QueryRow(ctx, s.failSQL, r.Scope, r.Tenant, r.ID, r.Fingerprint, string(r.Source), r.Principal,
		p.attempts, p.errText, p.ttl.Microseconds(), lockKey(r.Key)).Scan(&ok)
	return ok, err
}

// purge deletes no rows: it is one pass of maintainBuckets.
func (s *bucketStore) purge(ctx context.Context, pool *pgxpool.Pool, _ int) (n int64, more, locked bool, err error) {
	n, locked, err = s.maintainBuckets(ctx, pool)
	return n, false, locked, err
}

// claimsRunUpFront: on the time-bucket layout every DoEach run claims
// each request in its savepoint (claimInRun), whose statements name each
// shard's buckets from the view and which take in a bucket opened while
// the run goes on; an INSERT at the commit would meet the session's list
// of partitions as it was when the run took its first locks.
func (s *bucketStore) claimsRunUpFront() bool { return false }

// claimInRun is DoEach's claim on the time-bucket layout, inside the
// savepoint justonce_each that b (not yet sent) opens, in one round trip
// for a new key: the key's lock (recorded in a transaction-local setting),
// then, in a statement of its own, the key's claim row written into its
// shard's newest bucket if no bucket of the shard (named from the view)
// has the key and the setting says the lock is ours. A key that is not new is then looked up, and a row to take over
// goes through the layout's claim function. A stale view (a bucket opened
// since it was loaded) rolls the savepoint back and claims again with a
// fresh view; a bucket detached or dropped since is pruned from the
// statements (its rows had all expired), and the newest bucket's table
// missing (a view older than any bucket's life) fails the run. A key not
// claimed comes back with its row, the savepoint rolled back and released
// (which frees the key's lock); a key claimed leaves its columns in c.
func (s *bucketStore) claimInRun(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, p claimParams, c *claimedScan) (claimRow, error) {
	undo := func() error {
		_, err := conn.Exec(ctx, sqlEachUndo)
		return err
	}
	retry := func() error {
		s.forgetPlans()
		if err := undo(); err != nil {
			return storeErr("claim", err)
		}
		b = &pgx.Batch{}
		b.Queue(sqlEachSavepoint)
		return nil
	}
	req, ttl := p.req, p.ttl // ttl ≤ MaxTTL: DoEach checked every request's
	key := lockKey(req.Key)
	for attempt := 1; ; attempt++ {
		st, err := s.planDo(ctx, conn, req.Key)
		if err != nil {
			return claimRow{}, storeErr("claim", err)
		}
		token := strconv.FormatInt(key, 36) + "/" + strconv.Itoa(attempt)
		var locked, readCommitted, fresh, marked, inserted bool
		var now time.Time
		b.Queue(st.markLock, key, token).QueryRow(func(row pgx.Row) error {
			return row.Scan(&locked, &now, &readCommitted, &fresh, &marked)
		})
		b.Queue(st.claimNew, req.Scope, req.Tenant, req.ID, req.Fingerprint, string(req.Source), req.Principal,
			ttl.Microseconds(), token).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&inserted)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			return err
		})
		err = conn.SendBatch(ctx, b).Close()
		var pgErr *pgconn.PgError
		switch {
		case err != nil && errors.As(err, &pgErr) && pgErr.Code == "JO001" && attempt < maxConflictRetries:
			// The row met a newer bucket: the batch ran, inside the
			// savepoint, up to the refused row.
			if err := retry(); err != nil {
				return claimRow{}, err
			}
			continue
		case err != nil && isStaleView(err):
			// A bucket table the view names is gone. The batch may have
			// failed while pgx prepared it, before its RELEASE of the
			// previous request's savepoint and this one's SAVEPOINT ran,
			// so no savepoint here can be rolled back safely: the run
			// fails as a whole (the caller runs the requests one by one
			// with Do, which claims again with a fresh view).
			s.forgetPlans()
			return claimRow{}, storeErr("claim", err)
		case err != nil:
			return claimRow{}, storeErr("claim", err)
		case !readCommitted:
			return claimRow{}, storeErr("claim", errNotReadCommitted)
		case !fresh && attempt < maxConflictRetries:
			// A bucket newer than the view's (the row was not written:
			// its bucket would have refused it).
			if err := retry(); err != nil {
				return claimRow{}, err
			}
			continue
		case !fresh:
			return claimRow{}, storeErr("claim", errStaleView)
		case inserted:
			*c = claimedScan{attempts: 1, created: now, expires: now.Add(ttl.Truncate(time.Microsecond))}
			return claimRow{claimed: true}, nil
		}
		// Held elsewhere, or not new: its row.
		var ls recordScan
		found := false
		if err := conn.QueryRow(ctx, st.lookup, req.Scope, req.Tenant, req.ID).Scan(ls.destAt()...); err == nil {
			found = true
		} else if !errors.Is(err, pgx.ErrNoRows) {
			return claimRow{}, storeErr("lookup", err)
		}
		var cr claimRow
		var leased bool
		if found {
			cr.rec, cr.live, leased = ls.recordAt(req.Key, now)
		}
		if locked && cr.rec != nil && takeover(cr.rec, cr.live, leased, req.Fingerprint) {
			// An expired row or a lapsed lease, rare: the layout's claim
			// function takes it over (the lock is ours already).
			err := conn.QueryRow(ctx, s.claimOneSQL, claimOneArgs(p)...).Scan(c.dest()...)
			if errors.Is(err, pgx.ErrNoRows) { // the row changed since the look-up
				if err := undo(); err != nil {
					return claimRow{}, storeErr("claim", err)
				}
				return claimRow{}, nil
			}
			if isNoPartition(err) && attempt < maxConflictRetries {
				// The shard's newest bucket opened after this run took the
				// ledger's locks: bring the run's list of partitions up to
				// date (refreshPartitions) and claim again.
				if err := retry(); err != nil {
					return claimRow{}, err
				}
				if err := s.refreshPartitions(ctx, conn, req.Key); err != nil {
					return claimRow{}, storeErr("claim", err)
				}
				continue
			}
			if err != nil {
				return claimRow{}, storeErr("claim", err)
			}
			return claimRow{claimed: true}, nil
		}
		if locked && cr.rec == nil && attempt < maxConflictRetries {
			// The key was in a bucket the look-up no longer names: look
			// again with a fresh view.
			if err := retry(); err != nil {
				return claimRow{}, err
			}
			continue
		}
		if err := undo(); err != nil {
			return claimRow{}, storeErr("claim", err)
		}
		return cr, nil
	}
}

// shardOf is the key's shard, as processed_events_shard computes it in
// SQL: the first 32 bits of an MD5 of the key's length-prefixed parts.
func shardOf(k Key, shards int) int {
	var buf [64]byte
	b := strconv.AppendInt(buf[:0], int64(len(k.Scope)), 10)
	b = append(b, ':')
	b = append(b, k.Scope...)
	b = strconv.AppendInt(b, int64(len(k.Tenant)), 10)
	b = append(b, ':')
	b = append(b, k.Tenant...)
	b = append(b, k.ID...)
	sum := md5.Sum(b)
	return int(binary.BigEndian.Uint32(sum[:4]) % uint32(shards))
}

// bucketName is the table of bucket id.
func bucketName(id int) string { return "processed_events_b" + strconv.Itoa(id) }

// planDo returns Do's statements for k: those of k's shard from a view no
// older than viewMaxAge.
func (s *bucketStore) planDo(ctx context.Context, q querier, k Key) (doPlan, error) {
	v := s.view.Load()
	if v == nil || time.Since(v.loaded) > s.viewMaxAge {
		var err error
		if v, err = s.loadView(ctx, q); err != nil {
			return doPlan{}, fmt.Errorf("bucket view: %w", err)
		}
	}
	st := v.shards[shardOf(k, s.shards)]
	// Well before the shard's next bucket may open, the lock statement
	// need not look for it. The margin covers this clock's drift from the
	// database's over the view's life; a bucket opened all the same is
	// still caught by the row's INSERT.
	if v.dbTime.Add(time.Since(v.loaded)).Before(st.nextOpen.Add(-time.Second)) {
		st.lock, st.markLock = st.lockEarly, st.markLockEarly
	}
	return st, nil
}

// forgetPlans makes the next claim load the bucket view again.
func (s *bucketStore) forgetPlans() { s.view.Store(nil) }

// planStale reports whether err says the bucket view was stale (see
// isStaleView), and if so forgets it.
func (s *bucketStore) planStale(err error) bool {
	if !isStaleView(err) {
		return false
	}
	s.forgetPlans()
	return true
}

// queueClaim: the lock statement also says whether the transaction is READ
// COMMITTED and whether the plan's newest bucket is still the newest.
func (s *bucketStore) queueClaim(b *pgx.Batch, p doPlan, k Key, c *doClaim) {
	b.Queue(p.lock, lockKey(k)).QueryRow(func(row pgx.Row) error {
		return row.Scan(&c.locked, &c.now, &c.readCommitted, &c.fresh)
	})
	queueLookup(b, p.lookup, k, c.row.destAt(), &c.found)
}

// loadView reads the bucket list and builds each shard's statements.
func (s *bucketStore) loadView(ctx context.Context, q querier) (*bucketView, error) {
	ids := make([][]int32, s.shards)
	opened := make([]time.Time, s.shards)
	loaded := time.Now()
	var dbTime time.Time
	rows, err := q.Query(ctx, `SELECT shard, array_agg(id ORDER BY id), max(opened_at), statement_timestamp()
		FROM `+s.ident("processed_events_buckets")+` WHERE detached_at IS NULL GROUP BY shard`)
	if err != nil {
		return nil, err
	}
	var shard int32
	var list []int32
	var at time.Time
	if _, err := pgx.ForEachRow(rows, []any{&shard, &list, &at, &dbTime}, func() error {
		if shard < 0 || int(shard) >= s.shards {
			return fmt.Errorf("bucket of shard %d in a ledger of %d shards", shard, s.shards)
		}
		ids[shard] = append([]int32(nil), list...)
		opened[shard] = at
		return nil
	}); err != nil {
		return nil, err
	}
	v := &bucketView{loaded: loaded, dbTime: dbTime, shards: make([]doPlan, s.shards)}
	for sh, list := range ids {
		if len(list) == 0 {
			return nil, fmt.Errorf("shard %d has no bucket", sh)
		}
		v.shards[sh] = s.shardStatements(list)
		v.shards[sh].nextOpen = opened[sh].Add(s.width)
	}
	s.view.Store(v)
	return v, nil
}

// shardStatements builds Do's statements for a shard whose buckets are
// ids (ascending; the last is the newest).
func (s *bucketStore) shardStatements(ids []int32) doPlan {
	newest := int(ids[len(ids)-1])
	next := s.ident(bucketName(newest + s.shards))
	fresh := `to_regclass('` + strings.ReplaceAll(next, "'", "''") + `') IS NULL`
	var st doPlan
	st.lockEarly = strings.NewReplacer("{T}", s.table, "{OID}", s.oid).Replace(
		`SELECT pg_try_advisory_xact_lock($1::bigint # {OID}) AS locked, now(),
			current_setting('transaction_isolation') = 'read committed', true`)
	st.lock = strings.TrimSuffix(st.lockEarly, "true") + fresh
	// The look-up goes through the partitioned table, naming the shard's
	// buckets: planning prunes the others, so the statement runs as two
	// index scans under an Append, without the subquery and limit a
	// UNION ALL over the bucket tables needs (whose executor start-up
	// costs more than the scans). A key has at most one row in the
	// buckets the partitioned table shows (a takeover moves the row), and
	// a bucket the view names that has been detached or dropped since is
	// pruned like any other value with no partition: its rows, all
	// expired, are not seen, and the key is claimed as new.
	inShard := make([]string, len(ids))
	for i, id := range ids {
		inShard[len(ids)-1-i] = strconv.Itoa(int(id))
	}
	where := `e.scope = $1 AND e.tenant = $2 AND e.event_id = $3 AND e.bucket IN (` + strings.Join(inShard, ", ") + `)`
	st.lookup = strings.Replace(s.lookupAtSQL, "e.scope = $1 AND e.tenant = $2 AND e.event_id = $3", where, 1)
	bucket := `CASE WHEN ` + fresh + ` THEN ` + strconv.Itoa(newest) + ` ELSE ` +
		s.ident("processed_events_closed") + `(` + strconv.Itoa(newest) + `) END`
	st.insert = `INSERT INTO ` + s.ident(bucketName(newest)) + ` (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at,
		result_expires_at, bucket)
	VALUES ($1, $2, $3, 'done', $4, $5, $6, $7, $8, $9, $10, now(), clock_timestamp(),
		now() + $11::bigint * interval '1 microsecond', ` + resultClock(12) + `, ` + bucket + `)`

	mark := func(lock string) string {
		return `SELECT x.*, set_config('justonce.claim', CASE WHEN x.locked THEN $2::text ELSE '' END, true) IS NOT NULL
		FROM (` + lock + `) x`
	}
	st.markLock, st.markLockEarly = mark(st.lock), mark(st.lockEarly)
	// DoEach's claim row asks the bucket list, not the catalog, whether
	// the newest bucket is still the newest. to_regclass answers from the
	// session's catalog cache, which Postgres brings up to date when a
	// transaction starts and when it takes a lock it does not hold yet.
	// Do's look-up takes its transaction's first lock on the ledger after
	// the key's lock, so by Do's INSERT the cache knows every bucket opened
	// before the key's lock, and a bucket opened later cannot hold the key
	// (its writers take the key's lock). A DoEach run holds every lock it
	// needs once it has claimed a key, so a later key's check could miss a
	// bucket opened before that key's lock, and write the key beside a row
	// another process wrote there. The bucket list is read with the
	// statement's snapshot, taken after the key's lock.
	listed := `CASE WHEN NOT EXISTS (SELECT 1 FROM ` + s.ident("processed_events_buckets") + ` b WHERE b.id = ` +
		strconv.Itoa(newest+s.shards) + `) THEN ` + strconv.Itoa(newest) + ` ELSE ` +
		s.ident("processed_events_closed") + `(` + strconv.Itoa(newest) + `) END`
	st.claimNew = `INSERT INTO ` + s.ident(bucketName(newest)) + ` (scope, tenant, event_id, status, fingerprint, source, principal,
		created_at, completed_at, expires_at, bucket)
	SELECT $1, $2, $3, 'done', $4, $5, $6, now(), clock_timestamp(),
		now() + $7::bigint * interval '1 microsecond', ` + listed + `
	WHERE current_setting('justonce.claim', true) = $8::text
		AND NOT EXISTS (SELECT 1 FROM ` + s.table + ` e WHERE ` + where + `)
	RETURNING true`
	return st
}

// isStaleView reports whether err says the bucket view was stale: a bucket
// table it names was dropped (42P01), or the bucket a row was written into
// is no longer its shard's newest (JO001).
func isStaleView(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "JO001" ||
		pgErr.Code == "42P01" && strings.Contains(pgErr.Message, "processed_events_b"))
}

// refreshPartitions brings the session's cached list of the ledger's
// partitions up to date, inside the transaction on q, so that a claim
// made again can write into k's shard's newest bucket. A session applies
// the catalog changes others committed when its transaction starts and
// when it takes a lock it does not hold yet; a transaction that already
// holds the ledger's locks (a caller's that claimed before, with DoTx; a
// DoEach run) keeps the list it had, while the layout's SQL functions read
// the bucket list with fresh snapshots. Taking the lock the claim needs on
// the newest bucket's table, named from the bucket list, brings the list
// up to date.
func (s *bucketStore) refreshPartitions(ctx context.Context, q querier, k Key) error {
	var id int32
	if err := q.QueryRow(ctx, `SELECT max(id) FROM `+s.ident("processed_events_buckets")+` WHERE shard = $1`,
		shardOf(k, s.shards)).Scan(&id); err != nil {
		return err
	}
	_, err := q.Exec(ctx, `LOCK TABLE `+s.ident(bucketName(int(id)))+` IN ROW EXCLUSIVE MODE`)
	return err
}

// maintainBuckets is the janitor's pass on the time-bucket layout, under the
// janitor lock (a session lock: detaching a partition concurrently cannot
// run inside a transaction). It opens each shard's next bucket when the
// newest is a width old, closes the buckets that have a newer one (in a
// transaction of its own that starts after the opening committed, so
// every row of a closed bucket was claimed before its closed_at), then
// detaches and drops every bucket closed at least MaxTTL ago (all its rows
// have expired) that holds no running lease. It returns the rows the
// dropped buckets held, as Postgres estimates them.
func (s *bucketStore) maintainBuckets(ctx context.Context, pool *pgxpool.Pool) (dropped int64, locked bool, err error) {
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return 0, false, err
	}
	defer pc.Release()
	conn := pc.Conn()
	lockSQL := strings.NewReplacer("{T}", strings.ReplaceAll(s.table, "'", "''")).Replace(
		`SELECT pg_try_advisory_lock($1::bigint # (('{T}'::regclass)::oid::bigint << 32))`)
	buckets, layout := s.ident("processed_events_buckets"), s.ident("processed_events_layout")
	// The lock, and whether there is anything to do, in one round trip: a
	// bucket to open, to close, or closed MaxTTL ago (to detach, or
	// detached and waiting to be dropped), or a detach to finish. Most
	// passes find nothing.
	var work bool
	unlockSQL := strings.Replace(lockSQL, "pg_try_advisory_lock", "pg_advisory_unlock", 1)
	if err := conn.QueryRow(ctx, `SELECT w.locked, w.work, CASE WHEN w.locked AND NOT w.work THEN (`+unlockSQL+`) END
	FROM (SELECT l.locked, l.locked AND (
			EXISTS (SELECT 1 FROM `+buckets+` b, `+layout+` y GROUP BY b.shard, y.width HAVING max(b.opened_at) + y.width <= now())
			OR EXISTS (SELECT 1 FROM `+buckets+` b WHERE b.closed_at IS NULL
				AND EXISTS (SELECT 1 FROM `+buckets+` n WHERE n.shard = b.shard AND n.id > b.id))
			OR EXISTS (SELECT 1 FROM `+buckets+` b, `+layout+` y WHERE b.closed_at + y.max_ttl <= now())
			OR EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhparent = $2::regclass AND i.inhdetachpending)) AS work
		FROM (`+lockSQL+`) AS l(locked) OFFSET 0) w`, s.janitorLockKey(), s.table).Scan(&locked, &work, nil); err != nil || !locked {
		return 0, false, err
	}
	if !work { // and the lock went with the same statement
		return 0, true, nil
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, unlockSQL, s.janitorLockKey()); err != nil {
			_ = conn.Close(uctx) // ends the session, and its lock
		}
	}()
	// The process's own claims see the changes at once.
	changed := false
	defer func() {
		if changed {
			s.forgetPlans()
		}
	}()

	// Open the buckets due, each in a transaction of its own: the next
	// opening is one width after the last scheduled one (whole widths
	// past it when the janitor was away), which keeps the shards'
	// openings staggered.
	rows, err := conn.Query(ctx, `SELECT b.shard, max(b.opened_at) + l.width *
			greatest(1, floor(extract(epoch FROM now() - max(b.opened_at)) / extract(epoch FROM l.width)))
		FROM `+buckets+` b, `+layout+` l
		GROUP BY b.shard, l.width HAVING max(b.opened_at) + l.width <= now()`)
	if err != nil {
		return 0, true, err
	}
	type due struct {
		shard int32
		at    time.Time
	}
	var open []due
	var d due
	if _, err := pgx.ForEachRow(rows, []any{&d.shard, &d.at}, func() error { open = append(open, d); return nil }); err != nil {
		return 0, true, err
	}
	for _, d := range open {
		if _, err := conn.Exec(ctx, `SELECT `+s.ident("processed_events_open_bucket")+`($1, $2)`, d.shard, d.at); err != nil {
			return 0, true, fmt.Errorf("open a bucket of shard %d: %w", d.shard, err)
		}
		changed = true
	}
	if _, err := conn.Exec(ctx, `UPDATE `+buckets+` b SET closed_at = now()
		WHERE b.closed_at IS NULL AND EXISTS (SELECT 1 FROM `+buckets+` n WHERE n.shard = b.shard AND n.id > b.id)`); err != nil {
		return 0, true, fmt.Errorf("close buckets: %w", err)
	}

	rows, err = conn.Query(ctx, `
SELECT c.relname::text, i.inhdetachpending, greatest(c.reltuples, 0)::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
	LEFT JOIN `+buckets+` b ON b.id::text = substring(c.relname FROM '_b([0-9]+)$'),
	`+layout+` l
WHERE i.inhparent = $1::regclass AND (i.inhdetachpending OR b.closed_at + l.max_ttl <= now())
ORDER BY c.relname`, s.table)
	if err != nil {
		return 0, true, err
	}
	type part struct {
		name    string
		pending bool
		rows    int64
	}
	parts, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (part, error) {
		var p part
		return p, row.Scan(&p.name, &p.pending, &p.rows)
	})
	if err != nil {
		return 0, true, err
	}
	for _, p := range parts {
		name := s.ident(p.name)
		if !p.pending {
			// A lease that outlives its row's TTL keeps the bucket.
			var leased bool
			if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+name+
				` WHERE status = 'processing' AND lease_until > now())`).Scan(&leased); err != nil {
				return dropped, true, err
			}
			if leased {
				continue
			}
			// Waits for transactions that use the partitioned table,
			// without blocking claims; cancelled, it leaves the detach
			// pending, and the next pass finishes it.
			if err := execCancelling(ctx, conn, `ALTER TABLE `+s.table+` DETACH PARTITION `+name+` CONCURRENTLY`); err != nil {
				return dropped, true, fmt.Errorf("detach %s: %w", p.name, err)
			}
		} else if err := execCancelling(ctx, conn, `ALTER TABLE `+s.table+` DETACH PARTITION `+name+` FINALIZE`); err != nil {
			// Finishing an interrupted detach waits for every older
			// snapshot in the database, not only for users of the table.
			return dropped, true, fmt.Errorf("finish detaching %s: %w", p.name, err)
		}
		dropped += p.rows
		changed = true
	}
	// Detached buckets leave the bucket list at once (views loaded from
	// now on do not name them), and their tables go once every view that
	// could still name them has expired: a DROP that waited for a claim
	// using its table would hold up every claim queued behind it. A claim
	// running longer than that still holds the DROP up, for a moment: the
	// DROP gives up quickly and a later pass tries again.
	rows, err = conn.Query(ctx, `SELECT c.relname::text,
			coalesce(b.detached_at, now()) <= now() - $2::bigint * interval '1 microsecond'
		FROM pg_class c LEFT JOIN `+buckets+` b ON b.id::text = substring(c.relname FROM '_b([0-9]+)$')
		WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = $1::regclass)
			AND c.relname ~ '^processed_events_b[0-9]+$' AND c.relkind = 'r' AND NOT c.relispartition`,
		s.table, s.dropGrace.Microseconds())
	if err != nil {
		return dropped, true, err
	}
	type detached struct {
		name string
		due  bool
	}
	var gone []detached
	var dt detached
	if _, err := pgx.ForEachRow(rows, []any{&dt.name, &dt.due}, func() error { gone = append(gone, dt); return nil }); err != nil {
		return dropped, true, err
	}
	for _, d := range gone {
		id := strings.TrimPrefix(d.name, "processed_events_b")
		if _, err := conn.Exec(ctx, `UPDATE `+buckets+` SET detached_at = now() WHERE id = $1::integer AND detached_at IS NULL`, id); err != nil {
			return dropped, true, fmt.Errorf("bucket %s detached: %w", id, err)
		}
		if !d.due {
			continue
		}
		if _, err := conn.Exec(ctx, `BEGIN; SET LOCAL lock_timeout = '200ms'; DROP TABLE `+s.ident(d.name)+`; COMMIT`); err != nil {
			_, _ = conn.Exec(ctx, `ROLLBACK`)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
				continue
			}
			return dropped, true, fmt.Errorf("drop %s: %w", d.name, err)
		}
		if _, err := conn.Exec(ctx, `DELETE FROM `+buckets+` WHERE id = $1::integer`, id); err != nil {
			return dropped, true, fmt.Errorf("forget bucket %s: %w", id, err)
		}
	}
	// Rows of buckets whose tables are gone (a pass that stopped between
	// the DROP and the DELETE).
	if _, err := conn.Exec(ctx, `DELETE FROM `+buckets+` b WHERE b.detached_at IS NOT NULL
		AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relname = 'processed_events_b' || b.id
			AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = $1::regclass))`, s.table); err != nil {
		return dropped, true, fmt.Errorf("forget dropped buckets: %w", err)
	}
	return dropped, true, nil
}

// execCancelling runs sql on conn; when ctx ends first it asks the server
// to cancel the statement (rather than dropping the connection, which
// would leave the server waiting on, holding the janitor lock), then waits
// for the statement's answer.
func execCancelling(ctx context.Context, conn *pgx.Conn, sql string) error {
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-ctx.Done():
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = conn.PgConn().CancelRequest(cctx)
		case <-done:
		}
	}()
	_, err := conn.Exec(context.WithoutCancel(ctx), sql)
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return err
}

// checkTTL refuses, on the time-bucket layout, a TTL past MaxTTL (a row
// with it could outlive its bucket), before anything runs. The SQL
// functions (leases, takeovers, DoTx) refuse it themselves. The error is
// the one they raise: SQLSTATE 22023 (invalid_parameter_value).
func (s *bucketStore) checkTTL(ttl time.Duration) error {
	if ttl <= s.maxTTL {
		return nil
	}
	return &pgconn.PgError{Severity: "ERROR", Code: "22023",
		Message: fmt.Sprintf("justonce: TTL of %s exceeds the ledger's MaxTTL of %s", ttl, s.maxTTL)}
}
