package lanes

import (
	"sync"
	"time"

	"github.com/justonce/justonce/consumer"
)

// leaveAfter is how long cancelled attempts get to return before a wait
// that may leave them behind (a rebalance's) does.
var leaveAfter = time.Second

// Stop stops every lane: no attempt starts after it, the waits between
// retries end, and the queued messages are dropped (Config.Drop). Attempts
// in progress go on, on Context, until they end or Cancel.
func (s *Scheduler[K]) Stop() {
	s.mu.Lock()
	s.stopped = true
	s.stop()
	var queued []*consumer.Message
	for _, g := range s.groups {
		queued = s.unqueue(g, queued)
	}
	s.mu.Unlock()
	for _, m := range queued {
		s.drop(m, s.stopping)
	}
}

// unqueue appends g's queued messages to out, empties its lanes and gives
// their room in the buffer back. s.mu must be held.
func (s *Scheduler[K]) unqueue(g *group, out []*consumer.Message) []*consumer.Message {
	for _, l := range g.lanes {
		n := len(l.q) - l.head
		if n == 0 {
			continue
		}
		if s.cfg.Drop != nil {
			out = append(out, l.q[l.head:]...)
		}
		clear(l.q)
		l.q, l.head = l.q[:0], 0
		s.Release(n)
	}
	return out
}

// Cancel cancels every attempt's context: their transactions roll back.
func (s *Scheduler[K]) Cancel() { s.cancel() }

// idle returns a channel closed once wg has no goroutine left.
func idle(wg *sync.WaitGroup) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// Wait says how long Await lets the attempts in flight go on.
type Wait struct {
	// Grace is how long they may go on. Zero: they are cancelled at once
	// (and no warning is logged).
	Grace time.Duration
	// What and Why name them in the warning ("in-flight handlers",
	// "shutdown": "in-flight handlers still running at shutdown").
	What, Why string
	// Rebalance: handlers that ignore their cancellation for a second are
	// left behind, rather than waited for: they would hold the group's
	// rebalance.
	Rebalance bool
	// Cut, when it closes during the wait, cuts what is left of it to
	// RebalanceGrace and makes it a rebalance's (a shutdown's wait
	// outlived by the generation it stops).
	Cut            <-chan struct{}
	RebalanceGrace time.Duration
}

// Await waits, after Stop, for the attempts in flight as w says, cancels
// those still running, and waits for them to return. It returns nil once
// they all have; at a rebalance, a channel that closes when the handlers
// it left behind return.
func (s *Scheduler[K]) Await(w Wait) <-chan struct{} {
	return s.await(idle(&s.wg), s.cancel, w)
}

func (s *Scheduler[K]) await(done <-chan struct{}, cancel func(), w Wait) <-chan struct{} {
	if w.Grace > 0 && !s.waitGrace(done, &w) {
		s.cfg.Log.Warn(s.cfg.Name+": "+w.What+" still running"+at(w.Why)+"; cancelling them", "timeout", w.Grace)
	}
	cancel()
	if !w.Rebalance {
		<-done
		return nil
	}
	// A handler that ignores its cancellation would hold the rebalance,
	// and so the whole group. Leave it running: the commit after the wait
	// stops below its message, which the partition's next owner reads
	// again. If the handler returns success later its transaction still
	// commits (the ledger commits on a context of its own), and its effect
	// still happens once: the next run of its message waits for the key's
	// lock, then finds the key done.
	select {
	case <-done:
		return nil
	case <-time.After(leaveAfter):
		s.cfg.Log.Error(s.cfg.Name + ": " + w.What + " ignore their cancellation; leaving them behind at the rebalance")
		return done
	}
}

func at(why string) string {
	if why == "" {
		return ""
	}
	return " at " + why
}

// waitGrace waits for done up to w.Grace, cut by w.Cut; false when the
// time ran out. It updates w to the wait that ran out.
func (s *Scheduler[K]) waitGrace(done <-chan struct{}, w *Wait) bool {
	select {
	case <-done:
		return true
	default:
	}
	deadline := time.Now().Add(w.Grace)
	timer := time.NewTimer(w.Grace)
	defer timer.Stop()
	cut := w.Cut
	for {
		select {
		case <-done:
			return true
		case <-cut:
			cut = nil
			w.Rebalance, w.Why = true, "rebalance"
			if time.Until(deadline) > w.RebalanceGrace {
				w.Grace = w.RebalanceGrace
				timer.Reset(w.Grace)
			}
		case <-timer.C:
			return false
		}
	}
}

// Revoked is a set of groups Revoke stopped.
type Revoked struct {
	groups  []*group
	running int
	await   func(done <-chan struct{}, cancel func(), w Wait) <-chan struct{}
}

// Revoke stops the groups of keys (a partition taken from this member): no
// attempt of theirs starts after it, the waits between their retries end,
// their queued messages are dropped, and they are forgotten (a later
// Enqueue to the same key starts a new group). Keys without a group are
// passed over.
func (s *Scheduler[K]) Revoke(keys []K) *Revoked {
	rv := &Revoked{await: s.await}
	var queued []*consumer.Message
	s.mu.Lock()
	for _, k := range keys {
		g := s.groups[k]
		if g == nil {
			continue
		}
		delete(s.groups, k)
		g.stop()
		for _, l := range g.lanes {
			if l.drainers > 0 {
				rv.running++
			}
		}
		queued = s.unqueue(g, queued)
		rv.groups = append(rv.groups, g)
	}
	s.mu.Unlock()
	for _, m := range queued {
		s.drop(m, s.stopping)
	}
	return rv
}

// Running is how many of the groups' lanes had a message in hand.
func (rv *Revoked) Running() int { return rv.running }

// Cancel cancels the groups' attempts: their transactions roll back.
func (rv *Revoked) Cancel() {
	for _, g := range rv.groups {
		g.cancel()
	}
}

// End marks the groups' assignment over: a decision settled from now on
// (by a handler left behind) is not passed to Config.Settle, so that it
// cannot count in a later assignment of the same partition. It waits for
// the settles in progress.
func (rv *Revoked) End() {
	for _, g := range rv.groups {
		g.settleMu.Lock()
		g.ended = true
		g.settleMu.Unlock()
	}
}

// Await is Scheduler.Await for the groups' attempts only.
func (rv *Revoked) Await(w Wait) <-chan struct{} {
	var wg sync.WaitGroup
	for _, g := range rv.groups {
		wg.Go(g.wg.Wait)
	}
	return rv.await(idle(&wg), rv.Cancel, w)
}
