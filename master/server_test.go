package master

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// waitFor polls cond until it returns nil or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached within %v: %v", what, timeout, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func rpcCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// member is one running master with its gRPC server.
type member struct {
	srv    *Server
	addr   string // gRPC
	served chan error
	conn   *grpc.ClientConn
	once   sync.Once
}

// start runs a master on a fresh loopback gRPC listener (cfg.Advertise is
// set to it) and returns once the gRPC server answers. Cleanup stops it.
func start(t testing.TB, cfg Config) *member {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := serve(t, cfg, ln)
	// Status answers on any master; once it does, Serve is running, so a
	// Close cannot overtake it.
	waitFor(t, 10*time.Second, "gRPC server of "+cfg.ID, func() error {
		_, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
		return err
	})
	return m
}

// serve runs a master on ln (cfg.Advertise is set to it) and dials it;
// Cleanup stops it.
func serve(t testing.TB, cfg Config, ln net.Listener) *member {
	t.Helper()
	cfg.Advertise = ln.Addr().String()
	srv, err := New(cfg)
	if err != nil {
		ln.Close()
		t.Fatalf("new master %s: %v", cfg.ID, err)
	}
	m := &member{srv: srv, addr: cfg.Advertise, served: make(chan error, 1)}
	go func() { m.served <- srv.Serve(ln) }()
	m.conn, err = grpc.NewClient(m.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.stop(t) })
	return m
}

func (m *member) master() pb.MasterClient     { return pb.NewMasterClient(m.conn) }
func (m *member) registry() pb.RegistryClient { return pb.NewRegistryClient(m.conn) }

// stop closes the master and waits for Serve to return; it runs once.
func (m *member) stop(t testing.TB) {
	m.once.Do(func() {
		if err := m.conn.Close(); err != nil {
			t.Errorf("close client of %s: %v", m.srv.cfg.ID, err)
		}
		if err := m.srv.Close(); err != nil {
			t.Errorf("close %s: %v", m.srv.cfg.ID, err)
		}
		select {
		case err := <-m.served:
			if err != nil {
				t.Errorf("serve %s: %v", m.srv.cfg.ID, err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Serve of %s did not return after Close", m.srv.cfg.ID)
		}
	})
}

// cluster is n masters on raft's in-memory transport.
type cluster struct {
	t       testing.TB
	members []*member
	trans   []*raft.InmemTransport
	down    []bool
}

// fastTimings makes the leader's sweep quick and leaves the TTLs long, so a
// test only sees a timeout it asked for.
func fastTimings(cfg *Config) {
	cfg.SweepInterval = 20 * time.Millisecond
	cfg.PutTimeout = time.Minute
	cfg.NodeTTL = time.Minute
	cfg.LeaseTTL = 300 * time.Millisecond
}

func newCluster(t testing.TB, n int, tweak func(*Config)) *cluster {
	t.Helper()
	return newClusterOf(t, n, tweak, start)
}

// newClusterOf is newCluster with each member started by startMember.
func newClusterOf(t testing.TB, n int, tweak func(*Config), startMember func(testing.TB, Config) *member) *cluster {
	t.Helper()
	c := &cluster{t: t, members: make([]*member, n), trans: make([]*raft.InmemTransport, n), down: make([]bool, n)}
	var peers []raft.Server
	for i := range n {
		addr, tr := raft.NewInmemTransport("")
		c.trans[i] = tr
		if n > 1 {
			peers = append(peers, raft.Server{ID: raft.ServerID(fmt.Sprintf("m%d", i)), Address: addr})
		}
	}
	for i, a := range c.trans {
		for j, b := range c.trans {
			if i != j {
				a.Connect(b.LocalAddr(), b)
			}
		}
	}
	for i := range n {
		cfg := Config{ID: fmt.Sprintf("m%d", i), Dir: t.TempDir(), Peers: peers, Transport: c.trans[i]}
		fastTimings(&cfg)
		if tweak != nil {
			tweak(&cfg)
		}
		c.members[i] = startMember(t, cfg)
	}
	return c
}

// kill closes member i and cuts it off from the others.
func (c *cluster) kill(i int) {
	c.members[i].stop(c.t)
	c.down[i] = true
	for j, tr := range c.trans {
		if j != i {
			tr.Disconnect(c.trans[i].LocalAddr())
		}
	}
}

// leader waits until one live member leads and every live member knows its
// gRPC address, which also means the leader has applied the whole log.
func (c *cluster) leader() *member {
	c.t.Helper()
	var leader *member
	waitFor(c.t, 15*time.Second, "a raft leader", func() error {
		leader = nil
		for i, m := range c.members {
			if c.down[i] || !m.srv.IsLeader() {
				continue
			}
			if leader != nil {
				return errors.New("two leaders")
			}
			leader = m
		}
		if leader == nil {
			return errors.New("no leader")
		}
		for i, m := range c.members {
			if c.down[i] {
				continue
			}
			if id, addr := m.srv.Leader(); addr != leader.addr {
				return fmt.Errorf("%s sees leader %s at %q, want %q", m.srv.cfg.ID, id, addr, leader.addr)
			}
		}
		return nil
	})
	return leader
}

func (c *cluster) followers() []*member {
	var out []*member
	for i, m := range c.members {
		if !c.down[i] && !m.srv.IsLeader() {
			out = append(out, m)
		}
	}
	return out
}

func wantCode(t testing.TB, err error, want codes.Code, what string) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: code %v (%v), want %v", what, got, err, want)
	}
}

