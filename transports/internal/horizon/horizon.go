// Package horizon is what the consumer fronts share of the check their Run
// makes at start (consumer.Config.Horizon): the ledger TTL their claims
// use, the Kafka topic's horizon read from its configuration, the group's
// lag in messages and in messages older than the TTL, and the report (the
// hooks, the logs, the refusal) written once for every front.
package horizon

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/justonce/justonce/consumer"
)

// Timeout bounds a front's check: a broker that does not answer within it
// is logged, and Run consumes.
const Timeout = 10 * time.Second

// TTL is the ledger TTL of the claims a Processor of pc makes: pc.TTL,
// else the ledger's DefaultTTL.
func TTL(pc consumer.Config) time.Duration {
	if pc.TTL > 0 {
		return pc.TTL
	}
	return pc.Ledger.DefaultTTL()
}

// Front says how a front names itself and its broker's things in its logs.
type Front struct {
	// Log prefixes the front's log lines ("justonce kafka").
	Log string
	// Noun names what keeps the messages ("topic", "stream").
	Noun string
	// Group names the consumer's position ("group", "durable").
	Group string
}

// Found is what a front's check found.
type Found struct {
	// Topics are the horizons of the consumed topics (or streams), each
	// with the group's lag where the front could read it.
	Topics []consumer.Horizon
	// DeadLetters are the horizons of the topics (or streams) the front
	// publishes its dead letters to, where it could read them.
	DeadLetters []consumer.Horizon
	// Err is why some of it could not be read (Topics then lacks the
	// topics it could not read, or their lag is -1).
	Err error
}

// Report tells what a front found when Run started. It calls
// pc.Hooks.OnHorizon with each topic's horizon; under
// consumer.HorizonRefuse it returns a *consumer.HorizonError when a topic's
// horizon exceeds the TTL; otherwise it logs a warning for each such topic,
// one for each topic whose group has messages older than the TTL waiting,
// one when the check failed (unless ctx ended: Run is stopping), and an
// informational line for dead-letter topics that outlive the ledger. It
// returns nil unless it refuses.
//
// Dead letters are not compared for the refusal nor exported: the broker
// never delivers them to this consumer. They matter only when someone
// replays them, which is meant to run them; a dead letter replayed after
// the ledger forgot its key (its failed row, or the row an earlier replay
// left) runs without the release a failed key otherwise needs.
func Report(ctx context.Context, log *slog.Logger, pc consumer.Config, f Front, found Found) error {
	if found.Err != nil && ctx.Err() == nil {
		log.WarnContext(ctx, f.Log+": could not check the redelivery horizon (how long the broker may deliver a message again, against the ledger's TTL); consuming anyway",
			"err", found.Err, "horizon", pc.Horizon)
	}
	var exceeded []consumer.Horizon
	for _, h := range found.Topics {
		if pc.Hooks.OnHorizon != nil {
			pc.Hooks.OnHorizon(h)
		}
		if h.Exceeded() {
			exceeded = append(exceeded, h)
		} else {
			log.DebugContext(ctx, f.Log+": the ledger keeps IDs longer than the "+f.Noun+" keeps messages",
				f.Noun, h.Topic, "retention", h.RetentionString(), "basis", h.Basis, "ledger_ttl", h.TTL, "headroom", headroom(h))
		}
	}
	if pc.Horizon == consumer.HorizonRefuse && len(exceeded) > 0 {
		return &consumer.HorizonError{Horizons: exceeded}
	}
	for _, h := range exceeded {
		log.WarnContext(ctx, f.Log+": the "+f.Noun+" keeps messages longer than the ledger keeps their IDs; a redelivery, rewind or replay of a message older than the ledger TTL runs the handler again",
			f.Noun, h.Topic, "retention", h.RetentionString(), "basis", h.Basis, "ledger_ttl", h.TTL, "headroom", headroom(h))
	}
	for _, h := range found.Topics {
		if h.Stale > 0 {
			log.WarnContext(ctx, f.Log+": messages the "+f.Group+" has not consumed were written more than the ledger TTL ago; each of them that ran before (offsets reset, rewound or expired) runs the handler again",
				f.Noun, h.Topic, "behind", h.Behind, "older_than_ttl", h.Stale, "ledger_ttl", h.TTL)
		}
	}
	for _, h := range found.DeadLetters {
		if h.Exceeded() {
			log.InfoContext(ctx, f.Log+": the dead-letter "+f.Noun+" keeps dead letters longer than the ledger keeps IDs; a dead letter replayed after the ledger forgot its key runs without a release: replay each dead letter once",
				f.Noun, h.Topic, "retention", h.RetentionString(), "basis", h.Basis, "ledger_ttl", h.TTL)
		}
	}
	return nil
}

