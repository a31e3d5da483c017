// Package testsvc gives each test its real service: Postgres, Redis, Apache
// Kafka and NATS.
//
// Each service is found in this order:
//  1. an environment variable pointing at a running one
//     (JUSTONCE_TEST_POSTGRES_URL, JUSTONCE_TEST_REDIS_ADDR,
//     JUSTONCE_TEST_KAFKA_BROKERS, JUSTONCE_TEST_NATS_URL), also read from
//     the .services.env file that `make services-up` writes at the repository
//     root;
//  2. a container through testcontainers-go, when a Docker engine answers
//     (first, when JUSTONCE_TEST_CONTAINERS=1); containers use host
//     networking and free loopback ports, carry the label justonce.test=1,
//     and are started once per test process (PostgresContainer and
//     RedisContainer start one for a single test, terminated when it ends);
//  3. for NATS, the real server embedded in-process.
//
// When none is there the test fails with a message saying how to start one.
// Nothing is ever skipped.
//
// A program, not a test, starts the services that take a testing.TB (a
// replica set, Sentinel, a NATS cluster: the chaos and soak runs of
// harness/chaos do) with a Program, whose Fatal is a panic that Catch
// turns into an error.
package testsvc

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go"

	"github.com/justonce/justonce/harness/svcenv"
)

// Environment variables naming running services.
const (
	EnvPostgres = "JUSTONCE_TEST_POSTGRES_URL"
	EnvRedis    = "JUSTONCE_TEST_REDIS_ADDR"
	EnvKafka    = "JUSTONCE_TEST_KAFKA_BROKERS"
	EnvNATS     = "JUSTONCE_TEST_NATS_URL"
)

const howTo = "start the test services with `make services-up` (no Docker needed), or set %s to a running one, or run a Docker engine for testcontainers-go"

// Getenv returns the variable from the environment, else from the
// .services.env file at the repository root.
func Getenv(name string) string { return svcenv.Get(name) }

// RepoRoot returns the directory holding go.mod, searching up from the
// working directory.
func RepoRoot() string { return svcenv.RepoRoot() }

var (
	dockerOnce sync.Once
	dockerOK   bool
)

// dockerAvailable probes once per process for a Docker engine.
func dockerAvailable() bool {
	dockerOnce.Do(func() {
		p, err := testcontainers.NewDockerProvider()
		if err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		dockerOK = p.Health(ctx) == nil
	})
	return dockerOK
}

// containers started by this process, shared by its tests.
var (
	ctrMu sync.Mutex
	ctrs  = map[string]string{}
)

// fromContainer starts (once per process) a container and returns the
// address that start produced.
func fromContainer(name string, start func(ctx context.Context) (string, error)) (string, error) {
	ctrMu.Lock()
	defer ctrMu.Unlock()
	if a, ok := ctrs[name]; ok {
		return a, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a, err := start(ctx)
	if err != nil {
		return "", err
	}
	ctrs[name] = a
	return a, nil
}

// resolve finds a service address: env, else container, else fail.
func resolve(t testing.TB, env, name string, start func(ctx context.Context) (string, error)) string {
	t.Helper()
	if v := Getenv(env); v != "" && !(start != nil && forceContainers()) {
		return v
	}
	if start != nil && dockerAvailable() {
		a, err := fromContainer(name, start)
		if err != nil {
			t.Fatalf("testsvc: %s container: %v", name, err)
		}
		return a
	}
	t.Fatalf("testsvc: no %s: "+howTo, name, env)
	return ""
}
