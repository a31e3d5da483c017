package kafkainbox

import (
	"context"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/horizon"
)

// checkHorizon is Run's check at start (consumer.Config.Horizon), asked
// through cl, which dials as the reader's Dialer does (TLS, SASL, dial
// function): the topic's retention and the group's lag against the
// ledger's TTL, and the dead-letter topic's retention. fromEnd says a
// partition without a committed offset is read from its end
// (ReaderConfig.StartOffset kafka.LastOffset).
func (c *Consumer) checkHorizon(ctx context.Context, cl *kafka.Client, fromEnd bool) error {
	pc := c.cfg.Processor
	if pc.Horizon == consumer.HorizonOff {
		return nil
	}
	hctx, cancel := context.WithTimeout(ctx, horizon.Timeout)
	defer cancel()
	found := c.horizon(hctx, cl, horizon.TTL(pc), fromEnd)
	return horizon.Report(ctx, c.Log, pc, horizon.Front{Log: "justonce kafka", Noun: "topic", Group: "group"}, found)
}

// horizonConfigs are the topic settings the horizon is read from.
var horizonConfigs = []string{"cleanup.policy", "retention.ms", "segment.ms", "retention.bytes"}

func (c *Consumer) horizon(ctx context.Context, cl *kafka.Client, ttl time.Duration, fromEnd bool) horizon.Found {
	topics := []string{c.cfg.Topic}
	if !c.UserDL {
		topics = append(topics, c.cfg.DeadLetterTopic)
	}
	req := &kafka.DescribeConfigsRequest{}
	for _, t := range topics {
		req.Resources = append(req.Resources, kafka.DescribeConfigRequestResource{
			ResourceType: kafka.ResourceTypeTopic, ResourceName: t, ConfigNames: horizonConfigs})
	}
	res, err := cl.DescribeConfigs(ctx, req)
	if err != nil {
		return horizon.Found{Err: fmt.Errorf("topic %s: %w", c.cfg.Topic, err)}
	}
	var found horizon.Found
	for _, r := range res.Resources {
		consumed := r.ResourceName == c.cfg.Topic
		if r.Error != nil {
			// A dead-letter topic may not exist yet: it is created at
			// its first dead letter.
			if consumed {
				found.Err = fmt.Errorf("topic %s: %w", r.ResourceName, r.Error)
			}
			continue
		}
		configs := make(map[string]string, len(r.ConfigEntries))
		for _, e := range r.ConfigEntries {
			configs[e.ConfigName] = e.ConfigValue
		}
		h, err := horizon.Kafka(r.ResourceName, configs, ttl)
		switch {
		case err != nil && consumed:
			found.Err = err
		case err != nil:
		case consumed:
			found.Topics = append(found.Topics, h)
		default:
			found.DeadLetters = append(found.DeadLetters, h)
		}
	}
	if len(found.Topics) == 0 {
		if found.Err == nil {
			found.Err = fmt.Errorf("topic %s: the broker did not describe it", c.cfg.Topic)
		}
		return found
	}
	h := &found.Topics[0]
	if h.Behind, h.Stale, err = c.lag(ctx, cl, ttl, fromEnd); err != nil {
		h.Behind, h.Stale = -1, -1
		found.Err = fmt.Errorf("the lag of group %s on topic %s: %w", c.cfg.GroupID, c.cfg.Topic, err)
	}
	return found
}

// lag reads the group's committed offsets and the topic's offsets (start,
// end, and the first written at or after now − ttl) and returns
// horizon.Lag of them.
func (c *Consumer) lag(ctx context.Context, cl *kafka.Client, ttl time.Duration, fromEnd bool) (behind, stale int64, err error) {
	topic := c.cfg.Topic
	md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return 0, 0, err
	}
	switch {
	case len(md.Topics) != 1:
		return 0, 0, fmt.Errorf("metadata: %d topics for %s", len(md.Topics), topic)
	case md.Topics[0].Error != nil:
		return 0, 0, fmt.Errorf("metadata: %w", md.Topics[0].Error)
	}
	ids := make([]int, len(md.Topics[0].Partitions))
	at := time.Now().Add(-ttl)
	reqs := make([]kafka.OffsetRequest, 0, 3*len(ids))
	for i, p := range md.Topics[0].Partitions {
		ids[i] = p.ID
		reqs = append(reqs, kafka.FirstOffsetOf(p.ID), kafka.LastOffsetOf(p.ID), kafka.TimeOffsetOf(p.ID, at))
	}
	listed, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return 0, 0, err
	}
	fetched, err := cl.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: c.cfg.GroupID, Topics: map[string][]int{topic: ids}})
	if err == nil {
		err = fetched.Error
	}
	if err != nil {
		return 0, 0, fmt.Errorf("committed offsets: %w", err)
	}
	committed := map[int]int64{}
	for _, p := range fetched.Topics[topic] {
		if p.Error != nil {
			return 0, 0, fmt.Errorf("committed offset of partition %d: %w", p.Partition, p.Error)
		}
		committed[p.Partition] = p.CommittedOffset
	}
	parts := make([]horizon.Partition, 0, len(ids))
	for _, po := range listed.Topics[topic] {
		if po.Error != nil {
			return 0, 0, fmt.Errorf("offsets of partition %d: %w", po.Partition, po.Error)
		}
		fresh := int64(-1)
		for off := range po.Offsets { // one entry: the offset at the time asked, -1 when none
			fresh = off
		}
		com, ok := committed[po.Partition]
		if !ok {
			com = -1
		}
		parts = append(parts, horizon.Partition{Start: po.FirstOffset, End: po.LastOffset, Committed: com, Fresh: fresh})
	}
	if len(parts) != len(ids) {
		return 0, 0, fmt.Errorf("offsets of %d partitions, %d listed", len(ids), len(parts))
	}
	behind, stale = horizon.Lag(parts, fromEnd)
	return behind, stale, nil
}
