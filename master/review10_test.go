package master

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
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

	"github.com/tidepool-kv/tidepool/master/framed"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review10Listener counts its connections by how they open: framed's
// preface or HTTP/2's (gRPC).
type review10Listener struct {
	net.Listener
	framed, h2 atomic.Int32
}

func (l *review10Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &review10Conn{Conn: c, l: l}, nil
}

type review10Conn struct {
	net.Conn
	l    *review10Listener
	mu   sync.Mutex
	head []byte
}

func (c *review10Conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if len(c.head) < 24 {
		c.head = append(c.head, p[:min(n, 24-len(c.head))]...)
		if len(c.head) == 24 {
			switch {
			case string(c.head) == "tidepool framed rpc v1\r\n":
				c.l.framed.Add(1)
			case strings.HasPrefix(string(c.head), "PRI * HTTP/2.0"):
				c.l.h2.Add(1)
			}
		}
	}
	c.mu.Unlock()
	return n, err
}

// review10Start is start with a counting listener, and without a gRPC
// call to wait for Serve (its gRPC client is never used).
func review10Start(t testing.TB, cfg Config) (*member, *review10Listener) {
	t.Helper()
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := &review10Listener{Listener: inner}
	return serve(t, cfg, ln), ln
}

func review10Cluster(t testing.TB, n int, tweak func(*Config)) (*cluster, []*review10Listener) {
	t.Helper()
	var lns []*review10Listener
	c := newClusterOf(t, n, tweak, func(t testing.TB, cfg Config) *member {
		m, ln := review10Start(t, cfg)
		lns = append(lns, ln)
		return m
	})
	return c, lns
}

func review10Dial(t testing.TB, addrs ...string) *leaderconn.Conn {
	t.Helper()
	c, err := leaderconn.Dial(addrs, leaderconn.Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func review10Master(ctx context.Context, c *leaderconn.Conn, fn func(context.Context, pb.MasterClient, ...grpc.CallOption) error) error {
	return c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return fn(ctx, pb.NewMasterClient(cc), opts...)
	})
}

func review10Registry(ctx context.Context, c *leaderconn.Conn, fn func(context.Context, pb.RegistryClient, ...grpc.CallOption) error) error {
	return c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return fn(ctx, pb.NewRegistryClient(cc), opts...)
	})
}

