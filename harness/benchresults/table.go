package benchresults

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"unicode/utf8"
)

// Table is one table of a results file, with an optional heading and
// paragraphs before and after it.
type Table struct {
	Heading string   // a Markdown heading line ("### ./inbox"), or ""
	Before  []string // paragraphs before the table
	Columns []string
	Right   []bool // per column: right-aligned (numbers)
	Rows    [][]string
	After   []string // paragraphs after the table
}

// Markdown writes the table as GitHub-flavoured Markdown, its columns
// padded so that the file reads as a table in a terminal too.
func (t Table) Markdown(w io.Writer) error {
	var b strings.Builder
	if t.Heading != "" {
		b.WriteString(t.Heading + "\n\n")
	}
	for _, p := range t.Before {
		b.WriteString(p + "\n\n")
	}
	if len(t.Columns) > 0 {
		width := make([]int, len(t.Columns))
		cell := func(row []string, i int) string {
			if i < len(row) {
				return strings.ReplaceAll(row[i], "|", `\|`)
			}
			return ""
		}
		for i := range t.Columns {
			width[i] = max(3, utf8.RuneCountInString(cell(t.Columns, i)))
			for _, r := range t.Rows {
				width[i] = max(width[i], utf8.RuneCountInString(cell(r, i)))
			}
		}
		right := func(i int) bool { return i < len(t.Right) && t.Right[i] }
		line := func(row []string) {
			b.WriteString("|")
			for i := range t.Columns {
				c := cell(row, i)
				pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(c))
				if right(i) {
					b.WriteString(" " + pad + c + " |")
				} else {
					b.WriteString(" " + c + pad + " |")
				}
			}
			b.WriteString("\n")
		}
		line(t.Columns)
		b.WriteString("|")
		for i := range t.Columns {
			if right(i) {
				b.WriteString(" " + strings.Repeat("-", width[i]-1) + ": |")
			} else {
				b.WriteString(" " + strings.Repeat("-", width[i]) + " |")
			}
		}
		b.WriteString("\n")
		for _, r := range t.Rows {
			line(r)
		}
		b.WriteString("\n")
	}
	for _, p := range t.After {
		b.WriteString(p + "\n\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Summary is what a set of samples (one per round) comes to.
type Summary struct {
	Median, Min, Max float64
	N                int
}

// Summarize returns the median, the minimum and the maximum of xs.
func Summarize(xs []float64) Summary {
	if len(xs) == 0 {
		return Summary{Median: math.NaN(), Min: math.NaN(), Max: math.NaN()}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return Summary{Median: m, Min: s[0], Max: s[len(s)-1], N: len(s)}
}

// Range formats the summary's range as "min–max" with format.
func (s Summary) Range(format func(float64) string) string {
	return format(s.Min) + "–" + format(s.Max)
}

// FormatValue formats a metric with as many digits as go test prints it:
// four significant ones, integers from 1000 up.
func FormatValue(v float64) string {
	if math.IsNaN(v) {
		return "?"
	}
	var f string
	switch y := math.Abs(v); {
	case y == 0 || y >= 999.95:
		f = "%.0f"
	case y >= 99.995:
		f = "%.1f"
	case y >= 9.9995:
		f = "%.2f"
	case y >= 0.99995:
		f = "%.3f"
	case y >= 0.099995:
		f = "%.4f"
	case y >= 0.0099995:
		f = "%.5f"
	case y >= 0.00099995:
		f = "%.6f"
	default:
		f = "%.7f"
	}
	return fmt.Sprintf(f, v)
}

// FormatRatio formats a ratio with two decimals (as the documentation
// quotes ratios; more digits below 0.1) and a "×".
func FormatRatio(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "?"
	}
	if math.Abs(v) < 0.1 {
		return FormatValue(v) + "×"
	}
	return fmt.Sprintf("%.2f×", v)
}
