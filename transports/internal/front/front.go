// Package front is what every consumer front's Consumer holds of the
// runtime, made the same way by each front's New: the handler, the
// Processor made of the front's consumer.Config (with the front's dead
// letters unless the user gave some), the ledger's logger, and the check
// that Run runs once.
package front

import (
	"context"
	"log/slog"
	"sync/atomic"

	"github.com/justonce/justonce/consumer"
)

// Front is embedded in a front's Consumer. Set it up with Init.
type Front struct {
	// Handler is the user's handler.
	Handler consumer.Handler
	// UserDL: Processor.DeadLetter was given by the user.
	UserDL bool
	// Proc runs the handler.
	Proc *consumer.Processor
	// Log is the ledger's logger (never nil).
	Log *slog.Logger
	ran atomic.Bool
}

// DeadLetter publishes a message that failed for good.
type DeadLetter = func(ctx context.Context, m *consumer.Message, cause error) error

// Init makes the Processor of pc and h. When pc has no DeadLetter, it is
// the one deadLetter returns (called once, here). It returns pc with the
// Processor's defaults applied.
func (f *Front) Init(pc consumer.Config, h consumer.Handler, deadLetter func() DeadLetter) (consumer.Config, error) {
	f.Handler, f.UserDL = h, pc.DeadLetter != nil
	if !f.UserDL {
		pc.DeadLetter = deadLetter()
	}
	p, err := consumer.New(pc, h)
	if err != nil {
		return pc, err
	}
	f.Proc = p
	f.Log = pc.Ledger.Logger()
	if f.Log == nil {
		f.Log = slog.New(slog.DiscardHandler)
	}
	return p.Config(), nil
}

// Started returns consumer.ErrRunOnce when Run was called before.
func (f *Front) Started() error {
	if !f.ran.CompareAndSwap(false, true) {
		return consumer.ErrRunOnce
	}
	return nil
}
