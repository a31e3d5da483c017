package main

import (
	"encoding/json"
	"io"
	"time"
)

// The JSON output follows one set of rules, listed in the package
// documentation: snake_case keys, every key always present, null for a
// value that is not set, times as RFC 3339 strings in UTC (timePtr),
// durations as seconds in a float whose key ends in _seconds (seconds),
// counts as numbers.

// writeJSON writes v as indented JSON and a newline.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// timePtr returns t in UTC, nil when zero (null in JSON).
func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC().Round(0)
	return &t
}

// seconds is d in seconds, the one unit of durations in the JSON output.
func seconds(d time.Duration) float64 {
	return d.Seconds()
}

// strPtr returns s, nil when empty (null in JSON).
func strPtr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// timeText formats t in UTC, "-" when zero.
func timeText(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// relative says how far t is from now: "3m5s ago", "in 23h59m".
func relative(t, now time.Time) string {
	d := t.Sub(now)
	if d < 0 {
		return roundDuration(-d).String() + " ago"
	}
	return "in " + roundDuration(d).String()
}

// roundDuration keeps durations readable: whole seconds from one second up,
// milliseconds below.
func roundDuration(d time.Duration) time.Duration {
	if d >= time.Second {
		return d.Round(time.Second)
	}
	return d.Round(time.Millisecond)
}

// leaseText describes a lease's end: "2026-01-02T15:04:05Z (ran out 5m ago)".
func leaseText(until, now time.Time) string {
	if until.IsZero() {
		return "-"
	}
	if until.Before(now) {
		return timeText(until) + " (ran out " + roundDuration(now.Sub(until)).String() + " ago)"
	}
	return timeText(until) + " (runs out " + relative(until, now) + ")"
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
