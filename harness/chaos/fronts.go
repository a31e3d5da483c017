package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"time"

	"github.com/justonce/justonce/httpbridge"
)

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

// plan returns the IDs to produce: every unique ID once, in order, and
// duplicates of earlier IDs inserted later, so that duplicates are dupPct
// percent of all.
func plan(prefix string, unique, dupPct int) (ids []string, dups int) {
	dups = unique * dupPct / (100 - dupPct)
	ids = make([]string, 0, unique+dups)
	for i := 0; i < unique; i++ {
		ids = append(ids, prefix+strconv.Itoa(i))
	}
	for d := 0; d < dups; d++ {
		// A duplicate of an ID at least one position earlier: a later offset.
		at := 1 + mrand.N(len(ids))
		earlier := mrand.N(min(at, unique))
		ids = append(ids, "")
		copy(ids[at+1:], ids[at:])
		ids[at] = prefix + strconv.Itoa(earlier)
	}
	return ids, dups
}

// httpServer serves POST /pay through the bridge, on its own pool (whose
// connections are terminated with the workers').
type closer struct {
	URL   string
	close func()
}

func (c *closer) Close() { c.close() }

func httpServer(ctx context.Context, pgURL, redisAddr string) (*closer, error) {
	l, closeLedger, err := newLedger(ctx, pgURL, redisAddr, "http")
	if err != nil {
		return nil, err
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: l})
	if err != nil {
		return nil, err
	}
	route := bridge.Route(httpbridge.RouteConfig{Scope: scope, Required: true})
	mux := http.NewServeMux()
	mux.Handle("POST /pay", route(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := httpbridge.Key(r.Context())
		if _, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (event_id, transport) VALUES ($1, 'http')`, key); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		// A body unique to this execution: every client of a key must see it.
		fmt.Fprintf(w, `{"key":%q,"payment":"pay_%s"}`, key, randHex(6))
	})))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &closer{URL: "http://" + ln.Addr().String(), close: func() {
		_ = srv.Close()
		closeLedger()
	}}, nil
}
