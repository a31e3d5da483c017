package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// What a consumer costs per event, besides its speed: the round trips and
// statements it sends to Postgres (counted by the child on its pool's
// connections), the CPU time of the child process and of its Postgres
// backends (read from /proc by the orchestrator, so only when Postgres runs
// on this machine), and the WAL the server wrote meanwhile (all of the
// server's: other clients' writes count too).

// pgWire counts what a client sends on its Postgres connections: the
// turns (a read after writes: one round trip) and the statements (the
// frontend protocol's Execute and Query messages).
type pgWire struct {
	roundTrips, statements, bytesOut atomic.Int64
}

// dial is a pgconn DialFunc that counts on the connections it opens.
func (w *pgWire) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{KeepAlive: 5 * time.Minute}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &countedConn{Conn: c, w: w}, nil
}

// countedConn is one counted connection. It reads the frontend protocol
// as it goes out: the startup message (a length, no type byte), then
// messages of a type byte and a length.
type countedConn struct {
	net.Conn
	w       *pgWire
	mu      sync.Mutex
	wrote   bool // written since the last read
	started bool // the startup message is behind
	head    []byte
	skip    int // bytes of the current message still to pass
}

func (c *countedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.wrote = true
	c.scan(p)
	c.mu.Unlock()
	c.w.bytesOut.Add(int64(len(p)))
	return c.Conn.Write(p)
}

func (c *countedConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	if c.wrote {
		c.wrote = false
		c.w.roundTrips.Add(1)
	}
	c.mu.Unlock()
	return c.Conn.Read(p)
}

// scan follows the messages in p, counting Execute ('E') and Query ('Q').
func (c *countedConn) scan(p []byte) {
	for len(p) > 0 {
		if c.skip > 0 {
			n := min(c.skip, len(p))
			c.skip -= n
			p = p[n:]
			continue
		}
		want := 5
		if !c.started {
			want = 4
		}
		n := min(want-len(c.head), len(p))
		c.head = append(c.head, p[:n]...)
		p = p[n:]
		if len(c.head) < want {
			return
		}
		if !c.started {
			c.started = true
			c.skip = int(binary.BigEndian.Uint32(c.head)) - 4
		} else {
			if c.head[0] == 'E' || c.head[0] == 'Q' {
				c.w.statements.Add(1)
			}
			c.skip = int(binary.BigEndian.Uint32(c.head[1:])) - 4
		}
		c.head = c.head[:0]
	}
}

// childStats is what a consumer process reports when it exits
// (PEERS_STATS names the file).
type childStats struct {
	RoundTrips int64 `json:"round_trips"`
	Statements int64 `json:"statements"`
	BytesOut   int64 `json:"bytes_out"`
}

// childInstruments sets up what the orchestrator asked the child for: the
// counting of its Postgres traffic (PEERS_STATS) and a CPU profile
// (PEERS_CPUPROFILE). The returned function writes them out.
func childInstruments(cfg *pgxpool.Config) (finish func(), err error) {
	var w pgWire
	statsPath, profPath := os.Getenv("PEERS_STATS"), os.Getenv("PEERS_CPUPROFILE")
	if statsPath != "" {
		cfg.ConnConfig.DialFunc = w.dial
	}
	var prof *os.File
	if profPath != "" {
		if prof, err = os.Create(profPath); err != nil {
			return nil, err
		}
		if err := pprof.StartCPUProfile(prof); err != nil {
			prof.Close()
			return nil, err
		}
	}
	return func() {
		if prof != nil {
			pprof.StopCPUProfile()
			prof.Close()
		}
		if statsPath != "" {
			b, _ := json.Marshal(childStats{RoundTrips: w.roundTrips.Load(), Statements: w.statements.Load(), BytesOut: w.bytesOut.Load()})
			_ = os.WriteFile(statsPath, b, 0o644)
		}
	}, nil
}

// cost is what one throughput round of one peer cost.
type cost struct {
	child      childStats
	clientCPU  time.Duration // the consumer process, to its last effect
	serverCPU  time.Duration // its Postgres backends, to its last effect; 0: not measured
	walBytes   int64         // WAL the server wrote during the round (server-wide)
	serverSeen bool          // the backends' CPU could be read
}

// perEvent is a cost divided by the events of a round.
type perEvent struct {
	roundTrips, statements float64
	clientUS, serverUS     float64 // CPU µs per event
	walBytes               float64
	server                 bool
}

func (c cost) per(events int) perEvent {
	n := float64(events)
	return perEvent{
		roundTrips: float64(c.child.RoundTrips) / n, statements: float64(c.child.Statements) / n,
		clientUS: float64(c.clientCPU.Microseconds()) / n, serverUS: float64(c.serverCPU.Microseconds()) / n,
		walBytes: float64(c.walBytes) / n, server: c.serverSeen,
	}
}

// clockTick is the unit of /proc/<pid>/stat's CPU times (USER_HZ).
const clockTick = 10 * time.Millisecond

// procCPU returns the user and system CPU time of process pid, from
// /proc.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, err
	}
	// The fields after the command name, which is in parentheses.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	// utime and stime are fields 14 and 15, the 12th and 13th after it.
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad times", pid)
	}
	return time.Duration(ut+st) * clockTick, nil
}

// backendsCPU returns the CPU time of the Postgres backends serving the
// application name app (the consumer's pool sets it), when the server runs
// on this machine; ok is false when none could be read.
func backendsCPU(ctx context.Context, pool *pgxpool.Pool, app string) (d time.Duration, ok bool) {
	rows, err := pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	if err != nil {
		return 0, false
	}
	defer rows.Close()
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) != nil {
			continue
		}
		if c, err := procCPU(pid); err == nil {
			d += c
			ok = true
		}
	}
	return d, ok
}
