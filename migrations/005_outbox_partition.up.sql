-- justonce transactional outbox: a message may name the Kafka partition it
-- goes to (outbox.Message.Partition). NULL, as in every row written before:
-- the partition its key hashes to. Independent of any other version: it
-- only adds a nullable column to the outbox table of version 2 (no rewrite
-- of the table).

ALTER TABLE outbox ADD COLUMN IF NOT EXISTS partition integer
    CONSTRAINT outbox_partition_check CHECK (partition >= 0);
