package main

import (
	"context"
	"errors"
	"time"
)

// run is one chaos run (or, with sk, the setup and verdict of a soak run):
// setup, the fronts, the schedule of faults with the production, and the
// verdict.
func run(ctx context.Context, o options, sk *soakRun) (sum *summary, err error) {
	start := time.Now()
	e := newEnv(o)
	if sk != nil {
		e.stats = sk.stats
	}
	sum = e.sum
	defer func() {
		sum.took = time.Since(start)
		e.keep = err != nil || sum.violations() > 0
		e.cleanup()
		if e.svc != nil {
			if uerr := e.svc.ensureUp(ctx); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
	}()
	if err := e.setup(ctx); err != nil {
		return sum, err
	}
	if err := e.startFronts(ctx); err != nil {
		return sum, err
	}
	if sk != nil {
		if err := sk.drive(ctx, e); err != nil {
			return sum, err
		}
	} else {
		s := newSchedule(e)
		if err := s.produceWithFaults(ctx); err != nil {
			return sum, err
		}
		if err := s.untilDone(ctx); err != nil {
			return sum, err
		}
	}
	stopped, err := e.stopAll(ctx)
	if err != nil {
		return sum, err
	}
	if err := e.judge(ctx, stopped); err != nil {
		return sum, err
	}
	if sk == nil {
		e.runSteps(ctx)
	}
	if sk != nil {
		sk.judge(ctx, e)
	}
	return sum, nil
}

// setup starts the services and the run's schema, Redis, NATS and fault
// proxy.
func (e *env) setup(ctx context.Context) error {
	if err := e.setupLayout(); err != nil {
		return err
	}
	if err := e.setupServices(ctx); err != nil {
		return err
	}
	if err := e.setupPostgres(ctx); err != nil {
		return err
	}
	if err := e.setupRedis(); err != nil {
		return err
	}
	if err := e.setupProxy(); err != nil {
		return err
	}
	return nil
}

// startFronts starts every front asked for, the pipelines and the
// janitor.
func (e *env) startFronts(ctx context.Context) error {
	for _, t := range []string{"kafka", "franz"} {
		if e.want[t] {
			if err := e.startKafka(t); err != nil {
				return err
			}
		}
	}
	if err := e.setupNATS(); err != nil {
		return err
	}
	if e.want["nats"] {
		if err := e.startNATS(ctx); err != nil {
			return err
		}
	}
	if e.want["http"] {
		if err := e.startHTTP(ctx); err != nil {
			return err
		}
	}
	if e.want["grpc"] {
		if err := e.startGRPC(ctx); err != nil {
			return err
		}
	}
	if e.hopsOn {
		if err := e.startHops(ctx); err != nil {
			return err
		}
	}
	e.startJanitor(ctx)
	return nil
}
