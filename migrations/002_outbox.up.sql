-- justonce transactional outbox: messages a transaction adds, published by
-- the relay once it has committed. Plain SQL with unqualified names, like
-- 001: the migrator runs it with search_path set to the ledger's schema.

CREATE TABLE IF NOT EXISTS outbox (
    -- Insertion order: the relay publishes each lane in seq order.
    seq        bigint      GENERATED ALWAYS AS IDENTITY,
    -- The message ID (Kafka header ce_id, NATS Nats-Msg-Id).
    id         text        COLLATE "C" NOT NULL,
    -- hash(broker, topic, key) mod the writer's lane count: a relay owns a
    -- lane while it holds the lane's advisory lock.
    lane       integer     NOT NULL,
    broker     text        NOT NULL,
    topic      text        NOT NULL,
    key        bytea,
    headers    jsonb,
    value      bytea,
    -- pending: waiting for the relay; failed: refused by the broker for
    -- good (error says why), kept until retried or purged.
    status     text        NOT NULL DEFAULT 'pending',
    attempts   integer     NOT NULL DEFAULT 0,
    error      text,
    created_at timestamptz NOT NULL DEFAULT now(),
    failed_at  timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (seq),
    CONSTRAINT outbox_status_check CHECK (status IN ('pending', 'failed'))
);

-- The relay's queue: a lane's pending messages in order.
CREATE INDEX IF NOT EXISTS outbox_pending_idx ON outbox (lane, seq) WHERE status = 'pending';
-- Failed messages, for stats, retry and purge.
CREATE INDEX IF NOT EXISTS outbox_failed_idx ON outbox (id) WHERE status = 'failed';

-- Wake the relays when a transaction that added messages commits. NOTIFY
-- is delivered at commit, never for a rollback, but it serialises the
-- commits that send one on a global lock held through the commit's flush
-- to disk. So the trigger runs at commit (deferred) and only one
-- committing transaction of the schema at a time notifies (a try-lock);
-- the others commit side by side, and a relay woken by the one looks again
-- after each round that published anything. The channel is per schema.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF pg_try_advisory_xact_lock(hashtextextended('justonce.outbox.notify:' || TG_TABLE_SCHEMA, 0)) THEN
        PERFORM pg_notify(left('justonce_outbox.' || TG_TABLE_SCHEMA, 63), '');
    END IF;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE CONSTRAINT TRIGGER outbox_notify AFTER INSERT ON outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_notify();