func register(t testing.TB, m *member, node, endpoint string, specs ...*pb.SegmentSpec) *pb.RegisterResponse {
	t.Helper()
	resp, err := m.registry().Register(rpcCtx(t), &pb.RegisterRequest{Node: node, Endpoint: endpoint, Segments: specs})
	if err != nil {
		t.Fatalf("register %s: %v", node, err)
	}
	return resp
}

// putObject runs a whole two-phase put and returns where the value went.
func putObject(t testing.TB, m *member, key string, size uint64) *pb.Replica {
	t.Helper()
	r, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: key, Size: size, Checksum: uint32(size)})
	if err != nil {
		t.Fatalf("put start %q: %v", key, err)
	}
	if r.Exists || len(r.Replicas) != 1 {
		t.Fatalf("put start %q = %v", key, r)
	}
	items(t, m, "put end", m.master().PutEnd, key)
	return r.Replicas[0]
}

// endPlaced publishes a put with BatchPutEnd, as a client does after a
// leader change: with what its PutStart answered.
func endPlaced(t testing.TB, m *member, key string, r *pb.PutStartResult) {
	t.Helper()
	resp, err := m.master().BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: key, PutId: r.PutId, Size: r.Replicas[0].Length, Replicas: r.Replicas, Reservations: r.Reservations,
	}}})
	if err != nil {
		t.Fatalf("batch put end %q: %v", key, err)
	}
	if c := resp.Results[0].Code; c != 0 {
		t.Fatalf("batch put end %q: item code %v: %s", key, codes.Code(c), resp.Results[0].Message)
	}
}

// items calls a KeysRequest RPC and fails unless every item is OK.
func items(t testing.TB, m *member, what string, rpc func(context.Context, *pb.KeysRequest, ...grpc.CallOption) (*pb.ItemsResponse, error), keys ...string) {
	t.Helper()
	got := itemCodes(t, what, rpc, keys...)
	for i, c := range got {
		if c != 0 {
			t.Fatalf("%s %q: item code %v", what, keys[i], c)
		}
	}
}

func itemCodes(t testing.TB, what string, rpc func(context.Context, *pb.KeysRequest, ...grpc.CallOption) (*pb.ItemsResponse, error), keys ...string) []codes.Code {
	t.Helper()
	resp, err := rpc(rpcCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatalf("%s %q: %v", what, keys, err)
	}
	if len(resp.Results) != len(keys) {
		t.Fatalf("%s: %d results for %d keys", what, len(resp.Results), len(keys))
	}
	out := make([]codes.Code, len(keys))
	for i, r := range resp.Results {
		out[i] = codes.Code(r.Code)
	}
	return out
}

func exists(t testing.TB, m *member, keys ...string) []bool {
	t.Helper()
	resp, err := m.master().Exists(rpcCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatalf("exists %q: %v", keys, err)
	}
	return resp.Exists
}

func segmentUsed(t testing.TB, m *member, name string) uint64 {
	t.Helper()
	st, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Segments {
		if s.Name == name {
			return s.Used
		}
	}
	t.Fatalf("segment %s not in status %v", name, st.Segments)
	return 0
}

