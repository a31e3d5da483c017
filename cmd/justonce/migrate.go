package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/migrations"
)

func migrateCommand() *command {
	return &command{
		name:    "migrate",
		summary: "manage the ledger schema",
		help:    "migrate applies, reverts and reports the embedded justonce migrations.",
		subs: []*command{
			{
				name:    "up",
				summary: "apply pending migrations",
				help: `Applies every pending migration (or those up to --to) in one transaction,
under an advisory lock: several instances may run it at once. Creates the
schema if it is missing.`,
				setup: migrateUp,
			},
			{
				name:    "down",
				summary: "revert migrations (drops the ledger table and every key in it)",
				help: `Reverts applied migrations down to version --to (0: all of them), in one
transaction. Reverting version 1 drops processed_events: every recorded key
is forgotten, and events or requests seen again run again. It therefore
needs --yes.`,
				setup: migrateDown,
			},
			{
				name:    "status",
				summary: "show the schema version and pending migrations",
				setup:   migrateStatus,
			},
		},
	}
}

// migrator connects and returns a Migrator with the schema's display name.
func (d *dbFlags) migrator(ctx context.Context) (*migrations.Migrator, *pgxpool.Pool, string, error) {
	pool, err := d.pool(ctx)
	if err != nil {
		return nil, nil, "", err
	}
	schema := d.schema
	if schema == "" {
		var cur *string
		if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&cur); err == nil && cur != nil {
			schema = *cur
		} else {
			schema = "(search_path)"
		}
	}
	return migrations.New(pool, migrations.Config{Schema: d.schema}), pool, schema, nil
}

func migrateUp(f *flags) runFunc {
	db := addDBFlags(f)
	to := f.Int("to", 0, "target `version`; 0: the latest")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		return migrateTo(ctx, a, db, *to, true, *asJSON)
	}
}

func migrateDown(f *flags) runFunc {
	db := addDBFlags(f)
	to := f.Int("to", 0, "target `version`; 0 reverts everything")
	yes := f.Bool("yes", false, "confirm: reverting version 1 drops processed_events")
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		if !*yes {
			return usageErrorf("migrate down drops ledger tables and the keys in them; pass --yes to confirm")
		}
		return migrateTo(ctx, a, db, *to, false, *asJSON)
	}
}

// migrateJSON is migrate up --json and migrate down --json.
type migrateJSON struct {
	Schema string `json:"schema"`
	// From and To: the schema version before and after.
	From int `json:"from"`
	To   int `json:"to"`
	// Applied: the versions applied (up) or reverted (down), in the order
	// they ran; empty when there was nothing to do.
	Applied []int `json:"applied"`
}

func migrateTo(ctx context.Context, a *app, db *dbFlags, to int, up, asJSON bool) error {
	if to < 0 {
		return usageErrorf("--to must not be negative")
	}
	all, err := migrations.All()
	if err != nil {
		return err
	}
	if latest := all[len(all)-1].Version; to > latest {
		return usageErrorf("--to %d: this build knows versions up to %d", to, latest)
	}
	known := to == 0
	for _, m := range all {
		known = known || m.Version == to
	}
	if !known {
		return usageErrorf("--to %d: no migration has that version", to)
	}
	m, pool, schema, err := db.migrator(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := m.Status(ctx)
	if err != nil {
		return migrateErr(err)
	}
	if up && to == 0 {
		to = st.Latest
	}
	out := migrateJSON{Schema: schema, From: st.Version, To: st.Version, Applied: []int{}}
	// A version below the current one may be pending: released after a
	// newer one. Up applies it.
	pendingBelow := false
	for _, v := range st.Pending {
		pendingBelow = pendingBelow || v <= to
	}
	switch {
	case up && to < st.Version:
		return usageErrorf("--to %d is below the current version %d; use migrate down", to, st.Version)
	case !up && to > st.Version:
		return usageErrorf("--to %d is above the current version %d; use migrate up", to, st.Version)
	case to != st.Version || up && pendingBelow:
		res, err := m.Migrate(ctx, to)
		if err != nil {
			return migrateErr(err)
		}
		// No versions applied: another instance migrated meanwhile.
		out.From, out.To = res.From, res.To
		out.Applied = append(out.Applied, res.Applied...)
	}
	if asJSON {
		return writeJSON(a.stdout, out)
	}
	if len(out.Applied) == 0 {
		fmt.Fprintf(a.stdout, "schema %s: already at version %d, nothing to do\n", schema, out.To)
		return nil
	}
	verb := "applied"
	if !up {
		verb = "reverted"
	}
	fmt.Fprintf(a.stdout, "schema %s: %s %s, now at version %d (was %d)\n",
		schema, verb, versions(out.Applied), out.To, out.From)
	return nil
}

// migrateStatusJSON is migrate status --json.
type migrateStatusJSON struct {
	Schema  string `json:"schema"`
	Version int    `json:"version"` // 0: not migrated
	Latest  int    `json:"latest"`  // the latest version this build knows
	Pending []int  `json:"pending"`
}

func migrateStatus(f *flags) runFunc {
	db := addDBFlags(f)
	asJSON := f.jsonFlag()
	return func(ctx context.Context, a *app, args []string) error {
		if err := wantArgs(args); err != nil {
			return err
		}
		m, pool, schema, err := db.migrator(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		st, err := m.Status(ctx)
		if err != nil {
			return migrateErr(err)
		}
		if *asJSON {
			pending := st.Pending
			if pending == nil {
				pending = []int{}
			}
			return writeJSON(a.stdout, migrateStatusJSON{schema, st.Version, st.Latest, pending})
		}
		state := "up to date"
		if len(st.Pending) > 0 {
			state = "pending " + versions(st.Pending) + "; run 'justonce migrate up'"
		}
		fmt.Fprintf(a.stdout, "schema %s: version %d of %d, %s\n", schema, st.Version, st.Latest, state)
		return nil
	}
}

func migrateErr(err error) error {
	if errors.Is(err, migrations.ErrUnknownVersion) {
		return fmt.Errorf("%w (is this binary older than the schema?)", err)
	}
	return err
}

func versions(vs []int) string {
	s := make([]string, len(vs))
	for i, v := range vs {
		s[i] = fmt.Sprint(v)
	}
	if len(vs) == 1 {
		return "version " + s[0]
	}
	return "versions " + strings.Join(s, ", ")
}
