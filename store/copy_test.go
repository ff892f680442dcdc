package store_test

import (
	"bytes"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/enginetest"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/ticket"
	"github.com/tidepool-kv/tidepool/tiers"
)

// registry is an in-memory twin of the master's Registry service on a
// loopback gRPC socket: it registers every node in epoch 1, hands queued
// copies out once on heartbeats (at most copy_slots of them) and records
// the results.
type registry struct {
	pb.UnimplementedRegistryServer
	addr string

	mu         sync.Mutex
	registers  map[string]int
	keys       map[string][]byte // ticket key of each node
	heartbeats map[string]int
	slots      map[string]uint32 // the last copy_slots of each node
	queued     map[string][]*pb.CopyTask
	handedOut  map[uint64]time.Time
	results    map[uint64]*pb.CopyResult
	reportedAt map[uint64]time.Time
	reports    int   // results received, duplicates included
	hbErr      error // if set, every heartbeat's answer
	// Heartbeats after one that hands out copies fail with Internal, their
	// content ignored: loseAfterCopies of them; lose are still to fail.
	loseAfterCopies, lose int
}

func startRegistry(t *testing.T) *registry {
	t.Helper()
	r := &registry{
		registers: map[string]int{}, keys: map[string][]byte{}, heartbeats: map[string]int{}, slots: map[string]uint32{},
		queued: map[string][]*pb.CopyTask{}, handedOut: map[uint64]time.Time{},
		results: map[uint64]*pb.CopyResult{}, reportedAt: map[uint64]time.Time{},
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.addr = ln.Addr().String()
	srv := grpc.NewServer()
	pb.RegisterRegistryServer(srv, r)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("registry Serve: %v", err)
		}
	})
	return r
}

func (r *registry) Register(_ context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.registers[req.Node]++
	r.keys[req.Node] = req.TicketKey
	resp := &pb.RegisterResponse{Epoch: 1}
	for _, s := range req.Segments {
		resp.SegmentIds = append(resp.SegmentIds, req.Node+"/"+s.Name+"@1")
	}
	return resp, nil
}

func (r *registry) Heartbeat(_ context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.heartbeats[req.Node]++
	if r.hbErr != nil {
		return nil, r.hbErr
	}
	if r.lose > 0 {
		r.lose--
		return nil, status.Error(codes.Internal, "heartbeat lost")
	}
	now := time.Now()
	for _, res := range req.CopiesDone {
		r.reports++
		r.results[res.Id] = res
		r.reportedAt[res.Id] = now
	}
	r.slots[req.Node] = req.CopySlots
	q := r.queued[req.Node]
	n := min(len(q), int(req.CopySlots))
	for _, c := range q[:n] {
		r.handedOut[c.Id] = now
		// As the master does: the copying node reads the source and writes
		// the target with tickets until the copy's deadline.
		until := now.Add(time.Duration(c.TimeoutMs) * time.Millisecond).UnixNano()
		r.sign(c.Source, ticket.Ticket{Op: ticket.Read, Off: c.Source.GetOffset(), Len: c.Size, Expiry: until})
		r.sign(c.Target, ticket.Ticket{Op: ticket.Write, ID: c.Id, Off: c.Target.GetOffset(), Len: c.Size, Expiry: until})
	}
	if n > 0 {
		r.lose = r.loseAfterCopies
	}
	r.queued[req.Node] = q[n:]
	return &pb.HeartbeatResponse{Copies: q[:n]}, nil
}

// sign gives rep, unless it has one, a ticket t signed with the key of its
// segment's node (r.mu held).
func (r *registry) sign(rep *pb.Replica, t ticket.Ticket) {
	if rep == nil || rep.Ticket != nil {
		return
	}
	node, _, _ := strings.Cut(rep.Segment, "/")
	if k, err := ticket.SegmentKey(r.keys[node], rep.Segment); err == nil {
		rep.Ticket = k.Sign(t)
	}
}

func (r *registry) Leave(context.Context, *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	return &pb.HeartbeatResponse{}, nil
}

func (r *registry) queue(node string, tasks ...*pb.CopyTask) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queued[node] = append(r.queued[node], tasks...)
}

// result waits for copy id's result.
func (r *registry) result(t *testing.T, id uint64) *pb.CopyResult {
	t.Helper()
	var res *pb.CopyResult
	waitFor(t, waitLong, "the result of a copy", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		res = r.results[id]
		return res != nil
	})
	return res
}

