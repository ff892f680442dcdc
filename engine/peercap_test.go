package engine

import (
	"net"
	"testing"
)

// TestServerConnectionCapPerPeer: at MaxConnsPerPeer a peer host's new
// connection replaces that host's longest idle one, and leaves another
// host's connections alone, though they are older.
func TestServerConnectionCapPerPeer(t *testing.T) {
	p := startPeer(t, Config{MaxConnsPerPeer: 3, MaxServerConns: 100}, NewMemSegment("seg", make([]byte, 1<<20)))
	dialFrom := func(host string) net.Conn {
		t.Helper()
		n := p.accepts.Load()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(host)}}
		nc, err := d.Dial("tcp", p.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
		waitFor(t, "the connection to be accepted", func() bool { return p.accepts.Load() > n })
		return nc
	}
	var other, mine []net.Conn
	for range 3 {
		other = append(other, dialFrom("127.0.0.2"))
	}
	for range 3 {
		mine = append(mine, dialFrom("127.0.0.1"))
	}
	for i, nc := range append(append([]net.Conn(nil), other...), mine...) {
		if closedByPeer(nc) {
			t.Fatalf("connection %d closed below its host's cap", i)
		}
	}
	dialFrom("127.0.0.1")
	waitFor(t, "the host's longest idle connection to close", func() bool { return closedByPeer(mine[0]) })
	for i, nc := range other {
		if closedByPeer(nc) {
			t.Fatalf("another host's connection %d closed for this host's new one", i)
		}
	}
	// The other host still gets in, and this host's survivors still serve.
	c := newClient(t, Config{NoShm: true})
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Write([]byte("abc"), Target{Endpoint: p.addr, Segment: "seg"}, 0, Options{})
	}); err != nil {
		t.Fatalf("a write at this host's cap: %v", err)
	}
}
