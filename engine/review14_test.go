package engine

import (
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// r14Counts checks e.mu's counts agree: perPeer is exactly the tally of
// conns by peer, none over the caps; it returns the tally.
func r14Counts(t *testing.T, e *Engine) (conns int, perPeer map[string]int) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	tally := map[string]int{}
	for _, idle := range e.mu.conns {
		tally[idle.peer]++
	}
	if fmt.Sprint(tally) != fmt.Sprint(e.mu.perPeer) {
		t.Fatalf("perPeer %v, but the tracked connections by peer are %v", e.mu.perPeer, tally)
	}
	for p, n := range tally {
		if n > e.cfg.MaxConnsPerPeer {
			t.Fatalf("peer %s holds %d > %d", p, n, e.cfg.MaxConnsPerPeer)
		}
	}
	if len(e.mu.conns) > e.cfg.MaxServerConns {
		t.Fatalf("%d conns > %d", len(e.mu.conns), e.cfg.MaxServerConns)
	}
	return len(e.mu.conns), e.mu.perPeer
}

// TestReview14PeerCountsNeverDrift: connections from 4 hosts, some idle
// (evictable), some mid-request (not evictable: refused at a cap), some
// closed by the client, some by the idle timeout, churned concurrently:
// at every point the per-peer counts match the tracked connections, every
// refused connection is closed by the server, and once all are gone the
// counts are empty.
func TestReview14PeerCountsNeverDrift(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := startPeer(t, Config{Registerer: reg, MaxConnsPerPeer: 3, MaxServerConns: 7, IdleTimeout: 20 * time.Millisecond, StallTimeout: 50 * time.Millisecond},
		NewMemSegment("seg", make([]byte, 1<<20)))
	hosts := []string{"127.0.0.1", "127.0.0.2", "::ffff:127.0.0.3", "127.0.0.4"}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var all []net.Conn
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for range 60 {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(hosts[r.IntN(len(hosts))])}}
				nc, err := d.Dial("tcp", p.addr)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				all = append(all, nc)
				mu.Unlock()
				switch r.IntN(6) {
				case 0:
					nc.Write([]byte{0}) // a request begun: busy until the stall timeout
				case 1, 2:
					time.Sleep(time.Duration(r.IntN(5)) * time.Millisecond)
					nc.Close()
				}
				r14Counts(t, p.Engine)
				time.Sleep(time.Duration(r.IntN(6)) * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	// Every connection the server refused or dropped reads EOF; none hangs.
	mu.Lock()
	for _, nc := range all {
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 1)
		if _, err := nc.Read(buf); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Errorf("a connection neither served nor closed after 5 s")
			}
		}
		nc.Close()
	}
	mu.Unlock()
	waitFor(t, "the counts to empty", func() bool {
		n, pp := r14Counts(t, p.Engine)
		return n == 0 && len(pp) == 0
	})
	mfs, _ := reg.Gather()
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() == "tidepool_engine_server_conns_dropped_total" {
			for _, m := range mf.Metric {
				got[m.Label[0].GetValue()] = m.Counter.GetValue()
			}
		}
	}
	t.Logf("dropped: %v", got)
	// A loaded machine may close a quiet connection as stalled (mid-frame)
	// rather than idle: either is a deadline the churn had to reach.
	if got["evicted"] == 0 || got["refused"] == 0 || got["idle"]+got["stalled"] == 0 {
		t.Errorf("the churn did not reach eviction, refusal and the idle timeout: %v", got)
	}
}

// TestReview14MappedSameHost: an IPv4 peer reaching a dual-stack listener
// (IPv4-mapped) and one reaching an IPv4 listener count as the same host.
func TestReview14MappedSameHost(t *testing.T) {
	for _, a := range []net.Addr{
		&net.TCPAddr{IP: net.ParseIP("127.0.0.1")},
		&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1).To4()},
		&net.TCPAddr{IP: net.ParseIP("::ffff:127.0.0.1")},
	} {
		if h := peerHost(a); h != "127.0.0.1" {
			t.Errorf("peerHost(%#v) = %q", a, h)
		}
	}
}