func review10Exists(t testing.TB, c *leaderconn.Conn, keys ...string) ([]bool, error) {
	t.Helper()
	var resp *pb.ExistsResponse
	err := review10Master(rpcCtx(t), c, func(ctx context.Context, m pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = m.Exists(ctx, &pb.KeysRequest{Keys: keys}, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.Exists, nil
}

// TestReview10FramedClusterFailover: a Conn given the followers first
// registers a store, heartbeats and reads through them, framed (followers
// refuse with the leader trailer; no call falls back to gRPC); a follower
// answers a framed call as over gRPC (Unavailable, the trailer); after the
// leader is killed the same Conn reaches the new one.
func TestReview10FramedClusterFailover(t *testing.T) {
	c, lns := review10Cluster(t, 3, nil)
	leader := c.leader()
	var li int
	var addrs []string
	for i, m := range c.members {
		if m == leader {
			li = i
			continue
		}
		addrs = append(addrs, m.addr)
	}
	addrs = append(addrs, leader.addr)

	// A follower's refusal, framed: the code and the trailer.
	fc := framed.NewClient(addrs[0], nil, framed.Credentials{})
	defer fc.Close()
	var tr metadata.MD
	_, err := pb.NewMasterClient(fc).Exists(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k"}}, grpc.Trailer(&tr))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("framed Exists on a follower: %v, want Unavailable", err)
	}
	if got := tr.Get(leaderconn.Trailer); len(got) != 1 || got[0] != leader.addr {
		t.Fatalf("framed follower trailer %v, want the leader %s", tr, leader.addr)
	}

	conn := review10Dial(t, addrs...)
	var reg *pb.RegisterResponse
	if err := review10Registry(rpcCtx(t), conn, func(ctx context.Context, r pb.RegistryClient, o ...grpc.CallOption) (err error) {
		reg, err = r.Register(ctx, &pb.RegisterRequest{Node: "s1", Endpoint: "127.0.0.1:1", Segments: []*pb.SegmentSpec{dram("d", 64<<20)}}, o...)
		return err
	}); err != nil {
		t.Fatalf("register: %v", err)
	}
	heartbeat := func() error {
		return review10Registry(rpcCtx(t), conn, func(ctx context.Context, r pb.RegistryClient, o ...grpc.CallOption) error {
			_, err := r.Heartbeat(ctx, &pb.HeartbeatRequest{Node: "s1", Epoch: reg.Epoch}, o...)
			return err
		})
	}
	if err := heartbeat(); err != nil {
		t.Fatalf("heartbeat: %v", err)
	}
	if ex, err := review10Exists(t, conn, "k"); err != nil || len(ex) != 1 || ex[0] {
		t.Fatalf("exists: %v, %v", ex, err)
	}
	if n := lns[li].framed.Load(); n == 0 {
		t.Errorf("the leader saw no framed connection")
	}
	for i, l := range lns {
		if n := l.h2.Load(); n != 0 {
			t.Errorf("master %d saw %d gRPC connections; want every call framed", i, n)
		}
	}

	c.kill(li)
	next := c.leader()
	if ex, err := review10Exists(t, conn, "k"); err != nil || len(ex) != 1 || ex[0] {
		t.Fatalf("exists after failover to %s: %v, %v", next.srv.cfg.ID, ex, err)
	}
	if err := heartbeat(); err != nil {
		t.Fatalf("heartbeat after failover: %v", err)
	}
	for i, l := range lns {
		if n := l.h2.Load(); n != 0 {
			t.Errorf("master %d saw %d gRPC connections after the failover; want every call framed", i, n)
		}
	}
}

// TestReview10FramedLocalFirst: LocalFirst places a framed BatchPutStart
// on the caller's host (clientHost reads the framed peer), although the
// other host's segment is freer.
func TestReview10FramedLocalFirst(t *testing.T) {
	c, _ := review10Cluster(t, 1, func(cfg *Config) { cfg.Placement = LocalFirst })
	c.leader()
	conn := review10Dial(t, c.members[0].addr)
	for _, n := range []struct {
		node, endpoint string
		size           uint64
	}{{"near", "127.0.0.1:7", 64 << 20}, {"far", "192.0.2.1:7", 1 << 30}} {
		if err := review10Registry(rpcCtx(t), conn, func(ctx context.Context, r pb.RegistryClient, o ...grpc.CallOption) error {
			_, err := r.Register(ctx, &pb.RegisterRequest{Node: n.node, Endpoint: n.endpoint, Segments: []*pb.SegmentSpec{dram(n.node, n.size)}}, o...)
			return err
		}); err != nil {
			t.Fatalf("register %s: %v", n.node, err)
		}
	}
	var resp *pb.BatchPutStartResponse
	if err := review10Master(rpcCtx(t), conn, func(ctx context.Context, m pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = m.BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "k", Size: 4096}}}, o...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	r := resp.Results[0]
	if r.Status.Code != 0 || len(r.Replicas) != 1 {
		t.Fatalf("put start: %v", r)
	}
	if got := r.Replicas[0].Endpoint; got != "127.0.0.1:7" {
		t.Fatalf("LocalFirst over framed placed the put at %s, want the caller's host 127.0.0.1", got)
	}
}

// TestReview10FramedMetrics: the interceptor counts framed calls by method
// and code, as gRPC ones.
func TestReview10FramedMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	c, _ := review10Cluster(t, 1, func(cfg *Config) { cfg.Registerer = reg })
	c.leader()
	conn := review10Dial(t, c.members[0].addr)
	count := func(method, code string) float64 {
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() != "tidepool_master_requests_total" {
				continue
			}
			for _, m := range f.GetMetric() {
				var gotMethod, gotCode string
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "method":
						gotMethod = l.GetValue()
					case "code":
						gotCode = l.GetValue()
					}
				}
				if gotMethod == method && gotCode == code {
					return m.GetCounter().GetValue()
				}
			}
		}
		return 0
	}
	const method = "/tidepool.v1.Master/Exists"
	before := count(method, codes.OK.String())
	for range 3 {
		if _, err := review10Exists(t, conn, "k"); err != nil {
			t.Fatal(err)
		}
	}
	if got := count(method, codes.OK.String()) - before; got != 3 {
		t.Fatalf("3 framed Exists counted %v times", got)
	}
	if _, err := review10Exists(t, conn, ""); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("exists of an empty key: %v, want InvalidArgument", err)
	}
	if got := count(method, codes.InvalidArgument.String()); got != 1 {
		t.Fatalf("a refused framed Exists counted %v times", got)
	}
}

// review10FramedGoroutines lists the goroutines running framed code.
func review10FramedGoroutines() []string {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "tidepool/master/framed.") {
			out = append(out, g)
		}
	}
	return out
}