func (r *registry) count(m map[string]int, node string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return m[node]
}

// copyNode is a store node with DRAM tiers of 1 MiB, its own metrics, and
// transfers to other engines over TCP (no shared memory).
type copyNode struct {
	*store.Node
	tiers []*tiers.DRAMTier
	reg   *prometheus.Registry
}

func startCopyNode(t *testing.T, id string, r *registry, interval time.Duration, tierNames ...string) *copyNode {
	t.Helper()
	cn := &copyNode{reg: prometheus.NewRegistry()}
	var ts []tiers.Tier
	for _, name := range tierNames {
		tier, err := tiers.NewDRAM(name, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		cn.tiers = append(cn.tiers, tier)
		ts = append(ts, tier)
	}
	n, err := store.New(store.Config{
		ID: id, Masters: []string{r.addr}, Listen: "127.0.0.1:0", Tiers: ts,
		HeartbeatInterval: interval, Engine: engine.Config{NoShm: true},
		Registerer: cn.reg, Logger: mastertest.Logger(),
	})
	if err != nil {
		for _, tier := range ts {
			tier.Close()
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("close node %s: %v", id, err)
		}
	})
	cn.Node = n
	select {
	case <-n.Registered():
	case <-time.After(waitLong):
		t.Fatalf("node %s did not register within %v", id, waitLong)
	}
	return cn
}

// replica names length bytes at off of the node's segment.
func (cn *copyNode) replica(segment string, off, length uint64) *pb.Replica {
	return &pb.Replica{Endpoint: cn.Endpoint(), Segment: segment, Offset: off, Length: length}
}

func (cn *copyNode) counter(t *testing.T, name, result string) float64 {
	t.Helper()
	mfs, err := cn.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == name && (result == "" || m.GetLabel()[0].GetValue() == result) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

func wantCode(t *testing.T, res *pb.CopyResult, want codes.Code) {
	t.Helper()
	if got := codes.Code(res.GetStatus().GetCode()); got != want {
		t.Fatalf("copy %d: %s %q, want %s", res.Id, got, res.GetStatus().GetMessage(), want)
	}
}

// TestCopyWithinNode copies between two tiers of one node: the bytes
// arrive, and the result comes back on the heartbeat right after the copy,
// not a heartbeat interval later.
func TestCopyWithinNode(t *testing.T) {
	r := startRegistry(t)
	const interval = time.Second
	n := startCopyNode(t, "n1", r, interval, "dram0", "dram1")
	val := randomBytes(100_003)
	copy(n.tiers[0].Bytes()[4096:], val)
	size := uint64(len(val))
	r.queue("n1", &pb.CopyTask{
		Id: 1, Key: "k", Size: size, Checksum: client.Checksum(val), TimeoutMs: 10_000,
		Source: n.replica("n1/dram0@1", 4096, size), Target: n.replica("n1/dram1@1", 8192, size),
	})

	wantCode(t, r.result(t, 1), codes.OK)
	if !bytes.Equal(n.tiers[1].Bytes()[8192:8192+size], val) {
		t.Fatal("the target does not hold the value")
	}
	r.mu.Lock()
	took := r.reportedAt[1].Sub(r.handedOut[1])
	r.mu.Unlock()
	if took > interval/2 {
		t.Errorf("the result came %v after the task: the node waited for its next tick", took)
	}
	waitFor(t, waitLong, "copy_slots back at 4", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.slots["n1"] == 4
	})
	if ok, b := n.counter(t, "tidepool_store_copies_total", "ok"), n.counter(t, "tidepool_store_copied_bytes_total", ""); ok != 1 || b != float64(size) {
		t.Errorf("copies ok = %v, copied bytes = %v; want 1, %d", ok, b, size)
	}
}

