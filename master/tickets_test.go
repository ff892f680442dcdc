package master

import (
	"bytes"
	"fmt"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// chainDriver is an FSM with one node (with a ticket key if keyed) and a
// chain of n complete blocks of size bytes put one after another.
func chainDriver(t testing.TB, keyed bool, n int, size uint64) (*fsmDriver, []*object, []byte) {
	t.Helper()
	d := newDriver(t)
	var key []byte
	if keyed {
		key = bytes.Repeat([]byte{3}, ticket.NodeKeySize)
	}
	d.apply(t0, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n1", Endpoint: "e1", TicketKey: key,
		Segments: []*pb.SegmentSpec{{Name: "dram", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 30}}}}})
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("chain/%05d", i)
		d.put(t0, keys[i], size, "n1/dram@1")
	}
	return d, d.f.prefix(keys), key
}

// TestLookupTicketsCoverEachReplica: every replica of a lookup's answer
// has a read ticket the store admits for its own bytes until the lease
// ends, and a chain laid out contiguously costs one ticket.
func TestLookupTicketsCoverEachReplica(t *testing.T) {
	for _, size := range []uint64{4096, 1000} { // 1000: padded to the DRAM alignment
		d, objs, nodeKey := chainDriver(t, true, 64, size)
		resp := d.f.lookup(objs, t0, t0+5e9)
		if resp.Matched != 64 {
			t.Fatalf("matched %d", resp.Matched)
		}
		k, err := ticket.SegmentKey(nodeKey, resp.Segments[0].Segment)
		if err != nil {
			t.Fatal(err)
		}
		for j, off := range resp.ReplicaOffsets {
			tk := resp.ReplicaTicket(j)
			if _, err := k.Check(tk, ticket.Read, off, size, t0+5e9-1); err != nil {
				t.Fatalf("size %d: block %d: %v", size, j, err)
			}
			if _, err := k.Check(tk, ticket.Read, off, size, t0+5e9); err == nil {
				t.Fatalf("size %d: block %d: ticket valid past the lease", size, j)
			}
		}
		if n := len(resp.Tickets) / ticket.Size; n != 1 {
			t.Errorf("size %d: %d tickets for a contiguous chain, want 1", size, n)
		}
	}
	// Without a key nothing is signed.
	d, objs, _ := chainDriver(t, false, 4, 4096)
	if resp := d.f.lookup(objs, t0, t0+5e9); len(resp.Tickets) != 0 || len(resp.ReplicaTickets) != 0 {
		t.Fatalf("tickets for a store that checks none: %d bytes, %d indices", len(resp.Tickets), len(resp.ReplicaTickets))
	}
}

// TestSnapshotKeepsTicketKey: a leader restored from a snapshot signs
// with the key the node registered.
func TestSnapshotKeepsTicketKey(t *testing.T) {
	d, objs, nodeKey := chainDriver(t, true, 2, 4096)
	r := restored(t, snapshotBytes(t, d.f))
	resp := r.lookup(r.prefix([]string{objs[0].key(), objs[1].key()}), t0, t0+5e9)
	k, _ := ticket.SegmentKey(nodeKey, resp.Segments[0].Segment)
	if _, err := k.Check(resp.ReplicaTicket(1), ticket.Read, resp.ReplicaOffsets[1], 4096, t0); err != nil {
		t.Fatalf("after restore: %v", err)
	}
}

// BenchmarkLookupTickets is what tickets add to a lookup of 1024 blocks.
func BenchmarkLookupTickets(b *testing.B) {
	for _, keyed := range []bool{false, true} {
		b.Run(fmt.Sprintf("keyed=%v", keyed), func(b *testing.B) {
			d, objs, _ := chainDriver(b, keyed, 1024, 4096)
			b.ResetTimer()
			for range b.N {
				d.f.lookup(objs, t0, t0+5e9)
			}
		})
	}
}

// TestTicketSizeAgrees: the proto package, which imports nothing of ours,
// slices LookupResponse.tickets by its own copy of the ticket size.
func TestTicketSizeAgrees(t *testing.T) {
	d, objs, _ := chainDriver(t, true, 1, 4096)
	resp := d.f.lookup(objs, t0, t0+1)
	if got := resp.ReplicaTicket(0); len(got) != ticket.Size || len(resp.Tickets) != ticket.Size {
		t.Fatalf("ReplicaTicket gave %d bytes of a %d-byte answer; a ticket is %d", len(got), len(resp.Tickets), ticket.Size)
	}
}
