package testsvc

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// KafkaClusterConfig sizes a KafkaCluster.
type KafkaClusterConfig struct {
	// Nodes is the number of combined broker+controller nodes (default 3).
	Nodes int
	// BasePort: node i (1-based) listens on BasePort+i for clients and on
	// BasePort+10+i for the controller quorum. Default: the first of
	// 27000, 27020, ..., 27180 whose ports are all free (so 27001.. and
	// 27011.. when nothing holds them): below Linux's ephemeral range,
	// where no client connection can hold one.
	BasePort int
	// Heap is the JVM heap flags of each node (default -Xms128m -Xmx384m).
	Heap string
}

// KafkaCluster is a Kafka cluster of the test's own: Nodes KRaft nodes
// (each a broker and a controller voter) on loopback, run from the Kafka
// jars scripts/services.sh fetches (JUSTONCE_KAFKA_HOME, else
// $JUSTONCE_CACHE/kafka-$KAFKA_VERSION, else
// $HOME/.cache/justonce/kafka-4.1.2). The cluster defaults are those of a
// production cluster: replication factor 3 and min.insync.replicas 2 for
// new topics and the internal ones, no unclean leader election.
type KafkaCluster struct {
	// Brokers are the client addresses of every node, node 1 first.
	Brokers []string

	t     testing.TB
	cfg   KafkaClusterConfig
	home  string
	dir   string
	mu    sync.Mutex
	procs map[int]*exec.Cmd
	done  map[int]chan struct{}
}

// KafkaHome returns the directory holding the Kafka jars (libs/) and
// log4j2.xml, or "" when scripts/services.sh has not fetched them.
func KafkaHome() string {
	if v := os.Getenv("JUSTONCE_KAFKA_HOME"); v != "" {
		return v
	}
	cache := os.Getenv("JUSTONCE_CACHE")
	if cache == "" {
		h, _ := os.UserHomeDir()
		cache = filepath.Join(h, ".cache", "justonce")
	}
	v := os.Getenv("KAFKA_VERSION")
	if v == "" {
		v = "4.1.2"
	}
	home := filepath.Join(cache, "kafka-"+v)
	if _, err := os.Stat(filepath.Join(home, "libs", ".complete")); err != nil {
		return ""
	}
	return home
}

