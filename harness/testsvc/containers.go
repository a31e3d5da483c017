package testsvc

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/moby/moby/api/types/container"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Environment variables of the container path.
const (
	// EnvContainers, set to 1, makes the tests start Postgres and Redis
	// (and Kafka) through testcontainers-go even when JUSTONCE_TEST_* or
	// .services.env name running services.
	EnvContainers = "JUSTONCE_TEST_CONTAINERS"
	// EnvImage names one local image holding both postgres and
	// redis-server (scripts/test-image.sh builds it from Debian's
	// packages); unset, the official postgres:16 and redis:7 images are
	// used.
	EnvImage = "JUSTONCE_TEST_IMAGE"
)

// ContainerLabel marks every container testsvc starts, so that an engine
// without the testcontainers reaper (TESTCONTAINERS_RYUK_DISABLED) can be
// swept: `docker rm -f $(docker ps -aq --filter label=justonce.test=1)`.
const ContainerLabel = "justonce.test"

func forceContainers() bool { return os.Getenv(EnvContainers) == "1" }

func imageFor(official string) string {
	if v := os.Getenv(EnvImage); v != "" {
		return v
	}
	return official
}

// freePort returns a loopback TCP port nobody listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// runContainer starts a container on the host's network (the only network
// the tests use: every service listens on a loopback port of its own).
func runContainer(ctx context.Context, req testcontainers.ContainerRequest) (testcontainers.Container, error) {
	req.HostConfigModifier = func(hc *container.HostConfig) { hc.NetworkMode = "host" }
	if req.Labels == nil {
		req.Labels = map[string]string{}
	}
	req.Labels[ContainerLabel] = "1"
	// The provider's default network is the engine's "host" network:
	// without it testcontainers-go would create a bridge network
	// (reaper_default) when the engine has no "bridge" one.
	p, err := testcontainers.NewDockerProvider(testcontainers.WithDefaultBridgeNetwork("host"))
	if err != nil {
		return nil, err
	}
	return p.RunContainer(ctx, req)
}

// startPostgresContainer starts Postgres on a free loopback port and waits
// until it answers a query. The caller terminates the container.
func startPostgresContainer(ctx context.Context) (testcontainers.Container, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	c, err := runContainer(ctx, testcontainers.ContainerRequest{
		Image: imageFor("postgres:16"),
		Env:   map[string]string{"POSTGRES_HOST_AUTH_METHOD": "trust"},
		Cmd: []string{"postgres", "-p", strconv.Itoa(port), "-c", "listen_addresses=127.0.0.1",
			"-c", "max_connections=400"},
	})
	if err != nil {
		return c, "", err
	}
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	// The official image runs a socket-only server while it initialises:
	// the first TCP answer is the real server.
	deadline := time.Now().Add(60 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(cctx, dsn)
		if err == nil {
			err = conn.Ping(cctx)
			_ = conn.Close(cctx)
		}
		cancel()
		if err == nil {
			return c, dsn, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return c, "", fmt.Errorf("postgres container on port %d did not answer: %w", port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startRedisContainer starts redis-server on a free loopback port.
func startRedisContainer(ctx context.Context) (testcontainers.Container, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	c, err := runContainer(ctx, testcontainers.ContainerRequest{
		Image: imageFor("redis:7"),
		Cmd: []string{"redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no"},
		WaitingFor: wait.ForLog("Ready to accept connections").WithStartupTimeout(60 * time.Second),
	})
	if err != nil {
		return c, "", err
	}
	return c, "127.0.0.1:" + strconv.Itoa(port), nil
}

// terminateOnCleanup stops and removes c when t ends.
func terminateOnCleanup(t testing.TB, c testcontainers.Container) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := testcontainers.TerminateContainer(c, testcontainers.StopContext(ctx)); err != nil {
			t.Errorf("testsvc: terminate container: %v", err)
		}
	})
}

// PostgresContainer starts a Postgres server of the test's own through
// testcontainers-go (host networking, a free loopback port) and returns
// its URL. The container is terminated when the test ends.
func PostgresContainer(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, dsn, err := startPostgresContainer(ctx)
	if c != nil {
		terminateOnCleanup(t, c)
	}
	if err != nil {
		t.Fatalf("testsvc: postgres container: %v", err)
	}
	return dsn
}

// RedisContainer starts a Redis server of the test's own through
// testcontainers-go (host networking, a free loopback port) and returns
// its address. The container is terminated when the test ends.
func RedisContainer(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, addr, err := startRedisContainer(ctx)
	if c != nil {
		terminateOnCleanup(t, c)
	}
	if err != nil {
		t.Fatalf("testsvc: redis container: %v", err)
	}
	return addr
}

// envChild marks the child process RunInContainers starts.
const envChild = "JUSTONCE_TEST_CONTAINERS_CHILD"

// InContainersChild reports whether this process is the child of
// RunInContainers (whose parent test must not start another).
func InContainersChild() bool { return os.Getenv(envChild) == "1" }

// SuiteResult is what RunInContainers found.
type SuiteResult struct {
	Passed, Failed int
	// Commits is the number of transactions the container's Postgres
	// committed in the test database while the suite ran.
	Commits int64
}

var passLine = regexp.MustCompile(`^\s*--- (PASS|FAIL): `)

// RunInContainers runs this test binary's tests matching run (a -test.run
// pattern; skip, when not empty, a -test.skip pattern) in a child process
// whose Postgres and Redis are containers started here through
// testcontainers-go and terminated when t ends. The child's output is
// logged; t fails unless the child passes, ran at least one test and made
// the container's Postgres commit transactions.
func RunInContainers(t *testing.T, run, skip string) SuiteResult {
	t.Helper()
	if InContainersChild() {
		t.Fatalf("testsvc: RunInContainers called in its own child: exclude the parent test with the skip pattern")
	}
	start := time.Now()
	pgURL := PostgresContainer(t)
	redisAddr := RedisContainer(t)
	t.Logf("containers ready in %s: postgres %s, redis %s", time.Since(start).Round(time.Millisecond), pgURL, redisAddr)
	commits0 := pgCommits(t, pgURL)

	args := []string{"-test.run", run, "-test.count", "1", "-test.v"}
	if skip != "" {
		args = append(args, "-test.skip", skip)
	}
	if d, ok := t.Deadline(); ok {
		args = append(args, "-test.timeout", time.Until(d).Round(time.Second).String())
	}
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(),
		envChild+"=1",
		EnvContainers+"=0",
		EnvPostgres+"="+pgURL,
		EnvRedis+"="+redisAddr,
		"DATABASE_URL="+pgURL,
	)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()

	var res SuiteResult
	sc := bufio.NewScanner(bytes.NewReader(out.Bytes()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if m := passLine.FindStringSubmatch(sc.Text()); m != nil {
			if m[1] == "PASS" {
				res.Passed++
			} else {
				res.Failed++
			}
		}
	}
	res.Commits = pgCommits(t, pgURL) - commits0
	t.Logf("child suite (-test.run %q -test.skip %q) in %s: %d passed, %d failed, %d transactions committed in the container's Postgres",
		run, skip, time.Since(start).Round(time.Millisecond), res.Passed, res.Failed, res.Commits)
	if err != nil || res.Failed > 0 {
		logTail(t, out.Bytes(), 400)
		t.Fatalf("testsvc: child suite failed: %v", err)
	}
	if res.Passed == 0 {
		logTail(t, out.Bytes(), 100)
		t.Fatalf("testsvc: child suite ran no test (pattern %q)", run)
	}
	if res.Commits == 0 {
		t.Fatalf("testsvc: the child suite committed nothing in the container's Postgres: it used another server")
	}
	return res
}

func pgCommits(t testing.TB, dsn string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("testsvc: %v", err)
	}
	defer conn.Close(ctx)
	// A new session reads fresh statistics (backends report theirs at
	// exit and about once a second).
	var n int64
	err = conn.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	if err != nil {
		t.Fatalf("testsvc: pg_stat_database: %v", err)
	}
	return n
}

