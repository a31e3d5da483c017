package natsinbox

import (
	"context"
	"errors"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/harness/testsvc"
)

// benchReplayed is how many messages each side reads per round of
// BenchmarkReplaySource.
const benchReplayed = 5000

// BenchmarkReplaySource sizes its own work: a stream of benchReplayed
// messages is read whole, in each round, by a bare ordered consumer
// (Messages, the rate JetStream gives one reader) and by a ReplaySource,
// in alternating order. It reports the medians of both rates and of the
// paired ratios.
//
//	go test -run '^$' -bench ReplaySource -benchtime 3x ./transports/natsinbox/
func BenchmarkReplaySource(b *testing.B) {
	e := newEnv(b)
	subject := testsvc.Unique("replaybench")
	name := e.stream(b, subject, 0)
	ctx := context.Background()
	for i := 0; i < benchReplayed; i++ {
		if _, err := e.js.PublishAsync(subject, []byte(strconv.Itoa(i))); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("publishing did not complete")
	}
	bare := func() time.Duration {
		start := time.Now()
		cons, err := e.js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{})
		if err != nil {
			b.Fatal(err)
		}
		it, err := cons.Messages()
		if err != nil {
			b.Fatal(err)
		}
		defer it.Stop()
		for n := 0; n < benchReplayed; n++ {
			if _, err := it.Next(); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	replay := func() time.Duration {
		start := time.Now()
		src, err := NewReplaySource(ctx, ReplayConfig{Conn: e.nc, Stream: name})
		if err != nil {
			b.Fatal(err)
		}
		n := 0
		for {
			_, err := src.Next(ctx)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			n++
		}
		if n != benchReplayed {
			b.Fatalf("replayed %d messages, want %d", n, benchReplayed)
		}
		return time.Since(start)
	}
	var bareRates, replayRates, ratio []float64
	for round := 0; round < b.N; round++ {
		var tb, tr time.Duration
		if round%2 == 0 {
			tb, tr = bare(), replay()
		} else {
			tr, tb = replay(), bare()
		}
		bareRates = append(bareRates, benchReplayed/tb.Seconds())
		replayRates = append(replayRates, benchReplayed/tr.Seconds())
		ratio = append(ratio, tb.Seconds()/tr.Seconds())
		b.Logf("round %d: bare %v replay %v", round, tb, tr)
	}
	b.ReportMetric(median(bareRates), "bare-msg/s")
	b.ReportMetric(median(replayRates), "replay-msg/s")
	b.ReportMetric(median(ratio), "replay/bare")
}
