package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// These tests build the justonce binary and run it against a real Postgres
// (and Redis, for release), each test on a schema of its own.

const uuidKey = "550e8400-e29b-41d4-a716-446655440000"

// binary runs the built justonce with an environment of its own.
type binary struct {
	t    *testing.T
	path string
	env  []string
}

// result is one run of the binary.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return "exit " + strconv.Itoa(r.code) + "\nstdout:\n" + r.stdout + "\nstderr:\n" + r.stderr
}

// buildBinary compiles the command into dir.
func buildBinary(t *testing.T, dir string) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	require.NoError(t, err, "the go command is needed to build the binary")
	bin := filepath.Join(dir, "justonce")
	cmd := exec.Command(goTool, "build", "-o", bin, ".")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// cleanEnv is the test process's environment without the variables the
// binary reads, so that only what a test sets reaches it.
func cleanEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "DATABASE_URL", "JUSTONCE_SCHEMA", "REDIS_URL", "JUSTONCE_REDIS_PREFIX", "KAFKA_BROKERS", "NATS_URL":
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// on returns b reporting to t (a subtest).
func (b binary) on(t *testing.T) binary {
	b.t = t
	return b
}

func (b binary) with(env ...string) binary {
	b.env = append(append([]string{}, b.env...), env...)
	return b
}

func (b binary) run(args ...string) result {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, b.path, args...)
	cmd.Env = cleanEnv(b.env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		b.t.Fatalf("running %v: %v", args, err)
	}
	return r
}

// must runs the binary and requires exit code 0.
func (b binary) must(args ...string) result {
	b.t.Helper()
	r := b.run(args...)
	require.Equal(b.t, 0, r.code, "justonce %v\n%s", args, r)
	return r
}

// json runs the command (its words first in args) with --json, requires
// exit code 0, checks the output against the documented object and decodes
// it into v.
func (b binary) json(v any, args ...string) {
	b.t.Helper()
	r := b.must(append(args, "--json")...)
	checkJSON(b.t, strings.Join(args[:2], " "), r.stdout)
	require.NoError(b.t, json.Unmarshal([]byte(r.stdout), v), "justonce %v: %s", args, r.stdout)
}

