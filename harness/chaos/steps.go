package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/justonce/justonce/examples/payments/stepspay"
)

// fStepsKill is the steps fault: the payment service in steps (package
// stepspay) SIGKILLed between and inside the steps of its payments.
const fStepsKill = "steps service SIGKILL"

// stepsWorker is the payment service in steps, in a child process
// (`chaos steps-worker`), as stepspay.Prove starts it.
func stepsWorker() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Minute) // never outlive the run
	defer cancel()
	if err := stepspay.RunChild(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "chaos steps-worker:", err)
		return 1
	}
	return 0
}

// runSteps injects the steps fault (-steps-kills), once the run's other
// faults are over and judged: stepspay.Prove runs the payment service in
// steps on every front (HTTP, gRPC, kafka-go, franz-go, NATS), each
// payment delivered twice, and SIGKILLs it -steps-kills times, at each
// point between and inside a payment's steps in turn (around the order's
// transaction, before the provider call, after it and before its record,
// after its record, around the receipt's transaction), the fronts in
// turn; then it runs it to completion and checks every payment: one order
// row, one receipt, one charge at the provider. A failed check is a
// violation.
func (e *env) runSteps(ctx context.Context) {
	o, s := e.o, e.sum
	if o.stepsKills <= 0 {
		return
	}
	s.asked[fStepsKill] = o.stepsKills
	exe, err := os.Executable()
	if err != nil {
		s.problem("steps: %v", err)
		return
	}
	fmt.Fprintf(errOut, "chaos: steps: %d payments a front, %d SIGKILLs of the payment service\n", o.stepsPayments, o.stepsKills)
	rep, err := stepspay.Prove(ctx, stepspay.Config{
		Pool: e.pool, PGURL: e.workerPG, Brokers: e.brokers, NATSURL: e.nats.url(),
		Unique:   strings.ReplaceAll(e.schema, "_", "-"),
		PerFront: o.stepsPayments, Rounds: o.stepsKills,
		Command: func(env []string) *exec.Cmd {
			cmd := exec.Command(exe, "steps-worker")
			cmd.Env = append(os.Environ(), env...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			return cmd
		},
		Logf: func(format string, args ...any) { fmt.Fprintf(errOut, "chaos: steps: "+format+"\n", args...) },
	})
	s.faults[fStepsKill] = len(rep.Kills)
	s.steps = &rep
	if err != nil {
		s.problem("steps: %v", err)
		if n := len(rep.Output); n > 0 {
			fmt.Fprintf(errOut, "chaos: steps: the payment service's last run:\n%s\n", rep.Output[n-1])
		}
	}
}

// stepsExtra is what the summary says after the steps fault's count.
func (s *summary) stepsExtra() string {
	r := s.steps
	if r == nil || r.Payments == 0 {
		return ""
	}
	return fmt.Sprintf(" (%d payments over %s, each delivered twice: one order, one receipt, one charge each; "+
		"the provider deduplicated %d repeated charges; resumed under a later lease: %v)",
		r.Payments, strings.Join(stepspay.AllFronts, ", "), r.Repeats, r.Resumed)
}
