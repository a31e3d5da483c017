DROP TABLE IF EXISTS processed_events;
DROP SEQUENCE IF EXISTS processed_events_fencing_seq;
-- What the time-bucket layout adds (see migrations.LayoutTimeBuckets).
DROP TABLE IF EXISTS processed_events_layout;
DROP FUNCTION IF EXISTS processed_events_claim;
DROP FUNCTION IF EXISTS processed_events_fail;
DROP FUNCTION IF EXISTS processed_events_create_buckets;
DROP TABLE IF EXISTS processed_events_buckets;
DROP FUNCTION IF EXISTS processed_events_open_bucket;
DROP FUNCTION IF EXISTS processed_events_shard;
DROP FUNCTION IF EXISTS processed_events_closed;
