package kafkainbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/kafkareplay"
)

// ReplayConfig says what part of a topic to replay.
type ReplayConfig struct {
	// Brokers to bootstrap from. Required (Consumer.Replay: the
	// Consumer's).
	Brokers []string
	// Topic to replay. Required (Consumer.Replay: the Consumer's).
	Topic string
	// Partitions to replay; empty: all of them.
	Partitions []int
	// StartOffset is the first offset read in each partition. Default 0:
	// the oldest message the topic still holds.
	StartOffset int64
	// StartTime, when set, starts each partition at its first message
	// stamped at or after it, instead of StartOffset.
	StartTime time.Time
	// Dialer for TLS or SASL; nil: kafka.DefaultDialer. Consumer.Replay
	// defaults to the Dialer its Config.Reader sets.
	Dialer *kafka.Dialer
	// FetchWait bounds each wait for the next message; a partition that
	// yields nothing below its end for that long fails the replay.
	// Default 10 s.
	FetchWait time.Duration
}

// partitionRange is [start, end) of one partition.
type partitionRange struct {
	partition  int
	start, end int64
}

// ReplaySource reads a topic partition by partition, from the start
// position up to where each partition ended when the replay was opened, with
// plain partition readers: it joins no consumer group and commits nothing,
// so live consumers are not disturbed. It implements consumer.ReplaySource.
// Transaction markers are skipped (records of the same shape are not). A ReplaySource is not safe for
// concurrent use.
type ReplaySource struct {
	cfg    ReplayConfig
	ranges []partitionRange
	i      int             // current range
	next   int64           // next offset of the current range
	r      *kafka.Reader   // reader of the current range, nil before it starts
	ctl    *controlChecker // nil until a record looks like a marker
}

var _ consumer.ReplaySource = (*ReplaySource)(nil)

// NewReplaySource opens a replay of cfg.Topic. It fixes the end of each
// partition now: messages published later are not part of the replay.
func NewReplaySource(ctx context.Context, cfg ReplayConfig) (*ReplaySource, error) {
	if err := kafkareplay.Check("kafkainbox", cfg.Brokers, cfg.Topic, cfg.StartOffset, &cfg.FetchWait); err != nil {
		return nil, err
	}
	if cfg.Dialer == nil {
		cfg.Dialer = kafka.DefaultDialer
	}
	parts, err := cfg.Dialer.LookupPartitions(ctx, "tcp", cfg.Brokers[0], cfg.Topic)
	if err != nil {
		return nil, fmt.Errorf("justonce/kafkainbox: replay: partitions of %s: %w", cfg.Topic, err)
	}
	have := make([]int, 0, len(parts))
	for _, p := range parts {
		have = append(have, p.ID)
	}
	ids, err := kafkareplay.Partitions("kafkainbox", cfg.Topic, have, cfg.Partitions)
	if err != nil {
		return nil, err
	}
	s := &ReplaySource{cfg: cfg}
	for _, p := range ids {
		rg, err := s.bounds(ctx, p)
		if err != nil {
			return nil, err
		}
		if rg.start < rg.end {
			s.ranges = append(s.ranges, rg)
		}
	}
	return s, nil
}

// bounds asks partition p's leader for the replay's range.
func (s *ReplaySource) bounds(ctx context.Context, p int) (partitionRange, error) {
	conn, err := s.cfg.Dialer.DialLeader(ctx, "tcp", s.cfg.Brokers[0], s.cfg.Topic, p)
	if err != nil {
		return partitionRange{}, fmt.Errorf("justonce/kafkainbox: replay: leader of partition %d: %w", p, err)
	}
	defer conn.Close()
	first, last, err := conn.ReadOffsets()
	if err != nil {
		return partitionRange{}, fmt.Errorf("justonce/kafkainbox: replay: offsets of partition %d: %w", p, err)
	}
	at := int64(-1)
	byTime := !s.cfg.StartTime.IsZero()
	if byTime {
		if at, err = conn.ReadOffset(s.cfg.StartTime); err != nil {
			return partitionRange{}, fmt.Errorf("justonce/kafkainbox: replay: offset at %s of partition %d: %w", s.cfg.StartTime, p, err)
		}
	}
	start := kafkareplay.Start(first, last, s.cfg.StartOffset, byTime, at)
	return partitionRange{partition: p, start: start, end: last}, nil
}