func TestServerSingleNode(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, nil)
	m := c.leader()
	mc := m.master()

	t.Run("bootstrap", func(t *testing.T) {
		st, err := mc.Status(rpcCtx(t), &pb.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if st.LeaderId != "m0" || st.LeaderAddress != m.addr || st.RaftTerm == 0 || st.RaftCommitIndex == 0 {
			t.Fatalf("status = %v", st)
		}
		if len(st.Members) != 1 || !proto.Equal(st.Members[0], &pb.MemberInfo{Id: "m0", Address: m.addr, Leader: true, RaftAddress: st.SelfRaftAddress}) {
			t.Fatalf("members = %v", st.Members)
		}
	})

	t.Run("no segments", func(t *testing.T) {
		_, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "k", Size: 1})
		wantCode(t, err, codes.ResourceExhausted, "put start without stores")
	})

	t.Run("register", func(t *testing.T) {
		bad := []*pb.RegisterRequest{
			{Endpoint: "ep", Segments: []*pb.SegmentSpec{dram("a", 1)}},
			{Node: "s", Segments: []*pb.SegmentSpec{dram("a", 1)}},
			{Node: "s", Endpoint: "ep"},
			{Node: "s", Endpoint: "ep", Segments: []*pb.SegmentSpec{dram("", 1024)}},
			{Node: "s", Endpoint: "ep", Segments: []*pb.SegmentSpec{dram("a", 0)}},
		}
		for _, req := range bad {
			_, err := m.registry().Register(rpcCtx(t), req)
			wantCode(t, err, codes.InvalidArgument, fmt.Sprintf("register %v", req))
		}
		resp := register(t, m, "store1", "10.0.0.1:7000", dram("dram0", 1<<20))
		if resp.Epoch != 1 || !slices.Equal(resp.SegmentIds, []string{"store1/dram0@1"}) {
			t.Fatalf("register = %v", resp)
		}
		if _, err := m.registry().Heartbeat(rpcCtx(t), &pb.HeartbeatRequest{Node: "store1", Epoch: 1}); err != nil {
			t.Fatalf("heartbeat: %v", err)
		}
		for _, req := range []*pb.HeartbeatRequest{{Node: "store1", Epoch: 2}, {Node: "store1", Epoch: 0}, {Node: "nobody", Epoch: 1}} {
			_, err := m.registry().Heartbeat(rpcCtx(t), req)
			wantCode(t, err, codes.NotFound, fmt.Sprintf("heartbeat %v", req))
		}
	})

	t.Run("two-phase put", func(t *testing.T) {
		r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "obj", Size: 1000, Checksum: 0xabcd})
		if err != nil {
			t.Fatal(err)
		}
		want := &pb.Replica{Segment: "store1/dram0@1", Node: "store1", Endpoint: "10.0.0.1:7000", Offset: 0, Length: 1000, Tier: pb.Tier_TIER_DRAM}
		if r.Exists || len(r.Replicas) != 1 || !proto.Equal(r.Replicas[0], want) || r.Status.GetCode() != 0 {
			t.Fatalf("put start = %v, want replica %v", r, want)
		}
		// PROCESSING: invisible to readers, and a second put is refused.
		if exists(t, m, "obj")[0] {
			t.Fatal("a PROCESSING object exists")
		}
		gr, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"obj"}})
		if err != nil {
			t.Fatal(err)
		}
		if codes.Code(gr.Results[0].Status.Code) != codes.NotFound {
			t.Fatalf("get replicas of a PROCESSING object: %v", gr.Results[0])
		}
		_, err = mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "obj", Size: 1000})
		wantCode(t, err, codes.FailedPrecondition, "second put start")

		items(t, m, "put end", mc.PutEnd, "obj")
		gr, err = mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"obj"}})
		if err != nil {
			t.Fatal(err)
		}
		wantObj := &pb.ObjectReplicas{Status: &pb.ItemStatus{}, Size: 1000, Checksum: 0xabcd, Replicas: []*pb.Replica{want}}
		if len(gr.Results) != 1 || !proto.Equal(gr.Results[0], wantObj) || gr.LeaseTtlMs != 300 {
			t.Fatalf("get replicas = %v, want %v with a 300 ms lease", gr, wantObj)
		}
		if !exists(t, m, "obj")[0] {
			t.Fatal("a COMPLETE object does not exist")
		}
		// A put of a complete key is a success that writes nothing.
		r, err = mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "obj", Size: 5})
		if err != nil || !r.Exists || len(r.Replicas) != 0 {
			t.Fatalf("put of an existing key = %v, %v", r, err)
		}
		if used := segmentUsed(t, m, "store1/dram0@1"); used != 1024 {
			t.Fatalf("used = %d, want 1024", used)
		}
	})

	t.Run("bad input", func(t *testing.T) {
		// Past the first lease TTL, a put short of room is answered at
		// once, not held until the leader may evict; obj, leased again,
		// may not be evicted for it.
		waitEvictable(t, m)
		if _, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"obj"}}); err != nil {
			t.Fatal(err)
		}
		long := strings.Repeat("k", MaxKeyLen+1)
		for _, tc := range []struct {
			name string
			req  *pb.PutStartRequest
			want codes.Code
		}{
			{"empty key", &pb.PutStartRequest{Key: "", Size: 1}, codes.InvalidArgument},
			{"key of 4097 bytes", &pb.PutStartRequest{Key: long, Size: 1}, codes.InvalidArgument},
			{"zero size", &pb.PutStartRequest{Key: "z", Size: 0}, codes.InvalidArgument},
			{"too large", &pb.PutStartRequest{Key: "big", Size: 1<<20 + 1}, codes.OutOfRange},
			{"no room", &pb.PutStartRequest{Key: "big", Size: 1 << 20}, codes.ResourceExhausted},
		} {
			_, err := mc.PutStart(rpcCtx(t), tc.req)
			wantCode(t, err, tc.want, tc.name)
		}
		for _, tc := range []struct {
			name string
			keys []string
		}{
			{"no keys", nil},
			{"empty key", []string{"obj", ""}},
			{"long key", []string{long}},
			{"too many keys", make([]string, MaxBatchKeys+1)},
		} {
			for name, rpc := range map[string]func(context.Context, *pb.KeysRequest, ...grpc.CallOption) (*pb.ItemsResponse, error){
				"put end": mc.PutEnd, "put revoke": mc.PutRevoke, "remove": mc.Remove,
			} {
				_, err := rpc(rpcCtx(t), &pb.KeysRequest{Keys: tc.keys})
				wantCode(t, err, codes.InvalidArgument, name+" "+tc.name)
			}
			_, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: tc.keys})
			wantCode(t, err, codes.InvalidArgument, "get replicas "+tc.name)
			_, err = mc.Exists(rpcCtx(t), &pb.KeysRequest{Keys: tc.keys})
			wantCode(t, err, codes.InvalidArgument, "exists "+tc.name)
		}
		_, err := mc.BatchPutStart(rpcCtx(t), &pb.BatchPutStartRequest{})
		wantCode(t, err, codes.InvalidArgument, "empty batch")

		// A key of exactly the limit is fine.
		edge := strings.Repeat("e", MaxKeyLen)
		if _, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: edge, Size: 1}); err != nil {
			t.Fatalf("put of a %d-byte key: %v", MaxKeyLen, err)
		}
		items(t, m, "put revoke", mc.PutRevoke, edge)
	})

	t.Run("batch put start", func(t *testing.T) {
		resp, err := mc.BatchPutStart(rpcCtx(t), &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{
			{Key: "b1", Size: 100}, {Key: "", Size: 100}, {Key: "b2", Size: 0}, {Key: "b3", Size: 1 << 30}, {Key: "obj", Size: 1}, {Key: "b4", Size: 64},
		}})
		if err != nil {
			t.Fatal(err)
		}
		want := []codes.Code{codes.OK, codes.InvalidArgument, codes.InvalidArgument, codes.OutOfRange, codes.OK, codes.OK}
		for i, r := range resp.Results {
			if codes.Code(r.Status.GetCode()) != want[i] {
				t.Errorf("item %d: %v, want %v", i, r.Status, want[i])
			}
		}
		if !resp.Results[4].Exists || len(resp.Results[0].Replicas) != 1 || len(resp.Results[5].Replicas) != 1 {
			t.Fatalf("results = %v", resp.Results)
		}
		if resp.Results[0].Replicas[0].Offset == resp.Results[5].Replicas[0].Offset {
			t.Fatal("two puts of one batch share an offset")
		}
		items(t, m, "put revoke", mc.PutRevoke, "b1", "b4")
	})

	t.Run("unknown keys", func(t *testing.T) {
		gr, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"nope", "obj"}})
		if err != nil {
			t.Fatal(err)
		}
		if codes.Code(gr.Results[0].Status.Code) != codes.NotFound || gr.Results[1].Status.Code != 0 {
			t.Fatalf("get replicas = %v", gr.Results)
		}
		if got := exists(t, m, "nope", "obj"); !slices.Equal(got, []bool{false, true}) {
			t.Fatalf("exists = %v", got)
		}
		for _, tc := range []struct {
			name string
			rpc  func(context.Context, *pb.KeysRequest, ...grpc.CallOption) (*pb.ItemsResponse, error)
			want codes.Code
		}{
			{"put end", mc.PutEnd, codes.FailedPrecondition},
			{"put revoke", mc.PutRevoke, codes.FailedPrecondition},
			{"remove", mc.Remove, codes.NotFound},
		} {
			if got := itemCodes(t, tc.name, tc.rpc, "nope"); got[0] != tc.want {
				t.Errorf("%s of an unknown key: %v, want %v", tc.name, got[0], tc.want)
			}
		}
	})

	t.Run("list", func(t *testing.T) {
		var want []string
		for i := range 10 {
			k := fmt.Sprintf("list/a/%02d", i)
			putObject(t, m, k, 64)
			want = append(want, k)
		}
		putObject(t, m, "list/b", 64)
		putObject(t, m, "list/a", 64) // the prefix itself is a key too; sorts first
		want = append([]string{"list/a"}, want...)

		var got []string
		after := ""
		for page := 0; ; page++ {
			resp, err := mc.List(rpcCtx(t), &pb.ListRequest{Prefix: "list/a", Limit: 4, StartAfter: after})
			if err != nil {
				t.Fatal(err)
			}
			for _, o := range resp.Objects {
				if o.State != pb.ObjectState_OBJECT_STATE_COMPLETE || o.Size != 64 || len(o.Replicas) != 1 || o.CreatedUnixMs == 0 {
					t.Fatalf("list item %v", o)
				}
				got = append(got, o.Key)
			}
			if last := len(got) == len(want); resp.Truncated == last {
				t.Fatalf("page %d: truncated %v after %d of %d keys", page, resp.Truncated, len(got), len(want))
			}
			if !resp.Truncated {
				break
			}
			after = got[len(got)-1]
		}
		if !slices.Equal(got, want) {
			t.Fatalf("paged list = %v, want %v", got, want)
		}
		resp, err := mc.List(rpcCtx(t), &pb.ListRequest{Prefix: "list/"}) // default limit
		if err != nil || len(resp.Objects) != 12 || resp.Truncated {
			t.Fatalf("list = %d objects truncated %v, %v", len(resp.GetObjects()), resp.GetTruncated(), err)
		}
		resp, err = mc.List(rpcCtx(t), &pb.ListRequest{Prefix: "nothing/"})
		if err != nil || len(resp.Objects) != 0 || resp.Truncated {
			t.Fatalf("list of an empty prefix = %v, %v", resp, err)
		}
	})

	t.Run("remove", func(t *testing.T) {
		const seg = "store1/dram0@1"
		before := segmentUsed(t, m, seg)
		putObject(t, m, "rm", 1000)
		if used := segmentUsed(t, m, seg); used != before+1024 {
			t.Fatalf("used %d after a put, want %d", used, before+1024)
		}
		if _, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"rm"}}); err != nil { // takes a lease
			t.Fatal(err)
		}
		items(t, m, "remove", mc.Remove, "rm")
		if exists(t, m, "rm")[0] {
			t.Fatal("a removed object exists")
		}
		gr, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"rm"}})
		if err != nil || codes.Code(gr.Results[0].Status.Code) != codes.NotFound {
			t.Fatalf("get replicas of a removed object = %v, %v", gr, err)
		}
		// The leased range stays allocated until the lease is over and a
		// later command carries a time past it.
		if used := segmentUsed(t, m, seg); used != before+1024 {
			t.Fatalf("used %d right after remove, want the leased range kept (%d)", used, before+1024)
		}
		waitFor(t, 5*time.Second, "space of the removed object freed", func() error {
			itemCodes(t, "put revoke", mc.PutRevoke, "tick") // any command moves the FSM's clock
			if used := segmentUsed(t, m, seg); used != before {
				return fmt.Errorf("used %d, want %d", used, before)
			}
			return nil
		})
		// The key can be put again.
		putObject(t, m, "rm", 10)
	})
}

