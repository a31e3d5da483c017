package franzinbox_test

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// A member whose session expires while one of its handlers runs loses its
// partitions (franz-go's OnPartitionsLost) and must not commit their
// offsets any more: another member owns them. The loss is real: member A's
// requests are held on the wire (its heartbeats stop reaching the
// coordinator, as in a network partition) while its handler of partition P
// is in flight, until the coordinator drops A from the group; member B
// then takes P over and finds the held event in flight (the ledger answers
// InFlight). When A's requests flow again its next heartbeat is refused
// (UNKNOWN_MEMBER_ID) and franz-go calls the lost callback, the handler
// still held. The handler then either finishes (released by the test) or
// is held until the Consumer cancels it.
//
// Every OffsetCommit A sends is read off the wire with the brokers' answer:
// none of P is accepted from A once it was cut off, and once the lost
// callback runs A sends no request for P under its lost membership (so
// none past the message its handler finished after the loss either).
// Every payment is made once (payments table and ledger), the group
// finishes the topic, and A rejoins as a new member.
func TestLostPartitionsAreNotCommitted(t *testing.T) {
	t.Parallel()
	t.Run("HandlerFinishesAfterTheLoss", func(t *testing.T) {
		t.Parallel()
		testLost(t, true)
	})
	t.Run("HandlerCancelled", func(t *testing.T) {
		t.Parallel()
		testLost(t, false)
	})
}

