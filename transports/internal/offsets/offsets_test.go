package offsets

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The keys the Kafka fronts use: kafka-go numbers partitions with int,
// franz-go with int32.
type (
	kafkaGoTP struct {
		topic     string
		partition int
	}
	franzTP struct {
		topic     string
		partition int32
	}
)

func TestTracker(t *testing.T) {
	t.Run("kafka-go", func(t *testing.T) {
		testTracker(t, func(topic string, p int) kafkaGoTP { return kafkaGoTP{topic, p} })
	})
	t.Run("franz-go", func(t *testing.T) {
		testTracker(t, func(topic string, p int) franzTP { return franzTP{topic, int32(p)} })
	})
}

func testTracker[K comparable](t *testing.T, key func(topic string, partition int) K) {
	tp := key("t", 0)
	next := func(tr *Tracker[K]) (int64, bool) {
		off, ok := tr.Committable(nil)[tp]
		return off, ok
	}

	t.Run("InOrder", func(t *testing.T) {
		tr := NewTracker[K]()
		_, ok := next(tr)
		require.False(t, ok, "nothing fetched")
		for o := int64(10); o < 15; o++ {
			tr.Fetched(tp, o)
		}
		_, ok = next(tr)
		require.False(t, ok, "nothing done")
		tr.Done(tp, 10)
		tr.Done(tp, 11)
		off, _ := next(tr)
		require.EqualValues(t, 12, off)
		tr.Done(tp, 14) // out of order (parallel by key): 12 and 13 hold it back
		off, _ = next(tr)
		require.EqualValues(t, 12, off)
		tr.Done(tp, 13)
		tr.Done(tp, 12)
		off, _ = next(tr)
		require.EqualValues(t, 15, off)
	})

	t.Run("StoppedMessageHoldsTheCommit", func(t *testing.T) {
		tr := NewTracker[K]()
		for o := int64(0); o < 3; o++ {
			tr.Fetched(tp, o)
		}
		tr.Done(tp, 0)
		tr.Done(tp, 2) // 1 was stopped by a shutdown and never done
		off, _ := next(tr)
		require.EqualValues(t, 1, off)
	})

	t.Run("CommittedOnlyMovesForward", func(t *testing.T) {
		tr := NewTracker[K]()
		tr.Fetched(tp, 0)
		tr.Done(tp, 0)
		offs := tr.Committable(nil)
		tr.Committed(offs)
		_, ok := next(tr)
		require.False(t, ok, "already committed")
		tr.Fetched(tp, 1)
		_, ok = next(tr)
		require.False(t, ok, "1 is pending")
		tr.Done(tp, 1)
		off, _ := next(tr)
		require.EqualValues(t, 2, off)
		tr.Committed(map[K]int64{tp: 2})
		tr.Committed(map[K]int64{tp: 1}) // a late, older commit
		_, ok = next(tr)
		require.False(t, ok, "an older commit does not move the mark back")
	})

	t.Run("RefetchedAfterRebalance", func(t *testing.T) {
		// 20..24 fetched; 20..22 done; a rebalance restarts the partition
		// from 21 while 23 and 24 are still in flight.
		tr := NewTracker[K]()
		for o := int64(20); o < 25; o++ {
			tr.Fetched(tp, o)
		}
		for o := int64(20); o < 23; o++ {
			tr.Done(tp, o)
		}
		for o := int64(21); o < 25; o++ {
			tr.Fetched(tp, o)
		}
		off, _ := next(tr)
		require.EqualValues(t, 21, off, "the refetched copies are pending")
		for o := int64(21); o < 25; o++ {
			tr.Done(tp, o)
		}
		off, _ = next(tr)
		require.EqualValues(t, 23, off, "first copies of 23 and 24 still in flight")
		tr.Done(tp, 23)
		tr.Done(tp, 24)
		off, _ = next(tr)
		require.EqualValues(t, 25, off)
	})

	t.Run("Partitions", func(t *testing.T) {
		tr := NewTracker[K]()
		a, b := key("t", 0), key("t", 1)
		tr.Fetched(a, 5)
		tr.Fetched(b, 7)
		tr.Done(b, 7)
		require.Equal(t, map[K]int64{b: 8}, tr.Committable(nil))
	})

	t.Run("Only", func(t *testing.T) {
		tr := NewTracker[K]()
		a, b, c := key("t", 0), key("t", 1), key("u", 0)
		for _, p := range []K{a, b, c} {
			tr.Fetched(p, 3)
			tr.Done(p, 3)
		}
		require.Equal(t, map[K]int64{a: 4, b: 4, c: 4}, tr.Committable(nil), "nil: every partition")
		require.Equal(t, map[K]int64{b: 4}, tr.Committable(map[K]bool{b: true}))
		require.Equal(t, map[K]int64{a: 4, c: 4}, tr.Committable(map[K]bool{a: true, b: false, c: true}), "a false entry is left out")
		require.Empty(t, tr.Committable(map[K]bool{}), "empty, not nil: no partition")
		require.Empty(t, tr.Committable(map[K]bool{key("t", 9): true}), "a partition never fetched")

		tr.Committed(tr.Committable(map[K]bool{a: true}))
		require.Equal(t, map[K]int64{b: 4, c: 4}, tr.Committable(nil), "only a was committed")
	})

	t.Run("Forget", func(t *testing.T) {
		// 7 and 8 fetched, 8 done, then the partition is revoked: 7's
		// attempt is rolled back and never done. A later assignment
		// restarts from the group's committed offset, 7.
		tr := NewTracker[K]()
		other := key("t", 1)
		tr.Fetched(tp, 7)
		tr.Fetched(tp, 8)
		tr.Done(tp, 8)
		tr.Fetched(other, 2)
		tr.Done(other, 2)
		tr.Committed(map[K]int64{tp: 7})

		tr.Forget(map[K]bool{tp: true})
		require.Equal(t, map[K]int64{other: 3}, tr.Committable(nil), "tp gone, the other partition kept")

		tr.Fetched(tp, 7)
		tr.Done(tp, 7)
		off, ok := next(tr)
		require.True(t, ok, "the stale pending copy of 7 does not hold the commit back")
		require.EqualValues(t, 8, off)

		// Forgetting also drops the last commit: a later assignment may
		// start below it (the group's committed offset is authoritative).
		tr.Committed(map[K]int64{tp: 8})
		tr.Forget(map[K]bool{tp: true})
		tr.Fetched(tp, 5)
		tr.Done(tp, 5)
		off, ok = next(tr)
		require.True(t, ok)
		require.EqualValues(t, 6, off)

		tr.Forget(map[K]bool{key("never", 0): true}) // unknown: no-op
		tr.Forget(nil)
		require.Equal(t, map[K]int64{tp: 6, other: 3}, tr.Committable(nil))
	})

	t.Run("ForgottenWhileRunning", func(t *testing.T) {
		// 7 and 8 fetched, 7 done, then the partition is lost: forgotten
		// at once while 8 still runs. 8 ends after that (its transaction
		// committed, or a commit of 9 answered late): neither makes the
		// partition committable again, so nothing of it is committed.
		tr := NewTracker[K]()
		tr.Fetched(tp, 7)
		tr.Fetched(tp, 8)
		tr.Done(tp, 7)
		require.Equal(t, map[K]int64{tp: 8}, tr.Committable(nil))

		tr.Forget(map[K]bool{tp: true})
		tr.Done(tp, 8)
		require.Empty(t, tr.Committable(nil), "a message done after its partition was forgotten")
		tr.Committed(map[K]int64{tp: 9})
		require.Empty(t, tr.Committable(nil), "a commit recorded after its partition was forgotten")

		// A later assignment starts from the group's committed offset, 5:
		// neither the late Done nor the late commit of 9 holds it back.
		tr.Fetched(tp, 5)
		_, ok := next(tr)
		require.False(t, ok, "5 is pending")
		tr.Done(tp, 5)
		off, ok := next(tr)
		require.True(t, ok)
		require.EqualValues(t, 6, off)
	})
}

// BenchmarkTracker measures the per-message hot path: one Fetched and one
// Done per message, with a Committable and Committed every 100 messages,
// over 8 partitions.
func BenchmarkTracker(b *testing.B) {
	b.Run("kafka-go", func(b *testing.B) {
		benchTracker(b, func(topic string, p int) kafkaGoTP { return kafkaGoTP{topic, p} })
	})
	b.Run("franz-go", func(b *testing.B) {
		benchTracker(b, func(topic string, p int) franzTP { return franzTP{topic, int32(p)} })
	})
}

func benchTracker[K comparable](b *testing.B, key func(topic string, partition int) K) {
	const parts = 8
	tps := make([]K, parts)
	for i := range tps {
		tps[i] = key("bench-topic", i)
	}
	tr := NewTracker[K]()
	var msgs int
	for b.Loop() {
		for i := range 1000 {
			tp, off := tps[i%parts], int64(msgs/parts)
			tr.Fetched(tp, off)
			tr.Done(tp, off)
			msgs++
			if msgs%100 == 0 {
				tr.Committed(tr.Committable(nil))
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(msgs), "ns/msg")
}
