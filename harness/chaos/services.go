package main

import (
	"context"
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

	"github.com/justonce/justonce/consumer"
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

// crash SIGKILLs the service, waits until the process is gone, then
// restarts it and waits until it answers. It returns how long the service
// was down.
func (s *services) crash(ctx context.Context, service string) (time.Duration, error) {
	pid, err := s.pid(service)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return 0, fmt.Errorf("%s: kill %d: %w", service, pid, err)
	}
	for deadline := time.Now().Add(30 * time.Second); alive(pid); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%s: pid %d still alive 30 s after SIGKILL", service, pid)
		}
	}
	// A killed JVM's main thread can show as a zombie while its other
	// threads still hold the sockets: wait until the port is free.
	addr := "127.0.0.1:" + strconv.Itoa(s.ports[service])
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			break
		}
		_ = c.Close()
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%s: %s still accepts connections 30 s after SIGKILL", service, addr)
		}
	}
	// The killed process's last threads may still hold its files (Kafka's
	// data directory lock) for a moment after the port is free: a start
	// that fails at once is tried again, a bounded number of times.
	var upErr error
	for try := 0; try < 4; try++ {
		if upErr = s.up(ctx, service); upErr == nil {
			return time.Since(start), nil
		}
		fmt.Fprintf(os.Stderr, "chaos: %s restart failed (try %d), retrying: %v\n", service, try+1, upErr)
		time.Sleep(2 * time.Second)
	}
	return time.Since(start), upErr
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

// restart shuts the server down (JetStream flushes its file store) and
// starts a new one on the same port and store after down.
func (n *natsServer) restart(down time.Duration) error {
	n.shutdown()
	time.Sleep(down)
	return n.start()
}

// netFaults is an in-process TCP fault proxy (toxiproxy) between the
// consumers and HTTP server and Postgres and Redis. It listens on
// 127.0.0.1 only.
type netFaults struct {
	srv       *toxiproxy.ApiServer
	pg, redis *toxiproxy.Proxy
}

func newNetFaults(pgAddr, redisAddr string) (*netFaults, error) {
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	n := &netFaults{srv: srv}
	var err error
	if n.pg, err = n.proxy("pg", pgAddr); err != nil {
		return nil, err
	}
	if n.redis, err = n.proxy("redis", redisAddr); err != nil {
		n.pg.Stop()
		return nil, err
	}
	return n, nil
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

// toxic adds a toxic to p for d, then removes it.
func toxic(ctx context.Context, p *toxiproxy.Proxy, name, typ, stream string, attrs string, d time.Duration) error {
	body := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, name, typ, stream, attrs)
	if _, err := p.Toxics.AddToxicJson(strings.NewReader(body)); err != nil {
		return fmt.Errorf("toxic %s on %s: %w", name, p.Name, err)
	}
	_ = consumer.Sleep(ctx, d)
	return p.Toxics.RemoveToxic(context.WithoutCancel(ctx), name)
}

// netFault kinds, in turn.
var netFaultKinds = []string{"reset-peer", "latency", "timeout"}

// inject runs one network fault episode of the given kind.
//   - reset-peer: every Postgres connection is reset (RST) at the next
//     reply the server sends, that reply dropped, for 300 ms: a COMMIT in
//     flight is executed by the server and its answer never arrives
//     (ErrCommitUnknown).
//   - latency: 150 ms ± 100 ms on every reply from Postgres and Redis
//     for 2 s.
//   - timeout: no data flows to Postgres and Redis; connections are
//     closed after 1.5 s; for 2 s.
func (n *netFaults) inject(ctx context.Context, kind string) error {
	switch kind {
	case "reset-peer":
		return toxic(ctx, n.pg, "reset", "reset_peer", "downstream", `{"timeout":0}`, 300*time.Millisecond)
	case "latency":
		var wg sync.WaitGroup
		var e1, e2 error
		wg.Add(2)
		go func() {
			defer wg.Done()
			e1 = toxic(ctx, n.pg, "latency", "latency", "downstream", `{"latency":150,"jitter":100}`, 2*time.Second)
		}()
		go func() {
			defer wg.Done()
			e2 = toxic(ctx, n.redis, "latency", "latency", "downstream", `{"latency":150,"jitter":100}`, 2*time.Second)
		}()
		wg.Wait()
		return errors.Join(e1, e2)
	case "timeout":
		var wg sync.WaitGroup
		var e1, e2 error
		wg.Add(2)
		go func() {
			defer wg.Done()
			e1 = toxic(ctx, n.pg, "timeout", "timeout", "upstream", `{"timeout":1500}`, 2*time.Second)
		}()
		go func() {
			defer wg.Done()
			e2 = toxic(ctx, n.redis, "timeout", "timeout", "upstream", `{"timeout":1500}`, 2*time.Second)
		}()
		wg.Wait()
		return errors.Join(e1, e2)
	}
	return fmt.Errorf("unknown network fault %q", kind)
}
