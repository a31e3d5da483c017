//go:build unix

package stepspay

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/justonce/justonce/inbox"
)

// The child process's environment: where the payment service finds its
// services, and where it kills itself.
const (
	envPG       = "JUSTONCE_STEPSPAY_PG"
	envProvider = "JUSTONCE_STEPSPAY_PROVIDER"
	envHTTP     = "JUSTONCE_STEPSPAY_HTTP"
	envGRPC     = "JUSTONCE_STEPSPAY_GRPC"
	envBrokers  = "JUSTONCE_STEPSPAY_BROKERS"
	envTopics   = "JUSTONCE_STEPSPAY_TOPICS" // kafka-go's,franz-go's
	envNATS     = "JUSTONCE_STEPSPAY_NATS"
	envStream   = "JUSTONCE_STEPSPAY_STREAM"
	envGroup    = "JUSTONCE_STEPSPAY_GROUP"
	envKill     = "JUSTONCE_STEPSPAY_KILL" // front/point/passage; empty: run until ctx ends
)

// LeaseDuration is the payment service's lease: a payment a killed
// process held is taken over this long after the kill.
const LeaseDuration = time.Second

// RunChild is the payment service in a child process that Prove started
// (its Config.Command runs a program that calls RunChild): it reads its
// environment, serves every front until ctx ends, and SIGKILLs itself at
// the passage Prove asked for.
func RunChild(ctx context.Context) error {
	cfg, err := pgxpool.ParseConfig(os.Getenv(envPG))
	if err != nil {
		return err
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ledger, err := inbox.New(pool, inbox.Config{LeaseDuration: LeaseDuration,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))})
	if err != nil {
		return err
	}
	var crash func(front, point string)
	if k := strings.Split(os.Getenv(envKill), "/"); len(k) == 3 {
		at, _ := strconv.ParseInt(k[2], 10, 64)
		var hits atomic.Int64
		crash = func(front, point string) {
			if front == k[0] && point == k[1] && hits.Add(1) == at {
				fmt.Fprintf(os.Stderr, "payment service: SIGKILL at %s %s (passage %d)\n", front, point, at)
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				time.Sleep(time.Minute)
			}
		}
	}
	nc, err := nats.Connect(os.Getenv(envNATS))
	if err != nil {
		return err
	}
	defer nc.Close()
	topics := strings.Split(os.Getenv(envTopics), ",")
	if len(topics) != 2 {
		return fmt.Errorf("stepspay: %s wants two topics, got %q", envTopics, os.Getenv(envTopics))
	}
	return NewService(os.Getenv(envProvider), crash).Serve(ctx, ledger, Fronts{
		HTTPAddr: os.Getenv(envHTTP), GRPCAddr: os.Getenv(envGRPC),
		Brokers: strings.Split(os.Getenv(envBrokers), ","), KafkaTopic: topics[0], FranzTopic: topics[1],
		Group: os.Getenv(envGroup), NATS: nc, Stream: os.Getenv(envStream), LeaseDuration: LeaseDuration,
	})
}