// StartKafkaCluster starts the cluster, waits until every node is a
// registered broker, and stops it (SIGKILL, every node) when the test
// ends.
func StartKafkaCluster(t testing.TB, cfg KafkaClusterConfig) *KafkaCluster {
	t.Helper()
	if cfg.Nodes == 0 {
		cfg.Nodes = 3
	}
	if cfg.Heap == "" {
		cfg.Heap = "-Xms128m -Xmx384m"
	}
	home := KafkaHome()
	if home == "" {
		t.Fatalf("testsvc: no Kafka jars: run `make services-up` once (it fetches them), or set JUSTONCE_KAFKA_HOME")
	}
	c := &KafkaCluster{t: t, cfg: cfg, home: home, dir: t.TempDir(), procs: map[int]*exec.Cmd{}, done: map[int]chan struct{}{}}
	// The ports lie below the ephemeral range (32768-60999 by default),
	// where only a listener can hold one: take the first block whose
	// ports are all free.
	bases := []int{cfg.BasePort}
	if cfg.BasePort == 0 {
		bases = nil
		for b := 27000; b < 27200; b += 20 {
			bases = append(bases, b)
		}
	}
	end := time.Now().Add(15 * time.Second)
	for chosen := false; !chosen; {
		var busy error
		for _, b := range bases {
			c.cfg.BasePort = b
			if busy = c.portsFree(); busy == nil {
				chosen = true
				break
			}
		}
		if chosen {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("testsvc: kafka cluster: no free block of ports at %v: %v", bases, busy)
		}
		time.Sleep(200 * time.Millisecond)
	}
	cfg = c.cfg
	for i := 1; i <= cfg.Nodes; i++ {
		c.Brokers = append(c.Brokers, c.Addr(i))
	}
	t.Cleanup(c.stopAll)

	// A cluster id that starts with '-' reads as an option to the storage
	// tool (Kafka's own random ids avoid it too): draw again.
	clusterID := "-"
	for strings.HasPrefix(clusterID, "-") {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		clusterID = base64.RawURLEncoding.EncodeToString(b)
	}
	voters := make([]string, 0, cfg.Nodes)
	for i := 1; i <= cfg.Nodes; i++ {
		voters = append(voters, fmt.Sprintf("%d@127.0.0.1:%d", i, c.controllerPort(i)))
	}
	rf := min(3, cfg.Nodes)
	isr := max(1, rf-1)
	for i := 1; i <= cfg.Nodes; i++ {
		nd := c.nodeDir(i)
		if err := os.MkdirAll(nd, 0o755); err != nil {
			t.Fatal(err)
		}
		props := fmt.Sprintf(`process.roles=broker,controller
node.id=%d
controller.quorum.voters=%s
listeners=PLAINTEXT://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d
advertised.listeners=PLAINTEXT://127.0.0.1:%d
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=%s
num.partitions=3
default.replication.factor=%d
min.insync.replicas=%d
unclean.leader.election.enable=false
auto.create.topics.enable=false
offsets.topic.replication.factor=%d
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=%d
transaction.state.log.min.isr=%d
transaction.state.log.num.partitions=6
share.coordinator.state.topic.replication.factor=%d
share.coordinator.state.topic.min.isr=%d
group.initial.rebalance.delay.ms=0
replica.lag.time.max.ms=10000
num.network.threads=2
num.io.threads=4
background.threads=4
log.cleaner.enable=false
`, i, strings.Join(voters, ","), c.port(i), c.controllerPort(i), c.port(i), filepath.Join(nd, "data"),
			rf, isr, rf, rf, isr, rf, isr)
		if err := os.WriteFile(filepath.Join(nd, "server.properties"), []byte(props), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(c.java(), "-Xmx256m", "-XX:TieredStopAtLevel=1",
			"-Dlog4j2.configurationFile="+filepath.Join(home, "log4j2.xml"), "-Djustonce.kafka.startlog=WARN",
			"-cp", filepath.Join(home, "libs", "*"), "kafka.tools.StorageTool", "format",
			"-t", clusterID, "-c", filepath.Join(nd, "server.properties")).CombinedOutput()
		if err != nil {
			t.Fatalf("testsvc: kafka storage format (node %d): %v\n%s", i, err, out)
		}
	}
	for i := 1; i <= cfg.Nodes; i++ {
		c.Start(i)
	}
	c.WaitBrokers(cfg.Nodes, 3*time.Minute)
	return c
}

// portsFree checks that every port of the cluster can be listened on.
func (c *KafkaCluster) portsFree() error {
	for i := 1; i <= c.cfg.Nodes; i++ {
		for _, p := range []int{c.port(i), c.controllerPort(i)} {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			if err != nil {
				return err
			}
			_ = l.Close()
		}
	}
	return nil
}

func (c *KafkaCluster) port(i int) int           { return c.cfg.BasePort + i }
func (c *KafkaCluster) controllerPort(i int) int { return c.cfg.BasePort + 10 + i }
func (c *KafkaCluster) nodeDir(i int) string     { return filepath.Join(c.dir, "node"+strconv.Itoa(i)) }

// Addr returns node i's client address (1-based).
func (c *KafkaCluster) Addr(i int) string { return "127.0.0.1:" + strconv.Itoa(c.port(i)) }

// Node returns the node number of a broker address, or 0.
func (c *KafkaCluster) Node(addr string) int {
	for i, b := range c.Brokers {
		if b == addr {
			return i + 1
		}
	}
	return 0
}

// LogFile returns the path of node i's log.
func (c *KafkaCluster) LogFile(i int) string { return filepath.Join(c.nodeDir(i), "kafka.log") }

func (c *KafkaCluster) java() string {
	if h := os.Getenv("JAVA_HOME"); h != "" {
		return filepath.Join(h, "bin", "java")
	}
	return "java"
}

// Start starts node i (again, after Kill: its data directory is kept).
func (c *KafkaCluster) Start(i int) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.procs[i] != nil {
		c.t.Fatalf("testsvc: kafka node %d already runs", i)
	}
	logf, err := os.OpenFile(c.LogFile(i), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatal(err)
	}
	args := append(strings.Fields(c.cfg.Heap),
		"-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:CICompilerCount=1", "-Xss512k",
		"-Djava.awt.headless=true", "-Dlog4j2.configurationFile="+filepath.Join(c.home, "log4j2.xml"),
		"-cp", filepath.Join(c.home, "libs", "*"), "kafka.Kafka", filepath.Join(c.nodeDir(i), "server.properties"))
	cmd := exec.Command(c.java(), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		c.t.Fatalf("testsvc: start kafka node %d: %v", i, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = logf.Close()
		close(done)
	}()
	c.procs[i], c.done[i] = cmd, done
}

// Kill sends SIGKILL to node i and waits until it is gone. It returns the
// killed process's pid.
func (c *KafkaCluster) Kill(i int) int {
	c.t.Helper()
	c.mu.Lock()
	cmd, done := c.procs[i], c.done[i]
	delete(c.procs, i)
	delete(c.done, i)
	c.mu.Unlock()
	if cmd == nil {
		c.t.Fatalf("testsvc: kafka node %d is not running", i)
	}
	pid := cmd.Process.Pid
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		c.t.Fatalf("testsvc: kafka node %d (pid %d) still runs 30 s after SIGKILL", i, pid)
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		c.t.Fatalf("testsvc: kafka node %d (pid %d) ended with %v, not by SIGKILL (it had died before)", i, pid, cmd.ProcessState)
	}
	return pid
}

