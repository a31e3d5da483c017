// Package offsets tracks, per Kafka partition, the offset a consumer
// group member may safely commit. The Kafka fronts (kafkainbox on
// kafka-go, franzinbox on franz-go) share it.
//
// A Tracker is generic over its partition key K, and never looks inside
// it: each front keys it by its own topic/partition struct, built from
// its client's records as they come (kafka-go numbers partitions with
// int, franz-go with int32), so no conversion runs per message.
package offsets

import (
	"container/heap"
	"sync"
)

// Tracker computes, per partition, the offset that is safe to commit: the
// lowest offset fetched and not yet done, or one past the highest done
// offset when nothing is pending. Every offset below it has been processed
// (by this member, or by whoever committed the offset a generation started
// from), so committing it never skips an unprocessed message.
//
// Offsets may be fetched more than once and out of order: after a
// rebalance a client may restart a partition from its committed offset
// while older copies are still in flight. Pending offsets are therefore
// counted, not flagged, so that a copy fetched twice is safe too.
//
// A partition's state can be forgotten when the partition is revoked
// (after its last commit) or lost (at once, with attempts still in
// flight), so that a later assignment of it starts afresh from the group's
// committed offset. Only Fetched starts a partition's state: Done and
// Committed ignore a partition that is not tracked, so an attempt that
// ends after its partition was forgotten never makes it committable again.
//
// A Tracker is safe for concurrent use.
type Tracker[K comparable] struct {
	mu    sync.Mutex
	parts map[K]*partitionTrack
}

type partitionTrack struct {
	pending   map[int64]int // offset -> copies fetched and not done
	low       offsetHeap    // pending offsets, lazily cleaned
	maxDone   int64         // highest offset done, -1 when none
	committed int64         // last offset committed by us, -1 when none
}

// NewTracker returns an empty Tracker.
func NewTracker[K comparable]() *Tracker[K] {
	return &Tracker[K]{parts: map[K]*partitionTrack{}}
}

func (t *Tracker[K]) part(tp K) *partitionTrack {
	p, ok := t.parts[tp]
	if !ok {
		p = &partitionTrack{pending: map[int64]int{}, maxDone: -1, committed: -1}
		t.parts[tp] = p
	}
	return p
}

// Fetched records that offset of tp was handed to a worker.
func (t *Tracker[K]) Fetched(tp K, offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.part(tp)
	p.pending[offset]++
	heap.Push(&p.low, offset)
}

// Done records that the message at offset of tp was acknowledged: its
// ledger transaction committed, it was a duplicate, or it was
// dead-lettered. It is ignored when tp is not tracked: forgotten (its
// partition was lost) while the message ran.
func (t *Tracker[K]) Done(tp K, offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p, ok := t.parts[tp]
	if !ok {
		return
	}
	if n := p.pending[offset]; n > 1 {
		p.pending[offset] = n - 1
	} else {
		delete(p.pending, offset)
	}
	if offset > p.maxDone {
		p.maxDone = offset
	}
}

// Committable returns, for each partition (of only, when only is not nil)
// whose safe offset moved past the last commit, the offset to commit (the
// next one to read). It returns nil when there is none.
func (t *Tracker[K]) Committable(only map[K]bool) map[K]int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out map[K]int64
	for tp, p := range t.parts {
		if only != nil && !only[tp] {
			continue
		}
		for p.low.Len() > 0 && p.pending[p.low[0]] == 0 {
			heap.Pop(&p.low)
		}
		next := p.maxDone + 1
		if p.low.Len() > 0 {
			next = p.low[0]
		}
		if p.maxDone >= 0 && next > p.committed {
			if out == nil {
				out = map[K]int64{}
			}
			out[tp] = next
		}
	}
	return out
}

// Committed records a successful commit of offsets; an offset below one
// already committed for its partition is ignored, and so is a partition
// not tracked (forgotten since).
func (t *Tracker[K]) Committed(offsets map[K]int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for tp, off := range offsets {
		if p, ok := t.parts[tp]; ok && off > p.committed {
			p.committed = off
		}
	}
}

// Forget drops the state of the partitions in tps. Until a partition is
// fetched again, Done and Committed ignore it and Committable leaves it
// out.
func (t *Tracker[K]) Forget(tps map[K]bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for tp := range tps {
		delete(t.parts, tp)
	}
}

// offsetHeap is a min-heap of offsets.
type offsetHeap []int64

func (h offsetHeap) Len() int           { return len(h) }
func (h offsetHeap) Less(i, j int) bool { return h[i] < h[j] }
func (h offsetHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *offsetHeap) Push(x any)        { *h = append(*h, x.(int64)) }
func (h *offsetHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
