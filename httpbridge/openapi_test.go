package httpbridge

import (
	"os"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// TestOpenAPIFragment keeps openapi.yaml in step with the code: it parses,
// lists every problem type the bridge answers, and its examples carry the
// titles the bridge sends.
func TestOpenAPIFragment(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("openapi.yaml")
	require.NoError(t, err)
	var doc struct {
		OpenAPI    string `yaml:"openapi"`
		Components struct {
			Parameters map[string]struct {
				Name   string `yaml:"name"`
				In     string `yaml:"in"`
				Schema struct {
					MaxLength int `yaml:"maxLength"`
				} `yaml:"schema"`
			} `yaml:"parameters"`
			Headers map[string]struct {
				Description string `yaml:"description"`
			} `yaml:"headers"`
			Schemas struct {
				Problem struct {
					Properties struct {
						Type struct {
							Enum []string `yaml:"enum"`
						} `yaml:"type"`
					} `yaml:"properties"`
				} `yaml:"Problem"`
			} `yaml:"schemas"`
			Responses map[string]struct {
				Content map[string]struct {
					Example  *problem `yaml:"example"`
					Examples map[string]struct {
						Value problem `yaml:"value"`
					} `yaml:"examples"`
				} `yaml:"content"`
			} `yaml:"responses"`
		} `yaml:"components"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &doc))
	require.Equal(t, "3.0.3", doc.OpenAPI)
	p := doc.Components.Parameters["IdempotencyKey"]
	require.Equal(t, defaultHeader, p.Name)
	require.Equal(t, "header", p.In)
	require.Equal(t, defaultMaxKeyLen, p.Schema.MaxLength)

	var want []string
	for typ := range problemTitles {
		want = append(want, typ)
	}
	got := doc.Components.Schemas.Problem.Properties.Type.Enum
	slices.Sort(want)
	slices.Sort(got)
	require.Equal(t, want, got)

	require.Contains(t, doc.Components.Headers, "IdempotencyKeyExpires")
	for _, code := range []string{"IdempotencyKeyInvalid", "IdempotencyRequestInProgress", "IdempotencyKeyReused", "IdempotencyKeyRateExceeded"} {
		require.Contains(t, doc.Components.Responses, code)
	}
	n := 0
	for name, r := range doc.Components.Responses {
		for _, c := range r.Content {
			var exs []problem
			if c.Example != nil && c.Example.Type != "" {
				exs = append(exs, *c.Example)
			}
			for _, e := range c.Examples {
				exs = append(exs, e.Value)
			}
			for _, e := range exs {
				require.Equal(t, problemTitles[e.Type], e.Title, "%s: %s", name, e.Type)
				n++
			}
		}
	}
	require.GreaterOrEqual(t, n, 7)
}