// TestServerRevokesStalePut: a put neither ended nor revoked within the
// put timeout is forgotten; its space stays reserved until no late write
// can land (the reservation's window, the timeout and the grace), then it
// is free again.
func TestServerRevokesStalePut(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.PutTimeout = 300 * time.Millisecond
		cfg.ReserveWindow = 100 * time.Millisecond
		cfg.Registerer = reg
	})
	m := c.leader()
	mc := m.master()
	register(t, m, "s", "ep", dram("a", 1<<20))

	stale, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "stale", Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	putObject(t, m, "done", 64) // ended in time: never revoked
	seg := func() *pb.SegmentInfo {
		st, err := mc.Status(rpcCtx(t), &pb.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return st.Segments[0]
	}
	if s := seg(); s.Used != 64 || s.Reserved < 4096 {
		t.Fatalf("used %d, reserved %d: want 64 used and the stale put's 4096 reserved", s.Used, s.Reserved)
	}
	waitFor(t, 10*time.Second, "the stale put forgotten", func() error {
		if n := counter(t, reg, "tidepool_master_puts_expired_total"); n != 1 {
			return fmt.Errorf("expired counter = %v, want 1", n)
		}
		return nil
	})
	if got := itemCodes(t, "put end", mc.PutEnd, "stale"); got[0] != codes.FailedPrecondition {
		t.Fatalf("put end of an expired put: %v", got[0])
	}
	// Its space is kept for late writes, not reused at once.
	if s := seg(); s.Reserved < 4096 {
		t.Fatalf("reserved %d after the put expired, want its 4096 kept until the grace ends", s.Reserved)
	}
	waitFor(t, 15*time.Second, "the stale put's space freed", func() error {
		if s := seg(); s.Used != 64 || s.Reserved != 0 || s.Capacity-s.Used != 1<<20-64 {
			return fmt.Errorf("used %d, reserved %d", s.Used, s.Reserved)
		}
		return nil
	})
	// Too late to publish now: the space may be someone else's.
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: "stale", PutId: stale.PutId, Size: 4096, Replicas: stale.Replicas, Reservations: stale.Reservations,
	}}})
	if err != nil || codes.Code(resp.Results[0].Code) != codes.FailedPrecondition {
		t.Fatalf("publish after the space was freed: %v, %v", resp, err)
	}
	if !exists(t, m, "done")[0] || exists(t, m, "stale")[0] {
		t.Fatal("exists: want done and not stale")
	}
	// The key is free for a new put.
	putObject(t, m, "stale", 10)
}