// Next returns the next message of the replay, or io.EOF at its end. Its
// Raw is the kafka.Message.
func (s *ReplaySource) Next(ctx context.Context) (*consumer.Message, error) {
	for s.i < len(s.ranges) {
		rg := s.ranges[s.i]
		if s.r == nil {
			s.r = kafka.NewReader(kafka.ReaderConfig{
				Brokers:   s.cfg.Brokers,
				Topic:     s.cfg.Topic,
				Partition: rg.partition,
				Dialer:    s.cfg.Dialer,
				MaxWait:   500 * time.Millisecond,
				// No lag reads: they open a connection a minute for nothing.
				ReadLagInterval: -1,
			})
			if err := s.r.SetOffset(rg.start); err != nil {
				return nil, fmt.Errorf("justonce/kafkainbox: replay: partition %d: %w", rg.partition, err)
			}
			s.next = rg.start
		}
		if s.next >= rg.end {
			s.closeReader()
			s.i++
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.FetchWait)
		km, err := s.r.ReadMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("nothing read at offsets %d..%d within %s", s.next, rg.end-1, s.cfg.FetchWait)
			}
			return nil, fmt.Errorf("justonce/kafkainbox: replay: partition %d: %w", rg.partition, err)
		}
		s.next = km.Offset + 1
		if km.Offset >= rg.end {
			continue
		}
		if looksLikeMarker(km) {
			if s.ctl == nil {
				s.ctl = newControlChecker(s.cfg.Brokers, s.cfg.Dialer)
			}
			ctl, err := s.ctl.isControl(ctx, topicPartition{km.Topic, km.Partition}, km.Offset)
			if err != nil {
				return nil, fmt.Errorf("justonce/kafkainbox: replay: partition %d: telling a transaction marker from a record at offset %d: %w", rg.partition, km.Offset, err)
			}
			if ctl {
				continue
			}
		}
		return fromKafka(km), nil
	}
	return nil, io.EOF
}

// Close releases the current partition reader and idle connections. Call
// it when a replay ends; at io.EOF no reader is left open.
func (s *ReplaySource) Close() error {
	s.closeReader()
	if s.ctl != nil {
		s.ctl.close()
	}
	return nil
}

func (s *ReplaySource) closeReader() {
	if s.r != nil {
		_ = s.r.Close()
		s.r = nil
	}
}

// Replay re-reads a topic through p's handler (see
// consumer.Processor.Replay): events the ledger has done are skipped, only
// the missing ones run; with opts.DryRun it only counts. p must have the
// scope (and ID extractor) of the consumer whose effects are replayed.
// Consumer.Replay does this with a Consumer's own handler and settings.
func Replay(ctx context.Context, cfg ReplayConfig, p *consumer.Processor, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	return kafkareplay.Run(ctx, func() (*ReplaySource, error) { return NewReplaySource(ctx, cfg) }, p, opts)
}

// Replay re-reads a topic (by default the Consumer's own, from its oldest
// message) through the Consumer's handler, scope, ID extractor, retries
// and dead-lettering: events the ledger has done are skipped and only the
// missing ones run. With opts.DryRun it only counts what would run. It
// joins no group and commits no offset, so it may run beside Run, before
// or after it.
func (c *Consumer) Replay(ctx context.Context, cfg ReplayConfig, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	if len(cfg.Brokers) == 0 {
		cfg.Brokers = c.cfg.Brokers
	}
	if cfg.Topic == "" {
		cfg.Topic = c.cfg.Topic
	}
	if cfg.Dialer == nil {
		cfg.Dialer = c.readerConfig().Dialer
	}
	pc := c.cfg.Processor
	if !c.UserDL && !opts.DryRun {
		// A writer of the replay's own: Run closes the Consumer's.
		w, owned := c.deadLetterWriter()
		if owned {
			defer c.closeOwned(w)
		}
		pc.DeadLetter = c.deadLetterTo(w)
	}
	return kafkareplay.WithHandler(pc, c.Handler, opts, func(p *consumer.Processor) (consumer.ReplayReport, error) {
		return Replay(ctx, cfg, p, opts)
	})
}
