package consumer_test

import (
	"errors"
	"testing"
	"time"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

func TestSchedulingValidate(t *testing.T) {
	if err := (consumer.Scheduling{}).Validate(); err != nil {
		t.Fatalf("the zero Scheduling (all defaults) is refused: %v", err)
	}
	if err := consumer.DefaultScheduling().Validate(); err != nil {
		t.Fatalf("the defaults are refused: %v", err)
	}
	for name, s := range map[string]consumer.Scheduling{
		"negative Concurrency":     {Concurrency: -1},
		"unknown Ordering":         {Ordering: 9},
		"negative MaxBuffered":     {MaxBuffered: -1},
		"negative BatchSize":       {BatchSize: -1},
		"negative BatchMaxTime":    {BatchMaxTime: -1},
		"negative BatchLinger":     {BatchLinger: -1},
		"negative ShutdownTimeout": {ShutdownTimeout: -1},
	} {
		if err := s.Validate(); !errors.Is(err, inbox.ErrConfig) {
			t.Errorf("%s: Validate() = %v, want an inbox.ErrConfig", name, err)
		}
	}
}

func TestSchedulingWithDefaults(t *testing.T) {
	got := consumer.Scheduling{}.WithDefaults(consumer.DefaultScheduling())
	want := consumer.Scheduling{
		Concurrency: consumer.DefaultConcurrency, MaxBuffered: consumer.DefaultMaxBuffered,
		BatchSize: consumer.DefaultBatchSize, BatchMaxTime: consumer.DefaultBatchMaxTime,
		ShutdownTimeout: consumer.DefaultShutdownTimeout,
	}
	if got != want {
		t.Fatalf("zero fields: got %+v, want %+v", got, want)
	}
	set := consumer.Scheduling{Concurrency: 2, Ordering: consumer.ByKey, MaxBuffered: 5, BatchSize: 1,
		BatchMaxTime: time.Second, BatchLinger: time.Millisecond, ShutdownTimeout: time.Minute}
	if got := set.WithDefaults(consumer.DefaultScheduling()); got != set {
		t.Fatalf("set fields changed: got %+v, want %+v", got, set)
	}
	if got := (consumer.Scheduling{}).WithDefaults(consumer.Scheduling{Concurrency: 1}); got.Concurrency != 1 || got.BatchSize != 0 {
		t.Fatalf("a front's own defaults not applied as given: %+v", got)
	}
	if consumer.ByKey.String() != "ByKey" || consumer.ByPartition.String() != "ByPartition" {
		t.Fatal("Ordering names")
	}
}
