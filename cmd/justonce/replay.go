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
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

const replayHelpCommon = `The command line cannot run your handler (it is your Go code), so this
command is a dry run: it reads the range up to where it stood when the replay
began, asks the ledger which event IDs are already done in the scope, and
reports per partition how many were seen, would be skipped as duplicates,
would run, are recorded failed, or carry no ID. Nothing runs, nothing is
recorded, no consumer group or durable is touched. To run the missing events,
call Replay from Go with your handler (kafkainbox.Consumer.Replay,
natsinbox.Replay); its report counts the same things.`

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
	transport                                 string
	scope, tenant, since, fromTime, idHeaders string
	asJSON                                    *bool
	f                                         *flags
}

func addReplayFlags(f *flags, transport string) *replayCommon {
	r := &replayCommon{transport: transport, f: f}
	f.StringVar(&r.scope, "scope", "", "ledger `scope` of the consumer (Kafka: its group; NATS: its durable); required")
	f.StringVar(&r.tenant, "tenant", "", "`tenant` of the keys (all messages); empty: no tenant")
	f.StringVar(&r.since, "since", "", "start this long ago, a `duration` such as 24h; empty: no start time")
	f.StringVar(&r.fromTime, "from-time", "", "start at this RFC 3339 `time`, e.g. 2026-11-20T00:00:00Z; empty: no start time")
	f.StringVar(&r.idHeaders, "id-header", "", "comma-separated `headers` holding the event ID; empty: the transport's default")
	r.asJSON = f.jsonFlag()
	return r
}

// start is the start time the flags ask for, zero for none. position is
// the name of the transport's start position flag, which excludes a time.
func (r *replayCommon) start(position string) (time.Time, error) {
	if (r.since != "" || r.fromTime != "") && r.f.isSet(position) {
		return time.Time{}, usageErrorf("give --%s or a start time (--since, --from-time), not both", position)
	}
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

// replayJSON is replay kafka --json and replay nats --json.
type replayJSON struct {
	Transport  string             `json:"transport"` // "kafka" or "nats"
	Scope      string             `json:"scope"`
	DryRun     bool               `json:"dry_run"` // always true on the command line
	Partitions []replayCountsJSON `json:"partitions"`
	Total      replayTotalJSON    `json:"total"`
	Took       float64            `json:"took_seconds"`
}

// replayCountsJSON counts one partition (NATS: the stream, partition 0).
type replayCountsJSON struct {
	Partition int `json:"partition"`
	// First and Last: the first and last offset (Kafka) or stream
	// sequence (NATS) read.
	First int64 `json:"first"`
	Last  int64 `json:"last"`
	replayTotalJSON
}

type replayTotalJSON struct {
	Seen     int64 `json:"seen"`
	Skipped  int64 `json:"skipped"`   // done already: duplicates
	WouldRun int64 `json:"would_run"` // not in the ledger
	Failed   int64 `json:"failed"`    // recorded failed
	NoID     int64 `json:"no_id"`     // carry no event ID
}

func replayTotal(p consumer.PartitionReport) replayTotalJSON {
	return replayTotalJSON{Seen: p.Seen, Skipped: p.Skipped, WouldRun: p.Ran, Failed: p.Failed, NoID: p.NoID}
}

func (r *replayCommon) report(a *app, rep consumer.ReplayReport) error {
	if *r.asJSON {
		out := replayJSON{Transport: r.transport, Scope: r.scope, DryRun: rep.DryRun,
			Partitions: []replayCountsJSON{}, Total: replayTotal(rep.Total), Took: seconds(rep.Took)}
		for _, p := range rep.Partitions {
			out.Partitions = append(out.Partitions, replayCountsJSON{p.Partition, p.First, p.Last, replayTotal(p)})
		}
		return writeJSON(a.stdout, out)
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
	rc := addReplayFlags(f, "kafka")
	var brokers, topic string
	var fromOffset int64
	f.stringEnv(&brokers, "brokers", "KAFKA_BROKERS", "comma-separated Kafka `brokers` (host:port,...)")
	f.StringVar(&topic, "topic", "", "`topic` to replay; required")
	f.Int64Var(&fromOffset, "from-offset", 0, "first `offset` of every partition; 0: the oldest the topic keeps")
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if brokers == "" || topic == "" {
			return usageErrorf("--brokers and --topic are required")
		}
		if fromOffset < 0 {
			return usageErrorf("--from-offset must not be negative")
		}
		start, err := rc.start("from-offset")
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
	rc := addReplayFlags(f, "nats")
	var url, stream, subject string
	var fromSeq uint64
	f.stringEnv(&url, "nats-url", "NATS_URL", "NATS server `URL`, e.g. nats://127.0.0.1:4222")
	f.StringVar(&stream, "stream", "", "JetStream `stream` to replay; required")
	f.StringVar(&subject, "subject", "", "only this `subject` (a filter); empty: every subject of the stream")
	f.Uint64Var(&fromSeq, "from-seq", 0, "first stream `sequence`; 0: the oldest the stream keeps")
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if url == "" || stream == "" {
			return usageErrorf("--nats-url and --stream are required")
		}
		start, err := rc.start("from-seq")
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
