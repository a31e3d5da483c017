// Package itest gives the integrations' tests and examples a real
// Postgres: a schema of their own with the ledger migrated and an orders
// table, through the root module's test services.
package itest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/harness/testsvc"
)

// init makes the services that `make services-up` started at the
// repository root visible from this nested module: the root's
// .services.env is not found from here by testsvc, which looks beside the
// nearest go.mod.
func init() {
	if os.Getenv(testsvc.EnvPostgres) != "" {
		return
	}
	dir, err := os.Getwd()
	if err != nil {
		return
	}
	for {
		if f, err := os.Open(filepath.Join(dir, ".services.env")); err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
				if ok && !strings.HasPrefix(k, "#") && os.Getenv(strings.TrimSpace(k)) == "" {
					_ = os.Setenv(strings.TrimSpace(k), strings.Trim(strings.TrimSpace(v), `"'`))
				}
			}
			f.Close()
			return
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return
		}
		dir = parent
	}
}

// OrdersTable is the table the examples' handlers write.
const OrdersTable = `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`

// DB returns a pool on a migrated schema of the test's own, with the
// orders table.
func DB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pg := testsvc.Postgres(t)
	pg.Exec(t, OrdersTable)
	return pg.Pool
}

// exampleTB lets examples use testsvc without a *testing.T.
type exampleTB struct {
	testing.TB
	cleanups []func()
}

func (e *exampleTB) Helper()                           {}
func (e *exampleTB) Cleanup(f func())                  { e.cleanups = append(e.cleanups, f) }
func (e *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleTB) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }

// ExampleDB is DB for an example; call the returned func when done.
func ExampleDB() (*pgxpool.Pool, func()) {
	tb := &exampleTB{}
	pool := DB(tb)
	return pool, func() {
		for i := len(tb.cleanups) - 1; i >= 0; i-- {
			tb.cleanups[i]()
		}
	}
}

// Response is what a client saw.
type Response struct {
	Status      int
	Replayed    bool
	ContentType string
	Body        string
	ProblemType string // the "type" of a problem+json body
}

// String is one line: status, replayed, and the body or the problem type.
func (r Response) String() string {
	s := fmt.Sprint(r.Status)
	if r.Replayed {
		s += " replayed"
	}
	if r.ProblemType != "" {
		return s + " " + r.ContentType + " " + r.ProblemType
	}
	return s + " " + r.Body
}

// Post sends body to url with the Idempotency-Key key.
func Post(url, key, body string) (Response, error) {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return Response{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return Response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return Response{}, err
	}
	out := Response{
		Status:      resp.StatusCode,
		Replayed:    resp.Header.Get("Idempotent-Replayed") == "true",
		ContentType: resp.Header.Get("Content-Type"),
		Body:        strings.TrimSpace(string(b)),
	}
	if out.ContentType == "application/problem+json" {
		var p struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(b, &p); err != nil {
			return out, fmt.Errorf("problem body: %w", err)
		}
		out.ProblemType = p.Type
	}
	return out, nil
}
