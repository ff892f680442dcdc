package client

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review11Master answers lookups of any keys not removed (a block of 100
// bytes each, leased for a minute) and removes keys. holdLookup and
// holdRemove, when set, are taken by the next Lookup (after it has read
// the table) or Remove (before it changes the table), which calls them
// before answering: a test runs the other operation meanwhile.
type review11Master struct {
	pb.UnimplementedMasterServer
	mu         sync.Mutex
	gone       map[string]bool
	lookups    int
	holdLookup func()
	holdRemove func()
}

func (m *review11Master) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	keys, err := req.ChainKeys(16384)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	m.mu.Lock()
	m.lookups++
	n := 0
	for n < len(keys) && !m.gone[keys[n]] {
		n++
	}
	hold := m.holdLookup
	m.holdLookup = nil
	m.mu.Unlock()
	resp := &pb.LookupResponse{Matched: uint32(n), LeaseTtlMs: 60_000,
		Segments: []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: "127.0.0.1:1", Tier: pb.Tier_TIER_DRAM}}}
	for i := range n {
		resp.Sizes = append(resp.Sizes, 100)
		resp.Checksums = append(resp.Checksums, uint32(i))
		resp.ReplicaCounts = append(resp.ReplicaCounts, 1)
		resp.ReplicaSegments = append(resp.ReplicaSegments, 0)
		resp.ReplicaOffsets = append(resp.ReplicaOffsets, uint64(i)*100)
	}
	if hold != nil {
		hold()
	}
	return resp, nil
}

func (m *review11Master) Remove(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	m.mu.Lock()
	hold := m.holdRemove
	m.holdRemove = nil
	m.mu.Unlock()
	if hold != nil {
		hold()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.ItemsResponse{}
	for _, k := range req.Keys {
		if m.gone == nil {
			m.gone = map[string]bool{}
		}
		m.gone[k] = true
		resp.Results = append(resp.Results, &pb.ItemStatus{})
	}
	return resp, nil
}

func (m *review11Master) set(f func(m *review11Master)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(m)
}

func review11Chain(round, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("r11/%d/%02d", round, i)
	}
	return keys
}

// TestReview11LookupAnsweredBeforeRemove: a lookup the master answered
// before a removal, but whose descriptors reach the cache after Remove
// returned, must not answer a later lookup of the removed block. Remove
// used to drop the cached descriptors only before asking the master, and
// the lookup in flight put them back.
func TestReview11LookupAnsweredBeforeRemove(t *testing.T) {
	m := &review11Master{}
	c := fakeMasterClient(t, m)
	ctx := context.Background()
	for round := range 10 {
		chain := review11Chain(round, 4)
		answered, release := make(chan struct{}), make(chan struct{})
		m.set(func(m *review11Master) { m.holdLookup = func() { close(answered); <-release } })
		done := make(chan error, 1)
		go func() {
			mt, err := c.Lookup(ctx, chain)
			if err == nil && mt.Len() != len(chain) {
				err = fmt.Errorf("matched %d, want %d (it was answered before the remove)", mt.Len(), len(chain))
			}
			done <- err
		}()
		<-answered
		if err := c.Remove(ctx, chain[2]); err != nil {
			t.Fatal(err)
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatalf("the lookup in flight: %v", err)
		}
		c.descs.Wait() // its descriptors are in the cache, if admitted
		if mt, err := c.Lookup(ctx, chain); err != nil || mt.Len() != 2 {
			t.Fatalf("round %d: lookup after Remove of block 2 returned: %d blocks, %v; want 2", round, mt.Len(), err)
		}
	}
}