// TestCopyChecksumMismatch: bytes that do not match the checksum are
// reported as DataLoss and never written.
func TestCopyChecksumMismatch(t *testing.T) {
	r := startRegistry(t)
	n := startCopyNode(t, "n1", r, heartbeat, "dram0", "dram1")
	val := randomBytes(4096)
	copy(n.tiers[0].Bytes(), val)
	target := n.tiers[1].Bytes()[:len(val)]
	for i := range target {
		target[i] = 0xab
	}
	r.queue("n1", &pb.CopyTask{
		Id: 7, Key: "corrupt-key", Size: 4096, Checksum: client.Checksum(val) ^ 1, TimeoutMs: 10_000,
		Source: n.replica("n1/dram0@1", 0, 4096), Target: n.replica("n1/dram1@1", 0, 4096),
	})

	res := r.result(t, 7)
	wantCode(t, res, codes.DataLoss)
	if msg := res.Status.Message; !strings.Contains(msg, "corrupt-key") || !strings.Contains(msg, "n1/dram0@1") {
		t.Errorf("message %q names neither the key nor the source segment", msg)
	}
	if !bytes.Equal(target, bytes.Repeat([]byte{0xab}, len(val))) {
		t.Fatal("the target was written")
	}
	if got := n.counter(t, "tidepool_store_copies_total", "failed"); got != 1 {
		t.Errorf("failed copies = %v, want 1", got)
	}
}

// TestCopyBetweenNodes: a node reads from another node and writes to it,
// over TCP.
func TestCopyBetweenNodes(t *testing.T) {
	r := startRegistry(t)
	n1 := startCopyNode(t, "n1", r, heartbeat, "dram0")
	n2 := startCopyNode(t, "n2", r, heartbeat, "dram0")
	pull, push := randomBytes(300_000), randomBytes(5000)
	copy(n2.tiers[0].Bytes()[1000:], pull)
	copy(n1.tiers[0].Bytes()[500_000:], push)
	r.queue("n1",
		&pb.CopyTask{
			Id: 1, Key: "pull", Size: uint64(len(pull)), Checksum: client.Checksum(pull), TimeoutMs: 10_000,
			Source: n2.replica("n2/dram0@1", 1000, uint64(len(pull))), Target: n1.replica("n1/dram0@1", 0, uint64(len(pull))),
		},
		&pb.CopyTask{
			Id: 2, Key: "push", Size: uint64(len(push)), Checksum: client.Checksum(push), TimeoutMs: 10_000,
			Source: n1.replica("n1/dram0@1", 500_000, uint64(len(push))), Target: n2.replica("n2/dram0@1", 700_000, uint64(len(push))),
		})

	wantCode(t, r.result(t, 1), codes.OK)
	wantCode(t, r.result(t, 2), codes.OK)
	if !bytes.Equal(n1.tiers[0].Bytes()[:len(pull)], pull) {
		t.Error("n1 does not hold the value read from n2")
	}
	if !bytes.Equal(n2.tiers[0].Bytes()[700_000:700_000+len(push)], push) {
		t.Error("n2 does not hold the value written by n1")
	}
}

// TestCopyInvalidTask: tasks no transfer could carry out are refused
// with InvalidArgument; the node goes on.
func TestCopyInvalidTask(t *testing.T) {
	r := startRegistry(t)
	n := startCopyNode(t, "n1", r, heartbeat, "dram0", "dram1")
	good := func(id uint64) *pb.CopyTask {
		return &pb.CopyTask{
			Id: id, Key: "k", Size: 64, Checksum: client.Checksum(make([]byte, 64)), TimeoutMs: 10_000,
			Source: n.replica("n1/dram0@1", 0, 64), Target: n.replica("n1/dram1@1", 0, 64),
		}
	}
	bad := []func(*pb.CopyTask){
		func(c *pb.CopyTask) { c.Source = nil },
		func(c *pb.CopyTask) { c.Target = nil },
		func(c *pb.CopyTask) { c.Size, c.Source.Length, c.Target.Length = 0, 0, 0 },
		func(c *pb.CopyTask) { c.Source.Length = 65 },
		func(c *pb.CopyTask) { c.Target.Length = 63 },
		func(c *pb.CopyTask) { c.Source.Offset = math.MaxUint64 - 10 },
		func(c *pb.CopyTask) { c.Target.Segment = "" },
		func(c *pb.CopyTask) { c.TimeoutMs = 0 },
	}
	for i, edit := range bad {
		c := good(uint64(i + 1))
		edit(c)
		r.queue("n1", c)
	}
	for i := range bad {
		wantCode(t, r.result(t, uint64(i+1)), codes.InvalidArgument)
	}
	r.queue("n1", good(100))
	wantCode(t, r.result(t, 100), codes.OK)
}

