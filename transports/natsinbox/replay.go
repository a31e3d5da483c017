package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
)

// deadLetterIDPrefix starts the Nats-Msg-Id of the dead letters this
// package publishes with JetStream (see publishDeadLetter).
const deadLetterIDPrefix = "justonce-dlq:"

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
	// FetchWait bounds each wait for the next message. Default 2 s. A
	// wait that ends without a message ends the replay only if the stream
	// holds no matching message between the last one read and the end;
	// otherwise the read is tried again.
	FetchWait time.Duration
}

// ReplaySource reads a stream with an ordered, ephemeral consumer from the
// start position up to the stream's last sequence when the replay began.
// It touches no durable: live consumers are not disturbed. It implements
// consumer.ReplaySource.
//
// The dead letters that natsinbox published with JetStream (their
// Nats-Msg-Id starts with "justonce-dlq:") are not events: a replay
// whose subjects include them reads past them without returning them.
//
// The replay ends at its end sequence, or when a read waits in vain and
// the stream holds no matching message between the last one read and the
// end. A read that waits in vain while such messages remain (a busy or
// restarting server, a connection blip) is tried again until ctx ends:
// Next never reports the end with messages missing. Bound a replay with a
// deadline on ctx.
//
// Permissions: besides reading the stream's info and creating ephemeral
// consumers on it (a second, short-lived one finds StartTime's sequence),
// a replay gets single messages from the stream (JetStream's
// $JS.API.STREAM.MSG.GET) to tell a stalled read from the end.
type ReplaySource struct {
	cfg      ReplayConfig
	js       jetstream.JetStream
	st       jetstream.Stream
	cons     jetstream.Consumer
	batch    jetstream.MessageBatch // the fetch being read; nil between fetches
	got      int                    // messages batch gave so far
	single   bool                   // the next fetch asks for one message, with no byte limit
	maxBytes int                    // a fetch's byte limit: replayBatchBytes
	next     uint64                 // the lowest sequence not read yet
	endSeq   uint64
	done     bool
}

// One fetch of a replay asks for up to replayBatch messages and
// replayBatchBytes bytes. An ordered consumer is recreated at each fetch:
// fetching one message at a time cost a consumer per message. A message
// larger than replayBatchBytes (a server may allow that) makes a fetch end
// empty: the replay then fetches the next message alone, with no limit.
const (
	replayBatch      = 1000
	replayBatchBytes = 64 << 20
)

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
	info := st.CachedInfo()
	start := max(cfg.StartSeq, 1)
	if !cfg.StartTime.IsZero() {
		if start, err = seqAtTime(ctx, st, cfg.StartTime); err != nil {
			return nil, fmt.Errorf("justonce natsinbox: replay stream %q from %s: %w", cfg.Stream, cfg.StartTime, err)
		}
	}
	// By sequence, also from a time (resolved above): the check of what
	// remains (remains) needs the first sequence.
	s := &ReplaySource{cfg: cfg, js: js, st: st, next: start, endSeq: info.State.LastSeq, maxBytes: replayBatchBytes}
	if err := s.openConsumer(ctx); err != nil {
		return nil, err
	}
	if info.State.Msgs == 0 {
		s.done = true
	} else if more, err := s.remains(ctx); err != nil {
		return nil, fmt.Errorf("justonce natsinbox: replay stream %q: %w", cfg.Stream, err)
	} else if !more {
		s.done = true
	}
	return s, nil
}

// openConsumer starts the replay's ordered consumer at s.next. Until it
// succeeds, the replay has none (the next read tries again).
func (s *ReplaySource) openConsumer(ctx context.Context) error {
	s.cons, s.batch = nil, nil
	oc := jetstream.OrderedConsumerConfig{FilterSubjects: s.cfg.FilterSubjects, DeliverPolicy: jetstream.DeliverAllPolicy}
	if s.next > 1 {
		oc.DeliverPolicy, oc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, s.next
	}
	cons, err := s.js.OrderedConsumer(ctx, s.cfg.Stream, oc)
	if err != nil {
		return err
	}
	s.cons, s.batch = cons, nil
	return nil
}