// TestReview11LookupDuringRemove: a lookup that starts while the master
// has not yet applied a removal (and so matches the block) must not leave
// a descriptor that a lookup after Remove returned is answered from.
func TestReview11LookupDuringRemove(t *testing.T) {
	m := &review11Master{}
	c := fakeMasterClient(t, m)
	ctx := context.Background()
	for round := range 10 {
		chain := review11Chain(round, 4)
		asked, release := make(chan struct{}), make(chan struct{})
		m.set(func(m *review11Master) { m.holdRemove = func() { close(asked); <-release } })
		done := make(chan error, 1)
		go func() { done <- c.Remove(ctx, chain[2]) }()
		<-asked
		if mt, err := c.Lookup(ctx, chain); err != nil || mt.Len() != len(chain) {
			t.Fatalf("lookup before the master removed block 2: %d, %v", mt.Len(), err)
		}
		c.descs.Wait()
		close(release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if mt, err := c.Lookup(ctx, chain); err != nil || mt.Len() != 2 {
			t.Fatalf("round %d: lookup after Remove of block 2 returned: %d blocks, %v; want 2", round, mt.Len(), err)
		}
	}
}

// TestReview11LookupsOnRemovingClient races lookups of a chain on the
// client that removes one of its blocks: no lookup that starts after
// Remove returned may report the removed block (run it with -race).
func TestReview11LookupsOnRemovingClient(t *testing.T) {
	m := &review11Master{}
	c := fakeMasterClient(t, m)
	ctx := context.Background()
	const lookers, rounds, blocks, removed = 4, 50, 8, 5
	var bad atomic.Int64
	var total atomic.Int64
	for round := range rounds {
		chain := review11Chain(round, blocks)
		var after atomic.Bool // Remove has returned
		n0 := total.Load()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		done := func() { close(stop); wg.Wait() }
		for range lookers {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					late := after.Load()
					mt, err := c.Lookup(ctx, chain)
					if err != nil {
						t.Error(err)
						return
					}
					total.Add(1)
					if late && mt.Len() > removed {
						bad.Add(1)
					}
				}
			})
		}
		// Some lookups are answered from the cache before the removal.
		ok := review11Poll(t, "lookups before the remove", func() bool { return total.Load() > n0+20 })
		if ok {
			if err := c.Remove(ctx, chain[removed]); err != nil {
				t.Error(err)
			}
			after.Store(true)
			n := total.Load()
			review11Poll(t, "lookups after the remove", func() bool { return total.Load() > n+int64(lookers)*20 })
		}
		done()
		if t.Failed() {
			return
		}
	}
	if n := bad.Load(); n > 0 {
		t.Fatalf("%d of %d lookups that started after Remove returned reported the removed block", n, total.Load())
	}
}

// review11Poll polls cond until it holds, for at most 30 s, and reports
// whether it did.
func review11Poll(t *testing.T, what string, cond func() bool) bool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Errorf("timed out waiting for %s", what)
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// TestReview11RePutNotServedFromCache: a client whose cache holds a
// block that another client then removes, and that puts the key again,
// looks up and reads its own new value, not the cached older incarnation.
func TestReview11RePutNotServedFromCache(t *testing.T) {
	mm := mastertest.Start(t, nil)
	mastertest.StartStore(t, []string{mm.Addr()}, "s0", 16<<20, nil)
	newClient := func() *Client {
		c, err := New(Config{Masters: []string{mm.Addr()}, EngineConfig: engine.Config{NoShm: true}, Logger: mastertest.Logger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	a, b := newClient(), newClient()
	ctx := t.Context()
	for round := range 5 {
		key := fmt.Sprintf("r11/reput/%d", round)
		old, cur := bytes.Repeat([]byte{'o'}, 4096), bytes.Repeat([]byte{byte('0' + round)}, 4096)
		if err := a.Put(ctx, key, old); err != nil {
			t.Fatal(err)
		}
		if mt, err := a.Lookup(ctx, []string{key}); err != nil || mt.Len() != 1 {
			t.Fatalf("lookup: %d, %v", mt.Len(), err)
		}
		a.descs.Wait() // cached
		if err := b.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
		if err := a.Put(ctx, key, cur); err != nil {
			t.Fatal(err)
		}
		mt, err := a.Lookup(ctx, []string{key})
		if err != nil || mt.Len() != 1 {
			t.Fatalf("lookup after the re-put: %d, %v", mt.Len(), err)
		}
		if got, want := mt.Blocks[0].Checksum, Checksum(cur); got != want {
			t.Fatalf("round %d: the re-putting client's lookup answered checksum %08x, want the new value's %08x", round, got, want)
		}
		buf := make([]byte, len(cur))
		if _, errs := a.GetMatched(ctx, mt, [][]byte{buf}); errs[0] != nil || !bytes.Equal(buf, cur) {
			t.Fatalf("round %d: GetMatched after the re-put: %v, new value %v", round, errs[0], bytes.Equal(buf, cur))
		}
	}
}

// BenchmarkLookup1024Cached measures a lookup of a chain of 1024 blocks
// that the descriptor cache answers whole: it must not allocate or lock
// per block beyond what the cache itself does.
func BenchmarkLookup1024Cached(b *testing.B) {
	m := &review11Master{}
	c := fakeMasterClient(b, m)
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("kv/xxh3-64/m/t/%016x", i)
	}
	ctx := context.Background()
	if mt, err := c.Lookup(ctx, keys); err != nil || mt.Len() != len(keys) {
		b.Fatalf("%d, %v", mt.Len(), err)
	}
	c.descs.Wait()
	m.set(func(m *review11Master) { m.lookups = 0 })
	b.ReportAllocs()
	for b.Loop() {
		if mt, err := c.Lookup(ctx, keys); err != nil || mt.Len() != len(keys) {
			b.Fatalf("%d, %v", mt.Len(), err)
		}
	}
	m.set(func(m *review11Master) {
		if m.lookups > b.N/100 {
			b.Fatalf("%d of %d lookups asked the master", m.lookups, b.N)
		}
	})
	b.ReportMetric(float64(b.N)*1024/b.Elapsed().Seconds(), "probes/s")
}
