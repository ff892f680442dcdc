package master

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// review12Register registers node s (segment "a", 1 MiB of DRAM) with a
// ticket key and returns its segment key.
func review12Register(t *testing.T, m *member) *ticket.Key {
	t.Helper()
	nk := bytes.Repeat([]byte{9}, ticket.NodeKeySize)
	resp, err := m.registry().Register(rpcCtx(t), &pb.RegisterRequest{Node: "s", Endpoint: "ep", TicketKey: nk,
		Segments: []*pb.SegmentSpec{dram("a", 1<<20)}})
	if err != nil {
		t.Fatal(err)
	}
	k, err := ticket.SegmentKey(nk, resp.SegmentIds[0])
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func review12Expiry(t *testing.T, k *ticket.Key, b []byte) time.Time {
	tk, err := k.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	return time.Unix(0, tk.Expiry)
}

// TestReview12ReadTicketWithinLease: a read ticket must not outlast the
// lease the master recorded: Remove frees the space at the lease's end
// (leaseEnd), and a ticket valid after that reads whatever is put there.
// GetReplicas and Lookup stamp the lease first and read the clock again
// for the ticket, so each ticket ends after its lease.
func TestReview12ReadTicketWithinLease(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	k := review12Register(t, m)
	putObject(t, m, "obj", 4096)
	gr, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"obj"}})
	if err != nil {
		t.Fatal(err)
	}
	lease := m.srv.fsm.leaseEnd([]string{"obj"})
	got := review12Expiry(t, k, gr.Results[0].Replicas[0].Ticket).UnixNano()
	lr, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"obj"}})
	if err != nil {
		t.Fatal(err)
	}
	lease2 := m.srv.fsm.leaseEnd([]string{"obj"})
	got2 := review12Expiry(t, k, lr.ReplicaTicket(0)).UnixNano()
	if got > lease || got2 > lease2 {
		t.Fatalf("read tickets end %d ns (GetReplicas) and %d ns (Lookup) after the leases the master recorded", got-lease, got2-lease2)
	}
}

// TestReview12LookupTicketsRandomLayouts: replicas over several keyed and
// unkeyed nodes, removals leaving gaps, DRAM and SSD tiers, chains in
// random order: every replica's ticket admits a read of exactly its bytes.
func TestReview12LookupTicketsRandomLayouts(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 12))
	for round := range 30 {
		d := newDriver(t)
		keys := map[string][]byte{}
		for i, tier := range []pb.Tier{pb.Tier_TIER_DRAM, pb.Tier_TIER_SSD, pb.Tier_TIER_DRAM} {
			node := fmt.Sprintf("n%d", i)
			var nk []byte
			if i != 2 || round%2 == 0 {
				nk = bytes.Repeat([]byte{byte(i + 1)}, ticket.NodeKeySize)
			}
			d.apply(t0, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: node, Endpoint: "e" + node, TicketKey: nk,
				Segments: []*pb.SegmentSpec{{Name: "s", Tier: tier, Capacity: 1 << 24}}}}})
			if nk != nil {
				keys[SegmentID(node, "s", 1)] = nk
			}
		}
		segs := []string{"n0/s@1", "n1/s@1", "n2/s@1"}
		var all []string
		for i := range 60 {
			key := fmt.Sprintf("k%03d", i)
			size := uint64(1 + rng.IntN(10000))
			rng.Shuffle(3, func(i, j int) { segs[i], segs[j] = segs[j], segs[i] })
			cands := slices.Clone(segs)
			out := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
				Key: key, Size: size, Checksum: 1, Candidates: cands, DeadlineUnixNano: t0 + 1e9, Replicas: uint32(1 + rng.IntN(3)),
			}}}}})
			if r := out.([]PutStartResult)[0]; r.Err != nil {
				t.Fatal(r.Err)
			}
			if err := d.putEnd(t0, key); err != nil {
				t.Fatal(err)
			}
			all = append(all, key)
		}
		kept := all[:0]
		for _, k := range all {
			if rng.IntN(5) == 0 {
				_ = d.remove(t0, k, t0)
				continue
			}
			kept = append(kept, k)
		}
		all = kept
		if round%3 == 1 {
			rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
		}
		objs := d.f.prefix(all)
		resp := d.f.lookup(objs, t0, t0+5e9)
		at := 0
		for i := range int(resp.Matched) {
			for j := at; j < at+int(resp.ReplicaCounts[i]); j++ {
				seg := resp.Segments[resp.ReplicaSegments[j]].Segment
				nk, keyed := keys[seg]
				tk := resp.ReplicaTicket(j)
				if !keyed {
					if tk != nil {
						t.Fatalf("round %d: a ticket for unkeyed %s", round, seg)
					}
					continue
				}
				k, _ := ticket.SegmentKey(nk, seg)
				if _, err := k.Check(tk, ticket.Read, resp.ReplicaOffsets[j], resp.Sizes[i], t0); err != nil {
					t.Fatalf("round %d: block %d replica %d on %s at %d: %v", round, i, j, seg, resp.ReplicaOffsets[j], err)
				}
			}
			at += int(resp.ReplicaCounts[i])
		}
		if round < 3 {
			t.Logf("matched %d, replicas %d, tickets %d", resp.Matched, at, len(resp.Tickets)/ticket.Size)
		}
	}
}

