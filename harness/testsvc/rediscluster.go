package testsvc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of three masters (no replicas) on
// loopback, of the test's own: its nodes are redis-server processes the
// test may kill and restart. It is stopped when the test ends.
type RedisCluster struct {
	// Addrs are the masters' host:port, in start order.
	Addrs []string
	bin   string
	dir   string
	ports []int
	nodes []*clusterNode
}

type clusterNode struct {
	cmd    *exec.Cmd
	exited chan struct{}
}

// ClusterNodeTimeout is the cluster-node-timeout of StartRedisCluster's
// nodes: a master unreachable this long is marked failed by the others.
const ClusterNodeTimeout = 2 * time.Second

const clusterSize = 3

// StartRedisCluster starts three redis-server processes with
// cluster-enabled on a free block of loopback ports, joins them with
// `redis-cli --cluster create` and waits until every node reports
// cluster_state:ok. The ports are below 55536 (the cluster bus listens on
// port + 10000) and outside the ephemeral port range.
func StartRedisCluster(t testing.TB) *RedisCluster {
	t.Helper()
	bin := redisServerBin(t)
	cli := filepath.Join(filepath.Dir(bin), "redis-cli")
	if _, err := os.Stat(cli); err != nil {
		if cli, err = exec.LookPath("redis-cli"); err != nil {
			t.Fatalf("testsvc: redis-cli not found next to %s nor on PATH", bin)
		}
	}
	dir := t.TempDir()
	var c *RedisCluster
	t.Cleanup(func() {
		if c != nil {
			for i := range c.nodes {
				c.Kill(t, i)
			}
		}
	})
	// Another process may take a probed port before redis-server binds it:
	// then a node exits at once, and a new block is tried.
	var lastErr error
	for try := 0; try < 5; try++ {
		if c != nil {
			for i := range c.nodes {
				c.Kill(t, i)
			}
		}
		base := freePortBlock(t)
		c = &RedisCluster{bin: bin, dir: dir, nodes: make([]*clusterNode, clusterSize)}
		for i := 0; i < clusterSize; i++ {
			c.ports = append(c.ports, base+i)
			c.Addrs = append(c.Addrs, "127.0.0.1:"+strconv.Itoa(base+i))
		}
		if lastErr = c.startAll(); lastErr != nil {
			continue
		}
		args := append([]string{"--cluster", "create"}, c.Addrs...)
		args = append(args, "--cluster-replicas", "0", "--cluster-yes")
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("testsvc: redis-cli --cluster create: %v\n%s", err, out)
		}
		c.WaitState(t, 30*time.Second, "ok")
		return c
	}
	t.Fatalf("testsvc: could not start a Redis Cluster: %v", lastErr)
	return nil
}

func (c *RedisCluster) startAll() error {
	for i := range c.ports {
		if err := c.start(i); err != nil {
			return err
		}
	}
	return nil
}

// start runs node i (its nodes file, if any, is read again) and waits until
// it answers PING.
func (c *RedisCluster) start(i int) error {
	p := strconv.Itoa(c.ports[i])
	cmd := exec.Command(c.bin, "--port", p, "--bind", "127.0.0.1",
		"--cluster-enabled", "yes",
		"--cluster-config-file", filepath.Join(c.dir, "nodes-"+p+".conf"),
		"--cluster-node-timeout", strconv.FormatInt(ClusterNodeTimeout.Milliseconds(), 10),
		"--appendonly", "no", "--save", "",
		"--dir", c.dir, "--logfile", filepath.Join(c.dir, "redis-"+p+".log"))
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start redis-server: %w", err)
	}
	n := &clusterNode{cmd: cmd, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(n.exited) }()
	c.nodes[i] = n
	cl := c.nodeClient(i)
	defer cl.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-n.exited:
			return fmt.Errorf("redis-server on port %s exited: %s", p, c.logTail(i))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := cl.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on port %s did not answer in 10s: %v", p, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *RedisCluster) logTail(i int) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, "redis-"+strconv.Itoa(c.ports[i])+".log"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

func (c *RedisCluster) nodeClient(i int) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: c.Addrs[i], MaxRetries: -1, DialTimeout: time.Second,
		ReadTimeout: time.Second, WriteTimeout: time.Second, ContextTimeoutEnabled: true})
}

// NodeClient returns a client of node i alone, closed when the test ends.
func (c *RedisCluster) NodeClient(t testing.TB, i int) *redis.Client {
	cl := c.nodeClient(i)
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// Client returns a Cluster client with the tests' short timeouts and
// ContextTimeoutEnabled, closed when the test ends.
func (c *RedisCluster) Client(t testing.TB) *redis.ClusterClient {
	cl := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                 c.Addrs,
		ContextTimeoutEnabled: true,
		DialTimeout:           2 * time.Second,
		ReadTimeout:           2 * time.Second,
		WriteTimeout:          2 * time.Second,
		PoolSize:              64,
	})
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// Kill sends SIGKILL to node i (nothing is flushed) and waits for it to
// exit. Killing a stopped node does nothing.
func (c *RedisCluster) Kill(t testing.TB, i int) {
	t.Helper()
	n := c.nodes[i]
	if n == nil {
		return
	}
	_ = n.cmd.Process.Kill()
	<-n.exited
	c.nodes[i] = nil
}

// Restart starts node i again on its port with its nodes file, so it
// rejoins the cluster with the slots it had (and none of its data), then
// waits until every node reports cluster_state:ok.
func (c *RedisCluster) Restart(t testing.TB, i int) {
	t.Helper()
	if c.nodes[i] != nil {
		t.Fatalf("testsvc: cluster node %d is running", i)
	}
	if err := c.start(i); err != nil {
		t.Fatalf("testsvc: restart cluster node %d: %v", i, err)
	}
	c.WaitState(t, 30*time.Second, "ok")
}

// State returns node i's cluster_state ("ok" or "fail"), or "" when the
// node does not answer.
func (c *RedisCluster) State(i int) string {
	cl := c.nodeClient(i)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := cl.ClusterInfo(ctx).Result()
	if err != nil {
		return ""
	}
	return infoField(info, "cluster_state")
}

// infoField returns a field of an INFO reply (field:value lines), or "".
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// WaitState waits until every running node reports cluster_state:want,
// failing the test after timeout.
func (c *RedisCluster) WaitState(t testing.TB, timeout time.Duration, want string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var got []string
		all := true
		for i := range c.nodes {
			if c.nodes[i] == nil {
				continue
			}
			s := c.State(i)
			got = append(got, c.Addrs[i]+"="+s)
			all = all && s == want
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("testsvc: Redis Cluster not %q within %s: %s", want, timeout, strings.Join(got, " "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freePortBlock returns P such that P..P+2 and P+10000..P+10002 (the
// cluster bus) are free on loopback, at most 55535 and outside the
// ephemeral port range.
func freePortBlock(t testing.TB) int {
	t.Helper()
	offsets := make([]int, 0, 2*clusterSize)
	for i := 0; i < clusterSize; i++ {
		offsets = append(offsets, i, i+10000)
	}
	return lowPortBlock(t, 65535, offsets...)
}
