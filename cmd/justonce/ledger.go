package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/justonce/justonce/inbox"
)

// cliMaxKeyLen is the key part limit the CLI accepts: larger than any
// application's inbox.Config.MaxKeyLen, so every stored key can be named.
const cliMaxKeyLen = 1 << 16

func ledgerCommand() *command {
	return &command{
		name:    "ledger",
		summary: "inspect and repair processed_events",
		help:    "ledger inspects the processed_events table and repairs stuck keys.",
		subs: []*command{
			{
				name:    "stats",
				summary: "live rows by scope and status, and the oldest in-flight lease",
				help: `Counts the live (unexpired) rows of each scope and status. For rows still
processing (lease mode) it shows the earliest lease end: a lease that ran out
long ago is a stuck key, which the next delivery takes over, or which
'justonce ledger release' frees. Counting scans the table.`,
				setup: ledgerStats,
			},
			{
				name:    "show",
				summary: "one key: status, source, attempts, lease, timestamps, result, steps",
				args:    "<scope> <id>",
				help: `Shows the live row of one key. The event ID is masked (550e****0000) unless
--reveal is given: an Idempotency-Key may be all a client needs to replay a
stored response. The stored response body is never printed, only its size.
Exits 3 when the key has no live row (absent or expired).

A key run in steps (inbox.Ledger.DoSteps) also shows its recorded steps, in
order: name, kind (tx, call, compensate, failed), when each completed, the
size of its output and the fencing token of the lease that recorded it, and
where the key stopped: a key still processing resumes after its last step.

Put "--" before an ID that starts with a dash.`,
				setup: ledgerShow,
			},
			{
				name:    "release",
				summary: "free a stuck key, so that the next delivery or request runs again",
				args:    "<scope> <id>",
				help: `Deletes the key's row whatever its state, and its recorded steps (a key run
in steps), so the key is new again: the next
delivery of the event, or the next request with the Idempotency-Key, runs the
handler again. Use it for a key stuck in processing, or a failed key whose
cause was fixed. Without --force, a key that is done is refused (releasing it
lets its effect happen twice), and so is a key whose lease still runs (its
handler may be running: releasing it lets a second run start beside it).
The state is checked again as the row is deleted, so a key that completes
while the command runs is not released.

When the application uses the Redis replay cache, give --redis-url (and
--redis-prefix if it sets one) so that the cached result is dropped too;
otherwise a cached result may still be replayed until it expires there.
Without --redis-prefix the key is dropped under both default prefixes,
"justonce:" and "justonce:<schema>:" (the application uses the first when it
reaches its schema through search_path, the second when it names it in
inbox.Config.Schema).
With --redis-url nothing is released while Redis does not answer.

The output says what happened to the row (released, or no row) and to the
cache (invalidated; not checked, without --redis-url; or not invalidated).
Exits 3 when there is no row for the key, and 4 when the row was released
but the cached result could not be deleted from Redis (run the command again
once Redis answers).`,
				setup: ledgerRelease,
			},
			{
				name:    "purge",
				summary: "delete expired rows in small batches",
				help: `Deletes rows whose retention ran out, batch after batch, until none are left.
Rows whose lease still runs and rows another transaction holds are skipped.
Only one instance purges at a time (the janitor's advisory lock): if another
holds it, nothing is deleted and the command says so (exit code 0).
Applications that run the janitor (inbox.Ledger.RunJanitor) need no cron job.`,
				setup: ledgerPurge,
			},
		},
	}
}

