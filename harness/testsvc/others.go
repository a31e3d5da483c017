package testsvc

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/redis/go-redis/v9"
)

// RedisAddr returns host:port of the test Redis server.
func RedisAddr(t testing.TB) string {
	t.Helper()
	return resolve(t, EnvRedis, "redis", func(ctx context.Context) (string, error) {
		_, addr, err := startRedisContainer(ctx)
		return addr, err
	})
}

// Redis returns a client of the test Redis server and a key prefix unique
// to the test. The client has ContextTimeoutEnabled set.
func Redis(t testing.TB) (redis.UniversalClient, string) {
	t.Helper()
	c := NewRedisClient(RedisAddr(t))
	t.Cleanup(func() { _ = c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("testsvc: cannot reach Redis: %v ("+howTo+")", err, EnvRedis)
	}
	return c, Unique("t") + ":"
}

// NewRedisClient is the client the tests use: short timeouts, context
// deadlines honoured.
func NewRedisClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr:                  addr,
		ContextTimeoutEnabled: true,
		DialTimeout:           2 * time.Second,
		ReadTimeout:           2 * time.Second,
		WriteTimeout:          2 * time.Second,
		MaxRetries:            -1,
		PoolSize:              64,
	})
}

// RedisProcess is a redis-server of the test's own, which the test may stop
// and start again (fault injection) without disturbing other tests.
type RedisProcess struct {
	Addr string
	bin  string
	port int
	dir  string
	cmd  *exec.Cmd
}

// StartRedis starts a private redis-server (Debian's redis-server, found on
// PATH or in JUSTONCE_REDIS_SERVER) on a free loopback port, without
// persistence. It is stopped when the test ends.
func StartRedis(t testing.TB) *RedisProcess {
	t.Helper()
	bin := redisServerBin(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	p := &RedisProcess{Addr: "127.0.0.1:" + strconv.Itoa(port), bin: bin, port: port, dir: t.TempDir()}
	p.Start(t)
	t.Cleanup(func() { p.Stop(t) })
	return p
}

// Start starts the server (again) and waits until it answers.
func (p *RedisProcess) Start(t testing.TB) {
	t.Helper()
	p.cmd = exec.Command(p.bin, "--port", strconv.Itoa(p.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", p.dir)
	p.cmd.Stdout, p.cmd.Stderr = nil, nil
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("testsvc: start redis-server: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", p.Addr, 100*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("testsvc: redis-server on %s did not answer in 10s", p.Addr)
}

// Stop kills the server (SIGKILL: nothing is flushed) and waits for it.
func (p *RedisProcess) Stop(t testing.TB) {
	t.Helper()
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

// KafkaBrokers returns the test Kafka brokers.
func KafkaBrokers(t testing.TB) []string {
	t.Helper()
	v := resolve(t, EnvKafka, "kafka", func(ctx context.Context) (string, error) {
		_, addr, err := startKafkaContainer(ctx)
		return addr, err
	})
	return strings.Split(v, ",")
}

// NATSURL returns the URL of a NATS server with JetStream for the test:
// JUSTONCE_TEST_NATS_URL when set, else a real nats-server embedded in the
// test process with a file store in a temporary directory (written without
// fsync per message, the server's default), shut down when the test ends.
func NATSURL(t testing.TB) string {
	t.Helper()
	if v := Getenv(EnvNATS); v != "" {
		return v
	}
	ns := StartNATS(t, "")
	return ns.ClientURL()
}

// StartNATS starts an embedded nats-server with JetStream storing under dir
// (a new temporary directory when empty). It is shut down when the test
// ends; tests may Shutdown and start another on the same dir to simulate a
// restart.
func StartNATS(t testing.TB, dir string) *server.Server {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	ns, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      -1,
		JetStream: true,
		StoreDir:  filepath.Join(dir, "js"),
		NoLog:     true,
		NoSigs:    true,
	})
	if err != nil {
		t.Fatalf("testsvc: nats server: %v", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatalf("testsvc: embedded nats-server not ready")
	}
	t.Cleanup(func() {
		ns.Shutdown()
		ns.WaitForShutdown()
	})
	return ns
}

// Eventually polls cond every 10 ms until it returns true or the deadline
// passes, then fails the test with msg.
func Eventually(t testing.TB, deadline time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	end := time.Now().Add(deadline)
	for {
		if cond() {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("testsvc: condition not met within %s: %s", deadline, fmt.Sprintf(msg, args...))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
