package franzinbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/internal/kafkareplay"
)

// ReplayConfig says what part of a topic to replay.
type ReplayConfig struct {
	// Brokers to bootstrap from. Required (Consumer.Replay: the
	// Consumer's).
	Brokers []string
	// Topic to replay. Required (Consumer.Replay: the Consumer's, when it
	// reads one topic).
	Topic string
	// Partitions to replay; empty: all of them.
	Partitions []int
	// StartOffset is the first offset read in each partition. Default 0:
	// the oldest message the topic still holds.
	StartOffset int64
	// StartTime, when set, starts each partition at its first message
	// stamped at or after it, instead of StartOffset.
	StartTime time.Time
	// ClientOptions for TLS, SASL and the like (see Config.ClientOptions).
	// Consumer.Replay defaults to its Config.ClientOptions.
	ClientOptions []kgo.Opt
	// FetchWait bounds each wait for the next message; a partition that
	// yields nothing below its end for that long fails the replay.
	// Default 10 s.
	FetchWait time.Duration
}

// ReplaySource reads a topic, from the start position up to where each
// partition's committed data ended when the replay was opened (its last
// stable offset), read committed like the Consumer: it joins no consumer
// group and commits nothing, so live consumers are not disturbed. It
// implements consumer.ReplaySource. A ReplaySource is not safe for
// concurrent use.
type ReplaySource struct {
	cfg     ReplayConfig
	cl      *kgo.Client     // nil when there is nothing to read
	end     map[int32]int64 // partition -> end offset, for the partitions not finished
	pending []*kgo.Record   // polled, not yet returned
	paused  map[int32]bool  // finished partitions, paused
	closed  bool
}

var _ consumer.ReplaySource = (*ReplaySource)(nil)

// NewReplaySource opens a replay of cfg.Topic. It fixes the end of each
// partition now: messages published later are not part of the replay.
func NewReplaySource(ctx context.Context, cfg ReplayConfig) (*ReplaySource, error) {
	if err := kafkareplay.Check("franzinbox", cfg.Brokers, cfg.Topic, cfg.StartOffset, &cfg.FetchWait); err != nil {
		return nil, err
	}
	base := append(slices.Clone(cfg.ClientOptions), kgo.SeedBrokers(cfg.Brokers...))
	acl, err := kgo.NewClient(base...)
	if err != nil {
		return nil, fmt.Errorf("justonce/franzinbox: replay: client config: %w", err)
	}
	defer acl.Close()
	adm := kadm.NewClient(acl)
	starts, err := listed(adm.ListStartOffsets(ctx, cfg.Topic))
	if err != nil {
		return nil, fmt.Errorf("justonce/franzinbox: replay: start offsets of %s: %w", cfg.Topic, err)
	}
	ends, err := listed(adm.ListCommittedOffsets(ctx, cfg.Topic))
	if err != nil {
		return nil, fmt.Errorf("justonce/franzinbox: replay: end offsets of %s: %w", cfg.Topic, err)
	}
	var at kadm.ListedOffsets
	if !cfg.StartTime.IsZero() {
		if at, err = listed(adm.ListOffsetsAfterMilli(ctx, cfg.StartTime.UnixMilli(), cfg.Topic)); err != nil {
			return nil, fmt.Errorf("justonce/franzinbox: replay: offsets at %s of %s: %w", cfg.StartTime, cfg.Topic, err)
		}
	}
	if len(starts[cfg.Topic]) == 0 {
		return nil, fmt.Errorf("%w: franzinbox: replay: no topic %s", inbox.ErrConfig, cfg.Topic)
	}
	have := make([]int32, 0, len(starts[cfg.Topic]))
	for p := range starts[cfg.Topic] {
		have = append(have, p)
	}
	want := make([]int32, len(cfg.Partitions))
	for i, p := range cfg.Partitions {
		want[i] = int32(p)
	}
	parts, err := kafkareplay.Partitions("franzinbox", cfg.Topic, have, want)
	if err != nil {
		return nil, err
	}
	s := &ReplaySource{cfg: cfg, end: map[int32]int64{}, paused: map[int32]bool{}}
	from := map[int32]kgo.Offset{}
	for _, p := range parts {
		end := ends[cfg.Topic][p].Offset
		// ListOffsetsAfterMilli gives the end offset when nothing is
		// stamped after StartTime.
		start := kafkareplay.Start(starts[cfg.Topic][p].Offset, end, cfg.StartOffset, at != nil, at[cfg.Topic][p].Offset)
		if start < end {
			s.end[p] = end
			from[p] = kgo.NewOffset().At(start)
		}
	}
	if len(from) == 0 {
		return s, nil
	}
	s.cl, err = kgo.NewClient(append(base,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{cfg.Topic: from}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(), // to see the end of a partition that ends with a marker
		kgo.FetchMaxWait(500*time.Millisecond),
	)...)
	if err != nil {
		return nil, fmt.Errorf("justonce/franzinbox: replay: client config: %w", err)
	}
	return s, nil
}

