-- justonce new-key rate limit: how many new idempotency keys each tenant
-- started in the current window, per count name (a route's or method's
-- scope by default), for ledgers without Redis (with Redis the counts live
-- there). Plain SQL with unqualified names, like 001: the migrator runs it
-- with search_path set to the ledger's schema.
--
-- One row per (name, tenant), reset when a new window starts, so the table
-- never grows past the tenants that ever counted and needs no purge. A
-- key's transaction adds itself to the count with its commit; the CHECK
-- refuses the key that would go over the limit, which rolls back that
-- transaction whole (its ledger row and its writes included).

CREATE TABLE IF NOT EXISTS key_rate (
    name         text        COLLATE "C" NOT NULL,
    tenant       text        COLLATE "C" NOT NULL DEFAULT '',
    window_start timestamptz NOT NULL,
    keys         bigint      NOT NULL,
    max_keys     bigint      NOT NULL,
    CONSTRAINT key_rate_pkey PRIMARY KEY (name, tenant),
    CONSTRAINT key_rate_limit CHECK (keys <= max_keys)
);