// printable quotes s when it holds characters that would break a line or a
// table (tabs, newlines, other control characters).
func printable(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

// keyText names a key for output, its ID masked unless reveal.
func keyText(k inbox.Key, reveal bool) string {
	id := inbox.Mask(k.ID)
	if reveal {
		id = k.ID
	}
	return printable(k.Scope) + "/" + printable(k.Tenant) + "/" + printable(id)
}

// keyArg reads <scope> <id> and --tenant into a Key.
func keyArg(args []string, tenant string) (inbox.Key, error) {
	if err := wantArgs(args, "<scope>", "<id>"); err != nil {
		return inbox.Key{}, err
	}
	k := inbox.Key{Scope: args[0], Tenant: tenant, ID: args[1]}
	if err := k.Validate(cliMaxKeyLen); err != nil {
		return k, usageErrorf("%v", err)
	}
	return k, nil
}

// statsJSON is ledger stats --json.
type statsJSON struct {
	Rows        []statsRowJSON   `json:"rows"`
	TotalRows   int64            `json:"total_rows"`
	OldestLease *oldestLeaseJSON `json:"oldest_in_flight_lease"`
}

type statsRowJSON struct {
	Scope            string     `json:"scope"`
	Status           string     `json:"status"`
	Rows             int64      `json:"rows"`
	OldestLeaseUntil *time.Time `json:"oldest_lease_until"`
}

type oldestLeaseJSON struct {
	Scope      string    `json:"scope"`
	LeaseUntil time.Time `json:"lease_until"`
	// OverdueSeconds is how long ago the lease ran out; negative while it
	// still runs.
	OverdueSeconds float64 `json:"overdue_seconds"`
}

func ledgerStats(f *flags) runFunc {
	db := addDBFlags(f)
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		l, done, err := db.ledger(ctx, nil)
		if err != nil {
			return err
		}
		defer done()
		st, err := l.Stats(ctx)
		if err != nil {
			return err
		}
		now := time.Now()
		var total int64
		var oldest *inbox.ScopeStats
		for i, s := range st {
			total += s.Rows
			if s.Status == inbox.StatusProcessing && !s.OldestLease.IsZero() &&
				(oldest == nil || s.OldestLease.Before(oldest.OldestLease)) {
				oldest = &st[i]
			}
		}
		if *asJSON {
			out := statsJSON{Rows: []statsRowJSON{}, TotalRows: total}
			for _, s := range st {
				out.Rows = append(out.Rows, statsRowJSON{s.Scope, string(s.Status), s.Rows, timePtr(s.OldestLease)})
			}
			if oldest != nil {
				out.OldestLease = &oldestLeaseJSON{oldest.Scope, oldest.OldestLease.UTC(), seconds(now.Sub(oldest.OldestLease))}
			}
			return writeJSON(a.stdout, out)
		}
		if len(st) == 0 {
			fmt.Fprintln(a.stdout, "no live rows")
			return nil
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SCOPE\tSTATUS\tROWS\tOLDEST LEASE")
		scopes := map[string]bool{}
		for _, s := range st {
			scopes[s.Scope] = true
			lease := "-"
			if s.Status == inbox.StatusProcessing {
				lease = leaseText(s.OldestLease, now)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", printable(s.Scope), s.Status, s.Rows, lease)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(a.stdout, "\n%d live %s in %d %s\n", total, plural(total, "row", "rows"), len(scopes), plural(int64(len(scopes)), "scope", "scopes"))
		if oldest == nil {
			fmt.Fprintln(a.stdout, "oldest in-flight lease: none")
		} else {
			fmt.Fprintf(a.stdout, "oldest in-flight lease: scope %s, %s\n", printable(oldest.Scope), leaseText(oldest.OldestLease, now))
		}
		return nil
	}
}

// recordJSON is ledger show --json.
type recordJSON struct {
	Scope  string `json:"scope"`
	Tenant string `json:"tenant"` // "": no tenant
	ID     string `json:"id"`
	// IDMasked: ID is masked (no --reveal).
	IDMasked      bool       `json:"id_masked"`
	Status        string     `json:"status"`
	Source        *string    `json:"source"`
	Principal     *string    `json:"principal"`
	Attempts      int        `json:"attempts"`
	FencingToken  int64      `json:"fencing_token"`
	LeaseOwner    *string    `json:"lease_owner"`
	LeaseUntil    *time.Time `json:"lease_until"`
	CreatedAt     *time.Time `json:"created_at"`
	CompletedAt   *time.Time `json:"completed_at"`
	ExpiresAt     *time.Time `json:"expires_at"`
	Duration      *float64   `json:"duration_seconds"`
	ResultCode    *int       `json:"result_code"`
	ResultHeaders int        `json:"result_headers"`
	ResultBytes   int        `json:"result_body_bytes"`
	Fingerprint   *string    `json:"fingerprint"` // hex
	Error         *string    `json:"error"`
	// Steps: the key's recorded steps, in order; empty for a key not run
	// in steps.
	Steps []stepJSON `json:"steps"`
	// LastStep: the name of the last recorded step; null when none.
	LastStep *string `json:"last_step"`
}

// stepJSON is one recorded step in ledger show --json.
type stepJSON struct {
	Seq          int        `json:"seq"`
	Name         string     `json:"name"`
	Kind         string     `json:"kind"`
	CompletedAt  *time.Time `json:"completed_at"`
	OutputBytes  int        `json:"output_bytes"`
	FencingToken int64      `json:"fencing_token"`
}

// stepsText says how far a key run in steps got.
func stepsText(rec *inbox.Record, steps []inbox.Step) string {
	if len(steps) == 0 {
		return "none"
	}
	last := steps[len(steps)-1]
	text := fmt.Sprintf("%d recorded, the last %s (%s)", len(steps), stepName(last.Name), last.Kind)
	for _, st := range steps {
		if st.Kind == inbox.StepFailed {
			text += fmt.Sprintf("; failed permanently at step %s", stepName(st.Name))
		}
	}
	switch rec.Status {
	case inbox.StatusProcessing:
		text += ": stopped there, the next attempt resumes after it"
	case inbox.StatusDone:
		text += ": completed"
	}
	return text
}

// stepName prints a step's name; a failure outside any step has none.
func stepName(name string) string {
	if name == "" {
		return "-"
	}
	return printable(name)
}

func ledgerShow(f *flags) runFunc {
	db := addDBFlags(f)
	tenant := f.String("tenant", "", "`tenant` of the key; empty: no tenant")
	reveal := f.Bool("reveal", false, "print the event ID in full instead of masked")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		k, err := keyArg(args, *tenant)
		if err != nil {
			return err
		}
		l, done, err := db.ledger(ctx, nil)
		if err != nil {
			return err
		}
		defer done()
		rec, err := l.Lookup(ctx, k)
		if errors.Is(err, inbox.ErrNotFound) {
			return notFoundErrorf("no live row for key %s", keyText(k, *reveal))
		}
		if err != nil {
			return err
		}
		steps, err := l.Steps(ctx, k)
		if err != nil {
			return err
		}
		id := inbox.Mask(rec.ID)
		if *reveal {
			id = rec.ID
		}
		if *asJSON {
			out := recordJSON{
				Scope: rec.Scope, Tenant: rec.Tenant, ID: id, IDMasked: !*reveal,
				Status: string(rec.Status), Source: strPtr(string(rec.Source)), Principal: strPtr(rec.Principal),
				Attempts: rec.Attempts, FencingToken: rec.FencingToken,
				LeaseOwner: strPtr(rec.LeaseOwner), LeaseUntil: timePtr(rec.LeaseUntil),
				CreatedAt: timePtr(rec.CreatedAt), CompletedAt: timePtr(rec.CompletedAt), ExpiresAt: timePtr(rec.ExpiresAt),
				ResultHeaders: len(rec.Result.Header), ResultBytes: len(rec.Result.Body),
				Fingerprint: strPtr(hex.EncodeToString(rec.Fingerprint)), Error: strPtr(rec.Error),
				Steps: []stepJSON{},
			}
			for _, st := range steps {
				out.Steps = append(out.Steps, stepJSON{st.Seq, st.Name, string(st.Kind), timePtr(st.CompletedAt), len(st.Output), st.Token})
			}
			if len(steps) > 0 {
				last := steps[len(steps)-1].Name
				out.LastStep = &last
			}
			if rec.Duration > 0 {
				d := seconds(rec.Duration)
				out.Duration = &d
			}
			if rec.Result.Code != 0 {
				code := rec.Result.Code
				out.ResultCode = &code
			}
			return writeJSON(a.stdout, out)
		}
		now := time.Now()
		dash := func(s string) string {
			if s == "" {
				return "-"
			}
			return printable(s)
		}
		when := func(t time.Time) string {
			if t.IsZero() {
				return "-"
			}
			return timeText(t) + " (" + relative(t, now) + ")"
		}
		idNote := ""
		if !*reveal {
			idNote = " (masked; --reveal prints it)"
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		line := func(name, value string) { fmt.Fprintf(tw, "%s:\t%s\n", name, value) }
		line("scope", printable(rec.Scope))
		line("tenant", dash(rec.Tenant))
		line("id", printable(id)+idNote)
		line("status", string(rec.Status))
		line("source", dash(string(rec.Source)))
		line("principal", dash(rec.Principal))
		line("attempts", strconv.Itoa(rec.Attempts))
		line("fencing token", strconv.FormatInt(rec.FencingToken, 10))
		line("lease owner", dash(rec.LeaseOwner))
		line("lease until", leaseText(rec.LeaseUntil, now))
		line("created", when(rec.CreatedAt))
		line("completed", when(rec.CompletedAt))
		line("expires", when(rec.ExpiresAt))
		duration := "-"
		if rec.Duration > 0 {
			duration = rec.Duration.String()
		}
		line("duration", duration)
		code := "-"
		if rec.Result.Code != 0 {
			code = strconv.Itoa(rec.Result.Code)
		}
		line("result code", code)
		line("result size", fmt.Sprintf("%d bytes, %d headers", len(rec.Result.Body), len(rec.Result.Header)))
		line("fingerprint", dash(hex.EncodeToString(rec.Fingerprint)))
		line("error", dash(rec.Error))
		line("steps", stepsText(rec, steps))
		if err := tw.Flush(); err != nil || len(steps) == 0 {
			return err
		}
		fmt.Fprintln(a.stdout)
		tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SEQ\tSTEP\tKIND\tCOMPLETED\tOUTPUT\tTOKEN")
		for _, st := range steps {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d bytes\t%d\n", st.Seq, stepName(st.Name), st.Kind, when(st.CompletedAt), len(st.Output), st.Token)
		}
		return tw.Flush()
	}
}

// Cache states of a release, as printed.
const (
	cacheInvalidated = "invalidated" // the key's cached result and lock are gone from Redis
	cacheNotChecked  = "not_checked" // no --redis-url: the cache was not touched
	cacheStale       = "stale"       // Postgres done, the cache could not be invalidated
	cacheUnavailable = "unavailable" // Redis did not answer: nothing was changed
)

// releaseJSON is ledger release --json.
type releaseJSON struct {
	Scope    string `json:"scope"`
	Tenant   string `json:"tenant"`
	ID       string `json:"id"`
	IDMasked bool   `json:"id_masked"` // always: release prints IDs masked
	// Released: a row was deleted in Postgres.
	Released bool `json:"released"`
	// Was: the row's state before ("done", "failed", "processing",
	// "expired"), or "absent".
	Was string `json:"was"`
	// Cache: what happened to the Redis replay cache: "invalidated",
	// "not_checked" (no --redis-url given), "stale" (could not be
	// invalidated: a cached result may be replayed until it expires) or
	// "unavailable" (Redis did not answer; nothing was released).
	Cache string `json:"cache"`
	// Error: why the command failed; null when it did not.
	Error *string `json:"error"`
}

func ledgerRelease(f *flags) runFunc {
	db := addDBFlags(f)
	rc := addRedisFlags(f)
	tenant := f.String("tenant", "", "`tenant` of the key; empty: no tenant")
	force := f.Bool("force", false, "release a key that is done (letting its effect happen again) or whose lease still runs")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		k, err := keyArg(args, *tenant)
		if err != nil {
			return err
		}
		l, done, err := db.ledger(ctx, rc)
		if err != nil {
			return err
		}
		defer done()
		now := time.Now()
		was, wasText := "absent", "absent"
		rec, err := l.Lookup(ctx, k)
		switch {
		case err == nil && rec.Status == inbox.StatusDone && !*force:
			return usageErrorf("key %s is done: releasing it lets its effect happen again; pass --force if that is meant", keyText(k, false))
		case err == nil && rec.Status == inbox.StatusProcessing && rec.LeaseUntil.After(now) && !*force:
			return usageErrorf("key %s is processing under a lease until %s: its handler may be running, and releasing the key "+
				"lets a second run start beside it; wait for the lease to run out, or pass --force if that is meant",
				keyText(k, false), leaseText(rec.LeaseUntil, now))
		case err == nil:
			was, wasText = string(rec.Status), string(rec.Status)
			if rec.Status == inbox.StatusProcessing && !rec.LeaseUntil.IsZero() {
				wasText += ", lease " + leaseText(rec.LeaseUntil, now)
			}
		case !errors.Is(err, inbox.ErrNotFound):
			return err
		}
		other, err := rc.otherPrefix(ctx, l, db.schema)
		if err != nil {
			return err
		}
		// Without --force the check is made again by the DELETE itself: a
		// key that completed (or was leased again) since the look-up stays.
		release := l.ReleaseStuck
		if *force {
			release = l.Release
		}
		ok, rerr := release(ctx, k)
		if errors.Is(rerr, inbox.ErrNotStuck) {
			return usageErrorf("key %s is not stuck: it is done, or a lease on it still runs (its row may have expired meanwhile): nothing released; "+
				"pass --force to release it all the same", keyText(k, false))
		}
		out := releaseJSON{Scope: k.Scope, Tenant: k.Tenant, ID: inbox.Mask(k.ID), IDMasked: true, Released: ok, Was: was, Cache: cacheNotChecked}
		if ok && was == "absent" {
			// The row had expired between the lookup and the release.
			out.Was, wasText = "expired", "expired"
		}
		if rc.url != "" {
			out.Cache = cacheInvalidated
		}
		if rc.url != "" && !errors.Is(rerr, inbox.ErrCacheUnavailable) {
			// The row changed (or, when Postgres failed, may have): drop
			// the key from the cache under the other default prefix too,
			// as the ledger did under its own.
			if err := rc.invalidate(ctx, other, k); err != nil && rerr == nil {
				rerr = &inbox.CacheError{Op: "release", Key: k, Stale: true, Err: err}
			}
		}
		redisErr := rerr
		var ce *inbox.CacheError
		if errors.As(rerr, &ce) {
			redisErr = ce.Err
		}
		var fail error
		switch {
		case errors.Is(rerr, inbox.ErrCacheStale):
			out.Cache = cacheStale
			what := "released " + keyText(k, false) + " in Postgres"
			if !ok {
				what = "no row for " + keyText(k, false) + " in Postgres"
			}
			fail = &exitError{code: exitCacheStale, err: fmt.Errorf("%s, but the Redis replay cache could not be invalidated: %w; "+
				"a cached result may be replayed until it expires there (run this command again once Redis answers)", what, redisErr)}
		case errors.Is(rerr, inbox.ErrCacheUnavailable):
			out.Cache = cacheUnavailable
			fail = fmt.Errorf("the Redis replay cache did not answer, nothing released: %w", redisErr)
		case rerr != nil:
			// Postgres failed: the row is where it was, or (its answer
			// lost) deleted; the cached result was dropped either way.
			return rerr
		case !ok:
			fail = notFoundErrorf("no row for key %s", keyText(k, false))
		}
		if fail != nil {
			out.Error = strPtr(fail.Error())
		}
		if *asJSON {
			if err := writeJSON(a.stdout, out); err != nil {
				return err
			}
			return fail
		}
		if ok {
			fmt.Fprintf(a.stdout, "released %s (was %s): the next delivery or request with this key runs again\n", keyText(k, false), wasText)
		} else if out.Cache != cacheUnavailable {
			fmt.Fprintf(a.stdout, "no row for %s in Postgres: nothing released\n", keyText(k, false))
		}
		switch out.Cache {
		case cacheInvalidated:
			fmt.Fprintln(a.stdout, "Redis replay cache: invalidated (the cached result and lock of the key are gone)")
		case cacheNotChecked:
			fmt.Fprintln(a.stdout, "Redis replay cache: not checked (no --redis-url); if the application uses one, "+
				"its cached result may be replayed until it expires there")
		case cacheStale:
			fmt.Fprintln(a.stdout, "Redis replay cache: NOT invalidated; its cached result may be replayed until it expires there")
		case cacheUnavailable:
			fmt.Fprintln(a.stdout, "Redis replay cache: unavailable; nothing was released")
		}
		return fail
	}
}

// purgeJSON is ledger purge --json.
type purgeJSON struct {
	Deleted int64 `json:"deleted"`
	// Busy: another instance held the janitor lock and is purging; this
	// run stopped (after Deleted rows).
	Busy bool `json:"busy"`
}

func ledgerPurge(f *flags) runFunc {
	db := addDBFlags(f)
	expired := f.Bool("expired", false, "delete the rows whose retention ran out (required)")
	batch := f.Int("batch", 1000, "most `rows` one statement deletes; small batches keep locks and WAL bursts short")
	pause := f.Duration("pause", 10*time.Millisecond, "pause between batches")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if !*expired {
			return usageErrorf("say what to purge: --expired (the only rows purge deletes are expired ones)")
		}
		if *batch <= 0 {
			return usageErrorf("--batch must be positive")
		}
		if *pause < 0 {
			return usageErrorf("--pause must not be negative")
		}
		l, done, err := db.ledger(ctx, nil)
		if err != nil {
			return err
		}
		defer done()
		deleted, err := l.Purge(ctx, inbox.JanitorConfig{BatchSize: *batch, Pause: *pause})
		busy := errors.Is(err, inbox.ErrJanitorBusy)
		if err != nil && !busy {
			return fmt.Errorf("%w (deleted %d rows before)", err, deleted)
		}
		if *asJSON {
			return writeJSON(a.stdout, purgeJSON{deleted, busy})
		}
		if busy {
			fmt.Fprintf(a.stdout, "another instance holds the janitor lock and is purging; deleted %d %s before it did\n", deleted, plural(deleted, "row", "rows"))
			return nil
		}
		fmt.Fprintf(a.stdout, "deleted %d expired %s\n", deleted, plural(deleted, "row", "rows"))
		return nil
	}
}
