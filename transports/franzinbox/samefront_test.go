package franzinbox_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The same program, written once against kafka-go, runs on franz-go after
// changing its import and its Config line: ExampleNew of this package and
// of kafkainbox (both run, with their output checked) differ in exactly the
// line that builds the Consumer.
func TestExampleNewIsTheSameProgramAsKafkainbox(t *testing.T) {
	body := func(path string) []string {
		src, err := os.ReadFile(path)
		require.NoError(t, err)
		m := regexp.MustCompile(`(?s)\nfunc ExampleNew\(\) \{\n(.*?)\n\}\n`).FindSubmatch(src)
		require.NotNil(t, m, "ExampleNew in %s", path)
		return strings.Split(string(m[1]), "\n")
	}
	franz, kafka := body("example_test.go"), body("../kafkainbox/example_test.go")
	require.Equal(t, len(kafka), len(franz), "the same number of lines")
	var differ []string
	for i := range kafka {
		if kafka[i] != franz[i] {
			differ = append(differ, franz[i], kafka[i])
		}
	}
	require.Len(t, differ, 2, "one line differs: %q", differ)
	require.Contains(t, differ[0], "c, err := franzinbox.New(franzinbox.Config{")
	require.Contains(t, differ[1], "c, err := kafkainbox.New(kafkainbox.Config{")
}