// countPending counts removed ranges still held back for read leases.
func countPending(f *FSM) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.pending)
}

// counter reads a counter without labels from a registry.
func counter(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no counter %s", name)
	return 0
}

func TestServerDeclaresSilentStoreDead(t *testing.T) {
	t.Parallel()
	const ttl = 500 * time.Millisecond
	c := newCluster(t, 1, func(cfg *Config) { cfg.NodeTTL = ttl })
	m := c.leader()
	beating := register(t, m, "beating", "ep-b", dram("a", 1<<20))
	register(t, m, "silent", "ep-s", dram("a", 1<<20))

	// The beating store heartbeats from a goroutine the test owns.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	hbErr := make(chan error, 1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(ttl / 5)
		defer tick.Stop()
		for {
			if _, err := m.registry().Heartbeat(ctx, &pb.HeartbeatRequest{Node: "beating", Epoch: beating.Epoch}); err != nil && ctx.Err() == nil {
				hbErr <- err
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })

	// Placement spreads by free ratio, so a few puts land on both stores.
	on := map[string][]string{}
	for i := 0; len(on["beating"]) == 0 || len(on["silent"]) == 0; i++ {
		if i == 10 {
			t.Fatalf("ten puts did not reach both stores: %v", on)
		}
		key := fmt.Sprintf("k%d", i)
		r := putObject(t, m, key, 4096)
		on[r.Node] = append(on[r.Node], key)
	}

	waitFor(t, 10*time.Second, "the silent store declared dead", func() error {
		for _, e := range exists(t, m, on["silent"]...) {
			if e {
				return errors.New("objects of the silent store still exist")
			}
		}
		return nil
	})
	for i, e := range exists(t, m, on["beating"]...) {
		if !e {
			t.Fatalf("object %s of the heartbeating store is gone", on["beating"][i])
		}
	}
	st, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Segments) != 1 || st.Segments[0].Node != "beating" || !st.Segments[0].Alive {
		t.Fatalf("segments = %v", st.Segments)
	}
	_, err = m.registry().Heartbeat(rpcCtx(t), &pb.HeartbeatRequest{Node: "silent", Epoch: 1})
	wantCode(t, err, codes.NotFound, "heartbeat of a dead store")
	if resp := register(t, m, "silent", "ep-s", dram("a", 1<<20)); resp.Epoch != 2 {
		t.Fatalf("re-register of a dead store: epoch %d, want 2", resp.Epoch)
	}
	select {
	case err := <-hbErr:
		t.Fatalf("heartbeat of the live store failed: %v", err)
	default:
	}
}

