package consumer

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// HorizonPolicy says what a consumer front does when Run starts and finds
// that its broker may deliver a message after the ledger has forgotten the
// message's ID (Config.Horizon). Such a delivery (a redelivery, an offset
// rewind or reset, a replay) is not a duplicate to the ledger any more:
// the handler runs again.
type HorizonPolicy uint8

// Horizon policies.
const (
	// HorizonWarn (the default) logs a warning with the numbers and
	// consumes.
	HorizonWarn HorizonPolicy = iota
	// HorizonRefuse makes Run return a *HorizonError, which matches
	// ErrRedeliveryHorizon, before it consumes anything. A check that
	// could not be made (the broker did not answer, or refused the
	// request) is logged, and Run consumes.
	HorizonRefuse
	// HorizonOff asks the broker nothing and logs nothing.
	HorizonOff
)

// String returns the policy's name.
func (p HorizonPolicy) String() string {
	switch p {
	case HorizonWarn:
		return "HorizonWarn"
	case HorizonRefuse:
		return "HorizonRefuse"
	case HorizonOff:
		return "HorizonOff"
	}
	return fmt.Sprintf("HorizonPolicy(%d)", uint8(p))
}

// ErrRedeliveryHorizon is matched (errors.Is) by the *HorizonError that a
// front's Run returns under HorizonRefuse.
var ErrRedeliveryHorizon = errors.New("justonce/consumer: the broker may redeliver a message after the ledger forgot its ID")

// Horizon is what a consumer front found, when Run started, about one
// topic (Kafka) or stream (JetStream): how long after a message was written
// the broker may still deliver it, against how long the ledger keeps the
// ID of a message it recorded. Hooks.OnHorizon receives one per topic.
type Horizon struct {
	// Topic is the Kafka topic, or the JetStream stream.
	Topic string
	// TTL is how long the ledger keeps the ID of a message the front
	// recorded: Config.TTL, else the ledger's DefaultTTL.
	TTL time.Duration
	// Retention is how long after it was written the broker may still
	// deliver a message (Kafka: retention.ms plus segment.ms; JetStream:
	// the stream's MaxAge). Unused when Unbounded.
	Retention time.Duration
	// Unbounded says the broker keeps messages without a time limit
	// (Kafka: retention.ms -1, or a compacted topic; JetStream: MaxAge
	// 0).
	Unbounded bool
	// Basis says what Retention was read from, for people: the broker's
	// settings and their values, and the limits that are not time (Kafka's
	// retention.bytes, JetStream's MaxMsgs and MaxBytes), which only ever
	// shorten the horizon by an amount the traffic decides.
	Basis string
	// Behind is how many messages the group (Kafka) or the durable
	// (JetStream) had not consumed, acked messages excluded; -1 when
	// unknown.
	Behind int64
	// Stale is how many of Behind were written more than TTL ago; -1 when
	// unknown. Each of them that ran before (offsets reset, rewound or
	// expired) runs again.
	Stale int64
}

// Exceeded reports whether the broker may deliver a message after the
// ledger forgot its ID: it keeps messages without a time limit, or longer
// than TTL.
func (h Horizon) Exceeded() bool { return h.Unbounded || h.Retention > h.TTL }

// Headroom is how many seconds the ledger keeps an ID beyond the broker's
// horizon: TTL − Retention, negative when the broker outlives the ledger,
// and −Inf when the broker keeps messages without a time limit. (An ID is
// recorded when its message runs, at or after it was written, so the true
// headroom of a message is Headroom plus the time it waited.)
func (h Horizon) Headroom() float64 {
	if h.Unbounded {
		return math.Inf(-1)
	}
	return (h.TTL - h.Retention).Seconds()
}

// RetentionString is Retention as text: a duration, or "forever".
func (h Horizon) RetentionString() string {
	if h.Unbounded {
		return "forever"
	}
	return h.Retention.String()
}

// HorizonError is what a front's Run returns under HorizonRefuse when a
// topic's (or stream's) horizon exceeds the ledger's TTL. It matches
// ErrRedeliveryHorizon.
type HorizonError struct {
	// Horizons are the topics whose horizon exceeds the TTL.
	Horizons []Horizon
}

// Error names each topic with its retention and the ledger's TTL.
func (e *HorizonError) Error() string {
	parts := make([]string, len(e.Horizons))
	for i, h := range e.Horizons {
		parts[i] = fmt.Sprintf("%s keeps messages %s (%s), the ledger keeps their IDs %s", h.Topic, h.RetentionString(), h.Basis, h.TTL)
	}
	return ErrRedeliveryHorizon.Error() + ": " + strings.Join(parts, "; ") +
		": raise Processor.TTL (or the ledger's DefaultTTL) above it, or shorten the broker's retention"
}

// Is reports whether target is ErrRedeliveryHorizon.
func (e *HorizonError) Is(target error) bool { return target == ErrRedeliveryHorizon }