// listed returns the offsets, or the first error of a partition.
func listed(l kadm.ListedOffsets, err error) (kadm.ListedOffsets, error) {
	if err != nil {
		return nil, err
	}
	return l, l.Error()
}

// Next returns the next message of the replay, or io.EOF at its end. Its
// Raw is the *kgo.Record. Records of aborted transactions and transaction
// markers are skipped.
func (s *ReplaySource) Next(ctx context.Context) (*consumer.Message, error) {
	for len(s.end) > 0 {
		for len(s.pending) > 0 {
			r := s.pending[0]
			s.pending[0] = nil
			s.pending = s.pending[1:]
			end, ok := s.end[r.Partition]
			if !ok || r.Offset >= end {
				continue // past the replay's end
			}
			if r.Offset+1 >= end {
				s.finish(r.Partition)
			}
			if r.Attrs.IsControl() {
				continue
			}
			return fromRecord(r), nil
		}
		if len(s.end) == 0 {
			break
		}
		pctx, cancel := context.WithTimeout(ctx, s.cfg.FetchWait)
		fs := s.cl.PollFetches(pctx)
		cancel()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var errs []error
		for _, fe := range fs.Errors() {
			if errors.Is(fe.Err, context.DeadlineExceeded) {
				left := make([]int32, 0, len(s.end))
				for p := range s.end {
					left = append(left, p)
				}
				slices.Sort(left)
				return nil, fmt.Errorf("justonce/franzinbox: replay: partitions %v of %s: nothing read below their end within %s", left, s.cfg.Topic, s.cfg.FetchWait)
			}
			errs = append(errs, fmt.Errorf("%s/%d: %w", fe.Topic, fe.Partition, fe.Err))
		}
		if len(errs) > 0 {
			return nil, fmt.Errorf("justonce/franzinbox: replay: %w", errors.Join(errs...))
		}
		s.pending = fs.Records()
	}
	s.Close()
	return nil, io.EOF
}

// finish marks partition p read to its end and stops fetching it.
func (s *ReplaySource) finish(p int32) {
	delete(s.end, p)
	if !s.paused[p] {
		s.paused[p] = true
		s.cl.PauseFetchPartitions(map[string][]int32{s.cfg.Topic: {p}})
	}
}

// Close releases the client. Call it when a replay ends; at io.EOF it is
// already released.
func (s *ReplaySource) Close() error {
	if s.cl != nil && !s.closed {
		s.closed = true
		s.cl.Close()
	}
	return nil
}

// Replay re-reads a topic through p's handler (see
// consumer.Processor.Replay): events the ledger has done are skipped, only
// the missing ones run; with opts.DryRun it only counts. p must have the
// scope (and ID extractor) of the consumer whose effects are replayed.
// Consumer.Replay does this with a Consumer's own handler and settings.
func Replay(ctx context.Context, cfg ReplayConfig, p *consumer.Processor, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	return kafkareplay.Run(ctx, func() (*ReplaySource, error) { return NewReplaySource(ctx, cfg) }, p, opts)
}

// Replay re-reads a topic (by default the Consumer's own, when it reads
// one, from its oldest message) through the Consumer's handler, scope, ID
// extractor, retries and dead-lettering: events the ledger has done are
// skipped and only the missing ones run. With opts.DryRun it only counts
// what would run. It joins no group and commits no offset, so it may run
// beside Run, before or after it.
func (c *Consumer) Replay(ctx context.Context, cfg ReplayConfig, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	if len(cfg.Brokers) == 0 {
		cfg.Brokers = c.cfg.Brokers
	}
	if cfg.Topic == "" {
		if len(c.cfg.Topics) != 1 {
			return consumer.ReplayReport{DryRun: opts.DryRun}, fmt.Errorf("%w: franzinbox: ReplayConfig.Topic is required when the Consumer reads several topics", inbox.ErrConfig)
		}
		cfg.Topic = c.cfg.Topics[0]
	}
	if cfg.ClientOptions == nil {
		cfg.ClientOptions = c.cfg.ClientOptions
	}
	pc := c.cfg.Processor
	if !c.UserDL && !opts.DryRun {
		// A producer of the replay's own: Run's client may not exist.
		cl, err := kgo.NewClient(c.baseOptions()...)
		if err != nil {
			return consumer.ReplayReport{DryRun: opts.DryRun}, fmt.Errorf("justonce/franzinbox: replay: client config: %w", err)
		}
		defer cl.Close()
		pc.DeadLetter = c.deadLetterTo(func() *kgo.Client { return cl })
	}
	return kafkareplay.WithHandler(pc, c.Handler, opts, func(p *consumer.Processor) (consumer.ReplayReport, error) {
		return Replay(ctx, cfg, p, opts)
	})
}
