package testsvc

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

// JSONLog captures what a logger writes, as JSON lines, for a test that
// looks for a line and its attributes. The zero value is ready to use.
type JSONLog struct{ buf LogBuffer }

// Logger returns a logger, at every level, that writes to l.
func (l *JSONLog) Logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(&l.buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// String returns everything written so far.
func (l *JSONLog) String() string { return l.buf.String() }

// Find returns the lines whose message contains msg, each as its JSON
// object ("level", "msg" and the attributes).
func (l *JSONLog) Find(msg string) []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(l.buf.String()))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && strings.Contains(fmt.Sprint(m["msg"]), msg) {
			out = append(out, m)
		}
	}
	return out
}

// One returns the one line whose message contains msg, failing the test
// when there is none or more than one.
func (l *JSONLog) One(t testing.TB, msg string) map[string]any {
	t.Helper()
	lines := l.Find(msg)
	if len(lines) != 1 {
		t.Fatalf("testsvc: %d log lines %q in:\n%s", len(lines), msg, l.buf.String())
	}
	return lines[0]
}
