package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// run is the whole program minus os.Args, os.Exit and the real
// environment: these cases need no binary and no database.
func TestRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		args   []string
		env    map[string]string
		code   int
		stdout string
		stderr string
	}{
		{name: "help", args: []string{"--help"}, code: exitOK, stdout: "Usage: justonce <command>"},
		{name: "help command", args: []string{"help", "ledger", "purge"}, code: exitOK, stdout: "Usage: justonce ledger purge [flags]"},
		{name: "no command", code: exitUsage, stderr: "justonce: missing command"},
		{name: "help unknown", args: []string{"help", "bogus"}, code: exitUsage, stderr: `unknown command "bogus"`},
		{name: "flags after arguments", args: []string{"ledger", "show", "s", "id", "--tenant"}, code: exitUsage,
			stderr: "flag needs an argument: -tenant"},
		{name: "environment", args: []string{"ledger", "stats"}, env: map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/db?connect_timeout=2"},
			code: exitFailure, stderr: "justonce ledger stats: cannot reach Postgres at 127.0.0.1:1 (database \"db\")"},
		{name: "flag beats environment", args: []string{"ledger", "stats", "--database-url", "postgres://u@127.0.0.1:2/flag"},
			env: map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/env"}, code: exitFailure, stderr: `(database "flag")`},
		{name: "purge needs --expired", args: []string{"ledger", "purge"}, env: map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/db"},
			code: exitUsage, stderr: "--expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tc.args, &stdout, &stderr, func(k string) string { return tc.env[k] })
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", &stdout, &stderr)
			require.Contains(t, stdout.String(), tc.stdout)
			require.Contains(t, stderr.String(), tc.stderr)
		})
	}
}

func TestParseInterspersed(t *testing.T) {
	t.Parallel()
	f := newFlags("x", func(string) string { return "" })
	tenant := f.String("tenant", "", "")
	reveal := f.Bool("reveal", false, "")
	pos, err := f.parse([]string{"scope", "--tenant", "acme", "id", "--reveal"})
	require.NoError(t, err)
	require.Equal(t, []string{"scope", "id"}, pos)
	require.Equal(t, "acme", *tenant)
	require.True(t, *reveal)

	f = newFlags("x", func(string) string { return "" })
	reveal = f.Bool("reveal", false, "")
	pos, err = f.parse([]string{"--", "scope", "--reveal"})
	require.NoError(t, err)
	require.Equal(t, []string{"scope", "--reveal"}, pos)
	require.False(t, *reveal)
}
