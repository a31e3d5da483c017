-- justonce ledger: a stored result's own clock. A row may keep its key (the
-- marker that deduplicates) longer than its result (the stored response,
-- which may hold personal data): result_expires_at is when the result stops
-- being answered; NULL means it lives as long as the row. Past it, reads
-- answer the row without its result, and the janitor clears the result's
-- columns (code, headers, body).
-- Plain SQL with unqualified names, like 001: the migrator runs it with
-- search_path set to the ledger's schema. On the time-bucket layout the
-- column and the index reach every bucket.

ALTER TABLE processed_events ADD COLUMN IF NOT EXISTS result_expires_at timestamptz;

-- The janitor clears results by their clock: rows arrive roughly in that
-- order, so a BRIN index finds them at almost no cost per insert, and the
-- clearing update changes no indexed column (it may stay a HOT update).
CREATE INDEX IF NOT EXISTS processed_events_result_expires_brin
    ON processed_events USING brin (result_expires_at);
