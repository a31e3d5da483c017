//go:build linux

package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/examples/payments/stepspay"
	"github.com/justonce/justonce/harness/testsvc"
)

// The proof's knobs.
const (
	// envStepsPayments is how many payments each front gets (default 200:
	// 1,000 over the five fronts).
	envStepsPayments = "JUSTONCE_PAYMENTS_STEPS_PER_FRONT"
	// envStepsRounds is how many runs of the payment service are
	// SIGKILLed (default 14: each kill point twice, the fronts in turn;
	// 35 kills every front at every point).
	envStepsRounds = "JUSTONCE_PAYMENTS_STEPS_ROUNDS"
	envChild       = "JUSTONCE_PAYMENTS_STEPS_CHILD"
)

func init() {
	child = func() (int, bool) {
		if os.Getenv(envChild) != "1" {
			return 0, false
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		ctx, cancel := context.WithTimeout(ctx, 4*time.Minute) // never outlive the test
		defer cancel()
		if err := stepspay.RunChild(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "payment service:", err)
			return 1, true
		}
		return 0, true
	}
}

// envInt reads a positive integer knob.
func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err, name)
	require.Positive(t, n, name)
	return n
}

// The payment service in steps (package stepspay), serving payments over
// HTTP, gRPC, Kafka (kafka-go and franz-go) and NATS JetStream, is
// SIGKILLed at every point between and inside the steps of a payment
// (before the provider call, after it but before its recovery point,
// after it, and around the Postgres steps), the fronts in turn, with every
// payment delivered twice and earlier payments resuming where the kills
// left them; then it runs to completion. Each payment must have one order
// row, one receipt, and one charge at the provider (a separate HTTP
// service behind justonce's own HTTP bridge), whose charge ID both of its
// deliveries got (HTTP, gRPC) or the ledger recorded (the consumers). It
// fails unless some charge was repeated with its key and deduplicated by
// the provider, and some payment resumed under a later lease: the kills
// must land with work in flight.
func TestStepsKilledOnEveryFront(t *testing.T) {
	pg := testsvc.Postgres(t, testsvc.MaxConns(8))
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	rep, err := stepspay.Prove(ctx, stepspay.Config{
		Pool: pg.Pool, PGURL: pg.URL, Brokers: testsvc.KafkaBrokers(t), NATSURL: testsvc.NATSURL(t),
		Unique:   testsvc.Unique("t"),
		PerFront: envInt(t, envStepsPayments, 200), Rounds: envInt(t, envStepsRounds, 14),
		Command: func(env []string) *exec.Cmd {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(append(os.Environ(), envChild+"=1"), env...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			return cmd
		},
		Logf: t.Logf,
	})
	if err != nil {
		for i, out := range rep.Output {
			t.Logf("payment service run %d output:\n%s", i, out)
		}
	}
	require.NoError(t, err)
	t.Logf("%d payments over %d kills: one order row, one receipt and one charge each; the provider got %d charge requests, "+
		"%d of them repeats of a key it had charged (deduplicated by its bridge); payments resumed under a later lease: %v",
		rep.Payments, len(rep.Kills), rep.Requests, rep.Repeats, rep.Resumed)
}
