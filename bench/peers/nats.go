package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// natsAckWait is the JetStream ack wait of every NATS peer's durable: how
// long the server waits for an ack before it delivers a message again. A
// SIGKILLed consumer's messages come again after it, so the crash phase
// waits it out. It is the one setting changed from each peer's defaults
// (30 s), the same for the three.
const natsAckWait = 10 * time.Second

// startNATS starts an embedded NATS server with JetStream (file storage
// in a directory of its own, on a free loopback port) unless PEERS_NATS_URL
// names one, and returns its URL and how to stop it.
func startNATS() (url string, stop func(), err error) {
	if u := os.Getenv("PEERS_NATS_URL"); u != "" {
		return u, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "peers-nats-")
	if err != nil {
		return "", nil, err
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoSigs: true})
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("nats server: %w", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		os.RemoveAll(dir)
		return "", nil, errors.New("nats server: not ready after 10 s")
	}
	return s.ClientURL(), func() { s.Shutdown(); s.WaitForShutdown(); os.RemoveAll(dir) }, nil
}

// produceNATS creates the stream name (file storage, one subject of the
// same name) and publishes the events to it, with the event ID in the
// event-id header and as Watermill's message UUID. No Nats-Msg-Id: the
// stream would drop the duplicates at publish (its dedupe window), and the
// workload's duplicates are deliveries the consumers must absorb, as a
// producer's retries after a lost ack are.
func produceNATS(ctx context.Context, url, name string, events []event) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return fmt.Errorf("connect to nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name}, Storage: jetstream.FileStorage}); err != nil {
		return fmt.Errorf("create stream %s: %w", name, err)
	}
	const chunk = 1000
	for i := 0; i < len(events); i += chunk {
		var acks []jetstream.PubAckFuture
		for _, e := range events[i:min(i+chunk, len(events))] {
			m := &nats.Msg{Subject: name, Data: payload(e), Header: nats.Header{
				idHeader: []string{e.ID}, wnats.WatermillUUIDHdr: []string{e.ID}}}
			f, err := js.PublishMsgAsync(m)
			if err != nil {
				return fmt.Errorf("publish to %s: %w", name, err)
			}
			acks = append(acks, f)
		}
		for _, f := range acks {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return fmt.Errorf("publish to %s: %w", name, err)
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(30 * time.Second):
				return fmt.Errorf("publish to %s: no ack after 30 s", name)
			}
		}
	}
	return nil
}

// deleteStream removes a lane's stream (and its consumers).
func deleteStream(ctx context.Context, url, name string) {
	nc, err := nats.Connect(url)
	if err != nil {
		return
	}
	defer nc.Close()
	if js, err := jetstream.New(nc); err == nil {
		_ = js.DeleteStream(ctx, name)
	}
}

// atRiskNATS counts the deliveries a restarted consumer gets again although
// their effect is there: the events past the durable's ack floor (the
// messages not all acked below it) whose ID has an effect. The streams'
// sequences are the events' positions, from 1.
func atRiskNATS(ctx context.Context, url, stream, durable string, events []event, done map[string]bool) (int, error) {
	nc, err := nats.Connect(url)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	// The older API: Watermill's durable is a push consumer, which the
	// jetstream package's Consumer refuses.
	js, err := nc.JetStream(nats.Context(ctx))
	if err != nil {
		return 0, err
	}
	info, err := js.ConsumerInfo(stream, durable)
	if err != nil {
		return 0, fmt.Errorf("consumer %s: %w", durable, err)
	}
	n := 0
	for i, e := range events {
		if uint64(i+1) > info.AckFloor.Stream && done[e.ID] {
			n++
		}
	}
	return n, nil
}

// consumeJustonceNATS: natsinbox.Consumer on the stream with its defaults
// (Concurrency 1, batches of up to 50 of the messages pulled), but
// AckWait (natsAckWait). The ledger row and the effect commit in one
// transaction; each message is acked after it.
func consumeJustonceNATS(ctx context.Context, a childArgs) error {
	nc, err := nats.Connect(a.natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	ledger, err := inbox.New(a.pool, inbox.Config{})
	if err != nil {
		return err
	}
	c, err := natsinbox.New(natsinbox.Config{
		Conn:      nc,
		Stream:    a.topic,
		Durable:   a.group,
		AckWait:   natsAckWait,
		Processor: consumer.Config{Ledger: ledger},
	}, a.effect)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// consumeHandwrittenNATS is the hand-written inbox (handwrittenOnce) on a
// JetStream pull consumer: one message at a time, acked after its
// transaction commits, a failed one retried in place.
func consumeHandwrittenNATS(ctx context.Context, a childArgs) error {
	nc, err := nats.Connect(a.natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, a.topic, jetstream.ConsumerConfig{
		Durable: a.group, AckPolicy: jetstream.AckExplicitPolicy, AckWait: natsAckWait, DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fmt.Errorf("durable %s: %w", a.group, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); it.Stop() }()
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil
			}
			return fmt.Errorf("next: %w", err)
		}
		id := m.Headers().Get(idHeader)
		for {
			err = handwrittenOnce(ctx, a.pool, id, a.fail)
			if err == nil || ctx.Err() != nil {
				break
			}
			time.Sleep(100 * time.Millisecond) // retry the message in place
		}
		if ctx.Err() != nil {
			return nil
		}
		if err := m.Ack(); err != nil && ctx.Err() == nil {
			return fmt.Errorf("ack: %w", err)
		}
	}
}

// consumeWatermillNATS: Watermill's router with watermill-nats's
// subscriber in JetStream mode, the one its documentation recommends
// (a durable push subscription from the first message, explicit acks,
// each ack a round trip), with the Deduplicator middleware. The effect is
// its own statement on the pool.
func consumeWatermillNATS(ctx context.Context, a childArgs) error {
	nc, err := nats.Connect(a.natsURL)
	if err != nil {
		return err
	}
	sub, err := wnats.NewSubscriberWithNatsConn(nc, wnats.SubscriberSubscriptionConfig{
		Unmarshaler:    &wnats.NATSMarshaler{},
		AckWaitTimeout: natsAckWait,
		JetStream: wnats.JetStreamConfig{
			DurablePrefix:    a.group,
			SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit(), nats.AckWait(natsAckWait)},
		},
	}, watermill.NopLogger{})
	if err != nil {
		nc.Close()
		return err
	}
	return runRouter(ctx, sub, a.topic, func(msg *message.Message) error {
		if err := a.fail.fail(msg.Metadata.Get(idHeader)); err != nil {
			return err
		}
		_, err := a.pool.Exec(msg.Context(), effectSQL, msg.Metadata.Get(idHeader))
		return err
	})
}
