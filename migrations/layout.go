package migrations

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Layout is how processed_events is stored. The ledger finds out which one
// a schema has; its API and guarantees are the same on both.
type Layout string

const (
	// LayoutPlain is one table; the janitor deletes expired rows in
	// batches. The default.
	LayoutPlain Layout = ""
	// LayoutTimeBuckets partitions processed_events into buckets that the
	// janitor drops whole once every row in them has expired, instead of
	// deleting rows. Keys are spread over Config.Shards shards by a hash;
	// each shard writes into its newest bucket, and the janitor opens a
	// shard's next bucket every Config.BucketWidth, at staggered times, so
	// that a claim looks the key up in its shard's two buckets while the
	// table's size stays flat. A row's TTL may not exceed Config.MaxTTL.
	// See docs/RETENTION.md.
	LayoutTimeBuckets Layout = "time-buckets"
)

// Defaults of the time-bucket layout.
const (
	DefaultMaxTTL = 24 * time.Hour
	// DefaultShards spreads keys over 8 shards: the table's size then
	// swings by about ±4 % around its mean (one shard's oldest bucket goes
	// at a time), in 16 buckets.
	DefaultShards = 8
)

func (c *Config) bucketDefaults() error {
	if c.MaxTTL == 0 {
		c.MaxTTL = DefaultMaxTTL
	}
	if c.BucketWidth == 0 {
		c.BucketWidth = c.MaxTTL
	}
	if c.Shards == 0 {
		c.Shards = DefaultShards
	}
	if c.MaxTTL < time.Second || c.BucketWidth < time.Second || c.Shards < 1 || c.Shards > 1024 ||
		c.MaxTTL%time.Second != 0 || c.BucketWidth%time.Second != 0 {
		return fmt.Errorf("justonce/migrations: time buckets need MaxTTL and BucketWidth of whole seconds ≥ 1s and 1 ≤ Shards ≤ 1024")
	}
	return nil
}