// seqAtTime returns the first sequence of st stored at or after t (the
// last sequence + 1 when there is none), as the server resolves a
// consumer's start time: from a short-lived consumer starting at t.
func seqAtTime(ctx context.Context, st jetstream.Stream, t time.Time) (uint64, error) {
	c, err := st.CreateConsumer(ctx, jetstream.ConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &t,
		AckPolicy: jetstream.AckNonePolicy, MemoryStorage: true, Replicas: 1,
		InactiveThreshold: time.Minute,
	})
	if err != nil {
		return 0, err
	}
	info := c.CachedInfo()
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = st.DeleteConsumer(dctx, info.Name) // else it goes after InactiveThreshold
	// A new consumer's delivered stream sequence is the one before its
	// start.
	return info.Delivered.Stream + 1, nil
}

// remains reports whether the stream holds a message matching the replay's
// subjects from s.next up to the end.
func (s *ReplaySource) remains(ctx context.Context) (bool, error) {
	if s.next > s.endSeq {
		return false, nil
	}
	filters := s.cfg.FilterSubjects
	if len(filters) == 0 {
		filters = []string{">"}
	}
	for _, f := range filters {
		m, err := s.st.GetMsg(ctx, s.next, jetstream.WithGetMsgSubject(f))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		if m.Sequence <= s.endSeq {
			return true, nil
		}
	}
	return false, nil
}

// Next returns the next message of the replay, or io.EOF at its end.
func (s *ReplaySource) Next(ctx context.Context) (*consumer.Message, error) {
	retry := 0
	for {
		if s.done {
			return nil, io.EOF
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		m, err := s.read(ctx)
		if errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages) {
			// The end, unless matching messages remain up to it: then
			// the server was slow, read again.
			more, err := s.remains(ctx)
			switch {
			case err == nil && !more:
				s.done = true
				return nil, io.EOF
			case err != nil && !s.transient(ctx, err):
				return nil, fmt.Errorf("justonce natsinbox: replay stream %q after sequence %d: %w", s.cfg.Stream, s.next-1, err)
			case err == nil:
				// Messages remain: the next one may be larger than a
				// fetch's byte limit.
				s.single = true
			}
			retry++
			if err := s.pause(ctx, retry); err != nil {
				return nil, err
			}
			continue
		}
		if err != nil {
			if !s.transient(ctx, err) {
				return nil, err
			}
			retry++
			if err := s.pause(ctx, retry); err != nil {
				return nil, err
			}
			continue
		}
		md, err := m.Metadata()
		if err != nil {
			return nil, err
		}
		if md.Sequence.Consumer != uint64(s.got) {
			// A fetch's consumer delivers from 1 on: messages were lost
			// on the way (a connection that failed while the server
			// delivered). Read again from the first one not read.
			if err := s.openConsumer(ctx); err != nil && !s.transient(ctx, err) {
				return nil, err
			}
			retry++
			if err := s.pause(ctx, retry); err != nil {
				return nil, err
			}
			continue
		}
		retry = 0
		s.single = false
		seq := md.Sequence.Stream
		if seq > s.endSeq {
			s.done = true
			return nil, io.EOF
		}
		s.next = seq + 1
		if seq == s.endSeq || md.NumPending == 0 {
			s.done = true
		}
		if strings.HasPrefix(m.Headers().Get(jetstream.MsgIDHeader), deadLetterIDPrefix) {
			continue // a dead letter, not an event
		}
		return &consumer.Message{
			Topic: m.Subject(), Headers: headers(m.Headers()), Value: m.Data(),
			Offset: int64(seq), Time: md.Timestamp, Attempt: 1, Raw: m,
		}, nil
	}
}