// headroom is h.Headroom for a log line.
func headroom(h consumer.Horizon) string {
	if h.Unbounded {
		return "-forever"
	}
	return (h.TTL - h.Retention).String()
}

// forever is the retention from which a Kafka duration is taken as no
// limit (and no time.Duration overflows): a hundred years.
const forever = 100 * 365 * 24 * time.Hour

// Kafka returns the horizon of a Kafka topic from its configuration (the
// DescribeConfigs answer, name to value), for a ledger TTL of ttl, with
// its lag unknown.
//
// A record stays in the log until its segment is deleted, and a segment
// is deleted once its newest record is retention.ms old; a segment takes
// records for up to segment.ms. So a record may be delivered up to
// retention.ms + segment.ms after it was written (plus the broker's
// retention check interval, five minutes by default). A topic whose
// cleanup.policy does not include delete (compact) keeps the newest record
// of each key forever, as does retention.ms -1. retention.bytes deletes by
// size, not time: said in Basis, not counted.
func Kafka(topic string, configs map[string]string, ttl time.Duration) (consumer.Horizon, error) {
	h := consumer.Horizon{Topic: topic, TTL: ttl, Behind: -1, Stale: -1}
	millis := func(name string) (time.Duration, error) {
		v, ok := configs[name]
		if !ok {
			return 0, fmt.Errorf("topic %s: the broker did not give its %s", topic, name)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("topic %s: %s %q: %w", topic, name, v, err)
		}
		if n < 0 || n >= int64(forever/time.Millisecond) {
			return -1, nil
		}
		return time.Duration(n) * time.Millisecond, nil
	}
	var basis []string
	policy := strings.ReplaceAll(configs["cleanup.policy"], " ", "")
	if policy != "" && !slices.Contains(strings.Split(policy, ","), "delete") {
		h.Unbounded = true
		h.Basis = "cleanup.policy " + policy + ": the newest record of each key is kept forever"
		return h, nil
	}
	retention, err := millis("retention.ms")
	if err != nil {
		return h, err
	}
	if retention < 0 {
		h.Unbounded = true
		basis = append(basis, "retention.ms "+configs["retention.ms"]+": no time limit")
	} else {
		segment, err := millis("segment.ms")
		if err != nil {
			return h, err
		}
		if segment < 0 {
			segment = forever
		}
		h.Retention = retention + segment
		if h.Retention >= forever {
			h.Unbounded = true
		}
		basis = append(basis, fmt.Sprintf("retention.ms %s + segment.ms %s: a segment is deleted once its newest record is retention.ms old", retention, segment))
	}
	if b, ok := configs["retention.bytes"]; ok && strings.TrimSpace(b) != "-1" {
		basis = append(basis, "retention.bytes "+b+" also deletes by size, not time (not counted)")
	}
	h.Basis = strings.Join(basis, "; ")
	return h, nil
}

// Partition is one partition's offsets, as a Kafka front reads them for
// its group's lag.
type Partition struct {
	// Start and End are the log start offset and the end offset (the
	// next offset to be written).
	Start, End int64
	// Committed is the group's committed offset; -1 when it has none.
	Committed int64
	// Fresh is the first offset written at or after now − TTL; -1 when
	// every record is older.
	Fresh int64
}

// Lag returns how many messages of parts the group has not consumed
// (behind) and how many of them were written more than the TTL ago
// (stale). A partition without a committed offset (or one below the log
// start, as after the log was deleted under it) is read from its start,
// or from its end when fromEnd (the group's reset offset).
func Lag(parts []Partition, fromEnd bool) (behind, stale int64) {
	for _, p := range parts {
		pos := p.Committed
		if pos < p.Start {
			pos = p.Start
			if fromEnd {
				pos = p.End
			}
		}
		pos = min(pos, p.End)
		behind += p.End - pos
		fresh := p.Fresh
		if fresh < 0 || fresh > p.End {
			fresh = p.End
		}
		stale += max(0, fresh-pos)
	}
	return behind, stale
}