// applyLayout converts processed_events to the configured layout when it
// is plain and time buckets are asked for. It runs in the migration
// transaction, with search_path set to schema.
func (m *Migrator) applyLayout(ctx context.Context, tx pgx.Tx, schema string) error {
	if m.cfg.Layout == LayoutPlain {
		return nil
	}
	if m.cfg.Layout != LayoutTimeBuckets {
		return fmt.Errorf("justonce/migrations: unknown layout %q", m.cfg.Layout)
	}
	var kind string
	if err := tx.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass('processed_events')`).Scan(&kind); err != nil {
		return fmt.Errorf("justonce/migrations: processed_events: %w", err)
	}
	if kind == "p" {
		return nil // converted already; the stored width and MaxTTL stay
	}
	// The ledger computes a key's shard from its UTF-8 bytes, and refuses
	// the layout on a database that stores text otherwise: refuse it here,
	// before anything changes.
	var encoding string
	if err := tx.QueryRow(ctx, `SELECT current_setting('server_encoding')`).Scan(&encoding); err != nil {
		return fmt.Errorf("justonce/migrations: server encoding: %w", err)
	}
	if encoding != "UTF8" && encoding != "SQL_ASCII" {
		return fmt.Errorf("justonce/migrations: the time-bucket layout needs a UTF8 database, not %s", encoding)
	}
	stmts, err := timeBucketSQL(schema, m.cfg)
	if err != nil {
		return err
	}
	for _, stmt := range stmts {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("justonce/migrations: time-bucket layout: %w\n%s", err, stmt)
		}
	}
	return nil
}

// timeBucketSQL returns the statements that move a plain processed_events
// to the time-bucket layout, copying its live rows. Functions name the
// table with its schema, so that they work whatever the caller's
// search_path. The partitioned table's columns are the plain table's, as
// 001_processed_events.up.sql declares them (plainTable), and the bucket.
func timeBucketSQL(schema string, cfg Config) ([]string, error) {
	plain, err := plainTable()
	if err != nil {
		return nil, err
	}
	q := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	names, columns := plain.names, plain.columns
	for _, c := range laterColumns {
		names = append(names, c.name)
		columns += "\n    " + c.name + " " + c.def + ","
	}
	lit := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	width := strconv.FormatInt(int64(cfg.BucketWidth/time.Second), 10) + " seconds"
	maxTTL := strconv.FormatInt(int64(cfg.MaxTTL/time.Second), 10) + " seconds"
	r := strings.NewReplacer(
		"{PE}", q("processed_events"), "{OLD}", q("processed_events_plain"),
		"{LAYOUT}", q("processed_events_layout"), "{BUCKETS}", q("processed_events_buckets"),
		"{SEQ}", q("processed_events_fencing_seq"),
		"{CLAIM}", q("processed_events_claim"), "{FAIL}", q("processed_events_fail"),
		"{OPEN}", q("processed_events_open_bucket"), "{SHARD}", q("processed_events_shard"),
		"{CLOSED}", q("processed_events_closed"),
		"{SCHEMA}", lit(schema), "{W}", lit(width), "{MAXTTL}", lit(maxTTL),
		"{MAXTTL_US}", strconv.FormatInt(cfg.MaxTTL.Microseconds(), 10),
		"{SHARDS}", strconv.Itoa(cfg.Shards),
		"{COLUMNS}", columns, "{CONSTRAINTS}", plain.constraints, "{NAMES}", strings.Join(names, ", "),
	)
	// newest: the newest bucket of the shard v_shard, as the statement
	// that reads it sees the bucket list.
	const newest = `(SELECT max(b.id) FROM {BUCKETS} b WHERE b.shard = v_shard)`
	// loadBuckets reads the buckets of the shard v_shard, where its keys'
	// rows are, into v_ids: a look-up restricted to them (a parameter, so
	// that Postgres prunes the other partitions before it starts) touches
	// their partitions only.
	const loadBuckets = `SELECT array_agg(b.id) INTO v_ids FROM {BUCKETS} b WHERE b.shard = v_shard AND b.detached_at IS NULL;`
	stmts := []string{
		`ALTER TABLE {PE} RENAME TO processed_events_plain`,
		// The plain table's columns and constraints, then the bucket the
		// row was written into: the partition key. A bucket holds keys of
		// one shard; bucket ids of shard s are s, s + shards, s + 2 ×
		// shards, ... in the order they were opened. The primary key
		// includes it, as a partitioned table's must.
		`CREATE TABLE {PE} (
{COLUMNS}
    bucket           integer     NOT NULL,
    CONSTRAINT processed_events_bucket_pkey PRIMARY KEY (scope, tenant, event_id, bucket){CONSTRAINTS}
) PARTITION BY LIST (bucket)`,
		`CREATE INDEX processed_events_bucket_processing_idx ON {PE} (lease_until) WHERE status = 'processing'`,
		`CREATE TABLE {LAYOUT} (
    width   interval NOT NULL,
    max_ttl interval NOT NULL,
    shards  integer  NOT NULL
)`,
		`INSERT INTO {LAYOUT} VALUES ({W}, {MAXTTL}, {SHARDS})`,
		// The buckets. opened_at schedules the shard's next bucket (one
		// width later); closed_at is set, in a transaction that starts after
		// the next bucket of the shard was committed, so every row of the
		// bucket was claimed before closed_at and has expired by closed_at
		// + MaxTTL.
		`CREATE TABLE {BUCKETS} (
    id        integer     PRIMARY KEY,
    shard     integer     NOT NULL,
    opened_at timestamptz NOT NULL,
    closed_at timestamptz,
    -- Set once the bucket is detached: claims stop naming its table, which
    -- is dropped a little later.
    detached_at timestamptz
)`,
		// shard(key): the key's shard, from the first 32 bits of an MD5 of
		// its length-prefixed parts. The ledger computes the same in Go.
		`CREATE FUNCTION {SHARD}(p_scope text, p_tenant text, p_id text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
    SELECT (('x' || substr(md5(octet_length(p_scope)::text || ':' || p_scope ||
        octet_length(p_tenant)::text || ':' || p_tenant || p_id), 1, 8))::bit(32)::bigint % {SHARDS})::integer
$fn$`,
		// closed(id) refuses a claim's row for bucket id, which is no
		// longer its shard's newest (SQLSTATE JO001): the ledger's view of
		// the buckets was stale; it reloads it and claims again.
		`CREATE FUNCTION {CLOSED}(p_bucket integer) RETURNS integer LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'justonce: bucket % is no longer its shard''s newest', p_bucket USING ERRCODE = 'JO001';
END
$fn$`,
		// open_bucket(shard, at) attaches the shard's next bucket, opened
		// at at. It is created as a table of its own, then attached, which
		// locks the parent only against other DDL (SHARE UPDATE EXCLUSIVE),
		// never against claims.
		`CREATE FUNCTION {OPEN}(p_shard integer, p_at timestamptz) RETURNS integer LANGUAGE plpgsql AS $fn$
DECLARE
    v_id   integer;
    v_name text;
BEGIN
    SELECT coalesce(max(b.id) + {SHARDS}, p_shard) INTO v_id FROM {BUCKETS} b WHERE b.shard = p_shard;
    v_name := 'processed_events_b' || v_id;
    EXECUTE format('CREATE TABLE %I.%I (LIKE {PE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', {SCHEMA}, v_name);
    EXECUTE format('ALTER TABLE {PE} ATTACH PARTITION %I.%I FOR VALUES IN (%s)', {SCHEMA}, v_name, v_id);
    INSERT INTO {BUCKETS} (id, shard, opened_at) VALUES (v_id, p_shard, p_at);
    RETURN v_id;
END
$fn$`,

		// claim takes the key's advisory lock, then looks for the key in
		// every bucket. Each statement of a volatile function takes a new
		// snapshot (READ COMMITTED), so the look-up sees every claim of
		// the key that committed before the lock became ours: those claims
		// held the lock until they committed. A row is at most once in the
		// table: an expired row or a lapsed lease is taken over by moving
		// the row to its shard's newest bucket. With p_existing, a key that
		// is not claimed returns its row (claimed false); else nothing.
		`CREATE FUNCTION {CLAIM}(
    p_scope text, p_tenant text, p_id text, p_fp bytea, p_source text, p_principal text,
    p_ttl_us bigint, p_lock bigint, p_lease_us bigint, p_owner text, p_existing boolean,
    OUT o_claimed boolean, OUT o_status text, OUT o_fingerprint bytea, OUT o_source text, OUT o_principal text,
    OUT o_lease_owner text, OUT o_lease_until timestamptz, OUT o_fencing_token bigint, OUT o_attempts integer,
    OUT o_response_code integer, OUT o_response_headers jsonb, OUT o_response_body bytea, OUT o_error text,
    OUT o_duration_us bigint, OUT o_created_at timestamptz, OUT o_completed_at timestamptz,
    OUT o_expires_at timestamptz, OUT o_live boolean, OUT o_leased boolean)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    r       {PE}%ROWTYPE;
    found_r boolean;
    v_now   timestamptz := now();
    v_shard integer := {SHARD}(p_scope, p_tenant, p_id);
    v_ids   integer[];
BEGIN
    o_claimed := false;
    IF p_ttl_us > {MAXTTL_US} THEN
        RAISE EXCEPTION 'justonce: TTL of % exceeds the ledger''s MaxTTL of %', p_ttl_us * interval '1 microsecond', {MAXTTL}::interval
            USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        IF p_existing THEN
            ` + loadBuckets + `
            SELECT * INTO r FROM {PE} e WHERE e.scope = p_scope AND e.tenant = p_tenant AND e.event_id = p_id
                AND e.bucket = ANY(v_ids);
            IF FOUND THEN
                o_claimed := false; o_status := r.status; o_fingerprint := r.fingerprint; o_source := r.source;
                o_principal := r.principal; o_lease_owner := r.lease_owner; o_lease_until := r.lease_until;
                o_fencing_token := r.fencing_token; o_attempts := r.attempts; o_response_code := r.response_code;
                o_response_headers := r.response_headers; o_response_body := r.response_body; o_error := r.error;
                o_duration_us := r.duration_us; o_created_at := r.created_at; o_completed_at := r.completed_at;
                o_expires_at := r.expires_at; o_live := r.expires_at > v_now; o_leased := r.lease_until > v_now;
            END IF;
        END IF;
        RETURN;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'justonce: the time-bucket ledger claims only in READ COMMITTED transactions'
            USING ERRCODE = '0A000';
    END IF;
    ` + loadBuckets + `
    SELECT * INTO r FROM {PE} e WHERE e.scope = p_scope AND e.tenant = p_tenant AND e.event_id = p_id
        AND e.bucket = ANY(v_ids) FOR UPDATE;
    found_r := FOUND;
    IF found_r AND NOT (r.expires_at <= v_now OR (r.status = 'processing' AND r.lease_until <= v_now
            AND (p_fp IS NULL OR r.fingerprint IS NULL OR r.fingerprint = p_fp))) THEN
        IF p_existing THEN
            o_claimed := false; o_status := r.status; o_fingerprint := r.fingerprint; o_source := r.source;
            o_principal := r.principal; o_lease_owner := r.lease_owner; o_lease_until := r.lease_until;
            o_fencing_token := r.fencing_token; o_attempts := r.attempts; o_response_code := r.response_code;
            o_response_headers := r.response_headers; o_response_body := r.response_body; o_error := r.error;
            o_duration_us := r.duration_us; o_created_at := r.created_at; o_completed_at := r.completed_at;
            o_expires_at := r.expires_at; o_live := r.expires_at > v_now; o_leased := r.lease_until > v_now;
        END IF;
        RETURN;
    END IF;
    o_claimed := true; o_fingerprint := p_fp; o_source := p_source; o_principal := p_principal;
    o_fencing_token := 0; o_attempts := 1; o_created_at := v_now;
    o_expires_at := v_now + p_ttl_us * interval '1 microsecond'; o_live := true;
    IF p_lease_us > 0 THEN
        o_status := 'processing'; o_lease_owner := p_owner;
        o_lease_until := v_now + p_lease_us * interval '1 microsecond';
        o_fencing_token := nextval('{SEQ}'); o_leased := true;
    ELSE
        o_status := 'done'; o_completed_at := v_now; o_leased := false;
    END IF;
    IF found_r THEN
        IF r.expires_at > v_now THEN
            o_attempts := r.attempts + 1;
        END IF;
        UPDATE {PE} SET status = o_status, fingerprint = p_fp, source = p_source, principal = p_principal,
            lease_owner = o_lease_owner, lease_until = o_lease_until, fencing_token = o_fencing_token,
            attempts = o_attempts, response_code = NULL, response_headers = NULL, response_body = NULL,
            error = NULL, duration_us = NULL, created_at = v_now, completed_at = o_completed_at,
            expires_at = o_expires_at, bucket = ` + newest + `
        WHERE scope = p_scope AND tenant = p_tenant AND event_id = p_id AND bucket = r.bucket;
    ELSE
        INSERT INTO {PE} (scope, tenant, event_id, status, fingerprint, source, principal, lease_owner,
            lease_until, fencing_token, attempts, created_at, completed_at, expires_at, bucket)
        VALUES (p_scope, p_tenant, p_id, o_status, p_fp, p_source, p_principal, o_lease_owner,
            o_lease_until, o_fencing_token, 1, v_now, o_completed_at, o_expires_at, ` + newest + `);
    END IF;
END
$fn$`,

		// fail records a dead-lettered key as failed unless it is done,
		// under the key's lock (waiting for a holder to finish).
		`CREATE FUNCTION {FAIL}(
    p_scope text, p_tenant text, p_id text, p_fp bytea, p_source text, p_principal text,
    p_attempts integer, p_error text, p_ttl_us bigint, p_lock bigint)
RETURNS boolean LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    r       {PE}%ROWTYPE;
    exp     timestamptz := now() + p_ttl_us * interval '1 microsecond';
    v_shard integer := {SHARD}(p_scope, p_tenant, p_id);
    v_ids   integer[];
BEGIN
    IF p_ttl_us > {MAXTTL_US} THEN
        RAISE EXCEPTION 'justonce: TTL of % exceeds the ledger''s MaxTTL of %', p_ttl_us * interval '1 microsecond', {MAXTTL}::interval
            USING ERRCODE = '22023';
    END IF;
    PERFORM pg_advisory_xact_lock(p_lock);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'justonce: the time-bucket ledger claims only in READ COMMITTED transactions'
            USING ERRCODE = '0A000';
    END IF;
    ` + loadBuckets + `
    SELECT * INTO r FROM {PE} e WHERE e.scope = p_scope AND e.tenant = p_tenant AND e.event_id = p_id
        AND e.bucket = ANY(v_ids) FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO {PE} (scope, tenant, event_id, status, fingerprint, source, principal, attempts, error,
            completed_at, expires_at, bucket)
        VALUES (p_scope, p_tenant, p_id, 'failed', p_fp, p_source, p_principal, p_attempts, p_error,
            now(), exp, ` + newest + `);
        RETURN true;
    END IF;
    IF r.status = 'done' AND r.expires_at > now() THEN
        RETURN false;
    END IF;
    UPDATE {PE} SET status = 'failed', error = p_error, attempts = p_attempts, completed_at = now(),
        lease_until = NULL, expires_at = exp, bucket = ` + newest + `
    WHERE scope = p_scope AND tenant = p_tenant AND event_id = p_id AND bucket = r.bucket;
    RETURN true;
END
$fn$`,

		// Every live row of the plain table must expire before its bucket
		// may go: a shard's first bucket opens up to (Shards-1)/Shards of
		// a width before now() (the schedule is staggered), so it closes
		// no earlier than now() + width/Shards, and goes MaxTTL after.
		// Claims that committed while this transaction waited for its
		// locks wrote rows expiring up to MaxTTL after now(): they fit as
		// long as the wait was shorter than width/Shards.
		`DO $do$
BEGIN
    IF EXISTS (SELECT 1 FROM {OLD} WHERE expires_at > now() + {W}::interval / {SHARDS} + {MAXTTL}::interval) THEN
        RAISE EXCEPTION 'justonce: live rows expire later than now + MaxTTL (%) + BucketWidth/Shards: convert with a larger MaxTTL', {MAXTTL}::interval;
    END IF;
END
$do$`,
		// Each shard's first bucket. The opening times are spread over one
		// width, so that the shards' next buckets open, and their oldest
		// go, one shard at a time.
		`SELECT {OPEN}(s, now() - {W}::interval * s / {SHARDS}) FROM generate_series(0, {SHARDS} - 1) s`,
		// The live rows (and expired rows whose lease still runs) go into
		// their shard's first bucket, which goes only once they expired.
		`INSERT INTO {PE} ({NAMES}, bucket)
SELECT {NAMES}, {SHARD}(scope, tenant, event_id)
FROM {OLD} WHERE expires_at > now() OR (status = 'processing' AND lease_until > now())`,
		`DROP TABLE {OLD}`,
		// The index of migration 6, which went with the plain table.
		`CREATE INDEX processed_events_result_expires_brin ON {PE} USING brin (result_expires_at)`,
	}
	for i, s := range stmts {
		stmts[i] = r.Replace(s)
	}
	return stmts, nil
}

// laterColumns are the columns that migrations after 001 add to
// processed_events (001 declares the others, plainTable): the conversion
// to time buckets adds them to the partitioned table and copies them with
// the rows, after 001's columns. Migration 6: a stored result's own clock.
var laterColumns = []struct{ name, def string }{
	{"result_expires_at", "timestamptz"},
}

// plainTableFile declares processed_events: its CREATE TABLE is the one
// place the ledger's columns are written. It stays as it was released
// (users copy it, and tools that keep checksums of applied migrations
// would refuse an edited one); parseTable reads it as it is: a column or a
// comment a line, then the constraints.
const plainTableFile = "001_processed_events.up.sql"

// tableParts is processed_events as plainTableFile declares it.
type tableParts struct {
	// columns are the column definitions, one a line with its comments,
	// each ending with a comma.
	columns string
	// constraints are the table's constraints but its primary key, one a
	// line, each after a comma and a line break.
	constraints string
	names       []string // the columns' names, in order
}

// plainTable reads processed_events' columns and constraints from
// plainTableFile.
func plainTable() (tableParts, error) {
	body, err := FS.ReadFile(plainTableFile)
	if err != nil {
		return tableParts{}, err
	}
	return parseTable(string(body))
}

// parseTable reads the CREATE TABLE of processed_events in text: the lines
// between it and the closing parenthesis, a column or a comment each, then
// a constraint each, the primary key named processed_events_pkey.
func parseTable(text string) (tableParts, error) {
	var p tableParts
	const open = "CREATE TABLE IF NOT EXISTS processed_events (\n"
	start := strings.Index(text, open)
	end := strings.Index(text[max(start, 0):], "\n);")
	if start < 0 || end < 0 {
		return p, fmt.Errorf("justonce/migrations: %s: no CREATE TABLE IF NOT EXISTS processed_events ( ... );", plainTableFile)
	}
	var columns, constraints []string
	pkey := false
	for _, line := range strings.Split(text[start+len(open):start+end], "\n") {
		field := strings.Fields(line)
		switch {
		case len(field) == 0 || strings.HasPrefix(field[0], "--"):
			if len(constraints) == 0 {
				columns = append(columns, line)
			}
		case field[0] == "CONSTRAINT" && len(field) > 2 && field[1] == "processed_events_pkey":
			pkey = true
		case field[0] == "CONSTRAINT":
			constraints = append(constraints, ",\n"+strings.TrimSuffix(line, ","))
		case len(constraints) > 0 || pkey || !strings.HasSuffix(line, ","):
			return p, fmt.Errorf("justonce/migrations: %s: a column after the constraints, or without its comma: %q", plainTableFile, line)
		default:
			columns = append(columns, line)
			p.names = append(p.names, field[0])
		}
	}
	if !pkey || len(p.names) == 0 {
		return p, fmt.Errorf("justonce/migrations: %s: processed_events has no columns or no processed_events_pkey", plainTableFile)
	}
	p.columns, p.constraints = strings.Join(columns, "\n"), strings.Join(constraints, "")
	return p, nil
}