// testLost runs the scenario; release says whether the held handler is
// released once the partitions are lost, or held until cancelled.
func testLost(t *testing.T, release bool) {
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	fx.pg.Exec(t, `CREATE TABLE payments (event_id text NOT NULL, member text NOT NULL, part int NOT NULL, off bigint NOT NULL)`)
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n = 200
	publish(t, brokers, topic, events("lost", 0, n, 50)...)

	var seq atomic.Int64 // orders what the wire tap and A's log see
	tap := &wireTap{seq: &seq}

	// A's log: the lost callback's first line is stamped on seq, and
	// whether the held handler was in flight at that instant is noted.
	var (
		logs          testsvc.LogBuffer
		lostSeq       atomic.Int64
		heldRunning   atomic.Bool
		heldCancelled atomic.Bool
		heldAtLoss    atomic.Bool
		lostEntered   = make(chan struct{})
		lostOnce      sync.Once
	)
	logA := slog.New(&hookHandler{
		Handler: slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}),
		on: func(r slog.Record) {
			if r.Message != "justonce franz: partitions revoked; waiting for their handlers in flight" || !boolAttr(r, "lost") {
				return
			}
			lostOnce.Do(func() {
				// Running, or already cancelled by this callback: nothing
				// else cancels it, A being cut off until now.
				heldAtLoss.Store(heldRunning.Load() || heldCancelled.Load())
				lostSeq.Store(seq.Add(1))
				close(lostEntered)
			})
		},
	})
	ledgerA, err := inbox.New(fx.pg.Pool, inbox.Config{Logger: logA})
	require.NoError(t, err)
	defer func() {
		if t.Failed() {
			t.Logf("A's log:\n%s", logs.String())
		}
	}()

	pay := func(member string, runs *atomic.Int64, then func(context.Context, *consumer.Message) error) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO payments (event_id, member, part, off) VALUES ($1, $2, $3, $4)`,
				m.ID, member, m.Partition, m.Offset); err != nil {
				return err
			}
			if then != nil {
				return then(ctx, m)
			}
			return nil
		}
	}

	// A's first message (partition P, offset g) waits until A is cut off,
	// so that P has done work whose commit cannot get through; the next
	// message of P (offset g+1, the held one) is held until the test
	// releases it, after the loss, or its context is cancelled.
	var (
		gate      atomic.Pointer[consumer.Message]
		gated     = make(chan struct{})
		cutOff    = make(chan struct{})
		heldOnce  atomic.Bool
		held      = make(chan string, 1)
		released  = make(chan struct{})
		heldErr   = make(chan error, 1)
		runsA     atomic.Int64
		runsB     atomic.Int64
		manageErr = make(chan error, 8)
	)
	openGate := sync.OnceFunc(func() { close(cutOff) })
	releaseHeld := sync.OnceFunc(func() { close(released) })
	handlerA := pay("a", &runsA, func(ctx context.Context, m *consumer.Message) error {
		if gate.CompareAndSwap(nil, m) {
			close(gated)
			select {
			case <-cutOff:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		g := gate.Load()
		if m.Partition != g.Partition || m.Offset != g.Offset+1 || !heldOnce.CompareAndSwap(false, true) {
			return nil
		}
		heldRunning.Store(true)
		held <- m.ID
		var err error
		select {
		case <-released:
		case <-ctx.Done():
			err = ctx.Err()
			heldCancelled.Store(true)
		}
		heldRunning.Store(false)
		heldErr <- err
		return err
	})

	procA := fx.processor()
	procA.Ledger = ledgerA
	clientA := "lost-a-" + topic
	cfgA := franzinbox.Config{
		Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: procA,
		Scheduling: consumer.Scheduling{BatchSize: 1}, CommitInterval: 100 * time.Millisecond,
		ClientOptions: append(append([]kgo.Opt(nil), fastGroup...),
			kgo.ClientID(clientA),
			kgo.Dialer(tap.dial),
			kgo.WithHooks(manageErrHook(manageErr)),
		),
	}
	stopA := start(t, cfgA, handlerA)
	// Cleanups run last first: these run before stopA's.
	t.Cleanup(tap.thaw)
	t.Cleanup(openGate)
	t.Cleanup(releaseHeld)

	waitFor(t, gated, 60*time.Second, "A runs its first message")
	g := gate.Load()
	p := int32(g.Partition)
	adm := admin(t, brokers)
	var memberA string
	testsvc.Eventually(t, 30*time.Second, func() bool {
		memberA = ""
		for _, m := range describeGroup(t, adm, group) {
			if m.ClientID == clientA && assigned(m, topic, p) {
				memberA = m.MemberID
			}
		}
		return memberA != ""
	}, "A is a member of the group with P (%d) assigned", p)
	testsvc.Eventually(t, 30*time.Second, func() bool { return tap.accepted(memberA, -1) > 0 },
		"the wire tap sees A's accepted commits (of other partitions)")

	// Cut A off: nothing it writes reaches the brokers any more.
	frozenSeq := tap.freeze()
	openGate() // P's first message is done now; its commit cannot get through
	var heldID string
	select {
	case heldID = <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("A did not reach the message it holds")
	}
	testsvc.Eventually(t, 45*time.Second, func() bool {
		for _, m := range describeGroup(t, adm, group) {
			if m.MemberID == memberA {
				return false
			}
		}
		return true
	}, "the coordinator drops A (session timeout) while its handler of P is held")
	require.True(t, heldRunning.Load(), "A's handler of P is still in flight when A is dropped")

	// B joins, takes P over and finds the held event in flight in A.
	inFlightB := make(chan struct{})
	inFlightOnce := sync.OnceFunc(func() { close(inFlightB) })
	procB := fx.processor()
	outcome := procB.Hooks.OnOutcome
	procB.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, took time.Duration) {
		if out.Disposition == inbox.InFlight && m.ID == heldID {
			inFlightOnce()
		}
		outcome(m, out, took)
	}
	stopB := start(t, franzinbox.Config{
		Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: procB,
		ClientOptions: append(append([]kgo.Opt(nil), fastGroup...), kgo.ClientID("lost-b-"+topic)),
	}, pay("b", &runsB, nil))
	waitFor(t, inFlightB, 60*time.Second, "B owns P and finds the held event in flight")

	// A's requests flow again: its heartbeat is refused and franz-go calls
	// the lost callback, with the handler still held.
	require.True(t, heldRunning.Load(), "A's handler of P is still in flight")
	tap.thaw()
	waitFor(t, lostEntered, 60*time.Second, "A's partitions are reported lost")
	require.True(t, heldAtLoss.Load(), "A's handler of P was in flight when its partitions were reported lost")
	if release {
		releaseHeld()
	}
	var heldRes error
	select {
	case heldRes = <-heldErr:
	case <-time.After(60 * time.Second):
		t.Fatal("the held handler did not return")
	}
	var groupErr error
	select {
	case groupErr = <-manageErr:
	case <-time.After(60 * time.Second):
		t.Fatal("franz-go reported no group session error")
	}
	require.True(t, errors.Is(groupErr, kerr.UnknownMemberID) || errors.Is(groupErr, kerr.IllegalGeneration),
		"the coordinator no longer knew A's membership: %v", groupErr)
	payer := "a" // the held handler committed its transaction after the loss
	if release {
		if heldRes != nil { // a Consumer may cancel the handlers of lost partitions at once
			require.ErrorIs(t, heldRes, context.Canceled)
			payer = "b"
		}
	} else {
		require.ErrorIs(t, heldRes, context.Canceled, "the Consumer cancelled the handler of the lost partition")
		payer = "b" // rolled back: the new owner ran it
	}

	// The group finishes the topic; A comes back as a new member.
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM payments`) >= n
	}, "the group processes every event")
	waitNoLag(t, brokers, group, topic)
	testsvc.Eventually(t, 60*time.Second, func() bool {
		for _, m := range describeGroup(t, adm, group) {
			if m.ClientID == clientA && m.MemberID != memberA {
				return true
			}
		}
		return false
	}, "A rejoins the group as a new member")
	stopB()
	stopA()

	// Exactly once: one payment and one ledger row per event.
	require.Equal(t, n, fx.pg.Count(t, `SELECT count(*) FROM payments`), "payments (doubled if more, lost if fewer)")
	require.Equal(t, n, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM payments`), "distinct payments")
	require.Equal(t, n, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`), "ledger rows")
	require.Equal(t, 1, fx.pg.Count(t, `SELECT count(*) FROM payments WHERE event_id = $1`, heldID), "the held event paid once")
	require.Equal(t, 1, fx.pg.Count(t, `SELECT count(*) FROM payments WHERE event_id = $1 AND member = $2`, heldID, payer), "the held event paid by %s", payer)

	// Commits: none of P accepted from A after it was cut off; none of P
	// asked for by A, as the member that lost P, after the loss.
	lost := lostSeq.Load()
	heldOff := g.Offset + 1
	var refusedP, staleP, pastHeld int
	for _, c := range tap.snapshot() {
		off, ok := c.offsets[p]
		if !ok {
			continue
		}
		code, answered := c.errs[p]
		if c.seq > frozenSeq {
			require.False(t, answered && code == 0, "A's commit of P (offset %d, member %s, sent after it was cut off) was accepted", off, c.member)
			if answered {
				refusedP++
			}
		}
		if c.member == memberA && c.seq > lost {
			staleP++
			if off > heldOff {
				pastHeld++
			}
		}
	}
	require.Positive(t, refusedP, "the commit of P that A sent while cut off was answered, and refused")
	require.Zero(t, staleP, "A sent %d OffsetCommit requests of lost partition P under its lost membership after the loss", staleP)
	require.Zero(t, pastHeld, "A, as the member that lost P, asked to commit P past the message its handler finished after the loss")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs, err := adm.FetchOffsetsForTopics(ctx, group, topic)
	require.NoError(t, err)
	final, ok := cs.Lookup(topic, p)
	require.True(t, ok)
	require.NotEqual(t, memberA, final.Metadata, "P's final offset was committed by a current member, not by A's lost one")

	require.Positive(t, runsB.Load(), "B consumed")
	require.Zero(t, tap.parseErrors(), "the wire tap read every OffsetCommit")
	t.Logf("P=%d held %s (offset %d, handler returned %v); A ran %d, B ran %d; group error %v; A's commit requests of P as the lost member after the loss: %d (refused)",
		p, heldID, heldOff, heldRes, runsA.Load(), runsB.Load(), groupErr, staleP)
}

