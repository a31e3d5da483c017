package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgconn"
)

// Exit codes. exitCodes describes them for the top-level help; the package
// documentation lists the same lines (a test checks it).
const (
	exitOK       = 0
	exitFailure  = 1
	exitUsage    = 2
	exitNotFound = 3
	// exitCacheStale: ledger release changed Postgres, but the Redis
	// replay cache could not be invalidated.
	exitCacheStale = 4
)

var exitCodes = []struct {
	code int
	text string
}{
	{exitOK, "success; also: help was asked for, ledger purge found another instance purging"},
	{exitFailure, "operational error: database, Redis, Kafka or NATS unreachable, schema not migrated, SQL error"},
	{exitUsage, "usage error: unknown command or flag, bad or missing argument or flag, missing confirmation"},
	{exitNotFound, "not found: ledger show or ledger release of a key with no row"},
	{exitCacheStale, "ledger release changed Postgres but could not invalidate the Redis replay cache; run it again"},
}

// environment lists the variables flags take their defaults from, for the
// top-level help.
var environment = []struct{ name, flag string }{
	{"DATABASE_URL", "--database-url: Postgres connection URL"},
	{"JUSTONCE_SCHEMA", "--schema: schema holding processed_events"},
	{"REDIS_URL", "--redis-url: Redis of the replay cache (ledger release)"},
	{"JUSTONCE_REDIS_PREFIX", "--redis-prefix: its key prefix (ledger release)"},
	{"KAFKA_BROKERS", "--brokers: Kafka brokers (replay kafka)"},
	{"NATS_URL", "--nats-url: NATS server (replay nats)"},
}

// app is what every command shares: its output and its environment.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string
}

// runFunc runs a leaf command with its positional arguments, after its
// flags were parsed.
type runFunc func(ctx context.Context, a *app, args []string) error

// command is one node of the command tree: a group (subs set) or a leaf
// (setup set).
type command struct {
	name    string
	summary string // one line, shown in the parent's list
	args    string // positional arguments in the usage line, e.g. "<scope> <id>"
	help    string // what the command does, shown by -h
	subs    []*command
	// setup defines the leaf's flags and returns the function that runs it.
	setup func(f *flags) runFunc
}

// rootCommand is the command tree.
//
// Each leaf gets its own flag.FlagSet; a group such as replay (replay
// kafka, replay nats) is a *command with subs, in its own file, added to
// this list. Leaves take the connection flags with addDBFlags, open the
// ledger with dbFlags.ledger, report usage errors with usageErrorf, write
// results to a.stdout and progress to a.stderr. A leaf that prints a result
// takes --json (flags.jsonFlag) and its object is added to the package
// documentation's list, which the tests check against the output.
func rootCommand() *command {
	return &command{
		name: "justonce",
		help: `justonce operates a justonce ledger: the processed_events table in Postgres
that gives Kafka and NATS consumers and HTTP Idempotency-Key requests their
exactly-once effects.`,
		subs: []*command{
			migrateCommand(),
			ledgerCommand(),
			outboxCommand(),
			replayCommand(),
		},
	}
}

// run is the whole program: it parses args (without the program name),
// runs the command and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	a := &app{stdout: stdout, stderr: stderr, getenv: getenv}
	root := rootCommand()
	// "justonce help ledger show" is "justonce ledger show -h".
	if len(args) > 0 && args[0] == "help" {
		args = append(append([]string{}, args[1:]...), "-h")
	}
	return a.dispatch(ctx, root, nil, args)
}

func isHelp(arg string) bool {
	switch arg {
	case "-h", "-help", "--help", "help":
		return true
	}
	return false
}

func (a *app) dispatch(ctx context.Context, c *command, path []string, args []string) int {
	path = append(path, c.name)
	if c.subs == nil {
		return a.runLeaf(ctx, c, path, args)
	}
	switch {
	case len(args) == 0:
		fmt.Fprintf(a.stderr, "%s: missing command\n\n", strings.Join(path, " "))
		a.groupUsage(a.stderr, c, path)
		return exitUsage
	case isHelp(args[0]):
		a.groupUsage(a.stdout, c, path)
		return exitOK
	}
	for _, sub := range c.subs {
		if sub.name == args[0] {
			return a.dispatch(ctx, sub, path, args[1:])
		}
	}
	fmt.Fprintf(a.stderr, "%s: unknown command %q\n\n", strings.Join(path, " "), args[0])
	a.groupUsage(a.stderr, c, path)
	return exitUsage
}

func (a *app) runLeaf(ctx context.Context, c *command, path []string, args []string) int {
	name := strings.Join(path, " ")
	f := newFlags(name, a.getenv)
	fn := c.setup(f)
	pos, err := f.parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		a.leafUsage(a.stdout, c, path, f)
		return exitOK
	case err != nil:
		return a.fail(name, &exitError{code: exitUsage, err: err})
	}
	return a.fail(name, fn(ctx, a, pos))
}

// fail reports err (if any) on stderr and returns its exit code.
func (a *app) fail(name string, err error) int {
	if err == nil {
		return exitOK
	}
	code := exitFailure
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	fmt.Fprintf(a.stderr, "%s: %v\n", name, err)
	switch code {
	case exitUsage:
		fmt.Fprintf(a.stderr, "Run '%s -h' for usage.\n", name)
	case exitFailure:
		if hint := hintFor(err); hint != "" {
			fmt.Fprintln(a.stderr, hint)
		}
	}
	return code
}

