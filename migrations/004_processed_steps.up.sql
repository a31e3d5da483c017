-- justonce recovery points: the recorded steps of a key run with
-- Ledger.DoSteps, one row per (scope, tenant, event_id, step). A step is
-- recorded once its effect happened (a Postgres step: in the same
-- transaction as its writes); a later attempt of the key skips it and gets
-- its output. Rows expire with their key's processed_events row.
-- Plain SQL with unqualified names, like 001: the migrator runs it with
-- search_path set to the ledger's schema.

CREATE TABLE IF NOT EXISTS processed_steps (
    scope        text        COLLATE "C" NOT NULL,
    tenant       text        COLLATE "C" NOT NULL DEFAULT '',
    event_id     text        COLLATE "C" NOT NULL,
    -- The step's name: the handler's own, or compensate:<name> for the
    -- compensation of step <name>.
    step         text        COLLATE "C" NOT NULL,
    -- The order the key's steps were recorded in: 1, 2, ...
    seq          integer     NOT NULL,
    -- tx: a Postgres step; call: an outside call; compensate: the undoing
    -- of an earlier step; failed: the permanent failure that started the
    -- compensations (output holds its error text).
    kind         text        NOT NULL,
    output       bytea,
    -- The fencing token of the lease that recorded the step.
    token        bigint      NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT now(),
    -- The key's expiry (its processed_events row's): refreshed at each claim
    -- of the key, so that a key's steps go with it.
    expires_at   timestamptz NOT NULL,
    CONSTRAINT processed_steps_pkey PRIMARY KEY (scope, tenant, event_id, step),
    CONSTRAINT processed_steps_kind_check CHECK (kind IN ('tx', 'call', 'compensate', 'failed'))
);

-- The janitor deletes by expiry, as on processed_events.
CREATE INDEX IF NOT EXISTS processed_steps_expires_at_brin
    ON processed_steps USING brin (expires_at);
