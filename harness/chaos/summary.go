package main

import (
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"time"

	"github.com/justonce/justonce/examples/payments/stepspay"
)

// Fault kinds, as counted in the summary.
const (
	fKill        = "consumer SIGKILL"
	fRedis       = "Redis outage"
	fPgTerminate = "pg_terminate_backend round"
	fPgCrash     = "Postgres SIGKILL+restart"
	fKafkaCrash  = "Kafka SIGKILL+restart"
	fNatsRestart = "NATS restart (file store)"
	fNet         = "network fault"
	fRelease     = "operator release+resend"
	fRelayKill   = "outbox relay SIGKILL"
	// The failovers, on the services with a standby.
	fPgFailover    = "Postgres failover"
	fRedisFailover = "Redis Sentinel failover"
	fNatsLeader    = "NATS stream leader kill"
	// fOverload stalls every handler on the effects table: the workers'
	// pools fill, the bridges shed (-overloads).
	fOverload = "overload (effects locked)"
)

var faultOrder = []string{fKill, fRelayKill, fRedis, fPgTerminate, fPgCrash, fKafkaCrash, fNatsRestart, fNet, fRelease, fStepsKill}

// haFaultOrder are the failovers, in the summary only when asked for.
var haFaultOrder = []string{fPgFailover, fRedisFailover, fNatsLeader}

const janitorScope = "chaos-janitor"

// summary is what the run did and found.
type summary struct {
	shed                                     atomic.Int64 // answers 503 overloaded / Unavailable OVERLOADED the clients got
	transports                               []string
	produced, duplicates, unique             map[string]int
	hostile                                  map[string]map[hostileKind]int
	effects, distinct                        map[string]int
	faults                                   map[string]int
	asked                                    map[string]int // faults asked for
	ha                                       map[string]bool
	netKinds                                 map[string]int
	down                                     map[string][]time.Duration
	rebuilt                                  []time.Duration // Postgres failovers: kill to the dead node streaming as the new standby
	obs                                      *observations
	pgTerminated                             int
	producerRetries                          atomic.Int64
	released, releaseFailed                  int
	httpRequests, httpFailed, httpMismatched int
	keys                                     map[string]*keyLoad // grpc: the clients' counts
	ledgerDone, ledgerFailed                 int
	deadLettered                             map[string]int
	janitorCreated, janitorLeft, janitorGone int
	natsSync                                 string
	layout                                   string
	bucketLayout                             bool
	bucketsOpened                            int
	killsBy                                  map[string]int // SIGKILLs by worker role
	hops                                     *hops
	hopLost, hopDoubled, hopLeaked           map[string]int
	hopLedger                                map[string][2]int // scope -> done, failed
	hopHTTPMismatched                        int
	relayKillsBusy                           int              // relay kills while outbox rows were waiting
	relayKillRows                            int              // outbox rows waiting at those kills
	steps                                    *stepspay.Report // the steps fault's (nil: off)
	took                                     time.Duration
	problems                                 []string
}

func (s *summary) violations() int { return len(s.problems) }

func (s *summary) problem(format string, args ...any) {
	s.problems = append(s.problems, fmt.Sprintf(format, args...))
}

func (s *summary) print(w io.Writer) {
	fmt.Fprintf(w, "\n== justonce chaos summary (%s) ==\n", s.took.Round(time.Second))
	fmt.Fprintf(w, "ledger layout: %s\n", s.layout)
	if on := s.haServices(); on != "" {
		fmt.Fprintf(w, "services with a standby: %s\n", on)
	}
	s.printTransports(w)
	s.printFaults(w)
	s.printWorkers(w)
	s.printHops(w)
	fmt.Fprintf(w, "violations: %d\n", len(s.problems))
	for _, p := range s.problems {
		fmt.Fprintln(w, "  -", p)
	}
}

// haServices names the services the run used with a standby, or "".
func (s *summary) haServices() string {
	var on []string
	if s.ha["postgres"] {
		on = append(on, "Postgres (a primary and a synchronous streaming standby, multi-host connection string with target_session_attrs=read-write)")
	}
	if s.ha["redis"] {
		on = append(on, "Redis (a master, a replica, three sentinels; the Sentinel failover client)")
	}
	if s.ha["nats"] {
		on = append(on, "NATS (a three-node JetStream cluster, streams with Replicas 3)")
	}
	return strings.Join(on, "; ")
}