// TestCopyTransferFailures: a replica that is not there is Unavailable, a
// source too slow for the timeout DeadlineExceeded.
func TestCopyTransferFailures(t *testing.T) {
	r := startRegistry(t)
	n1 := startCopyNode(t, "n1", r, heartbeat, "dram0")
	n2 := startCopyNode(t, "n2", r, heartbeat, "dram0")
	p := enginetest.NewProxy(t, n2.Endpoint())
	p.StallAfter(0)
	slow := n2.replica("n2/dram0@1", 0, 64)
	slow.Endpoint = p.Addr()
	r.queue("n1",
		&pb.CopyTask{Id: 1, Key: "gone", Size: 64, TimeoutMs: 10_000,
			Source: n2.replica("n2/dram0@7", 0, 64), Target: n1.replica("n1/dram0@1", 0, 64)},
		&pb.CopyTask{Id: 2, Key: "slow", Size: 64, TimeoutMs: 200,
			Source: slow, Target: n1.replica("n1/dram0@1", 0, 64)})

	wantCode(t, r.result(t, 1), codes.Unavailable)
	wantCode(t, r.result(t, 2), codes.DeadlineExceeded)
}

// TestCopyResultResent: a result whose heartbeat failed goes out again
// on the next one.
func TestCopyResultResent(t *testing.T) {
	r := startRegistry(t)
	n := startCopyNode(t, "n1", r, heartbeat, "dram0", "dram1")
	r.mu.Lock()
	r.loseAfterCopies = 2
	r.mu.Unlock()
	r.queue("n1", &pb.CopyTask{
		Id: 1, Key: "k", Size: 64, Checksum: client.Checksum(make([]byte, 64)), TimeoutMs: 10_000,
		Source: n.replica("n1/dram0@1", 0, 64), Target: n.replica("n1/dram1@1", 0, 64),
	})
	wantCode(t, r.result(t, 1), codes.OK)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reports != 1 || r.lose != 0 {
		t.Fatalf("%d reports with %d heartbeats still to lose, want 1 report after 2 lost heartbeats", r.reports, r.lose)
	}
}

// TestDrained: a node the master answers FAILED_PRECONDITION stops serving
// its segments and stays out of the pool: no registering again.
func TestDrained(t *testing.T) {
	r := startRegistry(t)
	r.mu.Lock()
	r.hbErr = status.Error(codes.FailedPrecondition, "node n1 was drained")
	r.mu.Unlock()
	n := startCopyNode(t, "n1", r, heartbeat, "dram0")

	waitFor(t, waitLong, "the node to leave the pool", func() bool { return n.Epoch() == 0 })
	e := peer(t)
	if err := transfer(t, e, false, make([]byte, 8), n.Endpoint(), "n1/dram0@1", 0); !errors.Is(err, engine.ErrSegmentNotFound) {
		t.Fatalf("read of a drained node's segment = %v, want ErrSegmentNotFound", err)
	}
	hb := r.count(r.heartbeats, "n1")
	for deadline := time.Now().Add(10 * heartbeat); time.Now().Before(deadline); time.Sleep(heartbeat / 2) {
		if regs, hbs := r.count(r.registers, "n1"), r.count(r.heartbeats, "n1"); regs != 1 || hbs != hb {
			t.Fatalf("a drained node registered %d times and heartbeat %d more times; want 1 and 0", regs, hbs-hb)
		}
	}
}

// TestCloseDuringCopies: Close cancels running copies and waits for them.
func TestCloseDuringCopies(t *testing.T) {
	r := startRegistry(t)
	n1 := startCopyNode(t, "n1", r, heartbeat, "dram0")
	n2 := startCopyNode(t, "n2", r, heartbeat, "dram0")
	p := enginetest.NewProxy(t, n2.Endpoint())
	stalled := p.StallAfter(0)
	for id := uint64(1); id <= 2; id++ {
		src := n2.replica("n2/dram0@1", 0, 4096)
		src.Endpoint = p.Addr()
		r.queue("n1", &pb.CopyTask{Id: id, Key: "k", Size: 4096, TimeoutMs: 60_000,
			Source: src, Target: n1.replica("n1/dram0@1", 4096*id, 4096)})
	}
	select {
	case <-stalled:
	case <-time.After(waitLong):
		t.Fatal("the copies never reached the source")
	}
	waitFor(t, waitLong, "copy_slots to count the running copies", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.slots["n1"] == 2
	})

	start := time.Now()
	if err := n1.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Close took %v", d)
	}
	if got := n1.counter(t, "tidepool_store_copies_total", "failed"); got != 2 {
		t.Fatalf("failed copies after Close = %v, want 2", got)
	}
}
