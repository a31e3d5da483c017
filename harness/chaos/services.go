package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/rs/zerolog"
)

// services crashes and restarts the Postgres and Kafka that
// scripts/services.sh started: SIGKILL of the process named in its pid
// file, then `services.sh up` for that service alone (which clears the
// stale pid file and waits until the service answers). The script reads
// the same JUSTONCE_* variables as this process, so a run against a
// private set of services (JUSTONCE_SERVICES_DIR, JUSTONCE_PG_PORT, ...)
// crashes only those.
type services struct {
	dir, script string
	ports       map[string]int // service -> the port it listens on
}

func newServices() (*services, error) {
	dir := os.Getenv("JUSTONCE_SERVICES_DIR")
	if dir == "" {
		dir = "/tmp/justonce-services"
	}
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	return &services{dir: dir, script: filepath.Join(root, "scripts", "services.sh"), ports: map[string]int{}}, nil
}

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "scripts", "services.sh")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("scripts/services.sh not found above the working directory")
		}
		dir = parent
	}
}

func (s *services) pidFile(service string) (file, pattern string) {
	switch service {
	case "postgres":
		return filepath.Join(s.dir, "pg", "data", "postmaster.pid"), "postgres"
	default:
		return filepath.Join(s.dir, "kafka", "kafka.pid"), "kafka.Kafka"
	}
}

// pid returns the live pid of service from its pid file.
func (s *services) pid(service string) (int, error) {
	file, pattern := s.pidFile(service)
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, fmt.Errorf("%s: no pid file (was it started by scripts/services.sh with JUSTONCE_SERVICES_DIR=%s?): %w", service, s.dir, err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return 0, fmt.Errorf("%s: pid file %s: %w", service, file, err)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmdline), pattern) {
		return 0, fmt.Errorf("%s: pid %d from %s is not running", service, pid, file)
	}
	return pid, nil
}

// check verifies that the service this run will crash is ours to crash:
// started by the script under s.dir, and the one listening on port.
func (s *services) check(service string, port int) error {
	if _, err := s.pid(service); err != nil {
		return err
	}
	s.ports[service] = port
	var file, marker string
	switch service {
	case "postgres":
		// postmaster.pid: pid, data dir, start time, port, ...
		file = filepath.Join(s.dir, "pg", "data", "postmaster.pid")
		b, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		if lines := strings.Split(string(b), "\n"); len(lines) > 3 && strings.TrimSpace(lines[3]) == strconv.Itoa(port) {
			return nil
		}
		marker = "port " + strconv.Itoa(port)
	default:
		file = filepath.Join(s.dir, "kafka", "server.properties")
		b, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		marker = "PLAINTEXT://127.0.0.1:" + strconv.Itoa(port) + ","
		if strings.Contains(string(b), marker) {
			return nil
		}
	}
	return fmt.Errorf("%s: %s does not describe the server the run uses (%s); set JUSTONCE_SERVICES_DIR and the JUSTONCE_*_PORT variables of the services in use", service, file, marker)
}

// kill SIGKILLs the service and waits until the process is gone and its
// port is free.
func (s *services) kill(service string) error {
	pid, err := s.pid(service)
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("%s: kill %d: %w", service, pid, err)
	}
	for deadline := time.Now().Add(30 * time.Second); alive(pid); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: pid %d still alive 30 s after SIGKILL", service, pid)
		}
	}
	// A killed JVM's main thread can show as a zombie while its other
	// threads still hold the sockets: wait until the port is free.
	addr := "127.0.0.1:" + strconv.Itoa(s.ports[service])
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			return nil
		}
		_ = c.Close()
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %s still accepts connections 30 s after SIGKILL", service, addr)
		}
	}
}

// restart starts the service killed by kill again and waits until it
// answers. The killed process's last threads may still hold its files
// (Kafka's data directory lock) for a moment after the port is free, and
// on a loaded machine a JVM may take longer to answer than services.sh
// waits for (it then finds the broker it started running but silent): a
// start that fails is tried again, 2 s later, for up to 3 minutes.
func (s *services) restart(ctx context.Context, service string) error {
	var upErr error
	deadline := time.Now().Add(3 * time.Minute)
	for try := 1; ; try++ {
		if upErr = s.up(ctx, service); upErr == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return upErr
		}
		fmt.Fprintf(errOut, "chaos: %s restart failed (try %d), retrying: %v\n", service, try, upErr)
		time.Sleep(2 * time.Second)
	}
}

// up runs `services.sh up` for one service, bounded by 3 minutes.
func (s *services) up(ctx context.Context, service string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", s.script, "up")
	cmd.Env = append(os.Environ(), "SERVICES="+service)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: restart: %w\n%s", service, err, out)
	}
	return nil
}

// ensureUp restarts any service of the run that is not running (after a
// failed restart), so that the run leaves them up.
func (s *services) ensureUp(ctx context.Context) error {
	var errs []error
	for name := range s.ports {
		if _, err := s.pid(name); err != nil {
			errs = append(errs, s.up(ctx, name))
		}
	}
	return errors.Join(errs...)
}

// alive: running and not a zombie.
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	return err == nil && !strings.Contains(string(b), "State:\tZ")
}

// natsServer is the embedded nats-server, restartable on the same port
// with the same file store.
type natsServer struct {
	mu         sync.Mutex
	port       int
	dir        string
	syncAlways bool
	s          *server.Server
}

