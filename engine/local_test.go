package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// served is the bytes a peer's tcp server has read and written for others.
func served(t *testing.T, reg prometheus.Gatherer) float64 {
	t.Helper()
	return counterValue(t, reg, "tidepool_engine_served_bytes_total", map[string]string{"op": "read"}) +
		counterValue(t, reg, "tidepool_engine_served_bytes_total", map[string]string{"op": "write"})
}

// startSelf is startPeer, returning once the engine serves: from then on it knows its address.
func startSelf(t *testing.T, cfg Config, segs ...Segment) testPeer {
	t.Helper()
	p := startPeer(t, cfg, segs...)
	waitFor(t, "Serve", func() bool { return len(p.Addrs()) > 0 })
	return p
}

// TestLocal has an engine read and write its own segments: the bytes move by a copy, and the
// engine's tcp server never hears of it.
func TestLocal(t *testing.T) {
	const size = 1 << 20
	reg := prometheus.NewRegistry()
	mem := NewMemSegment("dram0", make([]byte, size))
	opq := NewMemSegment("opaque", make([]byte, size))
	p := startSelf(t, Config{Registerer: reg}, mem, opaque{opq})
	r := rand.New(rand.NewPCG(1, 2))

	for _, tt := range []struct {
		name     string
		endpoint string
		seg      *MemSegment
	}{
		{"mapped", p.addr, mem},
		{"ReadAt/WriteAt", p.addr, opq},
		// One of the rails is ours: the other one, which nothing listens on, is never dialed.
		{"second rail", "127.0.0.1:1," + p.addr, mem},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tgt := Target{Endpoint: tt.endpoint, Segment: tt.seg.Name()}
			put := randomBytes(r, 300<<10)
			if _, err := run(t, p.Engine, func(b *Batch) *Task { return b.Write(put, tgt, 4000, Options{}) }); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(tt.seg.Bytes()[4000:4000+len(put)], put) {
				t.Fatal("segment does not hold the written bytes")
			}
			got := make([]byte, len(put))
			if _, err := run(t, p.Engine, func(b *Batch) *Task { return b.Read(got, tgt, 4000, Options{}) }); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, put) {
				t.Fatal("read back other bytes")
			}
			for _, op := range []struct {
				off int64
				n   int
			}{{size - 1, 2}, {size + 1, 0}} {
				_, err := run(t, p.Engine, func(b *Batch) *Task { return b.Read(make([]byte, op.n), tgt, op.off, Options{}) })
				if !errors.Is(err, ErrOutOfRange) {
					t.Fatalf("read %d+%d: err = %v, want ErrOutOfRange", op.off, op.n, err)
				}
			}
		})
	}
	if n := p.accepts.Load(); n != 0 {
		t.Errorf("the server accepted %d connections, want 0", n)
	}
	if n := served(t, reg); n != 0 {
		t.Errorf("the server served %v bytes, want 0", n)
	}

	// Once unregistered, the segment is not ours: the op goes to the server, which says so.
	p.Unregister("dram0")
	tgt := Target{Endpoint: p.addr, Segment: "dram0"}
	if _, err := run(t, p.Engine, func(b *Batch) *Task { return b.Read(make([]byte, 10), tgt, 0, Options{}) }); !errors.Is(err, ErrSegmentNotFound) {
		t.Fatalf("after Unregister: err = %v, want ErrSegmentNotFound", err)
	}
	if p.accepts.Load() == 0 {
		t.Error("after Unregister the op did not reach the server")
	}
}

// TestLocalOtherEngine: two engines in one process serve a segment of the same name; an op to
// the other engine's address goes to the other engine.
func TestLocalOtherEngine(t *testing.T) {
	a := startSelf(t, Config{}, NewMemSegment("dram0", make([]byte, 4096)))
	bSeg := NewMemSegment("dram0", make([]byte, 4096))
	b := startSelf(t, Config{}, bSeg)
	if _, err := run(t, a.Engine, func(bt *Batch) *Task {
		return bt.Write([]byte("to b"), Target{Endpoint: b.addr, Segment: "dram0"}, 0, Options{})
	}); err != nil {
		t.Fatal(err)
	}
	if got := string(bSeg.Bytes()[:4]); got != "to b" {
		t.Fatalf("b's segment holds %q", got)
	}
	if b.accepts.Load() == 0 {
		t.Error("the write did not reach b's server")
	}
}

func TestLocalAddrs(t *testing.T) {
	p := startSelf(t, Config{})
	if got := p.Addrs(); len(got) != 1 || got[0] != p.addr {
		t.Fatalf("Addrs = %v, want [%s]", got, p.addr)
	}

	var l localTransport
	l.setAddrs([]string{"10.0.0.1:7000", "0.0.0.0:7001", "[::]:7002"})
	for _, tt := range []struct {
		endpoint string
		want     bool
	}{
		{"10.0.0.1:7000", true},
		{"10.0.0.2:7000", false},
		{"10.0.0.1:70001", false},
		{"127.0.0.1:7000", false}, // that listener is not on the unspecified address
		{"127.0.0.1:7001", true},
		{"127.0.0.2:7001", true},
		{"localhost:7001", true},
		{"[::1]:7002", true},
		{"10.0.0.3:7001", false}, // might be ours, but finding out costs more than a miss may
		{"127.0.0.1:7003", false},
		{"10.9.9.9:1,10.0.0.1:7000", true},
		{"", false},
		{"garbage", false},
	} {
		if got := l.ours(tt.endpoint); got != tt.want {
			t.Errorf("ours(%q) = %v, want %v", tt.endpoint, got, tt.want)
		}
	}
	var none localTransport
	if none.ours("10.0.0.1:7000") {
		t.Error("an engine that serves nothing claims an address")
	}
}

// TestLocalMissIsCheap: an op the local transport cannot serve costs no allocation.
func TestLocalMissIsCheap(t *testing.T) {
	p := startSelf(t, Config{}, NewMemSegment("dram0", make([]byte, 4096)))
	ctx := context.Background()
	for _, tgt := range []Target{
		{Endpoint: p.addr, Segment: "elsewhere"},      // not registered here
		{Endpoint: "10.0.0.1:7000", Segment: "dram0"}, // registered, but another engine's
		{Endpoint: "10.0.0.1:7000,[::1]:1", Segment: "dram0"},
	} {
		op := &Op{Kind: OpRead, Target: tgt, Buf: make([]byte, 10)}
		if err := p.local.Do(ctx, op); !errors.Is(err, ErrUnsupported) {
			t.Fatalf("%v: err = %v, want ErrUnsupported", tgt, err)
		}
		if n := testing.AllocsPerRun(100, func() { _ = p.local.Do(ctx, op) }); n != 0 {
			t.Errorf("%v: %v allocations per miss, want 0", tgt, n)
		}
	}
}

func TestLocalClose(t *testing.T) {
	seg := NewMemSegment("dram0", make([]byte, 4096))
	p := startSelf(t, Config{}, seg)
	op := &Op{Kind: OpWrite, Target: Target{Endpoint: p.addr, Segment: "dram0"}, Buf: []byte("x")}
	if err := p.local.Do(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	p.local.Close()
	if err := p.local.Do(context.Background(), op); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: err = %v, want ErrClosed", err)
	}
}
