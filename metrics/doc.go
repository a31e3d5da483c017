// Package metrics exports justonce to Prometheus and, optionally, to
// OpenTelemetry tracing. Nothing is registered globally: the application
// registers the collectors it wants.
//
//	reg := prometheus.NewRegistry() // or prometheus.DefaultRegisterer
//	reg.MustRegister(metrics.NewLedgerCollector(ledger, metrics.LedgerConfig{}))
//	cm := metrics.NewConsumerCollector(metrics.ConsumerConfig{})
//	reg.MustRegister(cm)
//	cfg := consumer.Config{Ledger: ledger, Scope: "billing", Source: inbox.Source("kafka"),
//		Hooks: cm.Hooks("billing", inbox.Source("kafka"))}
//
// # Metrics
//
// The ledger (LedgerCollector), from inbox.Ledger.Counters; the counters
// count calls of this process since the ledger was created:
//
//	justonce_ledger_calls_total{disposition}            calls by what they did: executed,
//	                                                    duplicate, in_flight, mismatch, error
//	justonce_ledger_cache_replays_total                 duplicates answered from the Redis replay cache
//	justonce_ledger_redis_fallbacks_total               Redis calls that failed or timed out;
//	                                                    Postgres carried on alone
//	justonce_ledger_redis_recoveries_total              Redis calls answered after others had failed:
//	                                                    the end of a fallback episode
//	justonce_ledger_leases_lost_total                   leases found taken over or released
//	justonce_ledger_overloaded_total                    calls shed: no connection came free within
//	                                                    the request's acquire wait; nothing ran
//	justonce_ledger_steps_total{kind}                   steps (DoSteps) run and recorded: tx, call,
//	                                                    compensate
//	justonce_ledger_steps_resumed_total                 steps skipped because recorded already
//	                                                    (attempts resuming after a failure or crash)
//
// and, queried from Postgres at each scrape (inbox.Ledger.Stats, bounded by
// LedgerConfig.StatsTimeout), the table as all instances see it:
//
//	justonce_ledger_rows{scope,status}                  live rows
//	justonce_ledger_oldest_lease_overdue_seconds{scope} how long ago the earliest lease of the scope's
//	                                                    processing rows ran out; negative while it
//	                                                    still runs; absent when nothing is processing
//	justonce_ledger_stats_up                            1 when the last query answered, else 0
//
// and, with LedgerConfig.Replication, the replication of the ledger's
// database (inbox.Ledger.CheckReplication), for deployments where a
// failover promotes a standby:
//
//	justonce_ledger_commit_durable                      1 when commits are acknowledged only once a
//	                                                    synchronous standby has them, else 0
//	justonce_ledger_standbys                            standbys streaming from the database
//	justonce_ledger_sync_standbys                       standbys it waits for at each commit now
//	justonce_ledger_replication_up                      1 when the last query answered, else 0
//
// Consumers (ConsumerCollector, through consumer.Hooks):
//
//	justonce_consumer_handler_duration_seconds{scope,source,disposition}
//	                                                    histogram of one attempt, from claim to commit
//	                                                    (or to the ledger's answer for duplicates)
//	justonce_consumer_retries_total{scope,source}       attempts that will be retried
//	justonce_consumer_dead_lettered_total{scope,source,reason}
//	                                                    messages given up: no_id, invalid_key, handler
//	justonce_consumer_redelivery_headroom_seconds{scope,source,topic}
//	                                                    the ledger TTL minus how long the topic or
//	                                                    stream keeps messages, measured when Run
//	                                                    started; negative: a message may come again
//	                                                    after its ID expired; -Inf: kept forever
//	justonce_consumer_observed_total{scope,source,would}
//	                                                    attempts an observe-mode consumer ran, by what
//	                                                    dedupe would have done: would_run, would_skip,
//	                                                    would_conflict, would_refuse_missing_key,
//	                                                    would_refuse_invalid_key
//
// The transactional outbox (OutboxCollector): the relays' counters, fed by
// the outbox.RelayHooks that OutboxCollector.Hooks returns, and the table as
// every instance sees it, queried at each scrape:
//
//	justonce_outbox_pending                     messages waiting for a relay
//	justonce_outbox_oldest_pending_age_seconds  age of the oldest pending message; 0 when none
//	justonce_outbox_failed                      messages refused for good, waiting for retry or purge
//	justonce_outbox_stats_up                    1 when the last query answered, else 0
//	justonce_outbox_published_total{broker}     messages published (acked) by this process's relays
//	justonce_outbox_failed_total{broker}        messages this process's relays marked failed
//	justonce_outbox_publish_retries_total{broker}
//	                                            publishes that failed for the time being (retried)
//
// The request fronts' observe mode (BridgeCollector, through the bridges'
// Config.OnObserve):
//
//	justonce_bridge_observed_total{front,route,would}  requests an observe-mode route or method let
//	                                                   through, by what enforcing would have done:
//	                                                   would_run, would_replay, would_refuse_missing_key,
//	                                                   would_refuse_invalid_key, would_conflict,
//	                                                   would_mismatch
//
// Labels are bounded: scope is the consumer group or route name the
// application chose (never put an event ID in it), route an HTTP route's
// scope or a gRPC method's full name, source is http, kafka,
// nats or the like, status and disposition are fixed sets. Event IDs are
// never labels. Several ledgers in one registry (several schemas) need a
// label to tell them apart: register each collector through
// prometheus.WrapRegistererWith with a label of its own, such as ledger.
//
// alerts.yml in this directory has example Prometheus alert rules built on
// these metrics: stuck leases, in-flight (conflict) rate, fingerprint
// mismatches, Redis fallback, commits not replicated to a standby, dead
// letters, outbox backlog, failed outbox messages.
//
// Tracing is in package tracing.
package metrics
