package testsvc

import (
	"bytes"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// ephemeralRange returns Linux's ephemeral port range (where the kernel
// picks the local port of outgoing connections), 32768-60999 when it
// cannot be read.
func ephemeralRange() (lo, hi int) {
	lo, hi = 32768, 60999
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(bytes.TrimSpace(b))); len(f) == 2 {
			l, err1 := strconv.Atoi(f[0])
			h, err2 := strconv.Atoi(f[1])
			if err1 == nil && err2 == nil {
				lo, hi = l, h
			}
		}
	}
	return lo, hi
}

// lowPortBlock returns P such that P+o is free on loopback for every
// offset o, with every such port in 20000-maxPort and outside the
// ephemeral range: a port there can only be held by a listener, never by
// the local end of a client connection, so a server restarted on it finds
// it free again.
func lowPortBlock(t testing.TB, maxPort int, offsets ...int) int {
	t.Helper()
	lo, hi := ephemeralRange()
	const minPort = 20000
	span := 0
	for _, o := range offsets {
		span = max(span, o)
	}
	top := maxPort - span
	ephemeral := func(p int) bool { return p >= lo && p <= hi }
	for try := 0; try < 500; try++ {
		p := minPort + rand.IntN(top-minPort+1)
		ok := true
		for _, o := range offsets {
			ok = ok && !ephemeral(p+o)
		}
		if !ok {
			continue
		}
		var ls []net.Listener
		for _, o := range offsets {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+o))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			_ = l.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatalf("testsvc: no free block of ports %v in %d-%d outside the ephemeral range %d-%d", offsets, minPort, maxPort, lo, hi)
	return 0
}

// lowPorts returns n consecutive free loopback ports below the ephemeral
// range (see lowPortBlock).
func lowPorts(t testing.TB, n int) []int {
	t.Helper()
	offsets := make([]int, n)
	for i := range offsets {
		offsets[i] = i
	}
	base := lowPortBlock(t, 32767, offsets...)
	ports := make([]int, n)
	for i := range ports {
		ports[i] = base + i
	}
	return ports
}