// waitFor waits for ch to be closed, or fails the test after d.
func waitFor(t *testing.T, ch <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(d):
		t.Fatalf("timed out after %v waiting: %s", d, what)
	}
}

// describeGroup returns the group's members.
func describeGroup(t *testing.T, adm *kadm.Client, group string) []kadm.DescribedGroupMember {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	gs, err := adm.DescribeGroups(ctx, group)
	require.NoError(t, err)
	d, ok := gs[group]
	require.True(t, ok)
	require.NoError(t, d.Err)
	return d.Members
}

// assigned reports whether m is assigned partition p of topic.
func assigned(m kadm.DescribedGroupMember, topic string, p int32) bool {
	a, ok := m.Assigned.AsConsumer()
	if !ok {
		return false
	}
	for _, at := range a.Topics {
		if at.Topic == topic {
			for _, ap := range at.Partitions {
				if ap == p {
					return true
				}
			}
		}
	}
	return false
}

// boolAttr reports whether r has the boolean attribute key set to true.
func boolAttr(r slog.Record, key string) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key && a.Value.Kind() == slog.KindBool && a.Value.Bool() {
			found = true
			return false
		}
		return true
	})
	return found
}

// hookHandler calls on for each record, then passes it on.
type hookHandler struct {
	slog.Handler
	on func(slog.Record)
}

