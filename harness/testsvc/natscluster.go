package testsvc

import (
	"fmt"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATSClusterSize is the number of nodes of StartNATSCluster.
const NATSClusterSize = 3

// NATSCluster is a JetStream cluster of three nats-server nodes embedded
// in the test process, on loopback ports below the ephemeral range, each
// with a file store of its own. The routes between the nodes go through
// FaultProxies (each node's cluster address, as the others know it, is
// its proxy's), so that a test can cut a node off from the others while it
// runs. The test kills and restarts nodes; everything is shut down when
// it ends.
//
// A node runs in the test's process, so Kill cannot be a SIGKILL: it cuts
// the node's routes first (its peers hear nothing more from it, no
// leadership hand-over, as when its process dies), then shuts it down.
// Its file store is closed cleanly, which a SIGKILL would not do.
type NATSCluster struct {
	t     testing.TB
	mu    sync.Mutex
	nodes [NATSClusterSize]*natsNode
}

type natsNode struct {
	index       int
	opts        server.Options // what each start of the node copies
	srv         *server.Server // nil while down
	proxy       *FaultProxy    // in front of the node's cluster port
	cutName     []byte         // while cut off: how it names itself to its peers
	clientPort  int
	clusterPort int
}

// NATSAccount is the account the cluster's clients use (no auth: the
// global account).
const NATSAccount = server.DEFAULT_GLOBAL_ACCOUNT

// StartNATSCluster starts the three nodes and returns once JetStream has a
// meta leader that every node knows.
func StartNATSCluster(t testing.TB) *NATSCluster {
	t.Helper()
	c := &NATSCluster{t: t}
	// The store's directory first: cleanups run last-in first-out, so the
	// nodes stop before their files are removed.
	dir := t.TempDir()
	t.Cleanup(c.stopAll)
	ports := lowPorts(t, 2*NATSClusterSize)
	for i := range c.nodes {
		n := &natsNode{index: i, clientPort: ports[i], clusterPort: ports[NATSClusterSize+i]}
		n.proxy = Proxy(t, "127.0.0.1:"+strconv.Itoa(n.clusterPort))
		c.nodes[i] = n
	}
	for i, n := range c.nodes {
		var routes []*url.URL
		for j, m := range c.nodes {
			if j != i {
				routes = append(routes, &url.URL{Scheme: "nats-route", Host: m.proxy.Addr()})
			}
		}
		n.opts = server.Options{
			ServerName: fmt.Sprintf("n%d", i),
			Host:       "127.0.0.1",
			Port:       n.clientPort,
			JetStream:  true,
			StoreDir:   filepath.Join(dir, fmt.Sprintf("n%d", i)),
			// Bounded, so that three nodes in one test process stay small.
			JetStreamMaxMemory: 256 << 20,
			JetStreamMaxStore:  4 << 30,
			Cluster: server.ClusterOpts{
				Name:      "justonce",
				Host:      "127.0.0.1",
				Port:      n.clusterPort,
				Advertise: n.proxy.Addr(),
			},
			Routes: routes,
			NoLog:  true,
			NoSigs: true,
		}
	}
	for i := range c.nodes {
		c.start(i)
	}
	c.waitMetaLeader(60 * time.Second)
	return c
}

// start starts node i with its options and waits until it accepts
// clients.
func (c *NATSCluster) start(i int) {
	c.t.Helper()
	n := c.nodes[i]
	opts := n.opts
	opts.Routes = append([]*url.URL(nil), n.opts.Routes...)
	srv, err := server.NewServer(&opts)
	if err != nil {
		c.t.Fatalf("testsvc: nats node %d: %v", i, err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		c.t.Fatalf("testsvc: nats node %d not ready within 30 s", i)
	}
	c.mu.Lock()
	n.srv = srv
	c.mu.Unlock()
}

func (c *NATSCluster) server(i int) *server.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].srv
}

// Server returns node i's server, nil while it is down.
func (c *NATSCluster) Server(i int) *server.Server { return c.server(i) }

// ClientURL returns node i's client URL.
func (c *NATSCluster) ClientURL(i int) string {
	return "nats://127.0.0.1:" + strconv.Itoa(c.nodes[i].clientPort)
}

// ClientURLs returns every node's client URL, comma-separated, for
// nats.Connect.
func (c *NATSCluster) ClientURLs() string {
	urls := make([]string, len(c.nodes))
	for i := range c.nodes {
		urls[i] = c.ClientURL(i)
	}
	return strings.Join(urls, ",")
}

