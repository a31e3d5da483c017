-- Pending messages that named a partition are published by their key's
-- hash once the column is gone.
ALTER TABLE outbox DROP COLUMN IF EXISTS partition;
