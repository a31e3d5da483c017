package testsvc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMasterName is the name StartRedisSentinel's sentinels monitor
// the master by.
const SentinelMasterName = "justonce"

// SentinelDownAfter is the sentinels' down-after-milliseconds: a master
// that does not answer this long is subjectively down, and the failover
// starts once two sentinels agree.
const SentinelDownAfter = time.Second

// RedisSentinel is a Redis master, its replica and three sentinels of the
// test's own, on loopback ports below the ephemeral range: the test kills
// the master and the sentinels promote the replica, as in production.
// Everything is killed when the test ends. The data nodes keep nothing on
// disk (no snapshot, no append-only file).
type RedisSentinel struct {
	// Sentinels are the sentinels' host:port.
	Sentinels []string

	t    testing.TB
	bin  string
	dir  string
	mu   sync.Mutex
	data [2]*redisProc // the master and the replica, in start order
	sent [3]*redisProc
}

type redisProc struct {
	port   int
	args   []string
	cmd    *exec.Cmd
	exited chan struct{}
}

// redisServerBin returns the redis-server binary (JUSTONCE_REDIS_SERVER,
// else PATH), failing the test when there is none.
func redisServerBin(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv("JUSTONCE_REDIS_SERVER"); bin != "" {
		return bin
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("testsvc: redis-server not found: install Debian's redis-server (apt-get install redis-server) or set JUSTONCE_REDIS_SERVER")
	}
	return bin
}