func TestClusterFailover(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, nil)
	leader := c.leader()
	register(t, leader, "store1", "ep1", dram("a", 1<<20))
	register(t, leader, "store2", "ep2", dram("a", 1<<20))
	var keys []string
	want := map[string]*pb.ObjectReplicas{}
	for i := range 8 {
		k := fmt.Sprintf("k%d", i)
		putObject(t, leader, k, uint64(100*(i+1)))
		keys = append(keys, k)
	}
	gr, err := leader.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range gr.Results {
		want[keys[i]] = r
	}
	inflight, err := leader.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "inflight", Size: 64})
	if err != nil {
		t.Fatal(err)
	}

	t.Run("followers refuse with the leader's address", func(t *testing.T) {
		for _, f := range c.followers() {
			mc, rc := f.master(), f.registry()
			calls := map[string]func(grpc.CallOption) error{
				"put start": func(o grpc.CallOption) error {
					_, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "x", Size: 1}, o)
					return err
				},
				"batch put start": func(o grpc.CallOption) error {
					_, err := mc.BatchPutStart(rpcCtx(t), &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "x", Size: 1}}}, o)
					return err
				},
				"put end": func(o grpc.CallOption) error {
					_, err := mc.PutEnd(rpcCtx(t), &pb.KeysRequest{Keys: []string{"inflight"}}, o)
					return err
				},
				"put revoke": func(o grpc.CallOption) error {
					_, err := mc.PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: []string{"inflight"}}, o)
					return err
				},
				"remove": func(o grpc.CallOption) error {
					_, err := mc.Remove(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k0"}}, o)
					return err
				},
				"get replicas": func(o grpc.CallOption) error {
					_, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k0"}}, o)
					return err
				},
				"exists": func(o grpc.CallOption) error {
					_, err := mc.Exists(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k0"}}, o)
					return err
				},
				"list": func(o grpc.CallOption) error {
					_, err := mc.List(rpcCtx(t), &pb.ListRequest{}, o)
					return err
				},
				"register": func(o grpc.CallOption) error {
					_, err := rc.Register(rpcCtx(t), &pb.RegisterRequest{Node: "s3", Endpoint: "ep3", Segments: []*pb.SegmentSpec{dram("a", 4096)}}, o)
					return err
				},
				"heartbeat": func(o grpc.CallOption) error {
					_, err := rc.Heartbeat(rpcCtx(t), &pb.HeartbeatRequest{Node: "store1", Epoch: 1}, o)
					return err
				},
			}
			for name, call := range calls {
				var tr metadata.MD
				err := call(grpc.Trailer(&tr))
				wantCode(t, err, codes.Unavailable, f.srv.cfg.ID+" "+name)
				if got := tr.Get(LeaderTrailer); !slices.Equal(got, []string{leader.addr}) {
					t.Fatalf("%s %s: trailer %s = %q, want %q", f.srv.cfg.ID, name, LeaderTrailer, got, leader.addr)
				}
			}
			// A follower learns that the last put's entry committed with
			// the leader's next append, which may not come (7 objects) or
			// may (8: a reservation the leader made meanwhile); the put in
			// flight is no object yet.
			waitFor(t, 5*time.Second, "the follower's status", func() error {
				st, err := mc.Status(rpcCtx(t), &pb.StatusRequest{})
				if err != nil || st.LeaderAddress != leader.addr || len(st.Members) != 3 || st.Objects < 7 || st.Objects > 8 {
					return fmt.Errorf("status on follower %s = %v, %v", f.srv.cfg.ID, st, err)
				}
				return nil
			})
		}
	})

	t.Run("a new leader has every object", func(t *testing.T) {
		old := leader
		for i, m := range c.members {
			if m == old {
				c.kill(i)
			}
		}
		leader = c.leader()
		if leader == old {
			t.Fatal("the closed master still leads")
		}
		gr, err := leader.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: keys})
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range gr.Results {
			if !proto.Equal(r, want[keys[i]]) {
				t.Fatalf("%s after failover: %v, want %v", keys[i], r, want[keys[i]])
			}
		}
		if exists(t, leader, "inflight")[0] {
			t.Fatal("a PROCESSING object became visible in the failover")
		}
		// The put in flight survives the failover: the new leader did not
		// place it, so it publishes it with what its start answered.
		if got := itemCodes(t, "put end", leader.master().PutEnd, "inflight"); got[0] != codes.FailedPrecondition {
			t.Fatalf("put end by key of a put the old leader placed: %v", got[0])
		}
		endPlaced(t, leader, "inflight", inflight)
		if !exists(t, leader, "inflight")[0] {
			t.Fatal("the put ended on the new leader is not visible")
		}
		putObject(t, leader, "after", 64)
		for _, f := range c.followers() {
			var tr metadata.MD
			_, err := f.master().Exists(rpcCtx(t), &pb.KeysRequest{Keys: []string{"after"}}, grpc.Trailer(&tr))
			wantCode(t, err, codes.Unavailable, "exists on the remaining follower")
			if got := tr.Get(LeaderTrailer); !slices.Equal(got, []string{leader.addr}) {
				t.Fatalf("trailer after failover = %q, want %q", got, leader.addr)
			}
		}
	})
}