// TestReview10CloseWithFramedCallsInFlight: Close while framed calls run
// (a long Unpin, and Exists in a loop) returns promptly, the Unpin stops
// proposing, the callers get errors, and no framed goroutine is left once
// the client is closed too.
func TestReview10CloseWithFramedCallsInFlight(t *testing.T) {
	c, _ := review10Cluster(t, 1, nil)
	m := c.leader()
	s := m.srv
	conn := review10Dial(t, m.addr)
	if _, err := review10Exists(t, conn, "k"); err != nil {
		t.Fatal(err)
	}
	keys := make([]string, MaxBatchKeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	stopLoops := make(chan struct{})
	unpinDone := make(chan error, 1)
	before := s.raft.AppliedIndex()
	wg.Add(1)
	go func() {
		defer wg.Done()
		unpinDone <- conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
			_, err := pb.NewAdminClient(cc).Unpin(ctx, &pb.KeysRequest{Keys: keys}, o...)
			return err
		})
	}()
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stopLoops:
					return
				default:
				}
				cctx, ccancel := context.WithTimeout(ctx, 200*time.Millisecond)
				_ = review10Master(cctx, conn, func(ctx context.Context, m pb.MasterClient, o ...grpc.CallOption) error {
					_, err := m.Exists(ctx, &pb.KeysRequest{Keys: []string{"k"}}, o...)
					return err
				})
				ccancel()
			}
		}()
	}
	waitUnpinUnderWay(t, s, before)
	start := time.Now()
	atClose := s.raft.AppliedIndex()
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close hangs with framed calls in flight")
	}
	took := time.Since(start)
	if after := s.raft.AppliedIndex() - atClose; after > 10 {
		t.Errorf("the framed Unpin went on for %d raft rounds after Close began", after)
	}
	if took > 3*time.Second {
		t.Errorf("Close took %v with framed calls in flight", took)
	}
	// Do retries the Unavailable of the cut call until its context ends.
	select {
	case err := <-unpinDone:
		if err == nil {
			t.Errorf("the Unpin cut by Close succeeded")
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the framed Unpin did not end after Close")
	}
	close(stopLoops)
	wg.Wait()
	conn.Close()
	var left []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if left = review10FramedGoroutines(); len(left) == 0 {
			return
		}
	}
	t.Fatalf("%d framed goroutines left after Close and the client's Close:\n%s", len(left), strings.Join(left, "\n\n"))
}

// TestReview10CloseAnswersApplyQueuedBehindBusyRaft: with BatchApplyCh,
// raft.Apply queues a proposal in a buffered channel when the raft main
// loop is not taking them (here it waits to hand committed entries to an
// FSM that is held busy; a stalled log disk does the same), where before
// it waited at the channel for at most its timeout (the call's deadline)
// and then answered ErrEnqueueTimeout. Raft never answers what is still in
// that buffer when it shuts down. So a handler whose apply queued there
// outlives its deadline, Close's grace and raft's shutdown: Close returns
// "handlers still waiting on raft", grpc.Stop (WaitForHandlers) and with
// it Serve never return, and the handler's goroutine leaks.
func TestReview10CloseAnswersApplyQueuedBehindBusyRaft(t *testing.T) {
	cfg := Config{ID: "m0", Dir: t.TempDir()}
	fastTimings(&cfg)
	_, tr := raft.NewInmemTransport("")
	cfg.Transport = tr
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Advertise = inner.Addr().String()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(inner) }()
	closed := make(chan error, 1)
	closing, gotClosed := false, false
	defer func() {
		if !closing {
			go func() { closed <- s.Close() }()
		}
		if !gotClosed {
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
			}
		}
		select {
		case <-served:
		case <-time.After(3 * time.Second):
			t.Errorf("Serve did not return after Close")
		}
	}()
	waitFor(t, 10*time.Second, "leader", func() error {
		if !s.IsLeader() {
			return errors.New("not yet")
		}
		return nil
	})
	cmd := func() *pb.Command {
		return &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{"none"}, OnlyExpired: true}}}
	}
	s.fsm.mu.Lock()
	locked := true
	defer func() {
		if locked {
			s.fsm.mu.Unlock()
		}
	}()
	// Commit entries one at a time until raft's main loop stops taking
	// proposals: the FSM holds one batch, its channel 128 more, and the
	// loop then waits to hand over the next. Nothing waits for these
	// entries' futures (raft drops committed entries at shutdown, and
	// never answers those, as before).
	stuck := false
	for range 300 {
		before := s.raft.CommitIndex()
		c := cmd()
		c.NowUnixNano = time.Now().UnixNano()
		data, err := proto.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.raft.Apply(data, 200*time.Millisecond)
		deadline := time.Now().Add(time.Second)
		for s.raft.CommitIndex() <= before && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if s.raft.CommitIndex() <= before {
			stuck = true
			break
		}
	}
	if !stuck {
		t.Fatal("raft's main loop kept committing with the FSM held")
	}
	// A call with a deadline: its handler's apply must end by it.
	gc, err := grpc.NewClient(cfg.Advertise, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer gc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = pb.NewRegistryClient(gc).Leave(ctx, &pb.HeartbeatRequest{Node: "none", Epoch: 1})
	t.Logf("Leave with a 300 ms deadline: %v", err)

	start := time.Now()
	closing = true
	go func() { closed <- s.Close() }()
	// Close's grace passes (the FSM is held); once it shuts raft down,
	// let the FSM go, so raft's shutdown can finish.
	for s.raft.State() != raft.Shutdown && time.Since(start) < 10*time.Second {
		time.Sleep(5 * time.Millisecond)
	}
	s.fsm.mu.Unlock()
	locked = false
	select {
	case err := <-closed:
		gotClosed = true
		if err != nil {
			t.Errorf("Close after %v: %v", time.Since(start).Round(time.Millisecond), err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Close hangs")
	}
}