func (s *summary) printTransports(w io.Writer) {
	for _, t := range s.transports {
		fmt.Fprintf(w, "%-6s events produced %7d  duplicates %6d  unique %7d  effects %7d  distinct %7d\n",
			t, s.produced[t], s.duplicates[t], s.unique[t], s.effects[t], s.distinct[t])
		if h := s.hostile[t]; len(h) > 0 {
			var parts []string
			for k := hostileKind(1); k < numKinds; k++ {
				parts = append(parts, fmt.Sprintf("%s %d", k, h[k]))
			}
			fmt.Fprintf(w, "       hostile events: %s; dead-lettered %d\n", strings.Join(parts, ", "), s.deadLettered[t])
		}
	}
}

func (s *summary) printFaults(w io.Writer) {
	fmt.Fprintf(w, "faults injected:\n")
	kinds := append([]string(nil), faultOrder...)
	for i, f := range haFaultOrder {
		if s.asked[f] > 0 || s.faults[f] > 0 || s.ha[[]string{"postgres", "redis", "nats"}[i]] {
			kinds = append(kinds, f)
		}
	}
	if s.asked[fOverload] > 0 || s.faults[fOverload] > 0 {
		kinds = append(kinds, fOverload)
	}
	for _, f := range kinds {
		extra := s.faultExtra(f)
		if d := s.down[f]; len(d) > 0 {
			extra += fmt.Sprintf(" down for %s", durations(d))
		}
		if f == fPgFailover && len(s.rebuilt) > 0 {
			extra += fmt.Sprintf("; the dead node streaming as the new synchronous standby %s after the kill", durations(s.rebuilt))
		}
		fmt.Fprintf(w, "  %-28s %4d%s\n", f, s.faults[f], extra)
	}
	fmt.Fprintf(w, "  hostile handler runs        swallowed error %d, deferred constraint %d, panic %d, slower than the lock TTL %d\n",
		s.obs.get("hostile:swallow"), s.obs.get("hostile:deferred"), s.obs.get("hostile:panic"), s.obs.get("hostile:slow"))
	if s.bucketLayout {
		fmt.Fprintf(w, "  janitor                     %d short-TTL rows written, %d gone (time buckets: a bucket is dropped MaxTTL after it closed, not within a run); %d buckets opened during the run\n",
			s.janitorCreated, s.janitorGone, s.bucketsOpened)
	} else {
		fmt.Fprintf(w, "  janitor                     %d short-TTL rows written, %d purged, %d expired rows left behind\n",
			s.janitorCreated, s.janitorGone, s.janitorLeft)
	}
}

// faultExtra is what the summary says after a fault kind's count.
func (s *summary) faultExtra(f string) string {
	switch f {
	case fStepsKill:
		return s.stepsExtra()
	case fKill:
		extra := fmt.Sprintf(" (+%d workers exited on their own)", s.obs.crashes)
		if len(s.killsBy) > 0 {
			var ks []string
			for _, r := range []string{"kafka", "franz", "nats", "http", "grpc", roleKNA, roleKNB, roleHKA, roleHKB, roleRelay} {
				if n := s.killsBy[r]; n > 0 {
					ks = append(ks, fmt.Sprintf("%s %d", r, n))
				}
			}
			extra += " [" + strings.Join(ks, ", ") + "]"
		}
		return extra
	case fPgTerminate:
		return fmt.Sprintf(" (%d connections)", s.pgTerminated)
	case fNet:
		var ks []string
		for _, k := range netFaultKinds {
			ks = append(ks, fmt.Sprintf("%s %d", k, s.netKinds[k]))
		}
		return " (" + strings.Join(ks, ", ") + ")"
	case fNatsRestart:
		if s.ha["nats"] {
			return " (a node of the cluster leading neither the stream nor its consumer, on its file store)"
		}
		return " (" + s.natsSync + ")"
	case fPgCrash:
		if s.ha["postgres"] {
			return " (the primary, restarted in place: crash recovery, no promotion)"
		}
	case fRedis:
		if s.ha["redis"] {
			return " (the Sentinel master SIGKILLed and restarted at once)"
		}
	case fRelayKill:
		return fmt.Sprintf(" (after a stall of every relay; %d with outbox rows in hand, %d rows in all)", s.relayKillsBusy, s.relayKillRows)
	case fRelease:
		return fmt.Sprintf(" (%d keys released and resent, %d release calls failed)", s.released, s.releaseFailed)
	case fPgFailover:
		return " (primary SIGKILLed, synchronous standby promoted)"
	case fRedisFailover:
		return " (master SIGKILLed, replica promoted by the sentinels)"
	case fNatsLeader:
		return " (the node leading the stream killed, then restarted)"
	case fOverload:
		return fmt.Sprintf(" (every handler's INSERT held by a SHARE lock on effects: the pools fill, the bridges shed; clients saw %d answers 503 overloaded)", s.shed.Load())
	}
	return ""
}