func TestServerRestartKeepsObjects(t *testing.T) {
	t.Parallel()
	cfg := Config{ID: "m0", Dir: t.TempDir(), RaftAddr: "127.0.0.1:0"}
	fastTimings(&cfg)
	m := start(t, cfg)
	waitFor(t, 15*time.Second, "leadership", func() error {
		if _, addr := m.srv.Leader(); !m.srv.IsLeader() || addr != m.addr {
			return errors.New("not leader yet")
		}
		return nil
	})
	register(t, m, "store1", "ep1", dram("a", 1<<20))
	for i := range 5 {
		putObject(t, m, fmt.Sprintf("k%d", i), uint64(100+i))
	}
	// Part of the state goes into a raft snapshot, the rest stays in the log.
	if err := m.srv.raft.Snapshot().Error(); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	for i := 5; i < 10; i++ {
		putObject(t, m, fmt.Sprintf("k%d", i), uint64(100+i))
	}
	items(t, m, "remove", m.master().Remove, "k3")
	inflight, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "inflight", Size: 64})
	if err != nil {
		t.Fatal(err)
	}
	// Let the space of k3, held back for leases a new leader may not know
	// of, be freed, so the state below no longer depends on the clock.
	waitFor(t, 5*time.Second, "the space of k3 freed", func() error {
		itemCodes(t, "put revoke", m.master().PutRevoke, "tick")
		if n := countPending(m.srv.FSM()); n != 0 {
			return fmt.Errorf("%d pending frees", n)
		}
		return nil
	})
	before, err := m.master().List(rpcCtx(t), &pb.ListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	views := m.srv.FSM().segmentViews()
	m.stop(t)

	m = start(t, cfg) // same ID and Dir, new ports
	waitFor(t, 15*time.Second, "the restarted master leads with its state", func() error {
		if _, addr := m.srv.Leader(); !m.srv.IsLeader() || addr != m.addr {
			return errors.New("not leader yet")
		}
		after, err := m.master().List(rpcCtx(t), &pb.ListRequest{})
		if err != nil {
			return err
		}
		if len(after.Objects) != len(before.Objects) {
			return fmt.Errorf("%d objects, want %d", len(after.Objects), len(before.Objects))
		}
		for i := range after.Objects {
			if !proto.Equal(after.Objects[i], before.Objects[i]) {
				return fmt.Errorf("object %d: %v, want %v", i, after.Objects[i], before.Objects[i])
			}
		}
		return nil
	})
	if got := m.srv.FSM().segmentViews(); !slices.Equal(got, views) {
		t.Fatalf("segments after restart:\n%+v\nwant\n%+v", got, views)
	}
	if got := exists(t, m, "k0", "k3", "k9", "inflight"); !slices.Equal(got, []bool{true, false, true, false}) {
		t.Fatalf("exists after restart = %v", got)
	}
	endPlaced(t, m, "inflight", inflight)
}
