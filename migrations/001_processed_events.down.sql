DROP TABLE IF EXISTS processed_events;
DROP SEQUENCE IF EXISTS processed_events_fencing_seq;