// hintFor suggests a fix for well-known operational errors.
func hintFor(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return "Is the schema migrated? Check --schema (JUSTONCE_SCHEMA) and run 'justonce migrate up'."
	}
	return ""
}

// exitError carries the exit code of an error other than 1.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// usageErrorf reports a command used wrongly (exit code 2).
func usageErrorf(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

// notFoundErrorf reports a key that is not there (exit code 3).
func notFoundErrorf(format string, args ...any) error {
	return &exitError{code: exitNotFound, err: fmt.Errorf(format, args...)}
}

// wantArgs checks the number of positional arguments.
func wantArgs(args []string, names ...string) error {
	if len(args) < len(names) {
		return usageErrorf("missing %s", strings.Join(names[len(args):], " and "))
	}
	if len(args) > len(names) {
		return usageErrorf("unexpected argument %q", args[len(names)])
	}
	return nil
}

// flags is a leaf's flag set. Flags may take their default from an
// environment variable; the usage text names the variable and never prints
// its value (it may hold a password).
type flags struct {
	*flag.FlagSet
	getenv func(string) string
	env    map[string]string // flag name -> environment variable
}

func newFlags(name string, getenv func(string) string) *flags {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return &flags{FlagSet: fs, getenv: getenv, env: map[string]string{}}
}

// stringEnv defines a string flag whose default is the environment
// variable envVar.
func (f *flags) stringEnv(p *string, name, envVar, usage string) {
	f.StringVar(p, name, f.getenv(envVar), usage)
	f.env[name] = envVar
}

// jsonFlag defines --json, the same on every command that prints a result.
func (f *flags) jsonFlag() *bool {
	return f.Bool("json", false, "print the result as JSON (see 'justonce -h')")
}

// isSet reports whether the flag name was given on the command line.
func (f *flags) isSet(name string) bool {
	set := false
	f.Visit(func(fl *flag.Flag) { set = set || fl.Name == name })
	return set
}

func isBoolFlag(fl *flag.Flag) bool {
	b, ok := fl.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// parse parses flags and positional arguments in any order, as users of
// other CLIs expect ("show billing 42 --tenant acme"). After "--" every
// argument is positional, for IDs that begin with a dash.
func (f *flags) parse(args []string) ([]string, error) {
	var pos []string
	for {
		if err := f.Parse(args); err != nil {
			return nil, err
		}
		rest := f.Args()
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(pos, rest...), nil
		}
		if len(rest) == 0 {
			return pos, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func (a *app) groupUsage(w io.Writer, c *command, path []string) {
	name := strings.Join(path, " ")
	if c.help != "" {
		fmt.Fprintf(w, "%s\n\n", c.help)
	}
	fmt.Fprintf(w, "Usage: %s <command> [flags] [arguments]\n\nCommands:\n", name)
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	var walk func(c *command, prefix string)
	walk = func(c *command, prefix string) {
		for _, sub := range c.subs {
			if sub.subs != nil {
				walk(sub, prefix+sub.name+" ")
				continue
			}
			fmt.Fprintf(tw, "  %s%s\t%s\n", prefix, sub.name, sub.summary)
		}
	}
	walk(c, "")
	if len(path) == 1 {
		fmt.Fprintf(tw, "  help <command>\tshow a command's flags and arguments, as <command> -h does\n")
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\nRun '%s <command> -h' for a command's flags and arguments.\n", name)
	if len(path) > 1 {
		return
	}
	fmt.Fprint(w, "\nEvery command that prints a result takes --json: snake_case keys, times in\n"+
		"RFC 3339 UTC, durations in seconds (keys ending in _seconds), null when unset.\n")
	fmt.Fprint(w, "\nEnvironment (a flag wins over its variable):\n")
	tw = tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	for _, e := range environment {
		fmt.Fprintf(tw, "  %s\t%s\n", e.name, e.flag)
	}
	_ = tw.Flush()
	fmt.Fprint(w, "\nExit codes:\n")
	for _, e := range exitCodes {
		fmt.Fprintf(w, "  %d  %s\n", e.code, e.text)
	}
}

func (a *app) leafUsage(w io.Writer, c *command, path []string, f *flags) {
	name := strings.Join(path, " ")
	fmt.Fprintf(w, "Usage: %s [flags]", name)
	if c.args != "" {
		fmt.Fprintf(w, " %s", c.args)
	}
	fmt.Fprintf(w, "\n\n%s\n", c.summary)
	if c.help != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimSpace(c.help))
	}
	fmt.Fprint(w, "\nFlags:\n")
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	f.VisitAll(func(fl *flag.Flag) {
		arg, usage := flag.UnquoteUsage(fl)
		if arg != "" {
			arg = " " + arg
		}
		// Every flag shows its default, but a boolean's (false) and an
		// empty string's (the usage says what empty means). A flag read
		// from the environment names its variable, never the value (it
		// may hold a password).
		switch env, ok := f.env[fl.Name]; {
		case ok:
			usage += " (env " + env + ")"
		case fl.DefValue != "" && !isBoolFlag(fl):
			usage += " (default " + fl.DefValue + ")"
		}
		fmt.Fprintf(tw, "  --%s%s\t%s\n", fl.Name, arg, usage)
	})
	fmt.Fprintf(tw, "  -h, --help\tshow this help\n")
	_ = tw.Flush()
}
