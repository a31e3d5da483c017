DROP TABLE IF EXISTS processed_events;
DROP SEQUENCE IF EXISTS processed_events_fencing_seq;
-- What the time-bucket layout adds (see migrations.LayoutTimeBuckets).
DROP TABLE IF EXISTS processed_events_layout;
DROP FUNCTION IF EXISTS processed_events_claim;
DROP FUNCTION IF EXISTS processed_events_fail;
DROP FUNCTION IF EXISTS processed_events_create_buckets;
