package main

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/justonce/justonce/outbox"
)

func outboxCommand() *command {
	return &command{
		name:    "outbox",
		summary: "inspect the transactional outbox, retry or purge failed messages",
		help: `outbox inspects the outbox table (package outbox): the messages transactions
added, waiting for a relay to publish them, and those a broker refused for good.`,
		subs: []*command{
			{
				name:    "stats",
				summary: "pending and failed messages, and the age of the oldest pending one",
				help: `Counts the pending messages (waiting for a relay) and the failed ones (refused
by their broker for good: too large, unknown topic, no stream for the subject).
A pending message that keeps getting older means no relay runs, or its broker
fails for the time being (the relay logs why). Counting scans the table's
indexes.`,
				setup: outboxStats,
			},
			{
				name:    "failed",
				summary: "the failed messages with their errors, oldest first",
				help: `Lists the messages a broker refused for good, oldest first, with the broker's
error. Fix the cause (create the topic or the stream, raise the size limit),
then 'justonce outbox retry'; or drop them with 'justonce outbox purge'.`,
				setup: outboxFailed,
			},
			{
				name:    "retry",
				summary: "put failed messages back in the queue",
				args:    "[<id>...]",
				help: `Puts the failed messages with the given IDs, or with --all every failed
message, back in the queue; the relays are woken and publish them. A retried
message goes back to its place in its lane, before the newer messages still
pending there; newer messages of its key that were published meanwhile stay
ahead of it.`,
				setup: outboxRetry,
			},
			{
				name:    "purge",
				summary: "delete failed messages",
				args:    "[<id>...]",
				help: `Deletes failed messages: those with the given IDs, or with --all every failed
message; with --older-than only those that failed at least that long ago.
Pending messages are never purged: the relay deletes each message once its
broker acked it. --failed is required, to say so.`,
				setup: outboxPurge,
			},
		},
	}
}

// outbox opens the outbox on the configured schema.
func (d *dbFlags) outbox(ctx context.Context) (*outbox.Outbox, func(), error) {
	pool, err := d.pool(ctx)
	if err != nil {
		return nil, nil, err
	}
	o, err := outbox.New(pool, outbox.Config{Schema: d.schema})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return o, pool.Close, nil
}

// outboxStatsJSON is outbox stats --json.
type outboxStatsJSON struct {
	Pending                 int64      `json:"pending"`
	Failed                  int64      `json:"failed"`
	LanesPending            int64      `json:"lanes_pending"`
	OldestPendingAt         *time.Time `json:"oldest_pending_at"`
	OldestPendingAgeSeconds *float64   `json:"oldest_pending_age_seconds"`
	OldestFailedAt          *time.Time `json:"oldest_failed_at"`
}

func outboxStats(f *flags) runFunc {
	db := addDBFlags(f)
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		o, done, err := db.outbox(ctx)
		if err != nil {
			return err
		}
		defer done()
		st, err := o.Stats(ctx)
		if err != nil {
			return err
		}
		if *asJSON {
			out := outboxStatsJSON{Pending: st.Pending, Failed: st.Failed, LanesPending: st.Lanes,
				OldestPendingAt: timePtr(st.OldestPending), OldestFailedAt: timePtr(st.OldestFailed)}
			if !st.OldestPending.IsZero() {
				s := seconds(st.OldestPendingAge)
				out.OldestPendingAgeSeconds = &s
			}
			return writeJSON(a.stdout, out)
		}
		fmt.Fprintf(a.stdout, "pending: %d %s in %d %s\n", st.Pending, plural(st.Pending, "message", "messages"), st.Lanes, plural(st.Lanes, "lane", "lanes"))
		if st.Pending > 0 {
			fmt.Fprintf(a.stdout, "oldest pending: added %s (%s ago)\n", timeText(st.OldestPending), roundDuration(st.OldestPendingAge))
		}
		fmt.Fprintf(a.stdout, "failed: %d %s\n", st.Failed, plural(st.Failed, "message", "messages"))
		if st.Failed > 0 {
			fmt.Fprintln(a.stdout, "see 'justonce outbox failed'; after fixing the cause, 'justonce outbox retry --all'")
		}
		return nil
	}
}

