package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/justonce/justonce/inbox"
)

// ReplaySource yields the messages of a replay in order. Next returns
// io.EOF at the replay's end: where the topic or stream stood when the
// replay began, so that a replay of a live topic ends.
type ReplaySource interface {
	Next(ctx context.Context) (*Message, error)
}

// ReplayOptions configure Processor.Replay.
type ReplayOptions struct {
	// DryRun counts what would run, asking the ledger, without running or
	// recording anything. An ID the source repeats counts once as would
	// run, as the real run runs it once: the dry run remembers the key of
	// each event it counts as would run until the replay ends. That memory
	// grows with their number (about 120 bytes each plus the ID), without
	// bound: for millions of events that never ran, replay a range at a
	// time.
	DryRun bool
	// Progress, when set, is called with the report so far every
	// ProgressEvery (default 1 s) and once at the end.
	Progress      func(ReplayReport)
	ProgressEvery time.Duration
	// LookupBatch is how many IDs a dry run asks the ledger about at once.
	// Default 500.
	LookupBatch int
}

// PartitionReport counts one partition (Kafka) or stream (NATS, partition 0).
type PartitionReport struct {
	Partition int
	// Seen messages read; Skipped: already processed (duplicates in the
	// ledger, or a repeat of an ID that ran earlier in the replay); Ran:
	// ran now (or, in a dry run, would run: an ID repeated in the replay
	// counts once, see ReplayOptions.DryRun); Failed: dead-lettered now,
	// or recorded failed before; NoID: messages without an ID
	// (dead-lettered, or run without dedupe with AllowNoID).
	Seen, Skipped, Ran, Failed, NoID int64
	// First and Last offsets (or sequences) read.
	First, Last int64
}

// ReplayReport is what a replay did, per partition and in total.
type ReplayReport struct {
	DryRun     bool
	Partitions []PartitionReport // by partition
	Total      PartitionReport   // Partition is -1
	Took       time.Duration
}

func (r ReplayReport) String() string {
	verb := "ran"
	if r.DryRun {
		verb = "would run"
	}
	return fmt.Sprintf("seen %d, skipped as duplicates %d, %s %d, failed %d, without ID %d, in %s",
		r.Total.Seen, r.Total.Skipped, verb, r.Total.Ran, r.Total.Failed, r.Total.NoID, r.Took.Round(time.Millisecond))
}

type replayTally struct {
	mu    sync.Mutex
	dry   bool
	start time.Time
	parts map[int]*PartitionReport
}

func (t *replayTally) add(m *Message, f func(*PartitionReport)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.parts[m.Partition]
	if p == nil {
		p = &PartitionReport{Partition: m.Partition, First: m.Offset}
		t.parts[m.Partition] = p
	}
	p.Seen++
	p.Last = m.Offset
	f(p)
}

func (t *replayTally) report() ReplayReport {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := ReplayReport{DryRun: t.dry, Took: time.Since(t.start), Total: PartitionReport{Partition: -1}}
	for _, p := range t.parts {
		r.Partitions = append(r.Partitions, *p)
		r.Total.Seen += p.Seen
		r.Total.Skipped += p.Skipped
		r.Total.Ran += p.Ran
		r.Total.Failed += p.Failed
		r.Total.NoID += p.NoID
	}
	sort.Slice(r.Partitions, func(i, j int) bool { return r.Partitions[i].Partition < r.Partitions[j].Partition })
	return r
}

// Replay reads src to its end through this processor's handler: events the
// ledger has already done are skipped, only the missing ones run (with the
// usual retries and dead-lettering). Nothing is acked or committed on any
// consumer group: a replay does not disturb live consumers. With DryRun it
// only counts. When ctx ends, Replay returns the report so far with ctx's
// error.
func (p *Processor) Replay(ctx context.Context, src ReplaySource, opts ReplayOptions) (ReplayReport, error) {
	if opts.ProgressEvery <= 0 {
		opts.ProgressEvery = time.Second
	}
	if opts.LookupBatch <= 0 {
		opts.LookupBatch = 500
	}
	t := &replayTally{dry: opts.DryRun, start: time.Now(), parts: map[int]*PartitionReport{}}
	if opts.Progress != nil {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			tk := time.NewTicker(opts.ProgressEvery)
			defer tk.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tk.C:
					opts.Progress(t.report())
				}
			}
		}()
		defer func() {
			close(stop)
			wg.Wait()
			opts.Progress(t.report())
		}()
	}

	var pending []*Message // dry run: messages awaiting a ledger lookup
	// Dry run: the keys counted as would run so far in this replay. A key
	// repeated later in the replay (in any lookup batch) would run once:
	// its later copies count as duplicates. It holds one entry per event
	// counted as would run, without bound (see ReplayOptions.DryRun).
	willRun := map[inbox.Key]bool{}
	flush := func() error {
		if len(pending) == 0 {
			return nil
		}
		keys := make([]inbox.Key, len(pending))
		for i, m := range pending {
			keys[i] = p.request(m).Key
		}
		st, err := p.cfg.Ledger.Known(ctx, keys)
		if err != nil {
			return err
		}
		for i, m := range pending {
			t.add(m, func(r *PartitionReport) {
				switch {
				case st[i] == inbox.StatusFailed:
					r.Failed++
				case st[i] != "" || willRun[keys[i]]:
					r.Skipped++
				default:
					r.Ran++
					willRun[keys[i]] = true
				}
			})
		}
		pending = pending[:0]
		return nil
	}

	for {
		m, err := src.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return t.report(), err
		}
		if m.ID == "" {
			if id, err := p.cfg.ID(m); err == nil {
				m.ID = id
			}
		}
		if opts.DryRun {
			if m.ID == "" || p.cfg.Ledger.Validate(p.request(m)) != nil {
				t.add(m, func(r *PartitionReport) { r.NoID++ })
				continue
			}
			pending = append(pending, m)
			if len(pending) >= opts.LookupBatch {
				if err := flush(); err != nil {
					return t.report(), err
				}
			}
			continue
		}
		noID := m.ID == ""
		d := p.ProcessWithRetry(ctx, m, nil)
		if d.Action == Stop {
			return t.report(), ctx.Err()
		}
		t.add(m, func(r *PartitionReport) {
			switch {
			case noID:
				r.NoID++
			case d.DeadLettered:
				r.Failed++
			case d.Outcome.Disposition == inbox.Executed:
				r.Ran++
			case d.Outcome.Disposition == inbox.Duplicate && d.Outcome.Record != nil && d.Outcome.Record.Status == inbox.StatusFailed:
				r.Failed++
			default:
				r.Skipped++
			}
		})
	}
	if err := flush(); err != nil {
		return t.report(), err
	}
	return t.report(), nil
}
