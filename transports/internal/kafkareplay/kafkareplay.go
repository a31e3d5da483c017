// Package kafkareplay is what the Kafka fronts' replays (kafkainbox and
// franzinbox) share: the checks and defaults of a replay's configuration,
// the choice of partitions and of each partition's first offset, and the
// run of a source through a Processor.
package kafkareplay

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// DefaultFetchWait is ReplayConfig.FetchWait's default: how long a replay
// waits for the next message of a partition before it fails.
const DefaultFetchWait = 10 * time.Second

// Check checks a replay's configuration for front ("kafkainbox") and sets
// *fetchWait's default.
func Check(front string, brokers []string, topic string, startOffset int64, fetchWait *time.Duration) error {
	if len(brokers) == 0 || topic == "" {
		return fmt.Errorf("%w: %s: replay needs Brokers and Topic", inbox.ErrConfig, front)
	}
	if startOffset < 0 || *fetchWait < 0 {
		return fmt.Errorf("%w: %s: negative StartOffset or FetchWait", inbox.ErrConfig, front)
	}
	if *fetchWait == 0 {
		*fetchWait = DefaultFetchWait
	}
	return nil
}

// Partitions returns the partitions to replay, in order: want, each of
// which the topic must have, or all the topic has when want is empty.
func Partitions[P int | int32](front, topic string, have, want []P) ([]P, error) {
	ids := want
	if len(want) == 0 {
		ids = have
	}
	for _, p := range want {
		if !slices.Contains(have, p) {
			return nil, fmt.Errorf("%w: %s: topic %s has no partition %d", inbox.ErrConfig, front, topic, p)
		}
	}
	ids = slices.Clone(ids)
	slices.Sort(ids)
	return slices.Compact(ids), nil
}

// Start is the first offset a replay reads of a partition whose messages
// are first..end-1: startOffset, or with byTime at (the first offset
// stamped at or after the replay's StartTime; negative, or end, when none
// is), never below first.
func Start(first, end, startOffset int64, byTime bool, at int64) int64 {
	if !byTime {
		return max(startOffset, first)
	}
	if at < 0 {
		return end
	}
	return max(at, first)
}

// Source is a replay's source: it is closed when the replay ends.
type Source interface {
	consumer.ReplaySource
	Close() error
}

// Run opens a source and replays it through p (consumer.Processor.Replay).
func Run[S Source](ctx context.Context, open func() (S, error), p *consumer.Processor, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	src, err := open()
	if err != nil {
		return consumer.ReplayReport{DryRun: opts.DryRun}, err
	}
	defer src.Close()
	return p.Replay(ctx, src, opts)
}

// WithHandler runs replay with a Processor made of pc and h: a Consumer's
// own settings, with a dead-letter publisher of the replay's own.
func WithHandler(pc consumer.Config, h consumer.Handler, opts consumer.ReplayOptions, replay func(*consumer.Processor) (consumer.ReplayReport, error)) (consumer.ReplayReport, error) {
	p, err := consumer.New(pc, h)
	if err != nil {
		return consumer.ReplayReport{DryRun: opts.DryRun}, err
	}
	return replay(p)
}