func (s *summary) printWorkers(w io.Writer) {
	fmt.Fprintf(w, "workers saw: ErrCommitUnknown %d, ErrRolledBack %d, deferred FK at COMMIT %d, panics %d, other transient %d, other %d; dead letters %d\n",
		s.obs.get("retry:commit-unknown")+s.obs.get("dead-letter:commit-unknown"),
		s.obs.get("retry:rolled-back")+s.obs.get("dead-letter:rolled-back"),
		s.obs.get("retry:deferred-fk-error")+s.obs.get("dead-letter:deferred-fk-error"),
		s.obs.get("retry:panic-error")+s.obs.get("dead-letter:panic-error"),
		s.obs.get("retry:transient"), s.obs.get("retry:other")+s.obs.get("dead-letter:other")+s.obs.get("dead-letter:transient"),
		s.countPrefix("dead-letter:"))
	fmt.Fprintf(w, "  retries after a failed dead-letter publish %d\n", s.obs.get("retry:dead-letter-publish"))
	n, of, p50, pmax := s.obs.restartStats()
	fmt.Fprintf(w, "consumer restart to first effect: p50 %s, max %s (%d of %d restarts had an effect before the next kill or the end)\n",
		p50.Round(time.Millisecond), pmax.Round(time.Millisecond), n, of)
	fmt.Fprintf(w, "producer retries after a broker fault: %d\n", s.producerRetries.Load())
	if s.httpRequests > 0 {
		fmt.Fprintf(w, "http:   %d requests, %d without a 2xx in the end, %d keys answered with differing bodies\n",
			s.httpRequests, s.httpFailed, s.httpMismatched)
	}
	if g := s.keys["grpc"]; g != nil {
		fmt.Fprintf(w, "grpc:   %d calls, %d without an OK in the end, %d keys answered with differing orders\n",
			g.requests.Load(), g.failed.Load(), g.mismatched)
	}
	fmt.Fprintf(w, "ledger rows: %d done, %d failed\n", s.ledgerDone, s.ledgerFailed)
}

func (s *summary) printHops(w io.Writer) {
	h := s.hops
	if h == nil {
		return
	}
	for _, pipe := range []string{pipeKN, pipeHK} {
		if (pipe == pipeKN && !h.kn) || (pipe == pipeHK && !h.hk) {
			continue
		}
		a, b := "chaos-kn-a", "chaos-kn-b"
		if pipe == pipeHK {
			a, b = "chaos-hk-a", "chaos-hk-b"
		}
		fmt.Fprintf(w, "two-hop %s: %d unique source IDs -> B effects %d, distinct %d: lost %d, doubled %d; ledger A %d done, B %d done\n"+
			"       the hop holds %d messages (%d republished), %d sources with a rolled-back run's message; B answered %d deliveries as duplicates\n",
			pipe, s.unique[pipe], s.effects[pipe], s.distinct[pipe], s.hopLost[pipe], s.hopDoubled[pipe],
			s.hopLedger[a][0], s.hopLedger[b][0], h.published[pipe], h.published[pipe]-int64(s.unique[pipe]), s.hopLeaked[pipe],
			s.obs.get("hop-duplicate:"+map[string]string{pipeKN: roleKNB, pipeHK: roleHKB}[pipe]))
	}
	if h.hk {
		fmt.Fprintf(w, "two-hop http: %d requests, %d without a 2xx in the end, %d keys answered with differing bodies\n",
			h.load.requests.Load(), h.load.failed.Load(), s.hopHTTPMismatched)
	}
	fmt.Fprintf(w, "outbox relays: started %d times, %d publish attempts failed for the time being (retried), %d messages refused for good; outbox at the end: %s",
		s.obs.get("relay-started"), s.obs.get("relay-retry"), s.obs.get("relay-failed"), h.stats)
	if h.statsErr != nil {
		fmt.Fprintf(w, " (error: %v)", h.statsErr)
	}
	fmt.Fprintln(w)
}

func (s *summary) countPrefix(prefix string) int {
	s.obs.mu.Lock()
	defer s.obs.mu.Unlock()
	n := 0
	for k, v := range s.obs.counts {
		if strings.HasPrefix(k, prefix) {
			n += v
		}
	}
	return n
}

func durations(d []time.Duration) string {
	var parts []string
	for _, x := range d {
		parts = append(parts, x.Round(100*time.Millisecond).String())
	}
	return strings.Join(parts, ", ")
}
