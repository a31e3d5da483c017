package testsvc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PGReplicaSetConfig configures StartPostgresReplicaSet.
type PGReplicaSetConfig struct {
	// Synchronous makes the primary wait, at each commit, until the
	// standby has the commit's WAL (synchronous_standby_names = '*'), so
	// that a commit acknowledged to a client survives the primary's death.
	// False: asynchronous streaming replication, where the primary
	// acknowledges a commit as soon as it is in its own WAL.
	Synchronous bool
	// SyncCommit is the synchronous_commit setting of every node: "on"
	// (the default: with Synchronous, the standby has flushed the WAL),
	// "remote_apply" (the standby has applied it), "remote_write",
	// "local" or "off".
	SyncCommit string
	// Bin is the directory of the Postgres server binaries. Default:
	// JUSTONCE_PG_BIN, else the highest /usr/lib/postgresql/*/bin.
	Bin string
	// MaxConnections is each node's max_connections. Default 60.
	MaxConnections int
}

// PGReplicaSet is a Postgres primary and a streaming standby of the
// test's own, on loopback ports below the ephemeral range, run from the
// Debian server binaries (as the postgres user when the test runs as
// root: initdb and postgres refuse root). The standby reaches the primary
// through a FaultProxy, so that a test can cut replication at a chosen
// moment. The test kills the primary (SIGKILL of the postmaster and every
// backend), promotes the standby, and rebuilds the dead node as the new
// standby, as many times as it likes. Everything is killed and removed
// when the test ends.
//
// The nodes run with fsync off: the faults are process kills, after which
// the kernel still holds every write, so fsync changes nothing the tests
// prove and only slows a shared machine.
//
// With Synchronous, the replica set behaves as failover managers do in
// their default, non-strict mode (Patroni's synchronous_mode): a
// promoted standby starts as a primary with no synchronous standby (it has
// none to wait for) and commits at once, and RebuildStandby makes the
// rebuilt node its synchronous standby again. A primary that dies before
// that loses the commits it acknowledged alone.
type PGReplicaSet struct {
	t     testing.TB
	cfg   PGReplicaSetConfig
	bin   string
	dir   string
	cred  *syscall.Credential
	nodes [2]*pgNode

	mu      sync.Mutex
	primary int
}

type pgNode struct {
	index int
	port  int
	data  string
	log   string
	cmd   *exec.Cmd
	done  chan struct{}
	link  *FaultProxy // a standby's replication connection to the primary
}

// PGBin returns the directory of the Postgres server binaries:
// JUSTONCE_PG_BIN, else the highest /usr/lib/postgresql/*/bin, or "".
func PGBin() string {
	if v := os.Getenv("JUSTONCE_PG_BIN"); v != "" {
		return v
	}
	ds, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(ds, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(ds[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(ds[j])))
		return vi < vj
	})
	for i := len(ds) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(ds[i], "initdb")); err == nil {
			return ds[i]
		}
	}
	return ""
}