// outboxFailedJSON is outbox failed --json.
type outboxFailedJSON struct {
	Messages []failedMessageJSON `json:"messages"`
}

type failedMessageJSON struct {
	ID        string    `json:"id"`
	Broker    string    `json:"broker"`
	Topic     string    `json:"topic"`
	Attempts  int       `json:"attempts"`
	Error     string    `json:"error"`
	CreatedAt time.Time `json:"created_at"`
	FailedAt  time.Time `json:"failed_at"`
}

func outboxFailed(f *flags) runFunc {
	db := addDBFlags(f)
	limit := f.Int("limit", 100, "most `messages` to list; 0: all")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if *limit < 0 {
			return usageErrorf("--limit must not be negative")
		}
		o, done, err := db.outbox(ctx)
		if err != nil {
			return err
		}
		defer done()
		ms, err := o.Failed(ctx, *limit)
		if err != nil {
			return err
		}
		if *asJSON {
			out := outboxFailedJSON{Messages: []failedMessageJSON{}}
			for _, m := range ms {
				out.Messages = append(out.Messages, failedMessageJSON{m.ID, string(m.Broker), m.Topic, m.Attempts, m.Error, m.CreatedAt.UTC(), m.FailedAt.UTC()})
			}
			return writeJSON(a.stdout, out)
		}
		if len(ms) == 0 {
			fmt.Fprintln(a.stdout, "no failed messages")
			return nil
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tBROKER\tTOPIC\tFAILED\tERROR")
		for _, m := range ms {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", printable(m.ID), m.Broker, printable(m.Topic), timeText(m.FailedAt), printable(m.Error))
		}
		return tw.Flush()
	}
}

// outboxRetryJSON is outbox retry --json.
type outboxRetryJSON struct {
	Retried int64 `json:"retried"`
}

func outboxRetry(f *flags) runFunc {
	db := addDBFlags(f)
	all := f.Bool("all", false, "retry every failed message (instead of naming IDs)")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		switch {
		case len(args) == 0 && !*all:
			return usageErrorf("say what to retry: message IDs, or --all")
		case len(args) > 0 && *all:
			return usageErrorf("give message IDs or --all, not both")
		}
		o, done, err := db.outbox(ctx)
		if err != nil {
			return err
		}
		defer done()
		n, err := o.Retry(ctx, args...)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(a.stdout, outboxRetryJSON{n})
		}
		fmt.Fprintf(a.stdout, "put %d failed %s back in the queue\n", n, plural(n, "message", "messages"))
		return nil
	}
}

// outboxPurgeJSON is outbox purge --json.
type outboxPurgeJSON struct {
	Deleted int64 `json:"deleted"`
}

func outboxPurge(f *flags) runFunc {
	db := addDBFlags(f)
	failed := f.Bool("failed", false, "delete failed messages (required: pending ones are never purged)")
	all := f.Bool("all", false, "purge every failed message (instead of naming IDs)")
	olderThan := f.Duration("older-than", 0, "only messages that failed at least this long ago")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		switch {
		case !*failed:
			return usageErrorf("say what to purge: --failed (the only messages purge deletes are failed ones)")
		case len(args) == 0 && !*all:
			return usageErrorf("say which failed messages to purge: message IDs, or --all")
		case len(args) > 0 && *all:
			return usageErrorf("give message IDs or --all, not both")
		}
		if *olderThan < 0 {
			return usageErrorf("--older-than must not be negative")
		}
		o, done, err := db.outbox(ctx)
		if err != nil {
			return err
		}
		defer done()
		n, err := o.Purge(ctx, outbox.PurgeOptions{IDs: args, OlderThan: *olderThan})
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(a.stdout, outboxPurgeJSON{n})
		}
		fmt.Fprintf(a.stdout, "deleted %d failed %s\n", n, plural(n, "message", "messages"))
		return nil
	}
}
