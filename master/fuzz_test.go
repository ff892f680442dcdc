package master

import (
	"bytes"
	"context"
	"io"
	"maps"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// fuzzRPC is one RPC FuzzMasterRequests may call: a fresh request to
// decode the input into, and the call.
type fuzzRPC struct {
	name string
	req  func() proto.Message
	call func(context.Context, proto.Message) error
}

func unary[Req any, PReq interface {
	*Req
	proto.Message
}, Resp any](name string, call func(context.Context, PReq, ...grpc.CallOption) (Resp, error)) fuzzRPC {
	return fuzzRPC{
		name: name,
		req:  func() proto.Message { return PReq(new(Req)) },
		call: func(ctx context.Context, req proto.Message) error { _, err := call(ctx, req.(PReq)); return err },
	}
}

// masterRPCs are the Master, Registry and Admin RPCs, in a fixed order: an
// input's first byte picks one.
func masterRPCs(m *member) []fuzzRPC {
	mc, rc, ac := m.master(), m.registry(), pb.NewAdminClient(m.conn)
	return []fuzzRPC{
		unary("PutStart", mc.PutStart),
		unary("PutEnd", mc.PutEnd),
		unary("BatchPutEnd", mc.BatchPutEnd),
		unary("PutRevoke", mc.PutRevoke),
		unary("BatchPutStart", mc.BatchPutStart),
		unary("GetReplicas", mc.GetReplicas),
		unary("Exists", mc.Exists),
		unary("Remove", mc.Remove),
		unary("List", mc.List),
		unary("Status", mc.Status),
		unary("ReportCorrupt", mc.ReportCorrupt),
		unary("ReportUnreachable", mc.ReportUnreachable),
		unary("Lookup", mc.Lookup),
		unary("Children", mc.Children),
		unary("Register", rc.Register),
		unary("Heartbeat", rc.Heartbeat),
		unary("SegmentObjects", rc.SegmentObjects),
		unary("Adopt", rc.Adopt),
		unary("Leave", rc.Leave),
		unary("Pin", ac.Pin),
		unary("Unpin", ac.Unpin),
		unary("Evict", ac.Evict),
		{
			name: "Drain",
			req:  func() proto.Message { return &pb.DrainRequest{} },
			call: func(ctx context.Context, req proto.Message) error {
				st, err := ac.Drain(ctx, req.(*pb.DrainRequest))
				for err == nil {
					_, err = st.Recv()
				}
				if err == io.EOF {
					return nil
				}
				return err
			},
		},
		unary("Members", ac.Members),
		unary("AddMember", ac.AddMember),
		unary("RemoveMember", ac.RemoveMember),
	}
}

// fuzzStore is the store node FuzzMasterRequests keeps registered, so that
// puts can place: s, with one DRAM and one SSD segment.
var fuzzStore = &pb.RegisterRequest{Node: "s", Endpoint: "ep-s", Segments: []*pb.SegmentSpec{dram("a", 1<<20), ssd("b", 4<<20)}}

// heal registers the fuzzed master's store again if an input took it out
// of the pool (Leave, a Register of another epoch) and cancels a drain of
// it.
func heal(t *testing.T, m *member, epoch *uint64) {
	n, ok := m.srv.fsm.nodeState(fuzzStore.Node)
	if ok && n.draining && !n.down {
		if _, err := m.srv.apply(rpcCtx(t), &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: fuzzStore.Node, Cancel: true}}}); err != nil {
			t.Fatalf("cancel the drain of %s: %v", fuzzStore.Node, err)
		}
	}
	if ok && !n.down && !n.drained && n.epoch == *epoch {
		return
	}
	resp, err := m.registry().Register(rpcCtx(t), fuzzStore)
	if err != nil {
		t.Fatalf("register %s again: %v", fuzzStore.Node, err)
	}
	*epoch = resp.Epoch
}