func TestBinary(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t, t.TempDir())
	newBinary := func(t *testing.T, env ...string) binary { return binary{t: t, path: bin, env: env} }

	t.Run("Migrate", func(t *testing.T) {
		t.Parallel()
		pg := testsvc.Postgres(t, testsvc.NoMigrate())
		b := newBinary(t, "DATABASE_URL="+pg.URL, "JUSTONCE_SCHEMA="+pg.Schema)

		// The versions this build knows; the test assumes no particular
		// set (a version may land after a newer one).
		all, err := migrations.All()
		require.NoError(t, err)
		var vs, reversed []int
		for i := range all {
			vs = append(vs, all[i].Version)
			reversed = append(reversed, all[len(all)-1-i].Version)
		}
		latest := vs[len(vs)-1]

		r := b.must("migrate", "status")
		require.Contains(t, r.stdout, fmt.Sprintf("schema %s: version 0 of %d, pending %s", pg.Schema, latest, versions(vs)))

		r = b.must("migrate", "up")
		require.Contains(t, r.stdout, fmt.Sprintf("applied %s, now at version %d (was 0)", versions(vs), latest))
		r = b.must("migrate", "up")
		require.Contains(t, r.stdout, fmt.Sprintf("already at version %d", latest))

		var st struct {
			Schema  string `json:"schema"`
			Version int    `json:"version"`
			Latest  int    `json:"latest"`
			Pending []int  `json:"pending"`
		}
		b.json(&st, "migrate", "status")
		require.Equal(t, pg.Schema, st.Schema)
		require.Equal(t, latest, st.Version)
		require.Equal(t, latest, st.Latest)
		require.Empty(t, st.Pending)

		// The migrated table works.
		l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
		require.NoError(t, err)
		out, err := l.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "s", ID: "1"}}, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)

		// A version missing below the current one (the outbox's, 2,
		// reverted by hand): status lists it, up applies it.
		for _, m := range all {
			if m.Version == 2 {
				pg.Exec(t, m.Down)
			}
		}
		pg.Exec(t, `DELETE FROM justonce_migrations WHERE version = 2`)
		r = b.must("migrate", "status")
		require.Contains(t, r.stdout, fmt.Sprintf("version %d of %d, pending version 2", latest, latest))
		r = b.must("migrate", "up")
		require.Contains(t, r.stdout, fmt.Sprintf("applied version 2, now at version %d (was %d)", latest, latest))
		require.Equal(t, 1, pg.Count(t, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'", pg.Schema))

		// down is destructive: it wants --yes.
		r = b.run("migrate", "down")
		require.Equal(t, exitUsage, r.code, "%s", r)
		require.Contains(t, r.stderr, "--yes")
		require.Equal(t, 1, pg.Count(t, "SELECT count(*) FROM processed_events"))

		r = b.run("migrate", "up", "--to", strconv.Itoa(latest+3))
		require.Equal(t, exitUsage, r.code, "%s", r)
		r = b.run("migrate", "down", "--yes", "--to", strconv.Itoa(latest+1))
		require.Equal(t, exitUsage, r.code, "%s", r)

		r = b.must("migrate", "down", "--yes")
		require.Contains(t, r.stdout, fmt.Sprintf("reverted %s, now at version 0 (was %d)", versions(reversed), latest))
		b.json(&st, "migrate", "status")
		require.Equal(t, 0, st.Version)
		require.Equal(t, vs, st.Pending)
		require.Equal(t, 0, pg.Count(t, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_events'", pg.Schema))
		require.Equal(t, 0, pg.Count(t, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_steps'", pg.Schema))

		// up and down report in JSON what they did.
		var mig migrateJSON
		b.json(&mig, "migrate", "up")
		require.Equal(t, migrateJSON{Schema: pg.Schema, From: 0, To: latest, Applied: vs}, mig)
		b.json(&mig, "migrate", "up")
		require.Equal(t, migrateJSON{Schema: pg.Schema, From: latest, To: latest, Applied: []int{}}, mig)
		b.json(&mig, "migrate", "down", "--yes")
		require.Equal(t, migrateJSON{Schema: pg.Schema, From: latest, To: 0, Applied: reversed}, mig)

		// A ledger command on the unmigrated schema: an operational error
		// with a hint.
		r = b.run("ledger", "stats")
		require.Equal(t, exitFailure, r.code, "%s", r)
		require.Contains(t, r.stderr, "does not exist")
		require.Contains(t, r.stderr, "justonce migrate up")

		// Flags win over the environment; without --schema the URL's
		// search_path names the schema.
		r = newBinary(t).must("migrate", "up", "--database-url", pg.URL)
		require.Contains(t, r.stdout, "schema "+pg.Schema+": applied "+versions(vs))

		// A database newer than this build: status and up say so and
		// fail, rather than reporting it up to date or pointing at down.
		pg.Exec(t, `INSERT INTO justonce_migrations (version, name) VALUES ($1, 'future')`, latest+1)
		for _, args := range [][]string{{"migrate", "status"}, {"migrate", "up"}} {
			r = b.run(args...)
			require.Equal(t, exitFailure, r.code, "%s", r)
			require.Contains(t, r.stderr, fmt.Sprintf("database is at %d, this build knows up to %d", latest+1, latest), "%s", r)
			require.NotContains(t, r.stderr, "migrate down")
		}
	})

	t.Run("Ledger", func(t *testing.T) {
		t.Parallel()
		pg := testsvc.Postgres(t)
		b := newBinary(t, "DATABASE_URL="+pg.URL, "JUSTONCE_SCHEMA="+pg.Schema)
		ctx := context.Background()
		l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
		require.NoError(t, err)

		// billing: two done (one with a stored response), one failed.
		do(t, l, inbox.Request{Key: inbox.Key{Scope: "billing", Tenant: "acme", ID: uuidKey},
			Source: inbox.Source("kafka"), Fingerprint: []byte{1, 2, 3}, Principal: "svc-billing"},
			inbox.Result{Code: 201, Header: map[string][]string{"Content-Type": {"text/plain"}}, Body: []byte("hello")})
		do(t, l, inbox.Request{Key: inbox.Key{Scope: "billing", ID: "done-2"}, Source: inbox.Source("http")}, inbox.Result{})
		failReq := inbox.Request{Key: inbox.Key{Scope: "billing", ID: "failed-3"}, Source: inbox.Source("nats")}
		ok, err := l.RecordFailure(ctx, failReq, 5, errors.New("card declined: boom"))
		require.NoError(t, err)
		require.True(t, ok)
		// payments: a lease that ran out (its holder "crashed").
		stuck := inbox.Request{Key: inbox.Key{Scope: "payments", ID: "stuck-lease-0001"}, Source: inbox.Source("http")}
		lease, _, err := l.AcquireLease(ctx, stuck, 50*time.Millisecond)
		require.NoError(t, err)
		require.NotNil(t, lease)
		// old: three rows whose retention ran out.
		for _, id := range []string{"e1", "e2", "e3"} {
			do(t, l, inbox.Request{Key: inbox.Key{Scope: "old", ID: id}, TTL: time.Millisecond}, inbox.Result{})
		}
		time.Sleep(100 * time.Millisecond)

		t.Run("stats", func(t *testing.T) {
			b := b.on(t)
			r := b.must("ledger", "stats")
			t.Logf("justonce ledger stats:\n%s", r.stdout)
			for _, want := range []string{"SCOPE", "billing", "done", "failed", "payments", "processing", "ran out",
				"4 live rows in 2 scopes", "oldest in-flight lease: scope payments"} {
				require.Contains(t, r.stdout, want)
			}
			require.NotContains(t, r.stdout, "\nold ", "expired rows are not live")
			require.NotContains(t, r.stdout, " \n", "no trailing blanks")

			var st struct {
				Rows []struct {
					Scope            string     `json:"scope"`
					Status           string     `json:"status"`
					Rows             int64      `json:"rows"`
					OldestLeaseUntil *time.Time `json:"oldest_lease_until"`
				} `json:"rows"`
				TotalRows   int64 `json:"total_rows"`
				OldestLease *struct {
					Scope          string    `json:"scope"`
					LeaseUntil     time.Time `json:"lease_until"`
					OverdueSeconds float64   `json:"overdue_seconds"`
				} `json:"oldest_in_flight_lease"`
			}
			b.json(&st, "ledger", "stats")
			require.EqualValues(t, 4, st.TotalRows)
			got := map[string]int64{}
			for _, row := range st.Rows {
				got[row.Scope+"/"+row.Status] = row.Rows
				require.Equal(t, row.Status == "processing", row.OldestLeaseUntil != nil, "%+v", row)
			}
			require.Equal(t, map[string]int64{"billing/done": 2, "billing/failed": 1, "payments/processing": 1}, got)
			require.NotNil(t, st.OldestLease)
			require.Equal(t, "payments", st.OldestLease.Scope)
			require.Greater(t, st.OldestLease.OverdueSeconds, 0.0)
			require.Less(t, st.OldestLease.OverdueSeconds, 60.0)
		})

		t.Run("show", func(t *testing.T) {
			b := b.on(t)
			r := b.must("ledger", "show", "billing", uuidKey, "--tenant", "acme")
			t.Logf("justonce ledger show:\n%s", r.stdout)
			require.NotContains(t, r.stdout, uuidKey, "the key is masked")
			for _, want := range []string{"550e****0000 (masked", "status:", "done", "source:", "kafka",
				"svc-billing", "result code:", "201", "5 bytes, 1 headers", "010203"} {
				require.Contains(t, r.stdout, want)
			}
			// Flags before the arguments work the same.
			r2 := b.must("ledger", "show", "--tenant=acme", "billing", uuidKey)
			require.Equal(t, r.stdout[:strings.Index(r.stdout, "lease until")], r2.stdout[:strings.Index(r2.stdout, "lease until")])

			var rec recordJSON
			b.json(&rec, "ledger", "show", "billing", uuidKey, "--tenant", "acme", "--reveal")
			require.Equal(t, uuidKey, rec.ID)
			require.False(t, rec.IDMasked)
			require.Equal(t, "done", rec.Status)
			require.Equal(t, "kafka", *rec.Source)
			require.Equal(t, "svc-billing", *rec.Principal)
			require.Equal(t, 201, *rec.ResultCode)
			require.Equal(t, 5, rec.ResultBytes)
			require.Equal(t, 1, rec.ResultHeaders)
			require.Equal(t, "010203", *rec.Fingerprint)
			require.Nil(t, rec.Error, "unset: null")
			require.NotNil(t, rec.Duration)
			require.GreaterOrEqual(t, *rec.Duration, 0.0)
			require.Less(t, *rec.Duration, 60.0, "seconds")
			require.Equal(t, 1, rec.Attempts)
			require.NotNil(t, rec.CreatedAt)
			require.NotNil(t, rec.ExpiresAt)
			require.True(t, rec.ExpiresAt.After(time.Now().Add(23*time.Hour)))
			require.Nil(t, rec.LeaseUntil)

			b.json(&rec, "ledger", "show", "billing", "failed-3")
			require.Equal(t, "failed", rec.Status)
			require.Equal(t, "********", rec.ID, "IDs of eight characters or fewer are all stars")
			require.True(t, rec.IDMasked)
			require.Equal(t, 5, rec.Attempts)
			require.Equal(t, "card declined: boom", *rec.Error)
			require.Equal(t, "nats", *rec.Source)
			require.Nil(t, rec.ResultCode, "no result: null")
			require.Nil(t, rec.Fingerprint)
			require.Nil(t, rec.Principal)

			b.json(&rec, "ledger", "show", "payments", "stuck-lease-0001")
			require.Equal(t, "processing", rec.Status)
			require.Equal(t, lease.Token(), rec.FencingToken)
			require.NotNil(t, rec.LeaseUntil)
			require.True(t, rec.LeaseUntil.Before(time.Now()))
			require.NotEmpty(t, *rec.LeaseOwner)
			require.Nil(t, rec.CompletedAt)

			// Missing keys: exit 3. Tenants are isolated.
			r = b.run("ledger", "show", "billing", uuidKey)
			require.Equal(t, exitNotFound, r.code, "%s", r)
			require.Contains(t, r.stderr, "no live row for key billing//550e****0000")
			require.NotContains(t, r.stderr, uuidKey)
			r = b.run("ledger", "show", "billing", "e1")
			require.Equal(t, exitNotFound, r.code, "%s", r)
			r = b.run("ledger", "show", "old", "e1")
			require.Equal(t, exitNotFound, r.code, "expired rows are not shown\n%s", r)

			// An ID that begins with a dash follows "--".
			do(t, l, inbox.Request{Key: inbox.Key{Scope: "billing", ID: "-dash-id-0042"}}, inbox.Result{})
			r = b.run("ledger", "show", "billing", "-dash-id-0042")
			require.Equal(t, exitUsage, r.code, "%s", r)
			r = b.must("ledger", "show", "--reveal", "--", "billing", "-dash-id-0042")
			require.Contains(t, r.stdout, "-dash-id-0042")
			b.must("ledger", "release", "--force", "--", "billing", "-dash-id-0042")
		})

		t.Run("release", func(t *testing.T) {
			b := b.on(t)
			r := b.must("ledger", "release", "payments", "stuck-lease-0001")
			require.Contains(t, r.stdout, "released payments//stuc****0001 (was processing, lease ")
			require.Contains(t, r.stdout, "ran out")
			// Without --redis-url the cache was not touched, and it says so.
			require.Contains(t, r.stdout, "Redis replay cache: not checked (no --redis-url)")
			require.Equal(t, exitNotFound, b.run("ledger", "show", "payments", "stuck-lease-0001").code)
			r = b.run("ledger", "release", "payments", "stuck-lease-0001")
			require.Equal(t, exitNotFound, r.code, "%s", r)
			require.Contains(t, r.stderr, "no row for key")
			require.Contains(t, r.stdout, "nothing released")
			rel := releaseOut(t, b.run("ledger", "release", "payments", "stuck-lease-0001", "--json"), exitNotFound)
			require.Equal(t, releaseJSON{Scope: "payments", ID: "stuc****0001", IDMasked: true, Released: false, Was: "absent",
				Cache: "not_checked", Error: strPtr("no row for key payments//stuc****0001")}, rel)
			// The key is new again, and the old holder's fencing token is stale.
			lease2, out, err := l.AcquireLease(ctx, stuck, time.Minute)
			require.NoError(t, err)
			require.NotNil(t, lease2, "%+v", out)
			require.Greater(t, lease2.Token(), lease.Token())
			require.ErrorIs(t, lease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)
			require.NoError(t, lease2.Complete(ctx, inbox.Result{Code: 200}))

			// A done key is refused without --force.
			r = b.run("ledger", "release", "billing", "done-2")
			require.Equal(t, exitUsage, r.code, "%s", r)
			require.Contains(t, r.stderr, "--force")
			require.Equal(t, 1, pg.Count(t, "SELECT count(*) FROM processed_events WHERE event_id = 'done-2'"))
			rel = releaseOut(t, b.run("ledger", "release", "billing", "done-2", "--force", "--json"), exitOK)
			require.Equal(t, releaseJSON{Scope: "billing", ID: "******", IDMasked: true, Released: true, Was: "done", Cache: "not_checked"}, rel)
			require.Equal(t, 0, pg.Count(t, "SELECT count(*) FROM processed_events WHERE event_id = 'done-2'"))

			// A key whose lease still runs is refused without --force: its
			// handler may be running.
			live := inbox.Request{Key: inbox.Key{Scope: "payments", ID: "live-lease-0001"}}
			liveLease, _, err := l.AcquireLease(ctx, live, time.Hour)
			require.NoError(t, err)
			require.NotNil(t, liveLease)
			r = b.run("ledger", "release", "payments", "live-lease-0001")
			require.Equal(t, exitUsage, r.code, "%s", r)
			require.Contains(t, r.stderr, "handler may be running")
			require.Contains(t, r.stderr, "--force")
			require.Equal(t, 1, pg.Count(t, "SELECT count(*) FROM processed_events WHERE event_id = 'live-lease-0001'"))
			rel = releaseOut(t, b.run("ledger", "release", "payments", "live-lease-0001", "--force", "--json"), exitOK)
			require.True(t, rel.Released)
			require.Equal(t, "processing", rel.Was)
			require.ErrorIs(t, liveLease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)

			// A failed key is released at once; the next delivery runs.
			b.must("ledger", "release", "billing", "failed-3")
			out, err = l.Do(ctx, failReq, noop)
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
		})

		t.Run("purge", func(t *testing.T) {
			b := b.on(t)
			r := b.run("ledger", "purge")
			require.Equal(t, exitUsage, r.code, "%s", r)
			require.Contains(t, r.stderr, "--expired")
			require.Equal(t, exitUsage, b.run("ledger", "purge", "--expired", "--batch", "0").code)
			require.Equal(t, 3, pg.Count(t, "SELECT count(*) FROM processed_events WHERE scope = 'old'"))

			r = b.must("ledger", "purge", "--expired", "--batch", "2")
			require.Contains(t, r.stdout, "deleted 3 expired rows")
			require.Equal(t, 0, pg.Count(t, "SELECT count(*) FROM processed_events WHERE scope = 'old'"))
			require.Equal(t, 3, pg.Count(t, "SELECT count(*) FROM processed_events"), "live rows stay")

			var res struct {
				Deleted int64 `json:"deleted"`
				Busy    bool  `json:"busy"`
			}
			b.json(&res, "ledger", "purge", "--expired")
			require.Zero(t, res.Deleted)
			require.False(t, res.Busy)
		})

		t.Run("steps", func(t *testing.T) {
			b := b.on(t)
			// A key run in steps that stopped after two (the third failed
			// for the time being), and one that completed.
			pay := func(fail error) inbox.StepsFunc {
				return func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
					if _, err := s.Tx(ctx, "order", func(context.Context, pgx.Tx) ([]byte, error) { return []byte("order-1"), nil }); err != nil {
						return inbox.Result{}, err
					}
					if _, err := s.Call(ctx, "charge", func(context.Context, string) ([]byte, error) { return []byte("ch_0123456789"), nil }); err != nil {
						return inbox.Result{}, err
					}
					_, err := s.Call(ctx, "receipt", func(context.Context, string) ([]byte, error) { return nil, fail })
					return inbox.Result{Code: 201}, err
				}
			}
			stopped := inbox.Request{Key: inbox.Key{Scope: "shop", ID: "pay-stopped-01"}}
			_, err := l.DoSteps(ctx, stopped, 0, pay(errors.New("mailer down")))
			require.Error(t, err)
			done := inbox.Request{Key: inbox.Key{Scope: "shop", ID: "pay-done-0002"}}
			_, err = l.DoSteps(ctx, done, 0, pay(nil))
			require.NoError(t, err)

			r := b.must("ledger", "show", "shop", "pay-stopped-01")
			t.Logf("justonce ledger show:\n%s", r.stdout)
			for _, want := range []string{"status:", "processing",
				"2 recorded, the last charge (call): stopped there, the next attempt resumes after it",
				"SEQ", "1    order", "tx", "7 bytes", "2    charge", "call", "13 bytes"} {
				require.Contains(t, r.stdout, want)
			}
			require.NotContains(t, r.stdout, " \n", "no trailing blanks")
			var rec recordJSON
			b.json(&rec, "ledger", "show", "shop", "pay-stopped-01")
			require.Len(t, rec.Steps, 2)
			require.Equal(t, stepJSON{Seq: 2, Name: "charge", Kind: "call", CompletedAt: rec.Steps[1].CompletedAt,
				OutputBytes: 13, FencingToken: rec.FencingToken}, rec.Steps[1])
			require.NotNil(t, rec.Steps[0].CompletedAt)
			require.Equal(t, "charge", *rec.LastStep)

			r = b.must("ledger", "show", "shop", "pay-done-0002")
			require.Contains(t, r.stdout, "3 recorded, the last receipt (call): completed")
			b.json(&rec, "ledger", "show", "billing", uuidKey, "--tenant", "acme") // not run in steps
			require.Empty(t, rec.Steps)
			require.NotNil(t, rec.Steps, "an empty list, not null")
			require.Nil(t, rec.LastStep)
			r = b.must("ledger", "show", "billing", uuidKey, "--tenant", "acme")
			require.Contains(t, r.stdout, "steps:")
			require.NotContains(t, r.stdout, "SEQ")

			// Release takes the steps along: the lease ran out, so the key
			// is stuck and released without --force.
			r = b.must("ledger", "release", "shop", "pay-stopped-01")
			require.Contains(t, r.stdout, "released")
			require.Zero(t, pg.Count(t, "SELECT count(*) FROM processed_steps WHERE event_id = 'pay-stopped-01'"))
		})
	})

	t.Run("ReleaseRedis", func(t *testing.T) {
		t.Parallel()
		pg := testsvc.Postgres(t)
		addr := testsvc.RedisAddr(t)
		rc, prefix := testsvc.Redis(t)
		b := newBinary(t, "DATABASE_URL="+pg.URL, "JUSTONCE_SCHEMA="+pg.Schema)
		ctx := context.Background()
		l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: &inbox.RedisConfig{Client: rc, Prefix: prefix}})
		require.NoError(t, err)
		req := inbox.Request{Key: inbox.Key{Scope: "http:/orders", Tenant: "t1", ID: "order-key-0001"}, Source: inbox.Source("http")}

		do(t, l, req, inbox.Result{Code: 201, Body: []byte("order 1")})
		out, err := l.Do(ctx, req, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.True(t, out.Cached, "served from the replay cache")

		// Released in Postgres only, the cache still answers: the reason
		// --redis-url exists.
		b.must("ledger", "release", "http:/orders", "order-key-0001", "--tenant", "t1", "--force")
		out, err = l.Do(ctx, req, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.True(t, out.Cached)

		do(t, l, inbox.Request{Key: inbox.Key{Scope: "http:/orders", Tenant: "t1", ID: "order-key-0002"}}, inbox.Result{Code: 201})
		r := b.with("REDIS_URL=redis://"+addr+"/0").must("ledger", "release", "http:/orders", "order-key-0002",
			"--tenant", "t1", "--force", "--redis-prefix", prefix)
		require.Contains(t, r.stdout, "released http:/orders/t1/orde****0002")
		require.Contains(t, r.stdout, "Redis replay cache: invalidated")
		out, err = l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "http:/orders", Tenant: "t1", ID: "order-key-0002"}}, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition, "neither Postgres nor the cache remembers the key")

		// An unreachable Redis: nothing is released.
		do(t, l, inbox.Request{Key: inbox.Key{Scope: "http:/orders", ID: "order-key-0003"}}, inbox.Result{})
		r = b.run("ledger", "release", "http:/orders", "order-key-0003", "--force", "--redis-url", "redis://127.0.0.1:1/0")
		require.Equal(t, exitFailure, r.code, "%s", r)
		require.Contains(t, r.stderr, "cannot reach Redis, nothing was changed")
		require.Equal(t, 1, pg.Count(t, "SELECT count(*) FROM processed_events WHERE event_id = 'order-key-0003'"))
	})

	// ReleaseRedisDefaultPrefixes: an application without
	// RedisConfig.Prefix caches under "justonce:" when it reaches its
	// schema through search_path, under "justonce:<schema>:" when it names
	// it in Config.Schema. Without --redis-prefix a release drops the key
	// under both, whether the tool was given the schema or not.
	t.Run("ReleaseRedisDefaultPrefixes", func(t *testing.T) {
		t.Parallel()
		pg := testsvc.Postgres(t)
		addr := testsvc.RedisAddr(t)
		rc, _ := testsvc.Redis(t)
		ctx := context.Background()
		bySearchPath, err := inbox.New(pg.Pool, inbox.Config{Redis: &inbox.RedisConfig{Client: rc}})
		require.NoError(t, err)
		bySchema, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: &inbox.RedisConfig{Client: rc}})
		require.NoError(t, err)
		for _, env := range []string{"JUSTONCE_SCHEMA=" + pg.Schema, "JUSTONCE_SCHEMA="} {
			b := newBinary(t, "DATABASE_URL="+pg.URL, env, "REDIS_URL=redis://"+addr+"/0")
			for _, l := range []*inbox.Ledger{bySearchPath, bySchema} {
				req := inbox.Request{Key: inbox.Key{Scope: "orders", ID: testsvc.Unique("prefix-key")}}
				do(t, l, req, inbox.Result{Code: 201})
				out, err := l.Do(ctx, req, noop)
				require.NoError(t, err)
				require.True(t, out.Cached, "served from the replay cache")
				r := b.must("ledger", "release", "orders", req.ID, "--force")
				require.Contains(t, r.stdout, "Redis replay cache: invalidated")
				out, err = l.Do(ctx, req, noop)
				require.NoError(t, err)
				require.Equal(t, inbox.Executed, out.Disposition, "%s: the cache still answered the released key", env)
			}
		}
	})

	// ReleaseRedisRefuses: a Redis that answers the connection check but
	// refuses the release's commands (an ACL user without the right to
	// read or delete keys). Refused before the row is touched: nothing is
	// released, exit 1. Refused after: the row is released, the output
	// says the cache was not invalidated, exit 4, and indeed the
	// application's cache still answers.
	t.Run("ReleaseRedisRefuses", func(t *testing.T) {
		t.Parallel()
		pg := testsvc.Postgres(t)
		rp := testsvc.StartRedis(t)
		rc := testsvc.NewRedisClient(rp.Addr)
		t.Cleanup(func() { _ = rc.Close() })
		ctx := context.Background()
		require.NoError(t, rc.Do(ctx, "ACL", "SETUSER", "noread", "on", ">pw", "~*", "+@connection").Err())
		require.NoError(t, rc.Do(ctx, "ACL", "SETUSER", "nodel", "on", ">pw", "~*", "+@connection", "+pttl").Err())
		b := newBinary(t, "DATABASE_URL="+pg.URL, "JUSTONCE_SCHEMA="+pg.Schema)
		l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: &inbox.RedisConfig{Client: rc}})
		require.NoError(t, err)
		req := inbox.Request{Key: inbox.Key{Scope: "http:/orders", ID: "order-key-0004"}, Source: inbox.Source("http")}
		do(t, l, req, inbox.Result{Code: 201})
		out, err := l.Do(ctx, req, noop)
		require.NoError(t, err)
		require.True(t, out.Cached)
		count := func() int {
			return pg.Count(t, "SELECT count(*) FROM processed_events WHERE event_id = 'order-key-0004'")
		}

		r := b.run("ledger", "release", "http:/orders", "order-key-0004", "--force", "--redis-url", "redis://noread:pw@"+rp.Addr+"/0")
		require.Equal(t, exitFailure, r.code, "%s", r)
		require.Contains(t, r.stderr, "the Redis replay cache did not answer, nothing released")
		require.Contains(t, r.stdout, "Redis replay cache: unavailable; nothing was released")
		require.NotContains(t, r.stdout, "released http")
		require.Equal(t, 1, count())

		r = b.run("ledger", "release", "http:/orders", "order-key-0004", "--force", "--redis-url", "redis://nodel:pw@"+rp.Addr+"/0")
		require.Equal(t, exitCacheStale, r.code, "%s", r)
		require.Contains(t, r.stdout, "released http:/orders//orde****0004 (was done)")
		require.Contains(t, r.stdout, "Redis replay cache: NOT invalidated")
		require.Contains(t, r.stderr, "released http:/orders//orde****0004 in Postgres, but the Redis replay cache could not be invalidated")
		require.Contains(t, r.stderr, "NOPERM")
		require.Equal(t, 0, count())
		out, err = l.Do(ctx, req, noop)
		require.NoError(t, err)
		require.True(t, out.Cached, "what the command warned about: the cache still answers")

		// JSON says the same; run again with a Redis that may delete, and the
		// cache is clean.
		rel := releaseOut(t, b.run("ledger", "release", "http:/orders", "order-key-0004", "--json", "--redis-url", "redis://nodel:pw@"+rp.Addr+"/0"), exitCacheStale)
		require.False(t, rel.Released)
		require.Equal(t, "stale", rel.Cache)
		require.Contains(t, *rel.Error, "no row for http:/orders//orde****0004 in Postgres, but the Redis replay cache could not be invalidated")
		rel = releaseOut(t, b.run("ledger", "release", "http:/orders", "order-key-0004", "--json", "--redis-url", "redis://"+rp.Addr+"/0"), exitNotFound)
		require.Equal(t, "invalidated", rel.Cache)
		out, err = l.Do(ctx, req, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
	})

	t.Run("Errors", func(t *testing.T) {
		t.Parallel()
		b := newBinary(t)

		// Unreachable database: exit 1, a clear message, no password.
		r := b.run("ledger", "stats", "--database-url", "postgres://postgres:s3cret@127.0.0.1:1/postgres?sslmode=disable")
		require.Equal(t, exitFailure, r.code, "%s", r)
		require.Contains(t, r.stderr, "justonce ledger stats: cannot reach Postgres at 127.0.0.1:1")
		require.NotContains(t, r.stderr+r.stdout, "s3cret")
		r = b.with("DATABASE_URL=postgres://postgres@127.0.0.1:1/postgres").run("migrate", "status")
		require.Equal(t, exitFailure, r.code, "%s", r)
		require.Contains(t, r.stderr, "cannot reach Postgres")

		for _, tc := range []struct {
			args []string
			want string
		}{
			{nil, "missing command"},
			{[]string{"bogus"}, `unknown command "bogus"`},
			{[]string{"ledger"}, "missing command"},
			{[]string{"ledger", "bogus"}, `unknown command "bogus"`},
			{[]string{"ledger", "stats"}, "no database: set --database-url or DATABASE_URL"},
			{[]string{"ledger", "stats", "--bogus"}, "flag provided but not defined: -bogus"},
			{[]string{"ledger", "stats", "extra"}, `unexpected argument "extra"`},
			{[]string{"ledger", "show", "billing"}, "missing <id>"},
			{[]string{"ledger", "show"}, "missing <scope> and <id>"},
			{[]string{"ledger", "show", "", "x"}, "scope"},
			{[]string{"ledger", "release", "a", "b", "c"}, `unexpected argument "c"`},
			{[]string{"ledger", "show", "--database-url", "::bogus::", "a", "b"}, "--database-url"},
			{[]string{"migrate", "up", "--to", "-1", "--database-url", "postgres://x@127.0.0.1:1/x"}, "--to must not be negative"},
			{[]string{"migrate", "up", "--to", "x"}, "invalid value"},
		} {
			r := b.run(tc.args...)
			require.Equal(t, exitUsage, r.code, "%v\n%s", tc.args, r)
			require.Contains(t, r.stderr, tc.want, "%v", tc.args)
			require.Empty(t, r.stdout, "%v", tc.args)
		}
	})

	t.Run("Help", func(t *testing.T) {
		t.Parallel()
		b := newBinary(t)
		all := leaves()
		for _, h := range []string{"-h", "--help", "help"} {
			r := b.must(h)
			require.Contains(t, r.stdout, "Usage: justonce <command>")
			require.Contains(t, r.stdout, "Exit codes:\n  0  success")
			// Every command, with its one line.
			for _, l := range all {
				require.Regexp(t, `\n  `+regexp.QuoteMeta(l.path)+` +`+regexp.QuoteMeta(l.cmd.summary)+`\n`, r.stdout)
			}
		}
		// Wants beyond the flags, which every command's help lists with
		// their defaults.
		extra := map[string][]string{
			"ledger show":    {"<scope> <id>"},
			"ledger release": {"<scope> <id>", "(env REDIS_URL)", "Exits 3"},
			"ledger purge":   {"(default 1000)", "(default 10ms)"},
			"replay kafka":   {"(env KAFKA_BROKERS)", "dry run"},
			"replay nats":    {"(env NATS_URL)", "dry run"},
		}
		env := []string{"DATABASE_URL=postgres://u:hidden@h/db", "REDIS_URL=redis://:hidden@h", "KAFKA_BROKERS=hidden:9092", "NATS_URL=nats://hidden"}
		for _, l := range all {
			args := strings.Fields(l.path)
			for _, h := range []string{"-h", "--help"} {
				r := b.with(env...).must(append(args, h)...)
				require.Contains(t, r.stdout, "Usage: justonce "+l.path+" [flags]")
				require.Contains(t, r.stdout, "--database-url URL")
				require.Contains(t, r.stdout, "(env DATABASE_URL)")
				require.NotContains(t, r.stdout, "hidden", "help never prints the environment's values")
				for _, w := range extra[l.path] {
					require.Contains(t, r.stdout, w, l.path)
				}
				// Each flag on a line of its own, with its default: a
				// variable's name, a value, or (strings) what empty means.
				l.flags.VisitAll(func(fl *flag.Flag) {
					line := helpLine(t, r.stdout, "--"+fl.Name)
					switch env, ok := l.flags.env[fl.Name]; {
					case ok:
						require.Contains(t, line, "(env "+env+")", l.path)
					case isBoolFlag(fl):
					case fl.DefValue != "":
						require.Contains(t, line, "(default "+fl.DefValue+")", l.path)
					default:
						require.Regexp(t, `empty: |required`, line, "%s: what an empty --%s means", l.path, fl.Name)
					}
				})
			}
			r := b.must(append([]string{"help"}, args...)...)
			require.Contains(t, r.stdout, "Usage: justonce "+l.path)
		}
		for _, group := range []string{"migrate", "ledger", "replay"} {
			r := b.must(group, "-h")
			require.Contains(t, r.stdout, "Usage: justonce "+group+" <command>")
		}
	})
}

// helpLine returns the line of a command's help that describes flag.
func helpLine(t *testing.T, help, flag string) string {
	t.Helper()
	for _, l := range strings.Split(help, "\n") {
		if strings.HasPrefix(l, "  "+flag+" ") {
			return l
		}
	}
	t.Fatalf("the help lists no %s:\n%s", flag, help)
	return ""
}

func noop(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }

// releaseOut parses the JSON of ledger release --json, which is printed
// whatever the exit code, and checks the code.
func releaseOut(t *testing.T, r result, code int) releaseJSON {
	t.Helper()
	require.Equal(t, code, r.code, "%s", r)
	checkJSON(t, "ledger release", r.stdout)
	var rel releaseJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rel), "%s", r)
	return rel
}

// do runs req to completion with result res.
func do(t *testing.T, l *inbox.Ledger, req inbox.Request, res inbox.Result) {
	t.Helper()
	out, err := l.Do(context.Background(), req, func(context.Context, pgx.Tx) (inbox.Result, error) { return res, nil })
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
}
