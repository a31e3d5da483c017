package grpcbridge_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/harness/testsvc"
)

// exampleTB lets the examples borrow the tests' service discovery (an
// environment variable, .services.env or a container) without a
// *testing.T. Only the methods testsvc uses are provided.
type exampleTB struct {
	testing.TB
	cleanups []func()
}

func (e *exampleTB) Helper()                           {}
func (e *exampleTB) Cleanup(f func())                  { e.cleanups = append(e.cleanups, f) }
func (e *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleTB) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }

// exampleDB gives an example a migrated schema of its own, with a
// payments table; call the returned func when done.
func exampleDB() (*pgxpool.Pool, func()) {
	tb := &exampleTB{}
	pg := testsvc.Postgres(tb)
	if _, err := pg.Pool.Exec(context.Background(), `CREATE TABLE payments (id bigserial PRIMARY KEY, account text NOT NULL)`); err != nil {
		panic(err)
	}
	return pg.Pool, func() {
		for i := len(tb.cleanups) - 1; i >= 0; i-- {
			tb.cleanups[i]()
		}
	}
}