// StartRedisSentinel starts a master, a replica of it and three
// sentinels (redis-server --sentinel, quorum 2, down-after
// SentinelDownAfter), and returns once every sentinel knows the master,
// the replica and the two other sentinels.
func StartRedisSentinel(t testing.TB) *RedisSentinel {
	t.Helper()
	s := &RedisSentinel{t: t, bin: redisServerBin(t), dir: t.TempDir()}
	t.Cleanup(s.stopAll)
	ports := lowPorts(t, 5)
	for i := range s.data {
		p := ports[i]
		conf := filepath.Join(s.dir, fmt.Sprintf("redis-%d.conf", p))
		s.writeConf(conf, "")
		args := []string{conf, "--port", strconv.Itoa(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", s.dir, "--logfile", filepath.Join(s.dir, fmt.Sprintf("redis-%d.log", p))}
		if i == 1 {
			args = append(args, "--replicaof", "127.0.0.1", strconv.Itoa(ports[0]))
		}
		s.data[i] = &redisProc{port: p, args: args}
		s.start(s.data[i])
	}
	for i := range s.sent {
		p := ports[2+i]
		conf := filepath.Join(s.dir, fmt.Sprintf("sentinel-%d.conf", p))
		s.writeConf(conf, fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
logfile %s
sentinel monitor %s 127.0.0.1 %d 2
sentinel down-after-milliseconds %s %d
sentinel failover-timeout %s 10000
sentinel parallel-syncs %s 1
`, p, s.dir, filepath.Join(s.dir, fmt.Sprintf("sentinel-%d.log", p)),
			SentinelMasterName, ports[0], SentinelMasterName, SentinelDownAfter.Milliseconds(),
			SentinelMasterName, SentinelMasterName))
		s.sent[i] = &redisProc{port: p, args: []string{conf, "--sentinel"}}
		s.start(s.sent[i])
		s.Sentinels = append(s.Sentinels, "127.0.0.1:"+strconv.Itoa(p))
	}
	s.waitSentinels(s.data[0].port, 1, 60*time.Second)
	return s
}

func (s *RedisSentinel) writeConf(path, content string) {
	s.t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		s.t.Fatal(err)
	}
}

// start runs p and waits until it answers PING.
func (s *RedisSentinel) start(p *redisProc) {
	s.t.Helper()
	cmd := exec.Command(s.bin, p.args...)
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("testsvc: start redis-server on port %d: %v", p.port, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.mu.Lock()
	p.cmd, p.exited = cmd, exited
	s.mu.Unlock()
	c := s.client(p.port)
	defer c.Close()
	end := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-exited:
			s.t.Fatalf("testsvc: redis-server on port %d exited: %s", p.port, s.logTail(p.port))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(end) {
			s.t.Fatalf("testsvc: redis-server on port %d did not answer in 10 s: %v", p.port, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (s *RedisSentinel) logTail(port int) string {
	for _, name := range []string{"redis", "sentinel"} {
		if b, err := os.ReadFile(filepath.Join(s.dir, fmt.Sprintf("%s-%d.log", name, port))); err == nil {
			if len(b) > 2000 {
				b = b[len(b)-2000:]
			}
			return string(b)
		}
	}
	return ""
}

func (s *RedisSentinel) client(port int) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second, ContextTimeoutEnabled: true})
}

// Addr returns data node i's host:port (0: the first master, 1: its
// first replica).
func (s *RedisSentinel) Addr(i int) string { return "127.0.0.1:" + strconv.Itoa(s.data[i].port) }

// NodeClient returns a client of data node i alone, closed when the test
// ends.
func (s *RedisSentinel) NodeClient(t testing.TB, i int) *redis.Client {
	c := s.client(s.data[i].port)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Client returns a Sentinel client (redis.NewFailoverClient) that finds
// the master through the sentinels and follows a failover, with the
// tests' short timeouts and ContextTimeoutEnabled; closed when the test
// ends.
func (s *RedisSentinel) Client(t testing.TB) *redis.Client {
	c := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:            SentinelMasterName,
		SentinelAddrs:         s.Sentinels,
		ContextTimeoutEnabled: true,
		DialTimeout:           time.Second,
		ReadTimeout:           time.Second,
		WriteTimeout:          time.Second,
		MaxRetries:            -1,
		PoolSize:              64,
	})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Master returns the index of the data node the sentinels name master
// (the first sentinel that answers), or -1.
func (s *RedisSentinel) Master() int {
	for _, p := range s.sent {
		if i := s.masterOf(p); i >= 0 {
			return i
		}
	}
	return -1
}

func (s *RedisSentinel) masterOf(p *redisProc) int {
	c := s.client(p.port)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	addr, err := c.Do(ctx, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SentinelMasterName).StringSlice()
	if err != nil || len(addr) != 2 {
		return -1
	}
	for i, d := range s.data {
		if addr[1] == strconv.Itoa(d.port) {
			return i
		}
	}
	return -1
}

// KillMaster sends SIGKILL to the master's process (nothing is flushed
// or handed over) and waits until it exited. It returns its index.
func (s *RedisSentinel) KillMaster() int {
	s.t.Helper()
	m := s.Master()
	if m < 0 {
		s.t.Fatalf("testsvc: no sentinel names a master")
	}
	s.kill(s.data[m])
	return m
}

func (s *RedisSentinel) kill(p *redisProc) {
	s.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

// WaitFailover waits until every sentinel names the other data node than
// old master, and that node answers as a master.
func (s *RedisSentinel) WaitFailover(old int, within time.Duration) {
	s.t.Helper()
	s.waitSentinels(s.data[1-old].port, 0, within)
}

// WaitSettled waits until every sentinel names the same master, which
// says it is one and has a replica whose link to it is up (so that a
// failover has a node to promote), and returns the master's index.
func (s *RedisSentinel) WaitSettled(within time.Duration) int {
	s.t.Helper()
	end := time.Now().Add(within)
	for {
		m := s.Master()
		last := "no sentinel names a master"
		if m >= 0 {
			last = s.settled(m)
			if last == "" {
				return m
			}
		}
		if time.Now().After(end) {
			s.t.Fatalf("testsvc: sentinels not settled on a master with a replica within %s (master: node %d): %s", within, m, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// settled returns why the sentinels are not settled on data node m as
// the master of the other, or "".
func (s *RedisSentinel) settled(m int) string {
	if !s.running(1 - m) {
		return fmt.Sprintf("node %d is down", 1-m)
	}
	for _, p := range s.sent {
		if ok, why := s.sentinelSees(p, s.data[m].port, 1); !ok {
			return why
		}
	}
	if r := s.role(s.data[m].port); r != "master" {
		return fmt.Sprintf("node %d says it is %q", m, r)
	}
	if !s.linkUp(1 - m) {
		return fmt.Sprintf("node %d's replication link to node %d is not up", 1-m, m)
	}
	return ""
}

// running reports whether data node i's process runs.
func (s *RedisSentinel) running(i int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.data[i].cmd != nil
}

// linkUp reports whether data node i is a replica whose link to its
// master is up.
func (s *RedisSentinel) linkUp(i int) bool {
	c := s.client(s.data[i].port)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := c.Info(ctx, "replication").Result()
	return err == nil && infoField(info, "role") == "slave" && infoField(info, "master_link_status") == "up"
}

// Restart starts data node i again (it comes back empty); the sentinels
// make it a replica of the master.
func (s *RedisSentinel) Restart(i int) {
	s.t.Helper()
	p := s.data[i]
	if p.cmd != nil {
		s.t.Fatalf("testsvc: redis node %d runs", i)
	}
	s.start(p)
}

// RestartInPlace starts data node i again (it comes back empty) with the
// role its configuration file last recorded, not the one it was first
// started with: the sentinels rewrite a node's file when they promote or
// reconfigure it, so a master killed and restarted at once, before the
// sentinels' down-after, is the master again, and a replica a replica.
// (Restart starts the first replica as a replica of the first master
// again, whatever happened since.)
func (s *RedisSentinel) RestartInPlace(i int) {
	s.t.Helper()
	p := s.data[i]
	if s.running(i) {
		s.t.Fatalf("testsvc: redis node %d runs", i)
	}
	q := &redisProc{port: p.port}
	for j := 0; j < len(p.args); j++ {
		if p.args[j] == "--replicaof" {
			j += 2
			continue
		}
		q.args = append(q.args, p.args[j])
	}
	s.start(q)
	s.mu.Lock()
	p.cmd, p.exited = q.cmd, q.exited
	s.mu.Unlock()
}

// waitSentinels waits until every sentinel names the node on masterPort
// as master, knows wantReplicas replicas of it and the two other
// sentinels, and that node says it is a master.
func (s *RedisSentinel) waitSentinels(masterPort, wantReplicas int, within time.Duration) {
	s.t.Helper()
	end := time.Now().Add(within)
	var last string
	for {
		ok := s.role(masterPort) == "master"
		if !ok {
			last = fmt.Sprintf("node on port %d is %q", masterPort, s.role(masterPort))
		}
		for _, p := range s.sent {
			if !ok {
				break
			}
			ok, last = s.sentinelSees(p, masterPort, wantReplicas)
		}
		if ok {
			return
		}
		if time.Now().After(end) {
			s.t.Fatalf("testsvc: sentinels not settled on the master on port %d within %s: %s", masterPort, within, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sentinelSees reports whether sentinel p names the node on masterPort
// master, knows at least wantReplicas of its replicas and two other
// sentinels.
func (s *RedisSentinel) sentinelSees(p *redisProc, masterPort, wantReplicas int) (bool, string) {
	c := s.client(p.port)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	addr, err := c.Do(ctx, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SentinelMasterName).StringSlice()
	if err != nil || len(addr) != 2 || addr[1] != strconv.Itoa(masterPort) {
		return false, fmt.Sprintf("sentinel %d names %v (%v)", p.port, addr, err)
	}
	replicas, err := c.Do(ctx, "SENTINEL", "REPLICAS", SentinelMasterName).Slice()
	if err != nil || len(replicas) < wantReplicas {
		return false, fmt.Sprintf("sentinel %d knows %d replicas (%v)", p.port, len(replicas), err)
	}
	others, err := c.Do(ctx, "SENTINEL", "SENTINELS", SentinelMasterName).Slice()
	if err != nil || len(others) != len(s.sent)-1 {
		return false, fmt.Sprintf("sentinel %d knows %d other sentinels (%v)", p.port, len(others), err)
	}
	return true, ""
}

// role returns what the node on port says it is (master, slave), or "".
func (s *RedisSentinel) role(port int) string {
	c := s.client(port)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return ""
	}
	return infoField(info, "role")
}

// CutReplication stops the replica from receiving the master's writes
// until RestoreReplication: its replication connection is killed and it
// cannot log in again (a wrong masterauth; the master has no password),
// so it stays the sentinels' replica, eligible for promotion, while the
// writes made meanwhile reach the master alone.
func (s *RedisSentinel) CutReplication() {
	s.t.Helper()
	m := s.Master()
	r := s.data[1-m]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rc, mc := s.client(r.port), s.client(s.data[m].port)
	defer rc.Close()
	defer mc.Close()
	if err := rc.ConfigSet(ctx, "masterauth", "cut-by-the-test").Err(); err != nil {
		s.t.Fatalf("testsvc: replica on port %d: %v", r.port, err)
	}
	if err := mc.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
		s.t.Fatalf("testsvc: master on port %d: %v", s.data[m].port, err)
	}
	end := time.Now().Add(10 * time.Second)
	for {
		info, err := mc.Info(ctx, "replication").Result()
		if err == nil && infoField(info, "connected_slaves") == "0" {
			return
		}
		if time.Now().After(end) {
			s.t.Fatalf("testsvc: the replica on port %d is still connected to the master: %v\n%s", r.port, err, info)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// RestoreReplication lets the replica cut by CutReplication log in to
// its master again.
func (s *RedisSentinel) RestoreReplication() {
	s.t.Helper()
	for i := range s.data {
		if s.data[i].cmd == nil {
			continue
		}
		c := s.client(s.data[i].port)
		err := c.ConfigSet(context.Background(), "masterauth", "").Err()
		_ = c.Close()
		if err != nil {
			s.t.Fatalf("testsvc: redis node %d: %v", i, err)
		}
	}
}

func (s *RedisSentinel) stopAll() {
	for _, p := range append(s.data[:], s.sent[:]...) {
		if p != nil {
			s.kill(p)
		}
	}
}
