package natsinbox

import (
	"container/list"
	"sync"
)

// MaxTrackedMessages bounds how many JetStream messages the process
// remembers attempt counts for (see the package documentation, "Attempts").
// When more are pending a retry at once, the oldest entry is forgotten and
// that message's count starts again at 1: it gets more handler runs, never
// fewer.
const MaxTrackedMessages = 1 << 16

// attemptKey names one message of one durable: the stream (its name and
// creation time, so a stream deleted and created again under the same name
// is another stream), the durable, the ledger scope and the stream
// sequence.
type attemptKey struct {
	stream  string
	created int64
	durable string
	scope   string
	seq     uint64
}

// attemptCount is what a message carries across its redeliveries.
type attemptCount struct {
	attempt   int // consumer.Message.Attempt: counted handler failures + 1
	uncounted int // consumer.Message.Uncounted
}

type attemptEntry struct {
	key attemptKey
	n   attemptCount
}

// attemptTable remembers, for the messages of this process that were
// handed back to JetStream (Nak) without being done, how many handler
// failures counted. It is shared by every Consumer of the process, so a
// consumer restarted in the same process goes on counting. It holds at most
// max entries and forgets the oldest first.
type attemptTable struct {
	mu    sync.Mutex
	max   int
	byKey map[attemptKey]*list.Element
	order *list.List // of *attemptEntry, oldest first
}

func newAttemptTable(max int) *attemptTable {
	return &attemptTable{max: max, byKey: map[attemptKey]*list.Element{}, order: list.New()}
}

// attempts is the process's table.
var attempts = newAttemptTable(MaxTrackedMessages)

// get returns the counts remembered for k.
func (t *attemptTable) get(k attemptKey) (attemptCount, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.byKey[k]; ok {
		return e.Value.(*attemptEntry).n, true
	}
	return attemptCount{}, false
}

// put remembers n for k. Two copies of one message handled at once (a
// redelivery after AckWait while the first copy still waits) may report
// different counts: the higher one is kept.
func (t *attemptTable) put(k attemptKey, n attemptCount) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.byKey[k]; ok {
		old := e.Value.(*attemptEntry)
		old.n.attempt = max(old.n.attempt, n.attempt)
		old.n.uncounted = max(old.n.uncounted, n.uncounted)
		t.order.MoveToBack(e)
		return
	}
	t.byKey[k] = t.order.PushBack(&attemptEntry{key: k, n: n})
	for t.order.Len() > t.max {
		oldest := t.order.Front()
		delete(t.byKey, oldest.Value.(*attemptEntry).key)
		t.order.Remove(oldest)
	}
}

// forget drops k: the message is done (acked or dead-lettered).
func (t *attemptTable) forget(k attemptKey) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.byKey[k]; ok {
		delete(t.byKey, k)
		t.order.Remove(e)
	}
}

func (t *attemptTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.order.Len()
}
