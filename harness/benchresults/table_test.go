package benchresults

import (
	"bytes"
	"math"
	"testing"
)

func TestTableMarkdown(t *testing.T) {
	tb := Table{
		Heading: "### ./inbox",
		Before:  []string{"`go test ./inbox`."},
		Columns: []string{"benchmark", "metric", "value"},
		Right:   []bool{false, false, true},
		Rows: [][]string{
			{"BenchmarkA/x|y", "ratio", "0.93×"},
			{"", "plain-size-swing-±%", "48.50"},
		},
		After: []string{"after"},
	}
	var b bytes.Buffer
	if err := tb.Markdown(&b); err != nil {
		t.Fatal(err)
	}
	want := "### ./inbox\n\n`go test ./inbox`.\n\n" +
		"| benchmark       | metric              | value |\n" +
		"| --------------- | ------------------- | ----: |\n" +
		"| BenchmarkA/x\\|y | ratio               | 0.93× |\n" +
		"|                 | plain-size-swing-±% | 48.50 |\n" +
		"\nafter\n\n"
	if b.String() != want {
		t.Errorf("got\n%s\nwant\n%s", b.String(), want)
	}
}

func TestSummarize(t *testing.T) {
	if s := Summarize([]float64{3, 1, 2}); s != (Summary{Median: 2, Min: 1, Max: 3, N: 3}) {
		t.Errorf("odd: %+v", s)
	}
	if s := Summarize([]float64{4, 1, 2, 3}); s != (Summary{Median: 2.5, Min: 1, Max: 4, N: 4}) {
		t.Errorf("even: %+v", s)
	}
	if s := Summarize(nil); !math.IsNaN(s.Median) || s.N != 0 {
		t.Errorf("empty: %+v", s)
	}
	if got := Summarize([]float64{0.91, 0.955, 0.93}).Range(FormatRatio); got != "0.91×–0.95×" && got != "0.91×–0.96×" {
		t.Errorf("range %q", got)
	}
}

func TestFormat(t *testing.T) {
	for v, want := range map[float64]string{
		0: "0", 1234567: "1234567", 999.96: "1000", 974.4: "974.4", 48.5: "48.50", 8.326: "8.326",
		0.6246: "0.6246", 0.01234: "0.01234", 0.0001234: "0.0001234", -2.5: "-2.500",
	} {
		if got := FormatValue(v); got != want {
			t.Errorf("FormatValue(%v) = %q, want %q", v, got, want)
		}
	}
	for v, want := range map[float64]string{0.6246: "0.62×", 1.352: "1.35×", 12.346: "12.35×", 0.0123: "0.01230×", math.Inf(1): "?", math.NaN(): "?"} {
		if got := FormatRatio(v); got != want {
			t.Errorf("FormatRatio(%v) = %q, want %q", v, got, want)
		}
	}
}
