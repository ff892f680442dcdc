//go:build linux

package integration

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Engine wire format, written by hand as an attacker would (engine/frame.go).
const (
	frameOpRead        = 1
	frameOpWrite       = 2
	frameStatusOK      = 0
	frameStatusRefused = 6
)

func engineRequest(op byte, seg string, off, n uint64, tk []byte) []byte {
	b := []byte{0x54, 0x50, 2, op}
	b = binary.BigEndian.AppendUint16(b, uint16(len(seg)))
	b = append(b, seg...)
	b = binary.BigEndian.AppendUint64(b, off)
	b = binary.BigEndian.AppendUint64(b, n)
	b = append(b, byte(len(tk)))
	return append(b, tk...)
}

// engineCall sends one request (with payload for a write) on a fresh
// connection and returns the response's status and payload.
func engineCall(t *testing.T, addr string, req, payload []byte) (byte, []byte) {
	t.Helper()
	nc, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	_ = nc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := nc.Write(append(bytes.Clone(req), payload...)); err != nil {
		t.Fatal(err)
	}
	var hdr [11]byte
	if _, err := io.ReadFull(nc, hdr[:]); err != nil {
		t.Fatalf("engine response: %v", err)
	}
	body := make([]byte, binary.BigEndian.Uint64(hdr[3:]))
	if _, err := io.ReadFull(nc, body); err != nil {
		t.Fatalf("engine response body: %v", err)
	}
	return hdr[2], body
}

// TestWritesWithoutAValidTicketRefused: anyone who reached a store's engine
// port could write any offset of any segment (a write over a victim's
// extent with its CRC kept made `tidepool get` return the attacker's bytes),
// and a writer frozen past its put's deadline could land bytes in space
// the master had reused. Every request now needs the master's ticket for
// exactly its bytes, operation and time.
func TestWritesWithoutAValidTicketRefused(t *testing.T) {
	ctx := t.Context()
	m := startMaster(t, ctx, t.TempDir(), "--put-timeout", "2s", "--lease-ttl", "2s")
	s := startStore(t, ctx, "s1", m.grpc, "dram:64MiB")
	c := newClient(t, m.grpc)
	mc := pb.NewMasterClient(dialMaster(t, m.grpc))

	victim := make([]byte, 64<<10)
	rand.Read(victim)
	if err := c.Put(ctx, "victim", victim); err != nil {
		t.Fatal(err)
	}
	got, err := mc.GetReplicas(ctx, &pb.KeysRequest{Keys: []string{"victim"}})
	if err != nil || len(got.Results) != 1 || len(got.Results[0].Replicas) != 1 {
		t.Fatalf("GetReplicas: %v %v", got, err)
	}
	rep := got.Results[0].Replicas[0]
	if len(rep.Ticket) == 0 {
		t.Fatal("the master handed out a descriptor without a ticket")
	}
	readTicket := rep.Ticket

	// A put of another object: its write ticket covers its extent only.
	start, err := mc.BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "mine", Size: 4096}}})
	if err != nil || codes.Code(start.Results[0].Status.GetCode()) != codes.OK || len(start.Results[0].Replicas) != 1 {
		t.Fatalf("PutStart: %v %v", start, err)
	}
	mine := start.Results[0].Replicas[0]
	if mine.Segment != rep.Segment {
		t.Fatalf("the puts landed in %q and %q; the test needs one segment", rep.Segment, mine.Segment)
	}

	forged := make([]byte, 64)
	rand.Read(forged)
	flipped := bytes.Clone(mine.Ticket)
	flipped[0] ^= 0x80 // the extent's offset
	attack := make([]byte, 4096)
	rand.Read(attack)
	for _, tc := range []struct {
		name   string
		ticket []byte
	}{
		{"no ticket", nil},
		{"forged", forged},
		{"the victim's read ticket", readTicket},
		{"a write ticket for another extent", mine.Ticket},
		{"a write ticket with its extent changed", flipped},
	} {
		status, msg := engineCall(t, s.engine, engineRequest(frameOpWrite, rep.Segment, rep.Offset, uint64(len(attack)), tc.ticket), attack)
		if status != frameStatusRefused {
			t.Errorf("write over the victim with %s: status %d %q, want %d (forbidden)", tc.name, status, msg, frameStatusRefused)
		}
	}
	// A read needs a read ticket for its bytes too.
	if status, _ := engineCall(t, s.engine, engineRequest(frameOpRead, rep.Segment, rep.Offset, 4096, mine.Ticket), nil); status != frameStatusRefused {
		t.Errorf("read of the victim with another extent's write ticket: status %d, want forbidden", status)
	}
	// The hand-made frames are right: the put's own ticket writes its own extent.
	if status, msg := engineCall(t, s.engine, engineRequest(frameOpWrite, mine.Segment, mine.Offset, 4096, mine.Ticket), attack); status != frameStatusOK {
		t.Fatalf("write of the put's own extent with its ticket: status %d %q", status, msg)
	}
	if status, body := engineCall(t, s.engine, engineRequest(frameOpRead, rep.Segment, rep.Offset, uint64(len(victim)), readTicket), nil); status != frameStatusOK || !bytes.Equal(body, victim) {
		t.Fatalf("read of the victim with its lease's ticket: status %d, %d bytes", status, len(body))
	}

	// A writer frozen past the put's deadline: it sends its header and half
	// its bytes in time, then stalls. The store ends the request when the
	// ticket does, so the rest can never land.
	late, err := mc.BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "late", Size: 8192}}})
	if err != nil || len(late.Results[0].Replicas) != 1 {
		t.Fatalf("PutStart: %v %v", late, err)
	}
	lr := late.Results[0].Replicas[0]
	asked := time.Now()
	nc, err := net.Dial("tcp", s.engine)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Write(append(engineRequest(frameOpWrite, lr.Segment, lr.Offset, 8192, lr.Ticket), attack...)); err != nil {
		t.Fatal(err)
	}
	_ = nc.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, err = nc.Read(make([]byte, 64))
	var ne net.Error
	switch waited := time.Since(asked); {
	case err == nil:
		t.Fatal("the store answered a write still missing half its bytes")
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatal("the store held a frozen write for 30 s")
	case waited > 4500*time.Millisecond:
		// The stall timeout (5 s) cuts it anyway; the ticket must first.
		t.Errorf("the frozen write was cut %v after its PutStart; its ticket ended after 2 s", waited)
	}
	// Past the deadline the ticket is void for a fresh request too.
	waitFor(t, 10*time.Second, func() error {
		if status, msg := engineCall(t, s.engine, engineRequest(frameOpWrite, lr.Segment, lr.Offset, 4096, lr.Ticket), attack); status != frameStatusRefused {
			return fmt.Errorf("a write with a ticket past its put's deadline: status %d %q", status, msg)
		}
		return nil
	})
	// And a read past its lease.
	waitFor(t, 10*time.Second, func() error {
		if status, _ := engineCall(t, s.engine, engineRequest(frameOpRead, rep.Segment, rep.Offset, 4096, readTicket), nil); status != frameStatusRefused {
			return fmt.Errorf("a read with a ticket past its lease: status %d", status)
		}
		return nil
	})

	back, err := c.Get(ctx, "victim")
	if err != nil || !bytes.Equal(back, victim) {
		t.Fatalf("get victim: %v (%d bytes, equal %v)", err, len(back), bytes.Equal(back, victim))
	}
	if n, err := counter(s.http, "tidepool_engine_refused_requests_total"); err != nil || n < 8 {
		t.Errorf("refused requests counted: %v (%v), want at least 8", n, err)
	}
}