// FuzzMasterRequests sends arbitrary requests to a single-node master with
// one registered store: the first byte picks the RPC, the rest is its
// request, encoded. Every refusal is a status with a code that says what
// was wrong (never UNKNOWN or INTERNAL), and the master keeps answering.
func FuzzMasterRequests(f *testing.F) {
	m := newCluster(f, 1, func(cfg *Config) {
		// The store never heartbeats.
		cfg.NodeTTL = time.Hour
	}).leader()
	epoch := register(f, m, fuzzStore.Node, fuzzStore.Endpoint, fuzzStore.Segments...).Epoch
	rpcs := masterRPCs(m)
	seed := func(name string, req proto.Message) {
		for i, r := range rpcs {
			if r.name == name {
				b, err := proto.Marshal(req)
				if err != nil {
					f.Fatal(err)
				}
				f.Add(append([]byte{byte(i)}, b...))
				return
			}
		}
		f.Fatalf("no RPC %s", name)
	}
	seed("PutStart", &pb.PutStartRequest{Key: "k", Size: 100, Checksum: 1, Parent: "p", Tenant: "t", Replicas: 2})
	seed("BatchPutStart", &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "a", Size: 64}, {Key: "b", Size: 5000, Tier: pb.Tier_TIER_SSD, Parent: "a"}}})
	seed("PutEnd", &pb.KeysRequest{Keys: []string{"k", "a"}})
	seed("BatchPutEnd", &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{Key: "x", Size: 64, Replicas: []*pb.Replica{{Segment: "s/a@1", Offset: 0, Length: 64}}}}})
	seed("PutRevoke", &pb.KeysRequest{Keys: []string{"", "b"}, PutIds: []uint64{7, 0}})
	seed("GetReplicas", &pb.KeysRequest{Keys: []string{"a", "k"}})
	seed("Exists", &pb.KeysRequest{Keys: []string{"a"}})
	seed("Remove", &pb.KeysRequest{Keys: []string{"a"}})
	seed("List", &pb.ListRequest{Prefix: "a", Limit: 2})
	seed("Status", &pb.StatusRequest{})
	seed("ReportCorrupt", &pb.CorruptReplica{Key: "a", Segment: "s/a@1", Checksum: 1})
	seed("ReportUnreachable", &pb.UnreachableReport{Segments: []string{"s/a@1", "x"}})
	seed("Lookup", &pb.LookupRequest{Keys: []string{"a", "b"}})
	packed := &pb.LookupRequest{CountOnly: true}
	packed.PackKeys([]string{"a", "b"})
	seed("Lookup", packed)
	seed("Children", &pb.ChildrenRequest{Key: "a", Limit: 1})
	seed("Register", &pb.RegisterRequest{Node: "n", Endpoint: "ep", Segments: []*pb.SegmentSpec{dram("a", 4096)}, Adopt: []*pb.AdoptedObject{{Key: "kept", Segment: "a", Size: 64}}, AdoptMore: true})
	seed("Heartbeat", &pb.HeartbeatRequest{Node: "s", Epoch: 1, CopySlots: 1, CopiesDone: []*pb.CopyResult{{Id: 1, Key: "a", Status: &pb.ItemStatus{}}}})
	seed("SegmentObjects", &pb.SegmentObjectsRequest{Node: "s", Epoch: 1, Segment: "a", Limit: 1})
	seed("Adopt", &pb.AdoptRequest{Node: "n", Epoch: 1, Objects: []*pb.AdoptedObject{{Key: "kept2", Segment: "a", Offset: 64, Size: 64}}, Done: true})
	seed("Leave", &pb.HeartbeatRequest{Node: "s", Epoch: 1})
	seed("Pin", &pb.PinRequest{Key: "a", TtlMs: 1000})
	seed("Unpin", &pb.KeysRequest{Keys: []string{"a"}})
	seed("Evict", &pb.EvictRequest{Prefix: "a", DryRun: true, Tier: pb.Tier_TIER_DRAM})
	seed("Evict", &pb.EvictRequest{ToWatermark: 0.5})
	seed("Drain", &pb.DrainRequest{Node: "s", Cancel: true})
	seed("Members", &pb.MembersRequest{})
	seed("AddMember", &pb.AddMemberRequest{Id: "m9", RaftAddress: "127.0.0.1:1", GrpcAddress: "127.0.0.1:2"})
	seed("RemoveMember", &pb.RemoveMemberRequest{Id: "m0"})
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		r := rpcs[int(in[0])%len(rpcs)]
		req := r.req()
		if proto.Unmarshal(in[1:], req) != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		err := r.call(ctx, req)
		cancel()
		if err != nil {
			st, ok := status.FromError(err)
			if !ok {
				t.Fatalf("%s(%v): error %v is not a status", r.name, req, err)
			}
			if c := st.Code(); c == codes.Unknown || c == codes.Internal {
				t.Fatalf("%s(%v): %v", r.name, req, err)
			}
		}
		if _, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{}); err != nil {
			t.Fatalf("status after %s(%v): %v", r.name, req, err)
		}
		heal(t, m, &epoch)
	})
}

