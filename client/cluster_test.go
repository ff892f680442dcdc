package client_test

import (
	"context"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/enginetest"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// startTimeout bounds waits for a cluster to come up or settle.
const startTimeout = 15 * time.Second

// storeSpec describes one store node of a test cluster.
type storeSpec struct {
	id       string
	capacity int64 // of its single DRAM tier; default 64 MiB
	// proxied puts a proxy in front of the node's transfer engine and
	// advertises the proxy, so a test can stall or cut the node's traffic.
	proxied bool
}

type clusterOpts struct {
	stores []storeSpec // default: one 64 MiB store "s0"
	// master adjusts the master's config (timeouts) before it starts.
	master func(*master.Config)
	// heartbeat is the stores' heartbeat interval; default
	// mastertest.Heartbeat.
	heartbeat time.Duration
}

// cluster is one master and N store nodes in this process, on loopback:
// real raft (in-memory transport), real gRPC, real transfer engines.
type cluster struct {
	t      testing.TB
	opts   clusterOpts
	master *mastertest.Master
	addr   string // the master's gRPC address; a restarted master listens here again
	stores []*storeNode
}

type storeNode struct {
	spec  storeSpec
	node  *store.Node
	tier  *tiers.DRAMTier
	proxy *enginetest.Proxy // nil unless spec.proxied
}

// newCluster starts a master and the stores and waits until every store
// has registered; everything is closed when the test ends.
func newCluster(t testing.TB, opts clusterOpts) *cluster {
	t.Helper()
	if opts.stores == nil {
		opts.stores = []storeSpec{{id: "s0"}}
	}
	if opts.heartbeat == 0 {
		opts.heartbeat = mastertest.Heartbeat
	}
	c := &cluster{t: t, opts: opts}
	c.master = mastertest.Start(t, opts.master)
	c.addr = c.master.Addr()
	for i, spec := range opts.stores {
		if spec.capacity == 0 {
			spec.capacity = 64 << 20
		}
		c.stores = append(c.stores, &storeNode{spec: spec})
		c.startStore(i)
	}
	return c
}

// startStore starts store i with a fresh, empty tier and waits until it has
// registered.
func (c *cluster) startStore(i int) {
	c.t.Helper()
	s := c.stores[i]
	s.node, s.tier = mastertest.StartStore(c.t, []string{c.addr}, s.spec.id, s.spec.capacity, func(cfg *store.Config) {
		cfg.HeartbeatInterval = c.opts.heartbeat
		if s.spec.proxied {
			// The node picks its listener itself, so reserve a port
			// for it and point the proxy there.
			cfg.Listen = freePort(c.t)
			if s.proxy == nil {
				s.proxy = enginetest.NewProxy(c.t, "")
			}
			s.proxy.SetTarget(cfg.Listen)
			cfg.Advertise = s.proxy.Addr()
		}
	})
}

// stopStore closes a store node, which also unmaps its tier.
func (c *cluster) stopStore(s *storeNode) {
	if s.node == nil {
		return
	}
	if err := s.node.Close(); err != nil {
		c.t.Errorf("close store %s: %v", s.spec.id, err)
	}
	s.node, s.tier = nil, nil
}

// restartStore closes store i and starts it again, same ID, empty tier.
func (c *cluster) restartStore(i int) {
	c.t.Helper()
	c.stopStore(c.stores[i])
	c.startStore(i)
}

// newClient returns a client of the cluster, closed at the end of the test.
// Its bytes go over TCP: the stores live in this process, and shared memory
// would bypass the faults the tests inject on the wire.
func (c *cluster) newClient() *client.Client {
	return c.newClientWith(engine.Config{NoShm: true})
}

func (c *cluster) newClientWith(ecfg engine.Config) *client.Client {
	c.t.Helper()
	cl, err := client.New(client.Config{Masters: []string{c.addr}, Logger: mastertest.Logger(), EngineConfig: ecfg})
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() {
		if err := cl.Close(); err != nil {
			c.t.Errorf("close client: %v", err)
		}
	})
	return cl
}

func freePort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// testCtx bounds one test's calls.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 45*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// value returns n deterministic pseudo-random bytes.
func value(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)}).Read(b)
	return b
}
