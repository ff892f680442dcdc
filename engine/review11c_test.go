package engine

import (
	"net"
	"testing"
	"time"
)

// zeroSegment is a large staged (not Mapped) segment of zeros that holds
// no memory, like a big SSD file.
type zeroSegment struct {
	name string
	size int64
}

func (z zeroSegment) Name() string { return z.name }
func (z zeroSegment) Size() int64  { return z.size }
func (z zeroSegment) ReadAt(p []byte, off int64) (int, error) {
	clear(p)
	return len(p), nil
}
func (z zeroSegment) WriteAt(p []byte, off int64) (int, error) { return len(p), nil }

// review11cNonReaders opens n raw connections that each ask for a read of
// length bytes of seg and then never read a byte of the answer.
func review11cNonReaders(t *testing.T, addr, seg string, n int, length uint64) []net.Conn {
	t.Helper()
	var conns []net.Conn
	for range n {
		nc := dialRaw(t, addr)
		if _, err := nc.Write(appendRequest(nil, opRead, seg, 0, length, "")); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, nc)
	}
	return conns
}

// TestReview11cNonReadingPeersHoldStagingBuffers: StallTimeout bounds
// every read of a request's payload, but the answer to a read has only
// the request's overall write deadline, 10 s plus its length at 1 MiB/s
// (17 minutes for a read of MaxOpLen). A peer that asks for a large read
// of a staged segment (an SSD tier) and never reads the answer holds a
// staging buffer all that time; 16 of them (maxScratch) leave none, and
// every other peer's read or write of a staged segment is refused as
// busy. The peers here have taken no byte for many StallTimeouts.
func TestReview11cNonReadingPeersHoldStagingBuffers(t *testing.T) {
	const stall = 200 * time.Millisecond
	p := startPeer(t, Config{StallTimeout: stall}, zeroSegment{"ssd", MaxOpLen})
	review11cNonReaders(t, p.addr, "ssd", maxScratch, MaxOpLen)
	waitFor(t, "every staging buffer taken by a peer that does not read", func() bool {
		return p.scratchMade.Load() == maxScratch && len(p.scratch) == 0
	})
	time.Sleep(5 * stall) // none of them has read a byte since
	c := newClient(t, Config{NoShm: true})
	task, err := run(t, c, func(b *Batch) *Task {
		return b.Read(make([]byte, 4096), Target{Endpoint: p.addr, Segment: "ssd"}, 0, Options{Deadline: time.Now().Add(3 * time.Second)})
	})
	if err != nil || task.State() != Done {
		t.Fatalf("a read of the staged segment, %v after %d peers stopped reading their answers: %v %v (buffers free: %d of %d)",
			5*stall, maxScratch, task.State(), err, len(p.scratch), p.scratchMade.Load())
	}
}

// TestReview11cNonReadingPeersLockOutConnections: the same for a mapped
// segment (DRAM): a connection whose peer stopped reading the answer is
// mid-request, so the cap never closes it, and with MaxServerConns of
// them every new connection is refused until their overall deadlines
// (here 10 s + 64 s) pass: 4,096 requests from one host lock every
// client out of a store for a minute (17 with reads of MaxOpLen).
func TestReview11cNonReadingPeersLockOutConnections(t *testing.T) {
	const stall = 200 * time.Millisecond
	p := startPeer(t, Config{StallTimeout: stall, MaxServerConns: 4}, NewMemSegment("dram", make([]byte, 64<<20)))
	review11cNonReaders(t, p.addr, "dram", 4, 64<<20)
	waitFor(t, "the requests to be accepted", func() bool { return p.accepts.Load() == 4 })
	time.Sleep(5 * stall)
	c := newClient(t, Config{NoShm: true})
	task, err := run(t, c, func(b *Batch) *Task {
		return b.Read(make([]byte, 4096), Target{Endpoint: p.addr, Segment: "dram"}, 0, Options{Deadline: time.Now().Add(3 * time.Second)})
	})
	if err != nil || task.State() != Done {
		t.Fatalf("a read, %v after 4 peers (MaxServerConns) stopped reading their answers: %v %v (accepted %d)",
			5*stall, task.State(), err, p.accepts.Load())
	}
}
