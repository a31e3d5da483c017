// Package outbox is the transactional outbox: a handler that must announce
// what it did writes its messages in its own transaction, and a relay
// publishes them to Kafka or NATS JetStream once that transaction has
// committed, never if it rolled back.
//
// Add inserts messages into the outbox table (beside processed_events, in
// the ledger's schema: migrations versions 2 and 5) with the caller's pgx.Tx: a
// consumer.Handler's, httpbridge.Tx(ctx), a gRPC bridge's, or any other.
// Inside a justonce handler a message without an ID gets one derived from
// the event's key and its place among the handler's messages (EventID), so
// a retried or replayed handler writes the same IDs.
//
// A Relay publishes the committed messages through a Publisher per broker
// (RelayConfig.Publishers): Kafka with kafka-go
// (kafkainbox.NewOutboxPublisher) or franz-go
// (franzinbox.NewOutboxPublisher), acked by every in-sync replica, with
// the ID in the header ce_id; NATS JetStream (natsinbox.NewOutboxPublisher)
// with the ID in Nats-Msg-Id, acks awaited. This package links no broker
// client: a program links only the clients of the publishers it makes.
// Messages are spread over lanes by hash(broker, topic, key) (the broker,
// not the client: a Kafka message's lane is the same whichever Kafka
// publisher sends it); a relay publishes a lane only while it holds the
// lane's Postgres advisory lock, in one transaction that reads the lane's
// oldest pending messages in order, publishes them as one batch and
// deletes them. So several relays run side by side without publishing a
// message twice, and the messages of one key are published in the order
// they were committed (see below). A Kafka message goes to the partition
// its key hashes to, or to the one it names (Message.Partition). A relay wakes on LISTEN/NOTIFY when a
// transaction that added messages commits, and polls as a fallback.
//
// # Guarantees and where they stop
//
// Every committed message is published at least once. It is published
// twice only when a relay dies (or loses its database connection) after
// the broker acked a batch and before the batch's deletion committed: the
// next relay publishes the batch again with the same IDs (so does a
// database crash just after a batch committed: the relay commits without
// waiting for the WAL flush). A justonce consumer (kafkainbox,
// franzinbox, natsinbox) dedupes them in its ledger, and JetStream drops a
// repeated Nats-Msg-Id within the stream's duplicate window; any other
// consumer must dedupe on the message ID itself.
//
// Order holds per (broker, topic, key) among messages whose transactions
// did not overlap (and within one transaction, in the order Add was
// called). Two transactions that add messages of one key at the same time
// may be published in either order: the relay reads committed rows in
// insertion order, and a row inserted earlier by a transaction that
// commits later is not visible to it yet. Serialise the writers of one key
// (as a row lock on the entity the key names does) when their order
// matters. A message the broker refuses for good (ErrPermanent: too
// large, unknown topic, no stream for the subject) is marked failed and
// the rest of its lane goes on: a later message of the same key then
// overtakes it. Retry puts it back; Stats counts failed messages. A
// broker failure for the time being stops the lane and tries it again
// with backoff. Within one batch, though, the messages are in flight
// together: when the broker acks a later message of a key and not an
// earlier one (NATS during a leader election, or a Kafka batch sent in
// several requests), the later one is published, and the earlier one
// follows it on the retry.
package outbox
