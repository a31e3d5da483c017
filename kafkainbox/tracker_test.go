package kafkainbox

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTrackerWatermark(t *testing.T) {
	tp := topicPartition{"t", 0}
	next := func(tr *tracker) (int64, bool) {
		off, ok := tr.committable()[tp]
		return off, ok
	}

	t.Run("InOrder", func(t *testing.T) {
		tr := newTracker()
		_, ok := next(tr)
		require.False(t, ok, "nothing fetched")
		for o := int64(10); o < 15; o++ {
			tr.fetched(tp, o)
		}
		_, ok = next(tr)
		require.False(t, ok, "nothing done")
		tr.done(tp, 10)
		tr.done(tp, 11)
		off, _ := next(tr)
		require.EqualValues(t, 12, off)
		tr.done(tp, 14) // out of order (parallel by key): 12 and 13 hold it back
		off, _ = next(tr)
		require.EqualValues(t, 12, off)
		tr.done(tp, 13)
		tr.done(tp, 12)
		off, _ = next(tr)
		require.EqualValues(t, 15, off)
	})

	t.Run("StoppedMessageHoldsTheCommit", func(t *testing.T) {
		tr := newTracker()
		for o := int64(0); o < 3; o++ {
			tr.fetched(tp, o)
		}
		tr.done(tp, 0)
		tr.done(tp, 2) // 1 was stopped by a shutdown and never done
		off, _ := next(tr)
		require.EqualValues(t, 1, off)
	})

	t.Run("CommittedOnlyMovesForward", func(t *testing.T) {
		tr := newTracker()
		tr.fetched(tp, 0)
		tr.done(tp, 0)
		offs := tr.committable()
		tr.committed(offs)
		_, ok := next(tr)
		require.False(t, ok, "already committed")
		tr.fetched(tp, 1)
		_, ok = next(tr)
		require.False(t, ok, "1 is pending")
		tr.done(tp, 1)
		off, _ := next(tr)
		require.EqualValues(t, 2, off)
	})

	t.Run("RefetchedAfterRebalance", func(t *testing.T) {
		// 20..24 fetched; 20..22 done; a rebalance restarts the partition
		// from 21 while 23 and 24 are still in flight.
		tr := newTracker()
		for o := int64(20); o < 25; o++ {
			tr.fetched(tp, o)
		}
		for o := int64(20); o < 23; o++ {
			tr.done(tp, o)
		}
		for o := int64(21); o < 25; o++ {
			tr.fetched(tp, o)
		}
		off, _ := next(tr)
		require.EqualValues(t, 21, off, "the refetched copies are pending")
		for o := int64(21); o < 25; o++ {
			tr.done(tp, o)
		}
		off, _ = next(tr)
		require.EqualValues(t, 23, off, "first copies of 23 and 24 still in flight")
		tr.done(tp, 23)
		tr.done(tp, 24)
		off, _ = next(tr)
		require.EqualValues(t, 25, off)
	})

	t.Run("Partitions", func(t *testing.T) {
		tr := newTracker()
		a, b := topicPartition{"t", 0}, topicPartition{"t", 1}
		tr.fetched(a, 5)
		tr.fetched(b, 7)
		tr.done(b, 7)
		require.Equal(t, map[topicPartition]int64{b: 8}, tr.committable())
	})
}
