package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
)

// ReplayConfig says what part of a JetStream stream to replay.
type ReplayConfig struct {
	// Conn is the NATS connection. Required.
	Conn *nats.Conn
	// Stream to read. Required.
	Stream string
	// FilterSubjects narrows the replay to these subjects (all by default).
	FilterSubjects []string
	// StartSeq is the first stream sequence to read (default 1: the start
	// of what the stream still holds).
	StartSeq uint64
	// StartTime, when set, starts at the first message stored at or after
	// it (instead of StartSeq).
	StartTime time.Time
	// FetchWait bounds each wait for the next message. Default 2 s.
	FetchWait time.Duration
}

// ReplaySource reads a stream with an ordered, ephemeral consumer from the
// start position up to the stream's last sequence when the replay began.
// It touches no durable: live consumers are not disturbed. It implements
// consumer.ReplaySource.
type ReplaySource struct {
	cfg    ReplayConfig
	cons   jetstream.Consumer
	endSeq uint64
	done   bool
}

// NewReplaySource opens the replay. The end is fixed now: messages
// published later are not part of it.
func NewReplaySource(ctx context.Context, cfg ReplayConfig) (*ReplaySource, error) {
	if cfg.Conn == nil || cfg.Stream == "" {
		return nil, fmt.Errorf("justonce natsinbox: replay needs Conn and Stream")
	}
	if cfg.FetchWait <= 0 {
		cfg.FetchWait = 2 * time.Second
	}
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return nil, err
	}
	st, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("justonce natsinbox: replay stream %q: %w", cfg.Stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	oc := jetstream.OrderedConsumerConfig{FilterSubjects: cfg.FilterSubjects, DeliverPolicy: jetstream.DeliverAllPolicy}
	switch {
	case !cfg.StartTime.IsZero():
		oc.DeliverPolicy, oc.OptStartTime = jetstream.DeliverByStartTimePolicy, &cfg.StartTime
	case cfg.StartSeq > 1:
		oc.DeliverPolicy, oc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, cfg.StartSeq
	}
	cons, err := js.OrderedConsumer(ctx, cfg.Stream, oc)
	if err != nil {
		return nil, err
	}
	s := &ReplaySource{cfg: cfg, cons: cons, endSeq: info.State.LastSeq}
	ci, err := cons.Info(ctx)
	if err == nil && ci.NumPending == 0 {
		s.done = true
	}
	if info.State.Msgs == 0 || (cfg.StartSeq > info.State.LastSeq && cfg.StartTime.IsZero()) {
		s.done = true
	}
	return s, nil
}

// Next returns the next message of the replay, or io.EOF at its end.
func (s *ReplaySource) Next(ctx context.Context) (*consumer.Message, error) {
	if s.done {
		return nil, io.EOF
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m, err := s.cons.Next(jetstream.FetchMaxWait(s.cfg.FetchWait))
	if errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages) {
		// Nothing more matches the filter before the end.
		s.done = true
		return nil, io.EOF
	}
	if err != nil {
		return nil, err
	}
	md, err := m.Metadata()
	if err != nil {
		return nil, err
	}
	seq := md.Sequence.Stream
	if seq > s.endSeq {
		s.done = true
		return nil, io.EOF
	}
	if seq == s.endSeq || md.NumPending == 0 {
		s.done = true
	}
	return &consumer.Message{
		Topic: m.Subject(), Headers: headers(m.Headers()), Value: m.Data(),
		Offset: int64(seq), Time: md.Timestamp, Attempt: 1, Raw: m,
	}, nil
}

// Replay re-reads a stream through p's handler (see consumer.Processor.Replay):
// events the ledger has done are skipped, only the missing ones run; with
// opts.DryRun it only counts. Configure p as the live Consumer's Processor
// (same Scope, and ID = DefaultID unless the live one sets another), so
// that the replay finds the IDs the live consumer recorded.
func Replay(ctx context.Context, cfg ReplayConfig, p *consumer.Processor, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	src, err := NewReplaySource(ctx, cfg)
	if err != nil {
		return consumer.ReplayReport{}, err
	}
	return p.Replay(ctx, src, opts)
}

// Replay re-reads the Consumer's stream through its handler and runtime
// configuration: events the ledger has done are skipped, only the missing
// ones run (with the usual retries and dead-lettering). cfg.Conn,
// cfg.Stream and cfg.FilterSubjects default to the Consumer's. With
// opts.DryRun it only counts what would run. It touches no durable, so it
// may run beside Run, before or after it.
func (c *Consumer) Replay(ctx context.Context, cfg ReplayConfig, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	if cfg.Conn == nil {
		cfg.Conn = c.cfg.Conn
	}
	if cfg.Stream == "" {
		cfg.Stream = c.cfg.Stream
	}
	if cfg.FilterSubjects == nil {
		cfg.FilterSubjects = c.cfg.FilterSubjects
	}
	return Replay(ctx, cfg, c.proc, opts)
}