// StartPostgresReplicaSet initialises a primary, starts it, builds a
// standby from it with pg_basebackup and starts that, and returns once
// the standby streams (and, with Synchronous, once the primary waits for
// it at each commit).
func StartPostgresReplicaSet(t testing.TB, cfg PGReplicaSetConfig) *PGReplicaSet {
	t.Helper()
	if cfg.SyncCommit == "" {
		cfg.SyncCommit = "on"
	}
	if cfg.Bin == "" {
		cfg.Bin = PGBin()
	}
	if cfg.MaxConnections == 0 {
		cfg.MaxConnections = 60
	}
	if cfg.Bin == "" {
		t.Fatalf("testsvc: no Postgres server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql) and JUSTONCE_PG_BIN unset")
	}
	rs := &PGReplicaSet{t: t, cfg: cfg, bin: cfg.Bin}
	// The nodes' files must belong to the user the server runs as: a
	// directory of the test's own, outside t.TempDir (which only root may
	// enter).
	dir, err := os.MkdirTemp("", "justonce-pgrs-")
	if err != nil {
		t.Fatal(err)
	}
	rs.dir = dir
	t.Cleanup(func() {
		rs.stopAll()
		_ = os.RemoveAll(dir)
	})
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("testsvc: running as root, and there is no postgres user to run the Postgres servers as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		rs.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	ports := lowPorts(t, 2)
	for i := range rs.nodes {
		rs.nodes[i] = &pgNode{index: i, port: ports[i],
			data: filepath.Join(dir, fmt.Sprintf("node%d", i)), log: filepath.Join(dir, fmt.Sprintf("node%d.log", i))}
	}

	n := rs.nodes[0]
	if out, err := rs.command("initdb", "-D", n.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
		"--no-locale", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("testsvc: initdb: %v\n%s", err, out)
	}
	f, err := os.OpenFile(filepath.Join(n.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteString("\ninclude 'justonce.conf'\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	rs.writeConf(n, "", "")
	rs.start(n)
	rs.waitRole(n, false)
	rs.primary = 0
	rs.RebuildStandby()
	return rs
}

// command returns cmd for one of the server binaries, run as the postgres
// user when the test runs as root.
func (rs *PGReplicaSet) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(rs.bin, name), args...)
	cmd.Dir = rs.dir
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
	if rs.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: rs.cred}
	}
	return cmd
}

// writeConf writes the node's justonce.conf (included by postgresql.conf):
// primaryConnInfo makes it a standby, syncNames is the primary's
// synchronous_standby_names.
func (rs *PGReplicaSet) writeConf(n *pgNode, primaryConnInfo, syncNames string) {
	rs.t.Helper()
	conf := fmt.Sprintf(`# written by testsvc.PGReplicaSet
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = ''
max_connections = %d
shared_buffers = 32MB
fsync = off
wal_level = replica
max_wal_senders = 4
wal_keep_size = '256MB'
hot_standby = on
wal_receiver_status_interval = '1s'
wal_retrieve_retry_interval = '200ms'
synchronous_commit = '%s'
synchronous_standby_names = '%s'
logging_collector = off
log_line_prefix = '%%m [%%p] '
`, n.port, rs.cfg.MaxConnections, rs.cfg.SyncCommit, syncNames)
	if primaryConnInfo != "" {
		conf += "primary_conninfo = '" + primaryConnInfo + "'\n"
	}
	rs.writeFile(filepath.Join(n.data, "justonce.conf"), conf)
}

// writeFile writes a file the server reads, owned by its user.
func (rs *PGReplicaSet) writeFile(path, content string) {
	rs.t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		rs.t.Fatal(err)
	}
	if rs.cred != nil {
		if err := os.Chown(path, int(rs.cred.Uid), int(rs.cred.Gid)); err != nil {
			rs.t.Fatal(err)
		}
	}
}

// start runs the node's postmaster.
func (rs *PGReplicaSet) start(n *pgNode) {
	rs.t.Helper()
	logf, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		rs.t.Fatal(err)
	}
	cmd := rs.command("postgres", "-D", n.data)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		rs.t.Fatalf("testsvc: start postgres node %d: %v", n.index, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = logf.Close()
		close(done)
	}()
	n.cmd, n.done = cmd, done
}