// Cut cuts node i off from the other nodes: every route connection to it
// and from it is closed, and new ones are refused, until Heal. Its
// clients stay connected to it.
func (c *NATSCluster) Cut(i int) {
	c.t.Helper()
	srv := c.server(i)
	if srv == nil {
		c.t.Fatalf("testsvc: nats node %d is down", i)
	}
	n := c.nodes[i]
	n.proxy.Refuse(true)
	n.proxy.CutAll()
	// The routes node i opened itself go through the others' proxies: it
	// names itself by its server ID in the CONNECT it sends first.
	n.cutName = []byte(`"name":"` + srv.ID() + `"`)
	for j, m := range c.nodes {
		if j != i {
			m.proxy.CutClientsSending(n.cutName)
		}
	}
}

// Heal lets node i reach the other nodes again, and them reach it.
func (c *NATSCluster) Heal(i int) {
	n := c.nodes[i]
	n.proxy.Refuse(false)
	for j, m := range c.nodes {
		if j != i && n.cutName != nil {
			m.proxy.AllowClientsSending(n.cutName)
		}
	}
	n.cutName = nil
}

// Kill cuts node i off and shuts it down (see NATSCluster), and waits
// until it is down.
func (c *NATSCluster) Kill(i int) {
	c.t.Helper()
	srv := c.server(i)
	if srv == nil {
		c.t.Fatalf("testsvc: nats node %d is already down", i)
	}
	c.Cut(i)
	srv.Shutdown()
	srv.WaitForShutdown()
	c.mu.Lock()
	c.nodes[i].srv = nil
	c.mu.Unlock()
	c.Heal(i)
}

// Restart starts node i again, with its store, its ports and its name.
func (c *NATSCluster) Restart(i int) {
	c.t.Helper()
	if c.server(i) != nil {
		c.t.Fatalf("testsvc: nats node %d runs", i)
	}
	c.start(i)
}

// StreamLeader returns the index of the node leading stream, or -1.
func (c *NATSCluster) StreamLeader(stream string) int {
	for i := range c.nodes {
		if srv := c.server(i); srv != nil && srv.JetStreamIsStreamLeader(NATSAccount, stream) {
			return i
		}
	}
	return -1
}

// ConsumerLeader returns the index of the node leading the durable
// consumer of stream, or -1.
func (c *NATSCluster) ConsumerLeader(stream, durable string) int {
	for i := range c.nodes {
		if srv := c.server(i); srv != nil && srv.JetStreamIsConsumerLeader(NATSAccount, stream, durable) {
			return i
		}
	}
	return -1
}

// WaitStreamCurrent waits until stream has a leader and every running
// node's replica of it is current.
func (c *NATSCluster) WaitStreamCurrent(stream string, within time.Duration) {
	c.t.Helper()
	end := time.Now().Add(within)
	for {
		ok := c.StreamLeader(stream) >= 0
		for i := range c.nodes {
			if srv := c.server(i); ok && srv != nil {
				ok = srv.JetStreamIsStreamCurrent(NATSAccount, stream)
			}
		}
		if ok {
			return
		}
		if time.Now().After(end) {
			c.t.Fatalf("testsvc: stream %s not led and current on every node within %s (leader: node %d)", stream, within, c.StreamLeader(stream))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitMetaLeader waits until JetStream's meta group has a leader and every
// running node is current with it.
func (c *NATSCluster) waitMetaLeader(within time.Duration) {
	c.t.Helper()
	end := time.Now().Add(within)
	for {
		leaders, current, running := 0, 0, 0
		for i := range c.nodes {
			srv := c.server(i)
			if srv == nil {
				continue
			}
			running++
			if srv.JetStreamIsLeader() {
				leaders++
			}
			if srv.JetStreamIsCurrent() {
				current++
			}
		}
		if leaders == 1 && current == running {
			return
		}
		if time.Now().After(end) {
			c.t.Fatalf("testsvc: JetStream meta group not settled within %s: %d leaders, %d of %d nodes current", within, leaders, current, running)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *NATSCluster) stopAll() {
	for i := range c.nodes {
		if srv := c.server(i); srv != nil {
			srv.Shutdown()
			srv.WaitForShutdown()
		}
	}
}
