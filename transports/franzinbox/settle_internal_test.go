package franzinbox

import (
	"testing"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/offsets"
)

// A handler left running after its partition was revoked settles after
// the partition came back to this member: its offset must not count in
// the new assignment, whose tracking restarted below it, or the commit
// would pass messages the new assignment has not run.
func TestSettleOfAnEndedAssignmentIsNotRecorded(t *testing.T) {
	tp := topicPartition{"orders", 0}
	s := &session{tr: offsets.NewTracker[topicPartition](), parts: map[topicPartition]*part{}}
	ack := consumer.Decision{Action: consumer.Ack}
	msg := func(off int64) *consumer.Message {
		return &consumer.Message{Topic: tp.topic, Partition: int(tp.partition), Offset: off}
	}

	// The first assignment fetched offset 5; its handler outlives the
	// revoke, which commits nothing of it and forgets the partition.
	old := &part{}
	s.parts[tp] = old
	s.tr.Fetched(tp, 5)
	delete(s.parts, tp)
	s.tr.Forget(map[topicPartition]bool{tp: true})
	s.ended([]*part{old})

	// The partition comes back from the committed offset 0; 0 and 1 run,
	// and the next poll has not returned yet when the old handler does.
	cur := &part{}
	s.parts[tp] = cur
	for off := int64(0); off < 2; off++ {
		s.tr.Fetched(tp, off)
	}
	s.settle(cur, msg(0), ack)
	s.settle(cur, msg(1), ack)
	s.settle(old, msg(5), ack)
	if got := s.tr.Committable(nil)[tp]; got != 2 {
		t.Fatalf("committable offset %d, want 2: the old assignment's offset 5 counted in the new one", got)
	}
}