// Running reports whether node i's process runs.
func (c *KafkaCluster) Running(i int) bool {
	c.mu.Lock()
	done := c.done[i]
	c.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// WaitBrokers waits until the cluster's metadata, asked of any running
// node, lists n brokers.
func (c *KafkaCluster) WaitBrokers(n int, within time.Duration) {
	c.t.Helper()
	var last string
	end := time.Now().Add(within)
	for {
		for i := 1; i <= c.cfg.Nodes; i++ {
			if !c.Running(i) {
				continue
			}
			d := &kafka.Dialer{Timeout: time.Second}
			conn, err := d.Dial("tcp", c.Addr(i))
			if err != nil {
				last = err.Error()
				continue
			}
			_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
			bs, err := conn.Brokers()
			_ = conn.Close()
			if err != nil {
				last = err.Error()
				continue
			}
			if len(bs) == n {
				return
			}
			last = fmt.Sprintf("%d brokers registered", len(bs))
		}
		for i := 1; i <= c.cfg.Nodes; i++ {
			c.mu.Lock()
			started := c.procs[i] != nil
			c.mu.Unlock()
			if started && !c.Running(i) {
				c.t.Fatalf("testsvc: kafka node %d exited; its log:\n%s", i, c.tail(i, 40))
			}
		}
		if time.Now().After(end) {
			c.t.Fatalf("testsvc: kafka cluster: %d brokers not registered within %s (%s); node 1 log:\n%s", n, within, last, c.tail(1, 40))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (c *KafkaCluster) tail(i, lines int) string {
	b, _ := os.ReadFile(c.LogFile(i))
	s := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(s) > lines {
		s = s[len(s)-lines:]
	}
	return strings.Join(s, "\n")
}

func (c *KafkaCluster) stopAll() {
	c.mu.Lock()
	procs, dones := c.procs, c.done
	c.procs, c.done = map[int]*exec.Cmd{}, map[int]chan struct{}{}
	c.mu.Unlock()
	for _, cmd := range procs {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	for _, d := range dones {
		select {
		case <-d:
		case <-time.After(30 * time.Second):
		}
	}
}
