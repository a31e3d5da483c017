package franzinbox

import (
	"container/heap"
	"sync"
)

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int32
}

// tracker computes, per partition, the offset that is safe to commit: the
// lowest offset fetched and not yet done, or one past the highest done
// offset when nothing is pending. Every offset below it has been processed
// (by this member, or by whoever committed the offset a generation started
// from), so committing it never skips an unprocessed message.
//
// A partition's state is forgotten when the partition is revoked (after
// its last commit), so that a later assignment of it starts afresh from
// the group's committed offset. Pending offsets are counted, not flagged,
// so that a copy fetched twice is safe too.
type tracker struct {
	mu    sync.Mutex
	parts map[topicPartition]*partitionTrack
}

type partitionTrack struct {
	pending   map[int64]int // offset -> copies fetched and not done
	low       offsetHeap    // pending offsets, lazily cleaned
	maxDone   int64         // highest offset done, -1 when none
	committed int64         // last offset committed by us, -1 when none
}

func newTracker() *tracker {
	return &tracker{parts: map[topicPartition]*partitionTrack{}}
}

func (t *tracker) part(tp topicPartition) *partitionTrack {
	p, ok := t.parts[tp]
	if !ok {
		p = &partitionTrack{pending: map[int64]int{}, maxDone: -1, committed: -1}
		t.parts[tp] = p
	}
	return p
}

// fetched records that offset was handed to a worker.
func (t *tracker) fetched(tp topicPartition, offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.part(tp)
	p.pending[offset]++
	heap.Push(&p.low, offset)
}

// done records that offset's message was acknowledged: its ledger
// transaction committed, it was a duplicate, or it was dead-lettered.
func (t *tracker) done(tp topicPartition, offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.part(tp)
	if n := p.pending[offset]; n > 1 {
		p.pending[offset] = n - 1
	} else {
		delete(p.pending, offset)
	}
	if offset > p.maxDone {
		p.maxDone = offset
	}
}

// committable returns, for each partition (of only, when only is not nil)
// whose safe offset moved past the last commit, the offset to commit (the
// next one to read).
func (t *tracker) committable(only map[topicPartition]bool) map[topicPartition]int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out map[topicPartition]int64
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
				out = map[topicPartition]int64{}
			}
			out[tp] = next
		}
	}
	return out
}

// committed records a successful commit.
func (t *tracker) committed(offsets map[topicPartition]int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for tp, off := range offsets {
		if p := t.part(tp); off > p.committed {
			p.committed = off
		}
	}
}

// forget drops the state of the partitions in tps.
func (t *tracker) forget(tps map[topicPartition]bool) {
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
