package natsinbox

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Fakes for the replay's read logic: a stream of 4 messages, consumers
// that deliver given (stream, consumer) sequence pairs in one fetch.
type fakeMsg struct {
	jetstream.Msg
	md jetstream.MsgMetadata
}

func (m fakeMsg) Metadata() (*jetstream.MsgMetadata, error) { return &m.md, nil }
func (m fakeMsg) Headers() nats.Header                      { return nats.Header{} }
func (m fakeMsg) Subject() string                           { return "orders" }
func (m fakeMsg) Data() []byte                              { return nil }

type fakeBatch struct{ ch chan jetstream.Msg }

func (b fakeBatch) Messages() <-chan jetstream.Msg { return b.ch }
func (b fakeBatch) Error() error                   { return nil }

type fakeConsumer struct {
	jetstream.Consumer
	pairs   [][2]uint64 // stream, consumer sequences of its one fetch
	fetched bool
}

func (c *fakeConsumer) Fetch(int, ...jetstream.FetchOpt) (jetstream.MessageBatch, error) {
	ch := make(chan jetstream.Msg, len(c.pairs))
	if !c.fetched {
		for _, p := range c.pairs {
			ch <- fakeMsg{md: jetstream.MsgMetadata{Sequence: jetstream.SequencePair{Stream: p[0], Consumer: p[1]}, NumPending: 4 - p[0]}}
		}
	}
	c.fetched = true
	close(ch)
	return fakeBatch{ch}, nil
}

type fakeJS struct {
	jetstream.JetStream
	starts []uint64 // the start sequence of each consumer opened
	next   func(start uint64) *fakeConsumer
}

func (j *fakeJS) OrderedConsumer(_ context.Context, _ string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, error) {
	start := cfg.OptStartSeq
	if start == 0 {
		start = 1
	}
	j.starts = append(j.starts, start)
	return j.next(start), nil
}

// A fetch whose consumer sequence skips (message 3 lost on the way) is not
// read past: the replay reads again from message 3.
func TestReplayReadsAgainAfterAGapInAFetch(t *testing.T) {
	js := &fakeJS{next: func(start uint64) *fakeConsumer {
		c := &fakeConsumer{}
		for seq, n := start, uint64(1); seq <= 4; seq, n = seq+1, n+1 {
			c.pairs = append(c.pairs, [2]uint64{seq, n})
		}
		return c
	}}
	s := &ReplaySource{cfg: ReplayConfig{FetchWait: time.Second}, js: js, next: 1, endSeq: 4,
		cons: &fakeConsumer{pairs: [][2]uint64{{1, 1}, {2, 2}, {4, 4}}}}
	var got []int64
	for {
		m, err := s.Next(context.Background())
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, m.Offset)
	}
	if len(got) != 4 || got[0] != 1 || got[1] != 2 || got[2] != 3 || got[3] != 4 {
		t.Fatalf("replayed %v, want [1 2 3 4]", got)
	}
	if len(js.starts) != 1 || js.starts[0] != 3 {
		t.Fatalf("consumers opened at %v, want one at 3", js.starts)
	}
}