func (n *natsServer) start() error {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: n.port, JetStream: true,
		StoreDir: n.dir, SyncAlways: n.syncAlways, NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	go s.Start()
	if !s.ReadyForConnections(30 * time.Second) {
		s.Shutdown()
		return errors.New("embedded nats-server not ready")
	}
	n.mu.Lock()
	n.s = s
	n.mu.Unlock()
	return nil
}

func (n *natsServer) url() string { return "nats://127.0.0.1:" + strconv.Itoa(n.port) }

func (n *natsServer) shutdown() {
	n.mu.Lock()
	s := n.s
	n.s = nil
	n.mu.Unlock()
	if s != nil {
		s.Shutdown()
		s.WaitForShutdown()
	}
}

// netFaults is an in-process TCP fault proxy (toxiproxy) between the
// consumers and HTTP server and Postgres and Redis: one proxy per node
// (two of each with a standby). It listens on 127.0.0.1 only.
type netFaults struct {
	srv       *toxiproxy.ApiServer
	pg, redis []*toxiproxy.Proxy
}

func newNetFaults(pgAddrs, redisAddrs []string) (*netFaults, error) {
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	n := &netFaults{srv: srv}
	add := func(name, upstream string) (*toxiproxy.Proxy, error) {
		p, err := n.proxy(name, upstream)
		if err != nil {
			n.close()
		}
		return p, err
	}
	for i, a := range pgAddrs {
		p, err := add(proxyName("pg", i), a)
		if err != nil {
			return nil, err
		}
		n.pg = append(n.pg, p)
	}
	for i, a := range redisAddrs {
		p, err := add(proxyName("redis", i), a)
		if err != nil {
			return nil, err
		}
		n.redis = append(n.redis, p)
	}
	return n, nil
}

// proxyName is "pg", "pg1", ...: the first keeps the single node's name.
func proxyName(service string, i int) string {
	if i == 0 {
		return service
	}
	return service + strconv.Itoa(i)
}

func (n *netFaults) proxy(name, upstream string) (*toxiproxy.Proxy, error) {
	p := toxiproxy.NewProxy(n.srv, name, "127.0.0.1:0", upstream)
	if err := n.srv.Collection.Add(p, true); err != nil {
		return nil, fmt.Errorf("toxiproxy %s: %w", name, err)
	}
	return p, nil
}

func (n *netFaults) close() {
	_ = n.srv.Collection.Clear()
}

// listens returns the proxies' listen addresses.
func listens(ps []*toxiproxy.Proxy) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.Listen
	}
	return out
}

// netFault kinds, in turn.
var netFaultKinds = []string{"reset-peer", "latency", "timeout"}

// A toxic on some proxies, for a while.
type toxicSpec struct {
	name, typ, stream, attrs string
	proxies                  []*toxiproxy.Proxy
	d                        time.Duration
}

// toxics returns what one network fault episode of the given kind adds.
//   - reset-peer: every Postgres connection is reset (RST) at the next
//     reply the server sends, that reply dropped, for 300 ms: a COMMIT in
//     flight is executed by the server and its answer never arrives
//     (ErrCommitUnknown).
//   - latency: 150 ms ± 100 ms on every reply from Postgres and Redis
//     for 2 s.
//   - timeout: no data flows to Postgres and Redis; connections are
//     closed after 1.5 s; for 2 s.
func (n *netFaults) toxics(kind string) (toxicSpec, error) {
	both := append(append([]*toxiproxy.Proxy(nil), n.pg...), n.redis...)
	switch kind {
	case "reset-peer":
		return toxicSpec{"reset", "reset_peer", "downstream", `{"timeout":0}`, n.pg, 300 * time.Millisecond}, nil
	case "latency":
		return toxicSpec{"latency", "latency", "downstream", `{"latency":150,"jitter":100}`, both, 2 * time.Second}, nil
	case "timeout":
		return toxicSpec{"timeout", "timeout", "upstream", `{"timeout":1500}`, both, 2 * time.Second}, nil
	}
	return toxicSpec{}, fmt.Errorf("unknown network fault %q", kind)
}

// add adds the toxic to every proxy of t.
func (t toxicSpec) add() error {
	body := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, t.name, t.typ, t.stream, t.attrs)
	for _, p := range t.proxies {
		if _, err := p.Toxics.AddToxicJson(strings.NewReader(body)); err != nil {
			return fmt.Errorf("toxic %s on %s: %w", t.name, p.Name, err)
		}
	}
	return nil
}

// remove removes the toxic from every proxy of t.
func (t toxicSpec) remove(ctx context.Context) error {
	var errs []error
	for _, p := range t.proxies {
		errs = append(errs, p.Toxics.RemoveToxic(context.WithoutCancel(ctx), t.name))
	}
	return errors.Join(errs...)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// redisProc is a private redis-server the run stops and starts.
type redisProc struct {
	addr, bin, dir string
	port           int
	cmd            *exec.Cmd
}

func (r *redisProc) start() error {
	r.cmd = exec.Command(r.bin, "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", r.dir)
	if err := r.cmd.Start(); err != nil {
		return err
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", r.addr, 100*time.Millisecond); err == nil {
			_ = c.Close()
			return nil
		}
	}
	return fmt.Errorf("redis-server on %s did not answer", r.addr)
}

func (r *redisProc) stop() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
		r.cmd = nil
	}
}
