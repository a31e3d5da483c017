DROP INDEX IF EXISTS processed_events_result_expires_brin;
ALTER TABLE processed_events DROP COLUMN IF EXISTS result_expires_at;
