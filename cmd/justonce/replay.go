package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/kafkainbox"
	"github.com/justonce/justonce/natsinbox"
)

const replayHelpCommon = `The command line cannot run your handler (it is your Go code), so this
command is a dry run: it reads the range up to where it stood when the replay
began, asks the ledger which event IDs are already done in the scope, and
reports per partition how many were seen, would be skipped as duplicates,
would run, are recorded failed, or carry no ID. Nothing runs, nothing is
recorded, no consumer group or durable is touched. To run the missing events,
call Replay from Go with your handler (kafkainbox.Consumer.Replay,
natsinbox.Replay); the report has the same shape.`

func replayCommand() *command {
	return &command{
		name:    "replay",
		summary: "dry-run a replay: how many events of a topic or stream would run",
		help:    "replay reports what replaying a Kafka topic or a JetStream stream would run.\n\n" + replayHelpCommon,
		subs: []*command{
			{
				name:    "kafka",
				summary: "dry-run a replay of a Kafka topic",
				help:    "Reads a Kafka topic from --from-offset or --since/--from-time.\n\n" + replayHelpCommon,
				setup:   replayKafka,
			},
			{
				name:    "nats",
				summary: "dry-run a replay of a JetStream stream",
				help:    "Reads a JetStream stream from --from-seq or --since/--from-time.\n\n" + replayHelpCommon,
				setup:   replayNATS,
			},
		},
	}
}

// replayCommon are the flags both transports share.
type replayCommon struct {
	scope, tenant, since, fromTime, idHeaders string
	asJSON                                    bool
}

func addReplayFlags(f *flags) *replayCommon {
	r := &replayCommon{}
	f.StringVar(&r.scope, "scope", "", "ledger `scope` of the consumer (Kafka: its group; NATS: its durable). Required")
	f.StringVar(&r.tenant, "tenant", "", "`tenant` of the keys (all messages)")
	f.StringVar(&r.since, "since", "", "start this long ago (e.g. 24h)")
	f.StringVar(&r.fromTime, "from-time", "", "start at this RFC 3339 `time`")
	f.StringVar(&r.idHeaders, "id-header", "", "comma-separated `headers` holding the event ID (default: the transport's)")
	f.BoolVar(&r.asJSON, "json", false, "print JSON")
	return r
}

func (r *replayCommon) start() (time.Time, error) {
	switch {
	case r.since != "" && r.fromTime != "":
		return time.Time{}, usageErrorf("give --since or --from-time, not both")
	case r.since != "":
		d, err := time.ParseDuration(r.since)
		if err != nil || d <= 0 {
			return time.Time{}, usageErrorf("--since: want a positive duration like 24h")
		}
		return time.Now().Add(-d), nil
	case r.fromTime != "":
		t, err := time.Parse(time.RFC3339, r.fromTime)
		if err != nil {
			return time.Time{}, usageErrorf("--from-time: want RFC 3339, e.g. 2026-11-20T00:00:00Z")
		}
		return t, nil
	}
	return time.Time{}, nil
}

func (r *replayCommon) processor(ctx context.Context, db *dbFlags, def consumer.IDFunc) (*consumer.Processor, func(), error) {
	if r.scope == "" {
		return nil, nil, usageErrorf("--scope is required")
	}
	l, done, err := db.ledger(ctx, nil)
	if err != nil {
		return nil, nil, err
	}
	id := def
	if r.idHeaders != "" {
		id = consumer.HeaderID(strings.Split(r.idHeaders, ",")...)
	}
	cfg := consumer.Config{Ledger: l, Scope: r.scope, ID: id}
	if r.tenant != "" {
		cfg.Tenant = func(*consumer.Message) string { return r.tenant }
	}
	p, err := consumer.New(cfg, func(context.Context, pgx.Tx, *consumer.Message) error {
		return errors.New("justonce: the command line does not run handlers")
	})
	if err != nil {
		done()
		return nil, nil, err
	}
	return p, done, nil
}

func (r *replayCommon) report(a *app, rep consumer.ReplayReport) error {
	if r.asJSON {
		return writeJSON(a.stdout, rep)
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tFIRST\tLAST\tSEEN\tSKIPPED\tWOULD RUN\tFAILED\tNO ID")
	for _, p := range rep.Partitions {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", p.Partition, p.First, p.Last, p.Seen, p.Skipped, p.Ran, p.Failed, p.NoID)
	}
	t := rep.Total
	fmt.Fprintf(tw, "total\t\t\t%d\t%d\t%d\t%d\t%d\n", t.Seen, t.Skipped, t.Ran, t.Failed, t.NoID)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout, rep)
	return nil
}

func progress(a *app) func(consumer.ReplayReport) {
	return func(r consumer.ReplayReport) { fmt.Fprintf(a.stderr, "replay: %s\n", r) }
}

func replayKafka(f *flags) runFunc {
	db := addDBFlags(f)
	rc := addReplayFlags(f)
	var brokers, topic string
	var fromOffset int64
	f.stringEnv(&brokers, "brokers", "KAFKA_BROKERS", "comma-separated Kafka `brokers`")
	f.StringVar(&topic, "topic", "", "`topic` to replay. Required")
	f.Int64Var(&fromOffset, "from-offset", 0, "first `offset` of every partition (default: the oldest kept)")
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if brokers == "" || topic == "" {
			return usageErrorf("--brokers and --topic are required")
		}
		start, err := rc.start()
		if err != nil {
			return err
		}
		p, done, err := rc.processor(ctx, db, kafkainbox.DefaultID)
		if err != nil {
			return err
		}
		defer done()
		rep, err := kafkainbox.Replay(ctx, kafkainbox.ReplayConfig{Brokers: strings.Split(brokers, ","), Topic: topic,
			StartOffset: fromOffset, StartTime: start}, p, consumer.ReplayOptions{DryRun: true, Progress: progress(a)})
		if err != nil {
			return fmt.Errorf("replay kafka: %w", err)
		}
		return rc.report(a, rep)
	}
}

func replayNATS(f *flags) runFunc {
	db := addDBFlags(f)
	rc := addReplayFlags(f)
	var url, stream, subject string
	var fromSeq uint64
	f.stringEnv(&url, "nats-url", "NATS_URL", "NATS server `URL`")
	f.StringVar(&stream, "stream", "", "JetStream `stream` to replay. Required")
	f.StringVar(&subject, "subject", "", "only this `subject` (filter)")
	f.Uint64Var(&fromSeq, "from-seq", 0, "first stream `sequence` (default: the oldest kept)")
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if url == "" || stream == "" {
			return usageErrorf("--nats-url and --stream are required")
		}
		start, err := rc.start()
		if err != nil {
			return err
		}
		p, done, err := rc.processor(ctx, db, natsinbox.DefaultID)
		if err != nil {
			return err
		}
		defer done()
		nc, err := nats.Connect(url, nats.Timeout(10*time.Second))
		if err != nil {
			return fmt.Errorf("cannot reach NATS at %s: %w", url, err)
		}
		defer nc.Close()
		cfg := natsinbox.ReplayConfig{Conn: nc, Stream: stream, StartSeq: fromSeq, StartTime: start}
		if subject != "" {
			cfg.FilterSubjects = []string{subject}
		}
		rep, err := natsinbox.Replay(ctx, cfg, p, consumer.ReplayOptions{DryRun: true, Progress: progress(a)})
		if err != nil {
			return fmt.Errorf("replay nats: %w", err)
		}
		return rc.report(a, rep)
	}
}