func (h *hookHandler) Handle(ctx context.Context, r slog.Record) error {
	h.on(r)
	return h.Handler.Handle(ctx, r)
}

func (h *hookHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &hookHandler{Handler: h.Handler.WithAttrs(as), on: h.on}
}

func (h *hookHandler) WithGroup(name string) slog.Handler {
	return &hookHandler{Handler: h.Handler.WithGroup(name), on: h.on}
}

// manageErrHook passes the errors that end franz-go's group sessions (the
// ones it calls OnPartitionsLost for) to its channel.
type manageErrHook chan error

func (h manageErrHook) OnGroupManageError(err error) {
	select {
	case h <- err:
	default:
	}
}

// wireTap is a kgo.Dialer for one client: it reads the OffsetCommit
// requests the client writes, and the brokers' answers, off the wire, and
// can hold every request the client writes (freeze, until thaw), as a
// network that stops carrying them would: the client's heartbeats stop
// reaching the coordinator.
type wireTap struct {
	seq *atomic.Int64 // stamps each commit request when the client writes it

	mu      sync.Mutex
	thawed  chan struct{} // while frozen: closed by thaw
	commits []*tappedCommit
	bad     int // frames that did not parse
}

// tappedCommit is one OffsetCommit request and, once answered, the
// brokers' error code per partition (0: committed).
type tappedCommit struct {
	seq     int64
	member  string
	version int16
	offsets map[int32]int64
	errs    map[int32]int16 // nil until answered
}

func (w *wireTap) dial(ctx context.Context, network, host string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, host)
	if err != nil {
		return nil, err
	}
	return &tapConn{Conn: c, w: w, pending: map[int32]*tappedCommit{}, closed: make(chan struct{})}, nil
}

// freeze holds every request written from now on until thaw; it returns
// the seq stamp of the moment.
func (w *wireTap) freeze() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.thawed == nil {
		w.thawed = make(chan struct{})
	}
	return w.seq.Add(1)
}

func (w *wireTap) thaw() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.thawed != nil {
		close(w.thawed)
		w.thawed = nil
	}
}

// snapshot returns copies of the commits seen so far.
func (w *wireTap) snapshot() []tappedCommit {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]tappedCommit, len(w.commits))
	for i, c := range w.commits {
		out[i] = *c
	}
	return out
}

// accepted counts the partitions committed by member (p: any when -1).
func (w *wireTap) accepted(member string, p int32) int {
	k := 0
	for _, c := range w.snapshot() {
		if c.member != member || c.errs == nil {
			continue
		}
		for part, code := range c.errs {
			if code == 0 && (p < 0 || part == p) {
				k++
			}
		}
	}
	return k
}

