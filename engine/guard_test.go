package engine

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/ticket"
)

// ticketGuard admits requests as a store does: with a ticket its key
// signed for their operation and bytes.
type ticketGuard struct{ key *ticket.Key }

func (g ticketGuard) Admit(kind OpKind, _ string, off, n uint64, t []byte) (time.Time, error) {
	op := ticket.Read
	if kind == OpWrite {
		op = ticket.Write
	}
	got, err := g.key.Check(t, op, off, n, time.Now().UnixNano())
	if err != nil {
		return time.Time{}, fmt.Errorf("%w: %w", ErrForbidden, err)
	}
	return time.Unix(0, got.Expiry), nil
}

func newTicketGuard(t testing.TB) ticketGuard {
	t.Helper()
	nk, err := ticket.NewNodeKey()
	if err != nil {
		t.Fatal(err)
	}
	k, err := ticket.SegmentKey(nk, "dram")
	if err != nil {
		t.Fatal(err)
	}
	return ticketGuard{k}
}

func (g ticketGuard) sign(t testing.TB, op ticket.Op, off, n uint64, ttl time.Duration) string {
	t.Helper()
	return string(g.key.Sign(ticket.Ticket{Op: op, Off: off, Len: n, Expiry: time.Now().Add(ttl).UnixNano()}))
}

// TestGuardRefusesAndKeepsTheConnection: a refused write fails with
// ErrForbidden, its payload never reaches the segment, the rail is not
// blamed, and the connection carries the next request.
func TestGuardRefusesAndKeepsTheConnection(t *testing.T) {
	g := newTicketGuard(t)
	mem := NewMemSegment("dram", bytes.Repeat([]byte{0xab}, 1<<20))
	p := startPeer(t, Config{Guard: g}, mem)
	c := newClient(t, Config{ConnsPerPeer: 1})
	tgt := func(tk string) Target { return Target{Endpoint: p.addr, Segment: "dram", Ticket: tk} }
	val := bytes.Repeat([]byte{1}, 64<<10)
	for _, tc := range []struct {
		name string
		tk   string
	}{
		{"none", ""},
		{"forged", string(make([]byte, ticket.Size))},
		{"read ticket", g.sign(t, ticket.Read, 0, 1<<20, time.Minute)},
		{"other extent", g.sign(t, ticket.Write, 1<<19, 64<<10, time.Minute)},
		{"expired", g.sign(t, ticket.Write, 0, 1<<20, -time.Second)},
	} {
		task, err := run(t, c, func(b *Batch) *Task { return b.Write(val, tgt(tc.tk), 4096, Options{}) })
		if !errors.Is(err, ErrForbidden) || task.State() != Failed {
			t.Fatalf("write with %s ticket: %v (%v), want ErrForbidden", tc.name, err, task.State())
		}
	}
	// Through the server, not mem.Bytes(): the race detector sees no order
	// between this goroutine and the server's across the socket.
	before := make([]byte, 1<<20)
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Read(before, tgt(g.sign(t, ticket.Read, 0, 1<<20, time.Minute)), 0, Options{})
	}); err != nil || !bytes.Equal(before, bytes.Repeat([]byte{0xab}, 1<<20)) {
		t.Fatalf("a refused write reached the segment (read back: %v)", err)
	}
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Write(val, tgt(g.sign(t, ticket.Write, 4096, 64<<10, time.Minute)), 4096, Options{})
	}); err != nil {
		t.Fatalf("write with its ticket: %v", err)
	}
	dst := make([]byte, 64<<10)
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Read(dst, tgt(g.sign(t, ticket.Read, 0, 1<<20, time.Minute)), 4096, Options{})
	}); err != nil || !bytes.Equal(dst, val) {
		t.Fatalf("read with its ticket: %v", err)
	}
	if n := p.accepts.Load(); n != 1 {
		t.Errorf("%d connections for the refusals and their successors, want 1", n)
	}
	for _, r := range c.Rails() {
		if r.Errors != 0 {
			t.Errorf("rail %s counted %d errors for refusals", r.Addr, r.Errors)
		}
	}
}

// BenchmarkTicketTCP is the cost of tickets on the wire: the same reads
// and writes over loopback with and without the server checking them.
func BenchmarkTicketTCP(b *testing.B) {
	for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
		for _, kind := range []OpKind{OpRead, OpWrite} {
			for _, checked := range []bool{false, true} {
				name := fmt.Sprintf("%s/%dKiB/none", kind, size>>10)
				if checked {
					name = fmt.Sprintf("%s/%dKiB/ticket", kind, size>>10)
				}
				b.Run(name, func(b *testing.B) {
					g := newTicketGuard(b)
					cfg := Config{}
					tgt := Target{Segment: "dram"}
					if checked {
						cfg.Guard = g
						op := ticket.Read
						if kind == OpWrite {
							op = ticket.Write
						}
						tgt.Ticket = g.sign(b, op, 0, uint64(size), time.Hour)
					}
					p := startPeer(b, cfg, NewMemSegment("dram", make([]byte, size)))
					tgt.Endpoint = p.addr
					moveEach(b, newClient(b, Config{}), kind, tgt, size)
				})
			}
		}
	}
}

// BenchmarkTicketCost measures what tickets add to a request over TCP,
// with the noise of a shared machine cancelled: two peers, one guarded,
// take turns in rounds of 8 requests (each first as often), each guarded request carrying a
// ticket signed for it (the master's signing and the store's check both
// counted). ticket-% is the median over pairs of rounds of the guarded
// round's extra time over the plain one's, so a burst of other work on
// the machine moves a few pairs, not the figure.
func BenchmarkTicketCost(b *testing.B) {
	const round = 8
	for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
		for _, kind := range []OpKind{OpRead, OpWrite} {
			b.Run(fmt.Sprintf("%s/%dKiB", kind, size>>10), func(b *testing.B) {
				g := newTicketGuard(b)
				op := ticket.Read
				if kind == OpWrite {
					op = ticket.Write
				}
				plain := startPeer(b, Config{}, NewMemSegment("dram", make([]byte, size)))
				guarded := startPeer(b, Config{Guard: g}, NewMemSegment("dram", make([]byte, size)))
				c := newClient(b, Config{})
				buf := make([]byte, size)
				timed := func(tgt func() Target) time.Duration {
					start := time.Now()
					for range round {
						moveOnce(b, c, kind, tgt(), buf)
					}
					return time.Since(start)
				}
				var ratios []float64
				b.SetBytes(int64(size))
				b.ResetTimer()
				plainRound := func() time.Duration {
					return timed(func() Target { return Target{Segment: "dram", Endpoint: plain.addr} })
				}
				guardedRound := func() time.Duration {
					return timed(func() Target {
						tk := g.key.Sign(ticket.Ticket{Op: op, Len: uint64(size), Expiry: time.Now().Add(time.Minute).UnixNano()})
						return Target{Segment: "dram", Endpoint: guarded.addr, Ticket: string(tk)}
					})
				}
				for done := 0; done < b.N; done += 2 * round {
					var p, g time.Duration
					if len(ratios)%2 == 0 { // either goes first as often
						p, g = plainRound(), guardedRound()
					} else {
						g, p = guardedRound(), plainRound()
					}
					ratios = append(ratios, float64(g)/float64(p))
				}
				slices.Sort(ratios)
				b.ReportMetric(100*(ratios[len(ratios)/2]-1), "ticket-%")
			})
		}
	}
}