// fuzzFSM is FuzzFSMApply's starting state: nodes n1 (DRAM a, SSD b) and
// n2 (DRAM a), n3 down; complete objects k0, k1 (k0's child, of tenant t)
// and k2 (hard pinned); a put in flight, a copy in flight (id 16<<16), a
// removed object whose space is pending, and reservation 17 of [320, 4416)
// of n2/a@1.
func fuzzFSM(t testing.TB) *fsmDriver {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 1<<16), ssd("b", 1<<18))
	d.register(t0, "n2", "ep2", dram("a", 1<<16))
	d.register(t0, "n3", "ep3", dram("a", 4096))
	d.nodeDown(t0, "n3", 1)
	d.putWith(t0, "k0", 100, "", "", "n1/a@1")
	d.putWith(t0, "k1", 200, "k0", "t", "n2/a@1")
	d.put(t0, "k2", 300, "n1/a@1")
	if err := d.pin(t0, &pb.PinCmd{Key: "k2", Hard: true}); err != nil {
		t.Fatal(err)
	}
	d.put(t0, "gone", 64, "n2/a@1")
	if err := d.remove(t0, "gone", t0+1e9); err != nil {
		t.Fatal(err)
	}
	if r := d.putStart(t0, "proc", 500, t0+1e9, "n1/a@1"); r.Err != nil {
		t.Fatal(r.Err)
	}
	d.startCopy(t0, "k0", "n1/a@1", demote, t0+1e9, "n1/b@1")
	if r, ok := d.apply(t0, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
		Segment: "n2/a@1", Bytes: 4096, MinSpan: 64, AllocUntilUnixNano: t0 + 1e9, ReleaseAfterUnixNano: t0 + 2e9,
	}}}).(ReserveResult); !ok || r.Err != nil {
		t.Fatalf("reserve: %+v", r)
	}
	return d
}