func logTail(t testing.TB, b []byte, lines int) {
	t.Helper()
	s := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(s) > lines {
		s = s[len(s)-lines:]
	}
	t.Logf("child output (last %d lines):\n%s", len(s), strings.Join(s, "\n"))
}

// startKafkaContainer starts a single-node KRaft Kafka (apache/kafka) on two
// free loopback ports (broker and controller): with host networking the
// broker advertises the address clients dial.
func startKafkaContainer(ctx context.Context) (testcontainers.Container, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	cport, err := freePort()
	if err != nil {
		return nil, "", err
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	ctrl := "127.0.0.1:" + strconv.Itoa(cport)
	c, err := runContainer(ctx, testcontainers.ContainerRequest{
		Image: "apache/kafka:4.1.2",
		Env: map[string]string{
			"KAFKA_NODE_ID":                                          "1",
			"KAFKA_PROCESS_ROLES":                                    "broker,controller",
			"KAFKA_LISTENERS":                                        "PLAINTEXT://" + addr + ",CONTROLLER://" + ctrl,
			"KAFKA_ADVERTISED_LISTENERS":                             "PLAINTEXT://" + addr,
			"KAFKA_CONTROLLER_LISTENER_NAMES":                        "CONTROLLER",
			"KAFKA_LISTENER_SECURITY_PROTOCOL_MAP":                   "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
			"KAFKA_CONTROLLER_QUORUM_VOTERS":                         "1@" + ctrl,
			"KAFKA_NUM_PARTITIONS":                                   "4",
			"KAFKA_AUTO_CREATE_TOPICS_ENABLE":                        "true",
			"KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR":                 "1",
			"KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS":                 "0",
			"KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR":         "1",
			"KAFKA_TRANSACTION_STATE_LOG_MIN_ISR":                    "1",
			"KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
			"KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR":            "1",
			"KAFKA_HEAP_OPTS":                                        "-Xms256m -Xmx512m",
		},
		WaitingFor: wait.ForLog("Kafka Server started").WithStartupTimeout(2 * time.Minute),
	})
	if err != nil {
		return c, "", err
	}
	return c, addr, nil
}

// KafkaContainer starts a single-broker Kafka of the test's own through
// testcontainers-go (host networking, free loopback ports) and returns its
// bootstrap address. The container is terminated when the test ends.
func KafkaContainer(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, addr, err := startKafkaContainer(ctx)
	if c != nil {
		terminateOnCleanup(t, c)
	}
	if err != nil {
		t.Fatalf("testsvc: kafka container: %v", err)
	}
	return addr
}
