package kafkainbox_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The same program, written once against Kafka, runs against NATS after
// changing its import and its Config line: ExampleNew of this package and
// of natsinbox (both run, with their output checked) differ in exactly the
// line that builds the Consumer.
func TestExampleNewIsTheSameProgramOnNATS(t *testing.T) {
	body := func(path string) []string {
		src, err := os.ReadFile(path)
		require.NoError(t, err)
		m := regexp.MustCompile(`(?s)\nfunc ExampleNew\(\) \{\n(.*?)\n\}\n`).FindSubmatch(src)
		require.NotNil(t, m, "ExampleNew in %s", path)
		return strings.Split(string(m[1]), "\n")
	}
	kafka, nats := body("example_test.go"), body("../natsinbox/example_test.go")
	require.Equal(t, len(kafka), len(nats), "the same number of lines")
	var differ []string
	for i := range kafka {
		if kafka[i] != nats[i] {
			differ = append(differ, kafka[i], nats[i])
		}
	}
	require.Len(t, differ, 2, "one line differs: %q", differ)
	require.Contains(t, differ[0], "c, err := kafkainbox.New(kafkainbox.Config{")
	require.Contains(t, differ[1], "c, err := natsinbox.New(natsinbox.Config{")
}
