package migrations

import (
	"strings"
	"testing"
)

// The plain table's file parses into its columns, with its constraints
// but the primary key; a file whose table the parse cannot read fails the
// conversion instead of writing a table that lacks columns.
func TestParseTable(t *testing.T) {
	p, err := plainTable()
	if err != nil {
		t.Fatal(err)
	}
	if len(p.names) < 4 || strings.Join(p.names[:3], " ") != "scope tenant event_id" || !strings.Contains(p.columns, "expires_at ") {
		t.Fatalf("columns: %v", p.names)
	}
	if strings.Contains(p.constraints, "processed_events_pkey") || !strings.Contains(p.constraints, "processed_events_status_check") {
		t.Fatalf("constraints: %s", p.constraints)
	}
	for name, text := range map[string]string{
		"no table":       "CREATE TABLE other (\n    a int\n);",
		"no primary key": "CREATE TABLE IF NOT EXISTS processed_events (\n    a int,\n    CONSTRAINT c CHECK (a > 0)\n);",
		"no comma":       "CREATE TABLE IF NOT EXISTS processed_events (\n    a int\n    CONSTRAINT processed_events_pkey PRIMARY KEY (a)\n);",
		"column after constraint": "CREATE TABLE IF NOT EXISTS processed_events (\n    CONSTRAINT processed_events_pkey PRIMARY KEY (a),\n" +
			"    a int,\n);",
	} {
		if _, err := parseTable(text); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}