// read returns the next message of the current fetch, starting one when
// none runs: nats.ErrTimeout when a fetch ended with no message (it waited
// FetchWait), the fetch's error when it failed.
func (s *ReplaySource) read(ctx context.Context) (jetstream.Msg, error) {
	for {
		if s.batch == nil {
			if s.cons == nil {
				if err := s.openConsumer(ctx); err != nil {
					return nil, err
				}
			}
			var b jetstream.MessageBatch
			var err error
			if s.single {
				b, err = s.cons.Fetch(1, jetstream.FetchMaxWait(s.cfg.FetchWait))
			} else {
				b, err = s.cons.Fetch(replayBatch, jetstream.FetchMaxWait(s.cfg.FetchWait), jetstream.FetchMaxBytes(s.maxBytes))
			}
			if err != nil {
				return nil, err
			}
			s.batch, s.got = b, 0
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err() // the fetch goes on; the next read takes it up
		case m, ok := <-s.batch.Messages():
			if ok {
				s.got++
				return m, nil
			}
		}
		err, got := s.batch.Error(), s.got
		s.batch = nil
		switch {
		case err != nil:
			return nil, err
		case got == 0:
			return nil, nats.ErrTimeout
		}
	}
}

// transient reports whether err, from a read or a check of the stream,
// may pass when tried again: a timeout, the server or its JetStream
// unreachable for now, the read's ephemeral consumer lost (a server
// restart). Not when ctx ended, the connection was closed, or the server
// answered with an error (the stream deleted, ...).
func (s *ReplaySource) transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil || s.cfg.Conn.IsClosed() {
		return false
	}
	for _, e := range []error{
		nats.ErrTimeout, context.DeadlineExceeded, nats.ErrNoResponders, nats.ErrConnectionReconnecting,
		nats.ErrDisconnected, jetstream.ErrNoHeartbeat, jetstream.ErrConsumerDeleted,
		jetstream.ErrConsumerNotFound, jetstream.ErrConsumerLeadershipChanged, jetstream.ErrNoStreamResponse,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// pause waits before the retry'th try again (from 50 ms, doubling, at
// most 1 s: a read that timed out has already waited FetchWait).
func (s *ReplaySource) pause(ctx context.Context, retry int) error {
	return consumer.Sleep(ctx, min(50*time.Millisecond<<min(retry-1, 5), time.Second))
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
// ones run (with the usual retries and dead-lettering). cfg.Conn and
// cfg.Stream default to the Consumer's, cfg.FilterSubjects to its
// Config.FilterSubjects or, with Config.Bind on its own stream, to the
// bound durable's filter, read from the server (Replay may be called
// before Run). With opts.DryRun it only counts what would run. It touches
// no durable, so it may run beside Run, before or after it.
func (c *Consumer) Replay(ctx context.Context, cfg ReplayConfig, opts consumer.ReplayOptions) (consumer.ReplayReport, error) {
	if cfg.Conn == nil {
		cfg.Conn = c.cfg.Conn
	}
	if cfg.Stream == "" {
		cfg.Stream = c.cfg.Stream
	}
	if cfg.FilterSubjects == nil {
		switch {
		case c.cfg.Bind && c.js != nil && cfg.Stream == c.cfg.Stream:
			f, err := c.boundFilter(ctx)
			if err != nil {
				return consumer.ReplayReport{}, err
			}
			cfg.FilterSubjects = f
		case !c.cfg.Bind:
			cfg.FilterSubjects = c.cfg.FilterSubjects
		}
	}
	return Replay(ctx, cfg, c.Proc, opts)
}

// boundFilter returns the subjects the bound durable filters on (nil: the
// whole stream).
func (c *Consumer) boundFilter(ctx context.Context) ([]string, error) {
	cons, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Durable)
	if err != nil {
		return nil, fmt.Errorf("justonce natsinbox: replay: bound durable %q on stream %q: %w", c.cfg.Durable, c.cfg.Stream, err)
	}
	cc := cons.CachedInfo().Config
	if cc.FilterSubject != "" {
		return []string{cc.FilterSubject}, nil
	}
	return cc.FilterSubjects, nil
}