func (w *wireTap) parseErrors() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.bad
}

func (w *wireTap) failed() {
	w.mu.Lock()
	w.bad++
	w.mu.Unlock()
}

// tapConn is one tapped connection. franz-go writes one whole request per
// Write; both directions are still parsed as streams of size-prefixed
// frames.
type tapConn struct {
	net.Conn
	w *wireTap

	wmu  sync.Mutex
	wbuf []byte
	rbuf []byte // Read's only

	mu      sync.Mutex
	pending map[int32]*tappedCommit // by correlation ID

	closeOnce sync.Once
	closed    chan struct{}
}

func (c *tapConn) Write(b []byte) (int, error) {
	c.wmu.Lock()
	c.wbuf = append(c.wbuf, b...)
	for {
		frame, ok := nextFrame(&c.wbuf)
		if !ok {
			break
		}
		c.request(frame)
	}
	c.wmu.Unlock()

	c.w.mu.Lock()
	thawed := c.w.thawed
	c.w.mu.Unlock()
	if thawed != nil {
		select {
		case <-thawed:
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	return c.Conn.Write(b)
}

func (c *tapConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.rbuf = append(c.rbuf, b[:n]...)
		for {
			frame, ok := nextFrame(&c.rbuf)
			if !ok {
				break
			}
			c.response(frame)
		}
	}
	return n, err
}

func (c *tapConn) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// nextFrame takes the first whole size-prefixed frame off buf.
func nextFrame(buf *[]byte) ([]byte, bool) {
	b := *buf
	if len(b) < 4 {
		return nil, false
	}
	size := int(binary.BigEndian.Uint32(b))
	if len(b) < 4+size {
		return nil, false
	}
	frame := b[4 : 4+size]
	if rest := b[4+size:]; len(rest) > 0 {
		*buf = append([]byte(nil), rest...)
	} else {
		*buf = nil
	}
	return frame, true
}

// request records an OffsetCommit request: header (v1, or v2 when the
// request is flexible), then the body.
func (c *tapConn) request(frame []byte) {
	r := kbin.Reader{Src: frame}
	key, version, corr := r.Int16(), r.Int16(), r.Int32()
	req := kmsg.NewPtrOffsetCommitRequest()
	if key != req.Key() {
		return
	}
	r.NullableString() // client ID
	req.SetVersion(version)
	if req.IsFlexible() {
		kmsg.SkipTags(&r)
	}
	if !r.Ok() || req.ReadFrom(r.Src) != nil {
		c.w.failed()
		return
	}
	tc := &tappedCommit{seq: c.w.seq.Add(1), member: req.MemberID, version: version, offsets: map[int32]int64{}}
	for _, t := range req.Topics {
		for _, p := range t.Partitions {
			tc.offsets[p.Partition] = p.Offset
		}
	}
	c.w.mu.Lock()
	c.w.commits = append(c.w.commits, tc)
	c.w.mu.Unlock()
	c.mu.Lock()
	c.pending[corr] = tc
	c.mu.Unlock()
}

// response records the answer to a pending OffsetCommit: header
// (correlation ID, then tags when flexible), then the body.
func (c *tapConn) response(frame []byte) {
	if len(frame) < 4 {
		c.w.failed()
		return
	}
	corr := int32(binary.BigEndian.Uint32(frame))
	c.mu.Lock()
	tc := c.pending[corr]
	delete(c.pending, corr)
	c.mu.Unlock()
	if tc == nil {
		return
	}
	resp := kmsg.NewPtrOffsetCommitResponse()
	resp.SetVersion(tc.version)
	r := kbin.Reader{Src: frame[4:]}
	if resp.IsFlexible() {
		kmsg.SkipTags(&r)
	}
	if !r.Ok() || resp.ReadFrom(r.Src) != nil {
		c.w.failed()
		return
	}
	errs := map[int32]int16{}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			errs[p.Partition] = p.ErrorCode
		}
	}
	c.w.mu.Lock()
	tc.errs = errs
	c.w.mu.Unlock()
}