// FuzzFSMApply applies an arbitrary raft entry to an FSM holding a little
// of everything. Whatever the entry, Apply does not panic, and the FSM
// still snapshots to a state that restores, equal to it.
func FuzzFSMApply(f *testing.F) {
	now := t0 + 1000
	for _, c := range []*pb.Command{
		{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{Key: "new", Size: 128, Candidates: []string{"n2/a@1", "n1/b@1"}, DeadlineUnixNano: now + 1e9, Parent: "k1", Tenant: "t", Replicas: 2}}, Reclaim: []*pb.Reclaimable{{Key: "k0", Segment: "n1/a@1"}}}}},
		{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{"proc", "k0"}}}},
		{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{"proc", "k0"}, PutIds: []uint64{0, 1}}}},
		{Op: &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: []string{"k0", "k1"}, FreeAfterUnixNano: now + 10, CachedUntilUnixNano: []int64{now + 5}}}},
		{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n1", Endpoint: "ep1", Segments: []*pb.SegmentSpec{dram("a", 1<<16), ssd("b", 1<<18)}, Adopt: []*pb.AdoptedObject{{Key: "kept", Segment: "b", Offset: 4096, Size: 100, Parent: "k0"}}, AdoptMore: true, TicketKey: make([]byte, 32)}}},
		{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: "n2", Epoch: 1}}},
		{Op: &pb.Command_Member{Member: &pb.MemberCmd{Id: "m1", Address: "127.0.0.1:1"}}},
		{Op: &pb.Command_Pin{Pin: &pb.PinCmd{Key: "k0", SoftUntilUnixNano: now + 1e9}}},
		{Op: &pb.Command_Evict{Evict: &pb.EvictCmd{Keys: []string{"k2", "k1"}, FreeAfterUnixNano: now, AllowSoftPinned: true, CachedUntilUnixNano: []int64{now}}}},
		{Op: &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{Key: "k0", Segment: "n1/a@1", Checksum: 100, FreeAfterUnixNano: now, KeepLast: true}}},
		{Op: &pb.Command_CopyStart{CopyStart: &pb.CopyStartCmd{Items: []*pb.CopyStartItem{{Key: "k1", Source: "n2/a@1", Candidates: []string{"n1/b@1"}, DeadlineUnixNano: now + 1e9, Reason: pb.CopyReason_COPY_REASON_REPAIR}}}}},
		{Op: &pb.Command_CopyEnd{CopyEnd: &pb.CopyEndCmd{Items: []*pb.CopyEndItem{{Key: "k0", CopyId: 16 << 16}, {Key: "k1", CopyId: 1, Failed: true}}, FreeAfterUnixNano: now}}},
		{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: "n2"}}},
		{Op: &pb.Command_SetQuota{SetQuota: &pb.TenantQuota{Tenant: "t", Tier: pb.Tier_TIER_DRAM, Bytes: 1 << 20, Objects: 4}}},
		{Op: &pb.Command_Adopt{Adopt: &pb.AdoptCmd{Node: "n1", Epoch: 1, Objects: []*pb.AdoptedObject{{Key: "k9", Segment: "a", Offset: 8192, Size: 64, HardPinned: true, Tenant: "t"}}, Done: true}}},
		{Op: &pb.Command_DropReplicas{DropReplicas: &pb.DropReplicasCmd{Items: []*pb.DropReplicaCmd{{Key: "k1", Segment: "n2/a@1", Checksum: 200}, {Key: "k2", Segment: "n1/a@1", Checksum: 300}}}}},
		{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{Segment: "n1/a@1", Bytes: 8192, MinSpan: 128, AllocUntilUnixNano: now + 1e9, ReleaseAfterUnixNano: now + 2e9, Reclaim: []*pb.Reclaimable{{Key: "k2", Segment: "n1/a@1"}}}}},
		{Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: []*pb.PublishItem{{Key: "pub", Size: 64, Replicas: []*pb.Extent{{Segment: "n2/a@1", Offset: 320, Length: 64}}, PutId: 5, Parent: "k0", Reservations: []uint64{17}, ReplicasWanted: 1}}}}},
		{Op: &pb.Command_Release{Release: &pb.ReleaseCmd{Segment: "n2/a@1", Ids: []uint64{17}}}},
		{Op: &pb.Command_PublishColumns{PublishColumns: columnsOf([]*pb.PublishItem{
			{Key: "pub", Size: 64, Replicas: []*pb.Extent{{Segment: "n2/a@1", Offset: 320}}, PutId: 5, Parent: "k0", Reservations: []uint64{17}, ReplicasWanted: 1, Tenant: "t"},
			{Key: "pub2", Size: 64, Replicas: []*pb.Extent{{Segment: "n2/a@1", Offset: 384}, {Segment: "n1/a@1", Offset: 0}}, PutId: 6, Reservations: []uint64{17, 18}},
		})}},
	} {
		c.NowUnixNano = now
		data, err := proto.Marshal(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		d := fuzzFSM(t)
		d.f.Apply(&raft.Log{Index: d.index + 1, Term: 1, Type: raft.LogCommand, Data: data})
		snap := snapshotBytes(t, d.f)
		g := restored(t, snap)
		if again := snapshotBytes(t, g); !bytes.Equal(snap, again) {
			t.Fatal("a restored FSM snapshots differently")
		}
		sameState(t, d.f, g)
		countsAgree(t, d.f)
		countsAgree(t, g)
	})
}

// countsAgree checks the FSM's kept object counts against a walk of its
// table.
func countsAgree(t *testing.T, f *FSM) {
	t.Helper()
	var want objectCounts
	f.walk(func(o *object) { want.count(o, 1) }, nil)
	f.mu.RLock()
	got := f.counts
	f.mu.RUnlock()
	if got != want {
		t.Fatalf("kept object counts %+v, the table has %+v", got, want)
	}
	// The tenants' use, kept as replicas come and go, against the same
	// sums made afresh from the table.
	f.mu.Lock()
	kept := f.use
	f.use = map[quotaKey]tenantUse{}
	f.mu.Unlock()
	f.walk(func(o *object) { f.account(o, 1) }, nil)
	f.mu.Lock()
	walked := f.use
	f.use = kept
	f.mu.Unlock()
	if !maps.Equal(kept, walked) {
		t.Fatalf("kept tenant use %v, the table has %v", kept, walked)
	}
}