// TestReview12GrantRunTickets: each grant of a run writes its bytes with
// the run's ticket.
func TestReview12GrantRunTickets(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	k := review12Register(t, m)
	mc := m.master()
	r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "k0", Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	shape := &pb.PutStartRequest{Size: 1000}
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{
		Items:  []*pb.PutEndItem{{Key: "k0", PutId: r.PutId, Size: 1000}},
		Grants: []*pb.PutStartRequest{shape, shape, shape, shape, shape},
	})
	if err != nil || len(resp.Grants) == 0 {
		t.Fatalf("%v %v", resp, err)
	}
	n := 0
	for _, run := range resp.Grants {
		for _, rep := range run.Replicas {
			for i := range uint64(run.Count) {
				n++
				if _, err := k.Check(rep.Ticket, ticket.Write, rep.Offset+i*run.Stride, 1000, time.Now().UnixNano()); err != nil {
					t.Fatalf("grant %d of run %d: %v", i, run.FirstPutId, err)
				}
			}
		}
	}
	t.Logf("%d grants in %d runs", n, len(resp.Grants))
}

// TestReview12CopyTaskTickets: a copy's source ticket reads the source
// replica and its target ticket writes the target, whichever tier sorts
// first.
func TestReview12CopyTaskTickets(t *testing.T) {
	d := newDriver(t)
	k1 := bytes.Repeat([]byte{1}, ticket.NodeKeySize)
	k2 := bytes.Repeat([]byte{2}, ticket.NodeKeySize)
	d.apply(t0, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n1", Endpoint: "ep1", TicketKey: k1,
		Segments: []*pb.SegmentSpec{dram("a", 1<<20), ssd("b", 1<<20)}}}})
	d.apply(t0, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n2", Endpoint: "ep2", TicketKey: k2,
		Segments: []*pb.SegmentSpec{dram("a", 1<<20)}}}})
	d.put(t0, "pad", 5000, "n1/b@1")
	d.put(t0, "k", 100, "n1/b@1")
	deadline := time.Unix(0, t0+1e9)
	for _, target := range []string{"n1/a@1", "n2/a@1"} {
		c := d.startCopy(t0+1, "k", "n1/b@1", promote, deadline.UnixNano(), target)
		task, _, ok := d.f.copyTask("k", c, deadline)
		if !ok {
			t.Fatal("no task")
		}
		sk, _ := ticket.SegmentKey(k1, "n1/b@1")
		if _, err := sk.Check(task.Source.Ticket, ticket.Read, task.Source.Offset, 100, t0+1e9-1); err != nil {
			t.Fatalf("source ticket: %v", err)
		}
		nk := k1
		if target == "n2/a@1" {
			nk = k2
		}
		tk, _ := ticket.SegmentKey(nk, target)
		if _, err := tk.Check(task.Target.Ticket, ticket.Write, task.Target.Offset, 100, t0+1e9-1); err != nil {
			t.Fatalf("target ticket on %s: %v", target, err)
		}
		d.copyEnd(t0+2, t0+2, &pb.CopyEndItem{Key: "k", CopyId: c.Id, Failed: true})
	}
}

// TestReview12PutIDPastTicketIDs: a put id is the leader's raft term << 40
// | a sequence, so from term 2^16 on every put id exceeds the 56 bits a
// ticket holds: Sign fails, segment.ticket swallows the error, and every
// PutStart answers replicas without a ticket (every write refused, for
// good: terms only grow).
func TestReview12PutIDPastTicketIDs(t *testing.T) {
	d := newDriver(t)
	nk := bytes.Repeat([]byte{4}, ticket.NodeKeySize)
	d.apply(t0, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n1", Endpoint: "e", TicketKey: nk,
		Segments: []*pb.SegmentSpec{dram("a", 1<<20)}}}})
	pt := newPutTable()
	pt.reset(1 << 16) // the leader's raft term
	p := &pendingPut{item: &pb.PublishItem{Key: "k"}}
	pt.add(p)
	t.Logf("put id %#x", p.id)
	seg := d.f.segments["n1/a@1"]
	if tk := seg.ticket(access{op: ticket.Write, id: p.id, expiry: t0 + 1e9}, 0, 4096); len(tk) != ticket.Size {
		t.Fatalf("no write ticket for put id %#x (term %d): the store refuses the put's writes", p.id, 1<<16)
	}
}
