package franzinbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/horizon"
)

// checkHorizon is Run's check at start (consumer.Config.Horizon), before
// the group client exists: each topic's retention and the group's lag
// against the ledger's TTL, and the dead-letter topics' retention, asked
// through a client of the Consumer's options without its group (TLS and
// SASL apply).
func (c *Consumer) checkHorizon(ctx context.Context) error {
	pc := c.cfg.Processor
	if pc.Horizon == consumer.HorizonOff {
		return nil
	}
	hctx, cancel := context.WithTimeout(ctx, horizon.Timeout)
	defer cancel()
	var found horizon.Found
	cl, err := kgo.NewClient(c.baseOptions()...)
	if err != nil {
		found.Err = fmt.Errorf("client config: %w", err)
	} else {
		// Where the group reads a partition it has no offset for: the
		// end, or (the Consumer's default) the start.
		reset, _ := cl.OptValue(kgo.ConsumeResetOffset).(kgo.Offset)
		found = c.horizon(hctx, kadm.NewClient(cl), horizon.TTL(pc), reset == kgo.NewOffset().AtEnd())
		cl.Close()
	}
	return horizon.Report(ctx, c.Log, pc, horizon.Front{Log: "justonce franz", Noun: "topic", Group: "group"}, found)
}

// horizonConfigs are the topic settings the horizon is read from.
var horizonConfigs = []string{"cleanup.policy", "retention.ms", "segment.ms", "retention.bytes"}

func (c *Consumer) horizon(ctx context.Context, adm *kadm.Client, ttl time.Duration, fromEnd bool) horizon.Found {
	var deadLetters []string
	if !c.UserDL {
		for _, t := range c.cfg.Topics {
			if dl := c.cfg.deadLetterTopic(t); !slices.Contains(deadLetters, dl) {
				deadLetters = append(deadLetters, dl)
			}
		}
	}
	var found horizon.Found
	var errs []error
	rcs, err := adm.DescribeTopicConfigs(ctx, append(slices.Clone(c.cfg.Topics), deadLetters...)...)
	if err != nil && len(rcs) == 0 {
		return horizon.Found{Err: fmt.Errorf("topics %v: %w", c.cfg.Topics, err)}
	}
	for _, rc := range rcs {
		consumed := slices.Contains(c.cfg.Topics, rc.Name)
		if rc.Err != nil {
			// A dead-letter topic may not exist yet: it is created at
			// its first dead letter.
			if consumed {
				errs = append(errs, fmt.Errorf("topic %s: %w", rc.Name, rc.Err))
			}
			continue
		}
		configs := make(map[string]string, len(horizonConfigs))
		for _, cf := range rc.Configs {
			if cf.Value != nil && slices.Contains(horizonConfigs, cf.Key) {
				configs[cf.Key] = *cf.Value
			}
		}
		h, err := horizon.Kafka(rc.Name, configs, ttl)
		switch {
		case err != nil && consumed:
			errs = append(errs, err)
		case err != nil:
		case consumed:
			found.Topics = append(found.Topics, h)
		default:
			found.DeadLetters = append(found.DeadLetters, h)
		}
	}
	for _, t := range c.cfg.Topics {
		if !slices.ContainsFunc(found.Topics, func(h consumer.Horizon) bool { return h.Topic == t }) && len(errs) == 0 {
			errs = append(errs, fmt.Errorf("topic %s: the broker did not describe it", t))
		}
	}
	if len(found.Topics) > 0 {
		if err := c.lag(ctx, adm, ttl, fromEnd, found.Topics); err != nil {
			errs = append(errs, fmt.Errorf("the lag of group %s: %w", c.cfg.GroupID, err))
		}
	}
	found.Err = errors.Join(errs...)
	return found
}

// lag sets each horizon's Behind and Stale from the group's committed
// offsets and the topics' offsets (start, end, and the first written at or
// after now − ttl); on an error they stay -1. fromEnd: the group reads a
// partition without a committed offset from its end.
func (c *Consumer) lag(ctx context.Context, adm *kadm.Client, ttl time.Duration, fromEnd bool, hs []consumer.Horizon) error {
	topics := make([]string, len(hs))
	for i, h := range hs {
		topics[i] = h.Topic
	}
	starts, err := adm.ListStartOffsets(ctx, topics...)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return fmt.Errorf("start offsets: %w", err)
	}
	ends, err := adm.ListEndOffsets(ctx, topics...)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return fmt.Errorf("end offsets: %w", err)
	}
	fresh, err := adm.ListOffsetsAfterMilli(ctx, time.Now().Add(-ttl).UnixMilli(), topics...)
	if err == nil {
		err = fresh.Error()
	}
	if err != nil {
		return fmt.Errorf("offsets at now - TTL: %w", err)
	}
	committed, err := adm.FetchOffsets(ctx, c.cfg.GroupID)
	if err == nil {
		err = committed.Error()
	}
	if err != nil {
		return fmt.Errorf("committed offsets: %w", err)
	}
	for i := range hs {
		t := hs[i].Topic
		var parts []horizon.Partition
		for p, end := range ends[t] {
			start, ok1 := starts.Lookup(t, p)
			at, ok2 := fresh.Lookup(t, p)
			if !ok1 || !ok2 {
				return fmt.Errorf("topic %s partition %d: offsets missing", t, p)
			}
			com := int64(-1)
			if o, ok := committed.Lookup(t, p); ok {
				com = o.At
			}
			// ListOffsetsAfterMilli answers the end when every record is
			// older.
			parts = append(parts, horizon.Partition{Start: start.Offset, End: end.Offset, Committed: com, Fresh: at.Offset})
		}
		hs[i].Behind, hs[i].Stale = horizon.Lag(parts, fromEnd)
	}
	return nil
}