// running reports whether the node's postmaster runs.
func (n *pgNode) running() bool {
	if n.done == nil {
		return false
	}
	select {
	case <-n.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL to the node's postmaster and every process it
// started (each backend is a process group of its own), as when its
// machine dies, and waits until none of them runs. The postmaster is
// stopped first, so that it starts no process the kill would miss.
func (rs *PGReplicaSet) kill(n *pgNode) {
	rs.t.Helper()
	if n.cmd == nil {
		return
	}
	pid := n.cmd.Process.Pid
	children := killTree(pid)
	select {
	case <-n.done:
	case <-time.After(30 * time.Second):
		rs.t.Fatalf("testsvc: postgres node %d (pid %d) still runs 30 s after SIGKILL", n.index, pid)
	}
	// Once reparented, the children may linger as zombies until init
	// reaps them, which holds nothing.
	end := time.Now().Add(30 * time.Second)
	for _, c := range children {
		for processRuns(c) {
			if time.Now().After(end) {
				rs.t.Fatalf("testsvc: postgres node %d: backend %d still runs 30 s after SIGKILL", n.index, c)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	n.cmd, n.done = nil, nil
}

// killTree stops pid, sends SIGKILL to its children and then to it, and
// returns the children's pids.
func killTree(pid int) []int {
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	children := childrenOf(pid)
	for _, c := range children {
		_ = syscall.Kill(c, syscall.SIGKILL)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	return children
}

// procStat returns the fields of /proc/pid/stat after the command name:
// state, ppid, pgrp, ...
func procStat(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold spaces
	if i < 0 {
		return nil
	}
	return strings.Fields(s[i+1:])
}

// processRuns reports whether pid is a live process (not a zombie).
func processRuns(pid int) bool {
	f := procStat(pid)
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// childrenOf returns the pids of ppid's live children.
func childrenOf(ppid int) []int {
	var out []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		if f := procStat(pid); len(f) > 1 && f[0] != "Z" && f[1] == strconv.Itoa(ppid) {
			out = append(out, pid)
		}
	}
	return out
}

func (rs *PGReplicaSet) stopAll() {
	for _, n := range rs.nodes {
		if n != nil && n.cmd != nil {
			killTree(n.cmd.Process.Pid)
		}
	}
	for _, n := range rs.nodes {
		if n != nil && n.done != nil {
			select {
			case <-n.done:
			case <-time.After(30 * time.Second):
			}
		}
	}
}

// NodeURL returns a connection URL of node i (0 or 1) alone.
func (rs *PGReplicaSet) NodeURL(i int) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=5", rs.nodes[i].port)
}

// Port returns node i's port.
func (rs *PGReplicaSet) Port(i int) int { return rs.nodes[i].port }

// ConnString returns the multi-host connection string a client uses to
// follow the primary: both nodes, and target_session_attrs=read-write, so
// that a new connection skips a node that is down or a standby.
func (rs *PGReplicaSet) ConnString() string {
	return fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable connect_timeout=2 target_session_attrs=read-write",
		rs.nodes[0].port, rs.nodes[1].port)
}

// Pool returns a pool on ConnString with at most maxConns connections,
// closed when the test ends.
func (rs *PGReplicaSet) Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return newPool(t, rs.ConnString(), maxConns)
}

// Primary returns the index of the node that is (or, once killed, was)
// the primary.
func (rs *PGReplicaSet) Primary() int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.primary
}

// Standby returns the index of the other node.
func (rs *PGReplicaSet) Standby() int { return 1 - rs.Primary() }

// KillPrimary sends SIGKILL to the primary's postmaster and every one of
// its backends, and waits until they are gone. Nothing is flushed or
// handed over: the standby is left with what it had received. It returns
// the killed node's index.
func (rs *PGReplicaSet) KillPrimary() int {
	rs.t.Helper()
	p := rs.Primary()
	n := rs.nodes[p]
	if !n.running() {
		rs.t.Fatalf("testsvc: primary node %d is not running", p)
	}
	rs.kill(n)
	return p
}

// RestartPrimary starts the primary KillPrimary killed again, in place:
// it recovers from its crash and stays the primary (nothing is promoted),
// and the standby streams from it again. It returns once the primary
// accepts writes and, with Synchronous, waits for the standby at each
// commit again.
func (rs *PGReplicaSet) RestartPrimary() {
	rs.t.Helper()
	p := rs.nodes[rs.Primary()]
	s := rs.nodes[1-p.index]
	if p.running() {
		rs.t.Fatalf("testsvc: primary node %d runs: kill it before restarting it", p.index)
	}
	rs.start(p)
	rs.waitRole(p, false)
	if s.running() && s.link != nil {
		want := "async"
		if rs.cfg.Synchronous {
			want = "sync"
		}
		rs.waitStandby(p, s, want)
	}
}

// Promote promotes the standby (pg_promote) and waits until it accepts
// writes. The promoted node is a primary with no standby: with
// Synchronous it waits for none until RebuildStandby gives it one.
func (rs *PGReplicaSet) Promote() {
	rs.t.Helper()
	s := rs.nodes[rs.Standby()]
	if !s.running() {
		rs.t.Fatalf("testsvc: standby node %d is not running", s.index)
	}
	if s.link != nil {
		s.link.Close()
		s.link = nil
	}
	rs.writeConf(s, "", "")
	var promoted bool
	rs.query(s, func(c *pgx.Conn) error {
		if _, err := c.Exec(context.Background(), "SELECT pg_reload_conf()"); err != nil {
			return err
		}
		return c.QueryRow(context.Background(), "SELECT pg_promote(true, 60)").Scan(&promoted)
	})
	if !promoted {
		rs.t.Fatalf("testsvc: node %d was not promoted within 60 s; its log:\n%s", s.index, rs.tail(s, 30))
	}
	rs.waitRole(s, false)
	rs.mu.Lock()
	rs.primary = s.index
	rs.mu.Unlock()
}

// RebuildStandby makes the node that is not running (the primary killed
// last, or the second node at the start) the primary's standby: its data
// directory is replaced with a pg_basebackup of the primary, and it
// streams from the primary through a new FaultProxy. It returns once the
// standby streams and has everything the primary had written when the
// standby connected; with Synchronous, once the primary waits for it at
// each commit.
func (rs *PGReplicaSet) RebuildStandby() {
	rs.t.Helper()
	p := rs.nodes[rs.Primary()]
	s := rs.nodes[1-p.index]
	if s.running() {
		rs.t.Fatalf("testsvc: node %d runs: kill it before rebuilding it", s.index)
	}
	if !p.running() {
		rs.t.Fatalf("testsvc: primary node %d is not running", p.index)
	}
	if err := os.RemoveAll(s.data); err != nil {
		rs.t.Fatal(err)
	}
	if out, err := rs.command("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(p.port), "-U", "postgres",
		"-D", s.data, "-X", "stream", "-c", "fast", "--no-sync").CombinedOutput(); err != nil {
		rs.t.Fatalf("testsvc: pg_basebackup of node %d: %v\n%s", p.index, err, out)
	}
	s.link = Proxy(rs.t, fmt.Sprintf("127.0.0.1:%d", p.port))
	rs.writeConf(s, fmt.Sprintf("host=127.0.0.1 port=%s user=postgres application_name=node%d connect_timeout=2",
		strings.TrimPrefix(s.link.Addr(), "127.0.0.1:"), s.index), "")
	rs.writeFile(filepath.Join(s.data, "standby.signal"), "")
	rs.start(s)
	rs.waitRole(s, true)
	sync := ""
	if rs.cfg.Synchronous {
		sync = "*"
	}
	rs.writeConf(p, "", sync)
	rs.query(p, func(c *pgx.Conn) error {
		_, err := c.Exec(context.Background(), "SELECT pg_reload_conf()")
		return err
	})
	want := "async"
	if rs.cfg.Synchronous {
		want = "sync"
	}
	rs.waitStandby(p, s, want)
	rs.WaitStandbyCaughtUp()
}

// waitStandby waits until the primary p lists s as a streaming standby in
// pg_stat_replication, with sync_state want.
func (rs *PGReplicaSet) waitStandby(p, s *pgNode, want string) {
	rs.t.Helper()
	app := fmt.Sprintf("node%d", s.index)
	var last string
	rs.eventually(p, func(c *pgx.Conn) (bool, error) {
		var state, syncState string
		err := c.QueryRow(context.Background(), `SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1`, app).Scan(&state, &syncState)
		if errors.Is(err, pgx.ErrNoRows) {
			last = "not connected"
			return false, nil
		}
		last = state + "/" + syncState
		return state == "streaming" && syncState == want, err
	}, func() string {
		return fmt.Sprintf("node %d streaming from node %d as %s (last: %s)", s.index, p.index, want, last)
	})
}

// WaitStandbyCaughtUp waits until the standby has replayed everything the
// primary had written when it was called.
func (rs *PGReplicaSet) WaitStandbyCaughtUp() {
	rs.t.Helper()
	p := rs.nodes[rs.Primary()]
	s := rs.nodes[1-p.index]
	var target string
	rs.query(p, func(c *pgx.Conn) error {
		return c.QueryRow(context.Background(), "SELECT pg_current_wal_lsn()::text").Scan(&target)
	})
	rs.eventually(s, func(c *pgx.Conn) (bool, error) {
		var ok bool
		err := c.QueryRow(context.Background(), "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", target).Scan(&ok)
		return ok, err
	}, func() string { return fmt.Sprintf("node %d replayed node %d's WAL up to %s", s.index, p.index, target) })
}

// CutReplication cuts the standby's replication connection and refuses
// new ones until RestoreReplication: the primary goes on alone (with
// Synchronous, its commits wait).
func (rs *PGReplicaSet) CutReplication() {
	rs.t.Helper()
	s := rs.nodes[rs.Standby()]
	if s.link == nil {
		rs.t.Fatalf("testsvc: node %d is no standby", s.index)
	}
	s.link.Refuse(true)
	s.link.CutAll()
	// The walsender goes at once; wait until the primary sees it gone,
	// so that nothing written from now on can reach the standby.
	p := rs.nodes[rs.Primary()]
	app := fmt.Sprintf("node%d", s.index)
	rs.eventually(p, func(c *pgx.Conn) (bool, error) {
		var n int
		err := c.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_replication WHERE application_name = $1`, app).Scan(&n)
		return n == 0, err
	}, func() string { return fmt.Sprintf("node %d's walsender gone from node %d", s.index, p.index) })
}

// RestoreReplication lets the standby connect to the primary again.
func (rs *PGReplicaSet) RestoreReplication() {
	s := rs.nodes[rs.Standby()]
	if s.link != nil {
		s.link.Refuse(false)
	}
}

// waitRole waits until the node answers, and is a standby (in recovery)
// or a primary as asked.
func (rs *PGReplicaSet) waitRole(n *pgNode, standby bool) {
	rs.t.Helper()
	rs.eventually(n, func(c *pgx.Conn) (bool, error) {
		var rec bool
		err := c.QueryRow(context.Background(), "SELECT pg_is_in_recovery()").Scan(&rec)
		return rec == standby, err
	}, func() string {
		return fmt.Sprintf("node %d up as a %s", n.index, map[bool]string{true: "standby", false: "primary"}[standby])
	})
}

// query runs f on a connection of its own to node n, failing the test on
// error.
func (rs *PGReplicaSet) query(n *pgNode, f func(*pgx.Conn) error) {
	rs.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, rs.NodeURL(n.index))
	if err == nil {
		err = f(c)
		_ = c.Close(context.Background())
	}
	if err != nil {
		rs.t.Fatalf("testsvc: postgres node %d: %v; its log:\n%s", n.index, err, rs.tail(n, 30))
	}
}

// eventually polls cond on node n for up to 60 s; connection errors
// count as not yet.
func (rs *PGReplicaSet) eventually(n *pgNode, cond func(*pgx.Conn) (bool, error), what func() string) {
	rs.t.Helper()
	end := time.Now().Add(60 * time.Second)
	var last error
	for {
		if !n.running() {
			rs.t.Fatalf("testsvc: postgres node %d exited while waiting for: %s; its log:\n%s", n.index, what(), rs.tail(n, 40))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := pgx.Connect(ctx, rs.NodeURL(n.index))
		if err == nil {
			var ok bool
			ok, err = cond(c)
			_ = c.Close(ctx)
			if ok && err == nil {
				cancel()
				return
			}
		}
		cancel()
		if err != nil {
			last = err
		}
		if time.Now().After(end) {
			rs.t.Fatalf("testsvc: not within 60 s: %s (last error: %v); node %d's log:\n%s", what(), last, n.index, rs.tail(n, 40))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (rs *PGReplicaSet) tail(n *pgNode, lines int) string {
	b, _ := os.ReadFile(n.log)
	s := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(s) > lines {
		s = s[len(s)-lines:]
	}
	return strings.Join(s, "\n")
}
