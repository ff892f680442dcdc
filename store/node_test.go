package store_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/enginetest"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// Close must stop everything a Node started.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	heartbeat = 50 * time.Millisecond
	waitLong  = 15 * time.Second
)

// segments returns the master's segments by name.
func segments(t testing.TB, cl *client.Client) map[string]*pb.SegmentInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	defer cancel()
	st, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*pb.SegmentInfo{}
	for _, s := range st.Segments {
		out[s.Name] = s
	}
	return out
}

func newClient(t testing.TB, addr string) *client.Client {
	t.Helper()
	cl, err := client.New(client.Config{Masters: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// startNode starts a node with one DRAM tier and waits for its registration.
func startNode(t testing.TB, id string, masters []string, capacity int64) (*store.Node, *tiers.DRAMTier) {
	t.Helper()
	return mastertest.StartStore(t, masters, id, capacity, func(cfg *store.Config) { cfg.HeartbeatInterval = heartbeat })
}

// peer is a transfer engine that reads and writes the node's segments the
// way clients do.
func peer(t testing.TB) *engine.Engine {
	e := engine.New(engine.Config{})
	t.Cleanup(func() { e.Close() })
	return e
}

func transfer(t testing.TB, e *engine.Engine, write bool, buf []byte, endpoint, segment string, off int64) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	defer cancel()
	b := e.NewBatch()
	target := engine.Target{Endpoint: endpoint, Segment: segment}
	if write {
		b.Write(buf, target, off, engine.Options{})
	} else {
		b.Read(buf, target, off, engine.Options{})
	}
	if err := b.Submit(ctx); err != nil {
		return err
	}
	return b.Wait(ctx)
}

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

func TestNewRejectsBadConfig(t *testing.T) {
	tier, err := tiers.NewDRAM("dram0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	ok := store.Config{ID: "n", Masters: []string{"127.0.0.1:1"}, Listen: "127.0.0.1:0", Tiers: []tiers.Tier{tier}}
	for _, tc := range []struct {
		name string
		edit func(*store.Config)
	}{
		{"no ID", func(c *store.Config) { c.ID = "" }},
		{"no tiers", func(c *store.Config) { c.Tiers = nil }},
		{"no masters", func(c *store.Config) { c.Masters = nil }},
		{"bad listen address", func(c *store.Config) { c.Listen = "127.0.0.1:notaport" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			if n, err := store.New(cfg); err == nil {
				n.Close()
				t.Fatal("New accepted the config")
			}
		})
	}
}

// TestRegister: a node registers in epoch 1 and serves its tier under the
// name the master gave it, and only under that name.
func TestRegister(t *testing.T) {
	m := mastertest.Start(t, nil)
	cl := newClient(t, m.Addr())
	n, tier := startNode(t, "n1", []string{m.Addr()}, 1<<20)

	if e := n.Epoch(); e != 1 {
		t.Fatalf("Epoch = %d, want 1", e)
	}
	seg := segments(t, cl)["n1/dram0@1"]
	if seg == nil {
		t.Fatalf("the master has no segment n1/dram0@1: %v", segments(t, cl))
	}
	if seg.Node != "n1" || seg.Endpoint != n.Endpoint() || seg.Capacity != 1<<20 || seg.Epoch != 1 || !seg.Alive || seg.Tier != pb.Tier_TIER_DRAM {
		t.Fatalf("segment = %v, endpoint %s", seg, n.Endpoint())
	}

	e := peer(t)
	copy(tier.Bytes()[4096:], "written in place")
	got := make([]byte, 16)
	if err := transfer(t, e, false, got, n.Endpoint(), "n1/dram0@1", 4096); err != nil || string(got) != "written in place" {
		t.Fatalf("read n1/dram0@1 = %q, %v", got, err)
	}
	if err := transfer(t, e, true, []byte("through the engine"), n.Endpoint(), "n1/dram0@1", 8192); err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(tier.Bytes()[8192:], []byte("through the engine")) {
		t.Fatal("a write through the engine did not land in the tier")
	}
	for _, name := range []string{"dram0", "n1/dram0@2", "n1/dram0@0"} {
		if err := transfer(t, e, false, got, n.Endpoint(), name, 0); !errors.Is(err, engine.ErrSegmentNotFound) {
			t.Errorf("read %s = %v, want ErrSegmentNotFound", name, err)
		}
	}
}

// TestReregisterAfterNodeDown cuts the node off the master until the
// master declares it dead: the node's next heartbeat is refused, and it
// registers again in epoch 2 and serves its tier under the new name only.
func TestReregisterAfterNodeDown(t *testing.T) {
	m := mastertest.Start(t, nil)
	cl := newClient(t, m.Addr())
	p := enginetest.NewProxy(t, m.Addr()) // the node's only way to the master
	n, _ := startNode(t, "n1", []string{p.Addr()}, 1<<20)
	if e := n.Epoch(); e != 1 {
		t.Fatalf("Epoch = %d, want 1", e)
	}

	p.SetDown(true)
	waitFor(t, 5*mastertest.NodeTTL, "the master to declare the node dead", func() bool {
		return segments(t, cl)["n1/dram0@1"] == nil
	})
	if e := n.Epoch(); e != 1 {
		t.Fatalf("Epoch = %d while cut off, want 1", e)
	}
	p.SetDown(false)
	waitFor(t, waitLong, "the node to register again", func() bool { return n.Epoch() == 2 })
	waitFor(t, waitLong, "the master to list n1/dram0@2", func() bool {
		segs := segments(t, cl)
		return segs["n1/dram0@2"] != nil && segs["n1/dram0@2"].Alive && segs["n1/dram0@1"] == nil
	})

	e := peer(t)
	buf := make([]byte, 64)
	if err := transfer(t, e, false, buf, n.Endpoint(), "n1/dram0@1", 0); !errors.Is(err, engine.ErrSegmentNotFound) {
		t.Fatalf("read of the old epoch's segment = %v, want ErrSegmentNotFound", err)
	}
	if err := transfer(t, e, false, buf, n.Endpoint(), "n1/dram0@2", 0); err != nil {
		t.Fatalf("read n1/dram0@2: %v", err)
	}
	// It stays registered: heartbeats in epoch 2 are accepted.
	deadline := time.Now().Add(10 * heartbeat)
	for time.Now().Before(deadline) {
		if e := n.Epoch(); e != 2 {
			t.Fatalf("Epoch = %d, want to stay 2", e)
		}
		time.Sleep(heartbeat / 2)
	}
}

// TestReregisterWithFreshMaster replaces the master by one that lost its
// state: the node's heartbeat is refused and it registers with the new one.
func TestReregisterWithFreshMaster(t *testing.T) {
	m := mastertest.Start(t, nil)
	cl := newClient(t, m.Addr())
	n, _ := startNode(t, "n1", []string{m.Addr()}, 1<<20)

	m.RestartFresh()
	// The master lists the segment as soon as Register applies, a moment
	// before the node has its answer: wait for both.
	waitFor(t, waitLong, "the node to register with the new master", func() bool {
		return segments(t, cl)["n1/dram0@1"] != nil && n.Epoch() == 1
	})
	e := peer(t)
	if err := transfer(t, e, false, make([]byte, 8), n.Endpoint(), "n1/dram0@1", 0); err != nil {
		t.Fatalf("read n1/dram0@1 after re-registering: %v", err)
	}
}

// TestCloseStopsGoroutines: Close returns promptly, whether the node is
// registered or still trying to reach a master, and leaves nothing running.
func TestCloseStopsGoroutines(t *testing.T) {
	m := mastertest.Start(t, nil)
	cl := newClient(t, m.Addr())
	// Let the master settle as leader first, so that only the node's
	// goroutines are new.
	waitFor(t, waitLong, "the master to lead", func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), waitLong)
		defer cancel()
		st, err := cl.Status(ctx)
		return err == nil && m.Server().IsLeader() && st.LeaderAddress == m.Addr()
	})
	before := goleak.IgnoreCurrent()

	for _, tc := range []struct {
		name    string
		masters []string
	}{
		{"registered", []string{m.Addr()}},
		{"no master reachable", []string{freeAddr(t)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tier, err := tiers.NewDRAM("dram0", 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			n, err := store.New(store.Config{ID: "n-" + tc.name, Masters: tc.masters, Listen: "127.0.0.1:0", Tiers: []tiers.Tier{tier}, HeartbeatInterval: heartbeat})
			if err != nil {
				t.Fatal(err)
			}
			if tc.masters[0] == m.Addr() {
				select {
				case <-n.Registered():
				case <-time.After(waitLong):
					t.Fatal("not registered")
				}
			}
			// A peer holds a connection to the node's engine.
			e := engine.New(engine.Config{})
			defer e.Close()
			_ = transfer(t, e, false, make([]byte, 8), n.Endpoint(), "x", 0)

			start := time.Now()
			if err := n.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Fatalf("Close took %v", d)
			}
			if err := n.Close(); err != nil {
				t.Fatalf("second Close: %v", err)
			}
			if tier.Bytes() != nil {
				t.Fatal("Close did not close the tier")
			}
			e.Close()
			goleak.VerifyNone(t, before)
		})
	}
}

func freeAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
