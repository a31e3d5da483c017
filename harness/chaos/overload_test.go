package main

import (
	"context"
	"testing"
	"time"

	"github.com/justonce/justonce/harness/testsvc"
)

// The overload fault holds every INSERT into effects, with its
// connection, until it heals, and lets reads go on.
func TestOverloadFaultHoldsTheHandlers(t *testing.T) {
	pg := testsvc.Postgres(t, testsvc.MaxConns(4))
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL, transport text NOT NULL)`)
	e := &env{pool: pg.Pool, o: options{overloadFor: 300 * time.Millisecond}, sum: &summary{down: map[string][]time.Duration{}}}
	f := &overload{e: e}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ok, err := f.inject(ctx)
	if err != nil || !ok {
		t.Fatalf("inject: %v, %v", ok, err)
	}
	start := time.Now()
	inserted := make(chan time.Duration, 1)
	go func() {
		_, err := pg.Pool.Exec(ctx, `INSERT INTO effects VALUES ('e-1', 'http')`)
		if err != nil {
			t.Error(err)
		}
		inserted <- time.Since(start)
	}()
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO effects%'`) == 1
	}, "the INSERT waits on the lock")
	if n := pg.Count(t, `SELECT count(*) FROM effects`); n != 0 { // reads go on
		t.Fatalf("%d effects while locked", n)
	}
	if err := f.heal(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-inserted:
		if d < 300*time.Millisecond {
			t.Fatalf("the INSERT went through after %s, before the overload healed", d)
		}
	case <-ctx.Done():
		t.Fatal("the INSERT did not go through after the heal")
	}
	if got := len(e.sum.down[fOverload]); got != 1 {
		t.Fatalf("%d overload durations recorded", got)
	}
}
