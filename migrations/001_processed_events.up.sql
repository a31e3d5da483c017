-- justonce ledger: one row per (scope, tenant, event_id).
-- Plain SQL with unqualified names: the justonce migrator runs it with
-- search_path set to the configured schema; golang-migrate users can take the
-- file as it is.

CREATE SEQUENCE IF NOT EXISTS processed_events_fencing_seq AS bigint;

CREATE TABLE IF NOT EXISTS processed_events (
    -- Keys are opaque byte strings: "C" collation compares bytes, which is
    -- both the right equality and the cheapest ordering for the index.
    scope            text        COLLATE "C" NOT NULL,
    tenant           text        COLLATE "C" NOT NULL DEFAULT '',
    event_id         text        COLLATE "C" NOT NULL,
    status           text        NOT NULL,
    fingerprint      bytea,
    source           text        NOT NULL DEFAULT '',
    principal        text        NOT NULL DEFAULT '',
    lease_owner      text,
    lease_until      timestamptz,
    fencing_token    bigint      NOT NULL DEFAULT 0,
    attempts         integer     NOT NULL DEFAULT 1,
    response_code    integer,
    response_headers jsonb,
    response_body    bytea,
    error            text,
    duration_us      bigint,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    CONSTRAINT processed_events_pkey PRIMARY KEY (scope, tenant, event_id),
    CONSTRAINT processed_events_status_check CHECK (status IN ('processing', 'done', 'failed'))
);

-- The janitor deletes by expiry. Rows arrive roughly in expiry order, so a
-- BRIN index finds expired rows while costing almost nothing per insert
-- (a B-tree here costs every claim an extra index insertion).
CREATE INDEX IF NOT EXISTS processed_events_expires_at_brin
    ON processed_events USING brin (expires_at);

-- Stuck-lease queries look only at rows still processing (lease mode).
CREATE INDEX IF NOT EXISTS processed_events_processing_idx
    ON processed_events (lease_until)
    WHERE status = 'processing';
