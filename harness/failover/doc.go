// Package failover proves the ledger across the failover of every service
// it runs on, each with a standby that takes over: Postgres with a
// streaming standby promoted after the primary's death (synchronous and
// asynchronous replication), Redis behind Sentinel, and a three-node NATS
// JetStream cluster. The tests start those services themselves
// (harness/testsvc: StartPostgresReplicaSet, StartRedisSentinel,
// StartNATSCluster) on loopback, kill their leaders mid-run, and count
// every effect in Postgres: none lost, none doubled, and the time until
// work resumed after each failover. The package holds tests only.
package failover
