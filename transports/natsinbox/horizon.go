package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/horizon"
)

// checkHorizon is Run's check at start (consumer.Config.Horizon), once the
// durable is in place and before anything is pulled: the stream's MaxAge
// and the durable's backlog (ci) against the ledger's TTL, and the MaxAge
// of the streams that keep the dead letters of subjects.
func (c *Consumer) checkHorizon(ctx context.Context, si *jetstream.StreamInfo, ci *jetstream.ConsumerInfo, subjects []string) error {
	pc := c.cfg.Processor
	if pc.Horizon == consumer.HorizonOff {
		return nil
	}
	ttl := horizon.TTL(pc)
	h := streamHorizon(si.Config, ttl)
	h.Behind = int64(ci.NumPending) + int64(ci.NumAckPending)
	found := horizon.Found{Topics: []consumer.Horizon{h}}
	if !c.UserDL {
		hctx, cancel := context.WithTimeout(ctx, horizon.Timeout)
		found.DeadLetters, found.Err = c.deadLetterHorizons(hctx, subjects, ttl)
		cancel()
	}
	return horizon.Report(ctx, c.Log, pc, horizon.Front{Log: "justonce natsinbox", Noun: "stream", Group: "durable"}, found)
}

// streamHorizon is the horizon of a stream configured sc: its MaxAge (0:
// no time limit), with the limits that are not time in its Basis.
func streamHorizon(sc jetstream.StreamConfig, ttl time.Duration) consumer.Horizon {
	h := consumer.Horizon{Topic: sc.Name, TTL: ttl, Retention: sc.MaxAge, Unbounded: sc.MaxAge <= 0, Behind: -1, Stale: -1}
	basis := []string{"MaxAge " + sc.MaxAge.String()}
	if h.Unbounded {
		basis[0] = "MaxAge 0: no time limit"
	}
	var limits []string
	for _, l := range []struct {
		name string
		n    int64
	}{{"MaxMsgs", sc.MaxMsgs}, {"MaxBytes", sc.MaxBytes}, {"MaxMsgsPerSubject", sc.MaxMsgsPerSubject}} {
		if l.n > 0 {
			limits = append(limits, fmt.Sprintf("%s %d", l.name, l.n))
		}
	}
	if len(limits) > 0 {
		basis = append(basis, strings.Join(limits, ", ")+" also delete by count or size, not time (not counted)")
	}
	if sc.Retention != jetstream.LimitsPolicy {
		basis = append(basis, sc.Retention.String()+": an acked message is removed, one whose ack was lost stays")
	}
	h.Basis = strings.Join(basis, "; ")
	return h
}

// deadLetterHorizons returns the horizons of the streams that keep the
// dead letters of subjects (a subject without such a stream has none).
func (c *Consumer) deadLetterHorizons(ctx context.Context, subjects []string, ttl time.Duration) ([]consumer.Horizon, error) {
	var out []consumer.Horizon
	var errs []error
	var seen []string
	for _, s := range subjects {
		dl := c.deadLetterSubject(s)
		name, err := c.js.StreamNameBySubject(ctx, dl)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			continue
		case err != nil:
			errs = append(errs, fmt.Errorf("the stream of dead-letter subject %s: %w", dl, err))
			continue
		case slices.Contains(seen, name):
			continue
		}
		seen = append(seen, name)
		st, err := c.js.Stream(ctx, name)
		if err != nil {
			errs = append(errs, fmt.Errorf("dead-letter stream %s: %w", name, err))
			continue
		}
		out = append(out, streamHorizon(st.CachedInfo().Config, ttl))
	}
	return out, errors.Join(errs...)
}
