package inbox

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The time-bucket layout (migrations.LayoutTimeBuckets): processed_events is
// partitioned by the bucket of each row's claim time. Do and DoBatch claim as
// on the plain layout (the key's advisory lock, then a look-up over every
// bucket in a statement of its own, then the row written with the commit
// into the current bucket); the other claims and failures go through SQL
// functions the migration creates, which take the key's lock before they
// look for the key in every bucket and move a row they take over to the
// current bucket. The janitor creates buckets ahead and drops the ones whose
// rows have all expired. docs/RETENTION.md has the reasoning.

// detect finds out the table's layout, once: the statements that differ
// (claims, failures, the janitor) are switched before first use.
func (s *pgStore) detect(ctx context.Context, q querier) error {
	if s.ready.Load() {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ready.Load() {
		return nil
	}
	var kind string
	if err := q.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = $1::regclass`, s.table).Scan(&kind); err != nil {
		return fmt.Errorf("ledger layout: %w", err)
	}
	if kind == "p" {
		var width, maxTTL int64
		if err := q.QueryRow(ctx, `SELECT extract(epoch FROM width)::bigint, extract(epoch FROM max_ttl)::bigint FROM `+
			s.ident("processed_events_layout")).Scan(&width, &maxTTL); err != nil {
			return fmt.Errorf("ledger layout: %w", err)
		}
		s.useTimeBuckets(time.Duration(width)*time.Second, time.Duration(maxTTL)*time.Second)
	}
	s.ready.Store(true)
	return nil
}

// useTimeBuckets switches the statements that differ to the time-bucket
// layout's. The others work on both.
func (s *pgStore) useTimeBuckets(width, maxTTL time.Duration) {
	s.buckets = true
	oid := "(('" + strings.ReplaceAll(s.table, "'", "''") + "'::regclass)::oid::bigint << 32)"
	r := strings.NewReplacer("{T}", s.table, "{OID}", oid, "{CLAIM}", s.ident("processed_events_claim"),
		"{FAIL}", s.ident("processed_events_fail"),
		"{W}", fmt.Sprintf("'%d seconds'::interval", int64(width/time.Second)),
		"{MAXTTL_US}", strconv.FormatInt(maxTTL.Microseconds(), 10),
		// The layout's failure function, called where it raises: past its
		// TTL check, it takes a (blocking) advisory lock, then refuses any
		// transaction stricter than READ COMMITTED.
		"{REFUSE_RR}", s.ident("processed_events_fail")+"('', '', '', NULL, '', '', 0, '', 0, 0)")

	// The write-once path (Do, DoBatch), as on the plain layout: the key's
	// lock, then a look-up in a statement of its own, then the row, written
	// complete with the commit into the bucket of the transaction's time.
	// In READ COMMITTED the look-up's snapshot is taken after the lock is
	// ours, so it sees every row an earlier holder committed, whatever its
	// bucket; in a stricter isolation level it would not, and the lock
	// statement refuses (SQLSTATE 0A000). A TTL past MaxTTL is refused by
	// the row's INSERT (SQLSTATE 22023). Both refusals call the layout's
	// functions, which raise them; nothing else calls a function.
	const readCommitted = `current_setting('transaction_isolation') = 'read committed'`
	s.lockOneSQL = r.Replace(`SELECT CASE WHEN ` + readCommitted + ` THEN pg_try_advisory_xact_lock($1::bigint # {OID})
		ELSE {REFUSE_RR} END, now()`)
	s.lockManySQL = r.Replace(`SELECT array_agg(pg_try_advisory_xact_lock(u.k # {OID}) ORDER BY u.o), now()
		FROM unnest($1::bigint[]) WITH ORDINALITY AS u(k, o)
		WHERE CASE WHEN ` + readCommitted + ` THEN true ELSE {REFUSE_RR} END`)
	const ttl = `CASE WHEN %[1]s <= {MAXTTL_US} THEN %[1]s
		ELSE (SELECT f.o_attempts::bigint FROM {CLAIM}('', '', '', NULL, '', '', %[1]s, 0, 0, NULL, false) f) END`
	s.insertDoneSQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at, bucket)
	VALUES ($1, $2, $3, 'done', $4, $5, $6, $7, $8, $9, $10, now(), clock_timestamp(),
		now() + ` + fmt.Sprintf(ttl, "$11::bigint") + ` * interval '1 microsecond', date_bin({W}, now(), 'epoch'))`)
	s.insertManySQL = r.Replace(`INSERT INTO {T} (scope, tenant, event_id, status, fingerprint, source, principal,
		response_code, response_headers, response_body, duration_us, created_at, completed_at, expires_at, bucket)
	SELECT u.scope, u.tenant, u.event_id, 'done', u.fingerprint, u.source, u.principal,
		u.code, u.header, u.body, u.duration_us, now(), clock_timestamp(),
		now() + ` + fmt.Sprintf(ttl, "u.ttl_us") + ` * interval '1 microsecond', date_bin({W}, now(), 'epoch')
	FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[],
		$7::integer[], $8::text[]::jsonb[], $9::bytea[], $10::bigint[], $11::bigint[])
		AS u(scope, tenant, event_id, fingerprint, source, principal, code, header, body, duration_us, ttl_us)`)

	const out = `o_status, o_fingerprint, o_source, o_principal, o_lease_owner, o_lease_until, o_fencing_token,
		o_attempts, o_response_code, o_response_headers, o_response_body, o_error, o_duration_us,
		o_created_at, o_completed_at, o_expires_at, o_live, o_leased`
	s.claimOneSQL = r.Replace(`SELECT o_fencing_token, o_attempts, o_created_at, o_expires_at, o_lease_until
		FROM {CLAIM}($1::text, $2::text, $3::text, $4::bytea, $5::text, $6::text, $7::bigint,
			$8::bigint # {OID}, $9::bigint, $10::text, false)
		WHERE o_claimed`)
	s.claimSQL = r.Replace(`SELECT u.ord, f.o_claimed, ` + out + `
		FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::bigint[], $8::bigint[])
			WITH ORDINALITY AS u(scope, tenant, event_id, fingerprint, source, principal, ttl_us, lock_key, ord)
		CROSS JOIN LATERAL {CLAIM}(u.scope, u.tenant, u.event_id, u.fingerprint, u.source, u.principal,
			u.ttl_us, u.lock_key # {OID}, $9::bigint, $10::text, true) AS f`)
	s.failSQL = r.Replace(`SELECT {FAIL}($1::text, $2::text, $3::text, $4::bytea, $5::text, $6::text,
		$7::integer, $8::text, $9::bigint, $10::bigint # {OID})`)
}

// ident quotes name, qualified with the ledger's schema when it has one.
func (s *pgStore) ident(name string) string {
	if s.schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{s.schema, name}.Sanitize()
}

// maintainBuckets is the janitor's pass on the time-bucket layout, under the
// janitor lock (a session lock: detaching a partition concurrently cannot
// run inside a transaction): it creates the buckets ahead, then detaches
// and drops every bucket whose rows have all expired (its end + MaxTTL has
// passed) and that holds no running lease. It returns the rows the dropped
// buckets held, as Postgres estimates them.
func (s *pgStore) maintainBuckets(ctx context.Context, l *Ledger) (dropped int64, locked bool, err error) {
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return 0, false, err
	}
	defer pc.Release()
	conn := pc.Conn()
	lockSQL := strings.NewReplacer("{T}", strings.ReplaceAll(s.table, "'", "''")).Replace(
		`SELECT pg_try_advisory_lock($1::bigint # (('{T}'::regclass)::oid::bigint << 32))`)
	if err := conn.QueryRow(ctx, lockSQL, s.janitorLockKey()).Scan(&locked); err != nil || !locked {
		return 0, false, err
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		unlock := strings.Replace(lockSQL, "pg_try_advisory_lock", "pg_advisory_unlock", 1)
		if _, err := conn.Exec(uctx, unlock, s.janitorLockKey()); err != nil {
			_ = conn.Close(uctx) // ends the session, and its lock
		}
	}()

	if _, err := conn.Exec(ctx, `SELECT `+s.ident("processed_events_create_buckets")+`(now())`); err != nil {
		return 0, true, fmt.Errorf("create buckets: %w", err)
	}
	rows, err := conn.Query(ctx, `
SELECT c.relname::text, i.inhdetachpending, greatest(c.reltuples, 0)::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid, `+s.ident("processed_events_layout")+` l
WHERE i.inhparent = $1::regclass
	AND (i.inhdetachpending OR to_timestamp(substring(c.relname FROM '_p([0-9]+)$')::bigint) + l.width + l.max_ttl <= now())
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
			// Waits for transactions that use the table, without
			// blocking claims; cancelled, it leaves the detach pending,
			// and the next pass finishes it.
			if err := execCancelling(ctx, conn, `ALTER TABLE `+s.table+` DETACH PARTITION `+name+` CONCURRENTLY`); err != nil {
				return dropped, true, fmt.Errorf("detach %s: %w", p.name, err)
			}
		} else if err := execCancelling(ctx, conn, `ALTER TABLE `+s.table+` DETACH PARTITION `+name+` FINALIZE`); err != nil {
			// Finishing an interrupted detach waits for every older
			// snapshot in the database, not only for users of the table.
			return dropped, true, fmt.Errorf("finish detaching %s: %w", p.name, err)
		}
		if _, err := conn.Exec(ctx, `DROP TABLE `+name); err != nil {
			return dropped, true, fmt.Errorf("drop %s: %w", p.name, err)
		}
		dropped += p.rows
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
