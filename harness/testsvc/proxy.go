package testsvc

import (
	"bytes"
	"context"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// FaultProxy is a TCP proxy on 127.0.0.1 in front of one service, for
// tests that need the network to fail at a chosen moment: cut every open
// connection, refuse new ones, or cut a connection right after the server
// sent a given byte pattern (say, the command tag of a COMMIT) and before
// the client received it.
type FaultProxy struct {
	ln     net.Listener
	target string

	mu        sync.Mutex
	conns     map[net.Conn]struct{}
	heads     map[*proxied][]byte // what each client sent first (up to headSize)
	blocked   [][]byte            // CutClientsSending's patterns
	refuse    bool
	cutOn     []byte
	cutDone   chan struct{}
	stallOn   []byte
	stallFor  time.Duration
	stallDone chan struct{}
	closed    bool
}

// Proxy starts a FaultProxy to target (host:port), stopped when the test
// ends.
func Proxy(t testing.TB, target string) *FaultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testsvc: proxy: %v", err)
	}
	p := &FaultProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}, heads: map[*proxied][]byte{}}
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *FaultProxy) Addr() string { return p.ln.Addr().String() }

// Refuse makes the proxy close new connections at once (on) or forward
// them again (off).
func (p *FaultProxy) Refuse(on bool) {
	p.mu.Lock()
	p.refuse = on
	p.mu.Unlock()
}

// CutAll closes every open connection, both ways.
func (p *FaultProxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// CutWhenServerSends arms a one-shot fault: the first chunk from the
// server that contains pattern is dropped and its connection is cut both
// ways, so the server did the work and the client never hears of it. The
// returned channel is closed when the fault fired.
func (p *FaultProxy) CutWhenServerSends(pattern []byte) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutOn = append([]byte(nil), pattern...)
	p.cutDone = make(chan struct{})
	return p.cutDone
}

// StallWhenClientSends arms a one-shot fault: the first chunk from a
// client that contains pattern, and everything that client sends after it,
// reach the server d late (a slow network or a busy server). The returned
// channel is closed when the stall begins.
func (p *FaultProxy) StallWhenClientSends(pattern []byte, d time.Duration) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stallOn, p.stallFor = append([]byte(nil), pattern...), d
	p.stallDone = make(chan struct{})
	return p.stallDone
}

// headSize bounds what the proxy keeps of each client's first bytes, for
// CutClientsSending.
const headSize = 8 << 10

// proxied is one client's connection and the proxy's to the server.
type proxied struct{ client, server net.Conn }

// CutClientsSending cuts every open connection whose client sent pattern
// within its first 8 KiB (say, the name a server gives itself when it
// connects to a peer), and from now on every new one whose client sends
// it, until AllowClientsSending(pattern). Connections of other clients go
// on.
func (p *FaultProxy) CutClientsSending(pattern []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blocked = append(p.blocked, append([]byte(nil), pattern...))
	for c, head := range p.heads {
		if bytes.Contains(head, pattern) {
			_ = c.client.Close()
			_ = c.server.Close()
		}
	}
}

// AllowClientsSending lifts CutClientsSending(pattern): new connections
// of clients that send it are forwarded again.
func (p *FaultProxy) AllowClientsSending(pattern []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	kept := p.blocked[:0]
	for _, b := range p.blocked {
		if !bytes.Equal(b, pattern) {
			kept = append(kept, b)
		}
	}
	p.blocked = kept
}

// Close stops the proxy and cuts its connections.
func (p *FaultProxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	p.CutAll()
}

func (p *FaultProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse || p.closed
		p.mu.Unlock()
		if refuse {
			_ = c.Close()
			continue
		}
		go p.serve(c)
	}
}

func (p *FaultProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
}

func (p *FaultProxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

func (p *FaultProxy) serve(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	p.track(client, server)
	c := &proxied{client, server}
	p.mu.Lock()
	p.heads[c] = nil
	p.mu.Unlock()
	defer func() {
		_ = client.Close()
		_ = server.Close()
		p.untrack(client, server)
		p.mu.Lock()
		delete(p.heads, c)
		p.mu.Unlock()
	}()
	done := make(chan struct{}, 2)
	go func() { p.fromClient(c); done <- struct{}{} }()
	go func() { p.fromServer(client, server); done <- struct{}{} }()
	<-done
}

// fromClient copies client -> server; the armed stall holds the chunk
// that carries its pattern, and what follows, for its time; a client that
// sends a pattern CutClientsSending names is cut.
func (p *FaultProxy) fromClient(c *proxied) {
	pipe(c.client, c.server, func(chunk []byte) bool {
		p.mu.Lock()
		head := p.heads[c]
		if len(head) < headSize {
			head = append(head, chunk[:min(len(chunk), headSize-len(head))]...)
			p.heads[c] = head
		}
		for _, b := range p.blocked {
			if bytes.Contains(head, b) {
				p.mu.Unlock()
				return false // pipe's caller closes both
			}
		}
		stall := p.stallOn != nil && bytes.Contains(chunk, p.stallOn)
		var began chan struct{}
		var d time.Duration
		if stall {
			p.stallOn, began, d = nil, p.stallDone, p.stallFor
		}
		p.mu.Unlock()
		if stall {
			close(began)
			time.Sleep(d)
		}
		return true
	})
}

// fromServer copies server -> client; the armed cut drops the chunk that
// carries its pattern and closes both connections.
func (p *FaultProxy) fromServer(client, server net.Conn) {
	pipe(server, client, func(chunk []byte) bool {
		p.mu.Lock()
		cut := p.cutOn != nil && bytes.Contains(chunk, p.cutOn)
		var fired chan struct{}
		if cut {
			p.cutOn, fired = nil, p.cutDone
		}
		p.mu.Unlock()
		if cut {
			close(fired) // before the client can see the cut
			_ = client.Close()
			_ = server.Close()
		}
		return !cut
	})
}

// pipe copies src to dst chunk by chunk, each passed to check first; it
// stops when check returns false or either side fails.
func pipe(src, dst net.Conn, check func(chunk []byte) bool) {
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !check(buf[:n]) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// PoolVia returns a pool on the test's schema whose connections go to
// addr (a FaultProxy's) instead of the server, closed when the test ends.
func (pg *PG) PoolVia(t testing.TB, addr string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(pg.URL)
	if err != nil {
		t.Fatalf("testsvc: %v", err)
	}
	u.Host = addr
	return newPool(t, u.String(), maxConns)
}

// newPool returns a pool on connString with at most maxConns connections,
// closed when the test ends.
func newPool(t testing.TB, connString string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("testsvc: %v", err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testsvc: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Host returns the host:port of the test server behind pg.
func (pg *PG) Host() string {
	u, err := url.Parse(pg.URL)
	if err != nil {
		return ""
	}
	return u.Host
}
