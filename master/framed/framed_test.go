package framed

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// ---------------------------------------------------------------------------
// Harness: a small Master and Admin, served by a grpc.Server and a framed
// Server on one port (Split), and framed Clients whose fallback is a real
// grpc.ClientConn that counts what goes through it.

// testMaster answers List by echoing its prefix and limit (so concurrent
// calls can check they got their own answer) and Exists by whether each key
// starts with "y"; either can be replaced per test.
type testMaster struct {
	pb.UnimplementedMasterServer
	list   func(context.Context, *pb.ListRequest) (*pb.ListResponse, error)
	exists func(context.Context, *pb.KeysRequest) (*pb.ExistsResponse, error)
}

func (m *testMaster) List(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
	if m.list != nil {
		return m.list(ctx, req)
	}
	return echo(req), nil
}

func echo(req *pb.ListRequest) *pb.ListResponse {
	return &pb.ListResponse{Objects: []*pb.ObjectInfo{{Key: req.Prefix, Size: uint64(req.Limit)}}}
}

func (m *testMaster) Exists(ctx context.Context, req *pb.KeysRequest) (*pb.ExistsResponse, error) {
	if m.exists != nil {
		return m.exists(ctx, req)
	}
	out := &pb.ExistsResponse{}
	for _, k := range req.Keys {
		out.Exists = append(out.Exists, strings.HasPrefix(k, "y"))
	}
	return out, nil
}

// testAdmin streams three DrainProgress messages and a last one, Done.
type testAdmin struct {
	pb.UnimplementedAdminServer
}

func (testAdmin) Drain(req *pb.DrainRequest, s grpc.ServerStreamingServer[pb.DrainProgress]) error {
	for i := 3; i >= 1; i-- {
		if err := s.Send(&pb.DrainProgress{ObjectsLeft: uint64(i)}); err != nil {
			return err
		}
	}
	return s.Send(&pb.DrainProgress{Done: true})
}

type testServer struct {
	addr   string
	grpc   *grpc.Server
	framed *Server
	done   chan struct{}
	once   sync.Once
}

// startServer serves m (and testAdmin) on addr ("127.0.0.1:0" for a new
// port) over gRPC and framed, through intercept (nil: none) on both.
func startServer(t *testing.T, addr string, m pb.MasterServer, intercept grpc.UnaryServerInterceptor) *testServer {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	var opts []grpc.ServerOption
	if intercept != nil {
		opts = append(opts, grpc.UnaryInterceptor(intercept))
	}
	opts = append(opts, grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20))
	s := &testServer{addr: ln.Addr().String(), grpc: grpc.NewServer(opts...), framed: NewServer(intercept, nil), done: make(chan struct{})}
	for _, r := range []grpc.ServiceRegistrar{s.grpc, s.framed} {
		pb.RegisterMasterServer(r, m)
		pb.RegisterAdminServer(r, testAdmin{})
	}
	split := s.framed.Split(ln)
	go func() {
		defer close(s.done)
		_ = s.grpc.Serve(split)
	}()
	t.Cleanup(s.stop)
	return s
}

func (s *testServer) stop() {
	s.once.Do(func() {
		s.grpc.Stop()
		s.framed.Stop()
		<-s.done
	})
}

// countingConn is a fallback that counts the calls and streams it carries.
type countingConn struct {
	cc      grpc.ClientConnInterface
	invokes atomic.Int64
	streams atomic.Int64
}

func (c *countingConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	c.invokes.Add(1)
	return c.cc.Invoke(ctx, method, args, reply, opts...)
}

func (c *countingConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	c.streams.Add(1)
	return c.cc.NewStream(ctx, desc, method, opts...)
}

func grpcConn(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// newClient returns a framed client of addr and its counting fallback.
func newClient(t *testing.T, addr string) (*Client, *countingConn) {
	t.Helper()
	fb := &countingConn{cc: grpcConn(t, addr)}
	c := NewClient(addr, fb, Credentials{})
	t.Cleanup(func() { _ = c.Close() })
	return c, fb
}

// failingConn is a fallback that must not be used.
type failingConn struct{ used atomic.Int64 }

func (f *failingConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	f.used.Add(1)
	return status.Error(codes.FailedPrecondition, "fallback used")
}

func (f *failingConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	f.used.Add(1)
	return nil, status.Error(codes.FailedPrecondition, "fallback used")
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func list(ctx context.Context, cc grpc.ClientConnInterface, prefix string, opts ...grpc.CallOption) (*pb.ListResponse, error) {
	return pb.NewMasterClient(cc).List(ctx, &pb.ListRequest{Prefix: prefix}, opts...)
}

func wantEcho(t *testing.T, r *pb.ListResponse, err error, prefix string) {
	t.Helper()
	if err != nil {
		t.Fatalf("List(%.40q): %v", prefix, err)
	}
	if len(r.Objects) != 1 || r.Objects[0].Key != prefix {
		t.Fatalf("List(%.40q) answered %.80v", prefix, r)
	}
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// liveConn is the client's current framed connection, nil if none.
func liveConn(c *Client) *clientConn {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.conn != nil && c.mu.conn.live() {
		return c.mu.conn
	}
	return nil
}

func pendingCalls(cc *clientConn) int {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return len(cc.mu.pending)
}

// framedGoroutines is the stacks of the goroutines running this package's
// server or client code.
func framedGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, f := range []string{"framed.(*Server)", "framed.(*clientConn)", "framed.(*Client)", "framed.(*splitListener)"} {
			if strings.Contains(g, f) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}

func waitNoFramedGoroutines(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		gs := framedGoroutines()
		if len(gs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines of package framed left:\n%s", len(gs), strings.Join(gs, "\n\n"))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// Unary calls.

func TestUnaryRoundTrip(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c, fb := newClient(t, s.addr)
	ctx := testCtx(t)
	for i := range 3 {
		r, err := list(ctx, c, fmt.Sprintf("key-%d", i))
		wantEcho(t, r, err, fmt.Sprintf("key-%d", i))
	}
	ex, err := pb.NewMasterClient(c).Exists(ctx, &pb.KeysRequest{Keys: []string{"yes", "no", "y"}})
	if err != nil || len(ex.Exists) != 3 || !ex.Exists[0] || ex.Exists[1] || !ex.Exists[2] {
		t.Fatalf("Exists = %v, %v", ex, err)
	}
	// An empty request and an empty reply.
	emptyCalls := &testMaster{list: func(context.Context, *pb.ListRequest) (*pb.ListResponse, error) { return &pb.ListResponse{}, nil }}
	s2 := startServer(t, "127.0.0.1:0", emptyCalls, nil)
	c2, fb2 := newClient(t, s2.addr)
	r, err := pb.NewMasterClient(c2).List(ctx, &pb.ListRequest{})
	if err != nil || len(r.Objects) != 0 {
		t.Fatalf("empty List = %v, %v", r, err)
	}
	if n := fb.invokes.Load() + fb.streams.Load() + fb2.invokes.Load(); n != 0 {
		t.Fatalf("%d calls took the fallback, want all framed", n)
	}
	if liveConn(c) == nil {
		t.Fatal("no live framed connection after framed calls")
	}
}

func TestStatusPreserved(t *testing.T) {
	m := &testMaster{list: func(_ context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		var code codes.Code
		if _, err := fmt.Sscan(req.Prefix, &code); err != nil {
			return nil, err
		}
		return nil, status.Errorf(code, "failed with %v: ünïcode, %%d, \x00 and a long tail %s", code, strings.Repeat("x", 300))
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c, fb := newClient(t, s.addr)
	g := grpcConn(t, s.addr)
	ctx := testCtx(t)
	for code := codes.Canceled; code <= codes.Unauthenticated; code++ {
		_, ferr := list(ctx, c, fmt.Sprint(uint32(code)))
		_, gerr := list(ctx, g, fmt.Sprint(uint32(code)))
		fs, gs := status.Convert(ferr), status.Convert(gerr)
		if fs.Code() != code || fs.Code() != gs.Code() || fs.Message() != gs.Message() {
			t.Errorf("code %v: framed %v %q, gRPC %v %q", code, fs.Code(), fs.Message(), gs.Code(), gs.Message())
		}
	}
	if fb.invokes.Load() != 0 {
		t.Fatal("framed calls took the fallback")
	}
}

func TestHandlerSeesDeadlinePeerAndTrailer(t *testing.T) {
	type seen struct {
		deadline time.Time
		hasDL    bool
		peer     *peer.Peer
		method   string
	}
	got := make(chan seen, 1)
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		var sn seen
		sn.deadline, sn.hasDL = ctx.Deadline()
		sn.peer, _ = peer.FromContext(ctx)
		sn.method, _ = grpc.Method(ctx)
		got <- sn
		if err := grpc.SetTrailer(ctx, metadata.Pairs("tidepool-leader", "10.0.0.1:7000", "multi", "a")); err != nil {
			return nil, err
		}
		if err := grpc.SetTrailer(ctx, metadata.Pairs("multi", "b", "blob-bin", "\x00\xff")); err != nil {
			return nil, err
		}
		if err := grpc.SetHeader(ctx, metadata.Pairs("h", "1")); err != nil {
			return nil, err
		}
		if req.Prefix == "fail" {
			return nil, status.Error(codes.Unavailable, "not the leader")
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c, _ := newClient(t, s.addr)

	check := func(prefix string, wantCode codes.Code) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		want, _ := ctx.Deadline()
		var trailer, header metadata.MD
		_, err := list(ctx, c, prefix, grpc.Trailer(&trailer), grpc.Header(&header))
		if status.Code(err) != wantCode {
			t.Fatalf("List(%q) = %v, want %v", prefix, err, wantCode)
		}
		sn := <-got
		if !sn.hasDL {
			t.Fatal("the handler saw no deadline")
		}
		// The server's deadline is its arrival plus the timeout left
		// when the request was sent: a little after the caller's.
		if d := sn.deadline.Sub(want); d < -50*time.Millisecond || d > 500*time.Millisecond {
			t.Fatalf("handler deadline %v off the caller's by %v", sn.deadline, d)
		}
		if sn.method != pb.Master_List_FullMethodName {
			t.Fatalf("grpc.Method = %q", sn.method)
		}
		cc := liveConn(c)
		if cc == nil {
			t.Fatal("no live framed connection")
		}
		if sn.peer == nil || sn.peer.Addr.String() != cc.conn.LocalAddr().String() {
			t.Fatalf("handler peer %v, want the client's address %v", sn.peer, cc.conn.LocalAddr())
		}
		if sn.peer.LocalAddr == nil || sn.peer.LocalAddr.String() != s.addr {
			t.Fatalf("handler peer local address %v, want %v", sn.peer.LocalAddr, s.addr)
		}
		if v := trailer.Get("tidepool-leader"); len(v) != 1 || v[0] != "10.0.0.1:7000" {
			t.Fatalf("trailer = %v", trailer)
		}
		if v := trailer.Get("multi"); len(v) != 2 || v[0] != "a" || v[1] != "b" {
			t.Fatalf("trailer multi = %v", v)
		}
		if v := trailer.Get("blob-bin"); len(v) != 1 || v[0] != "\x00\xff" {
			t.Fatalf("trailer blob-bin = %q", v)
		}
		if header == nil {
			t.Fatal("the header call option was left nil")
		}
	}
	check("ok", codes.OK)
	check("fail", codes.Unavailable) // as a follower refuses, naming the leader

	// No deadline: the handler sees none.
	var trailer metadata.MD
	if _, err := list(context.Background(), c, "ok", grpc.Trailer(&trailer)); err != nil {
		t.Fatal(err)
	}
	if sn := <-got; sn.hasDL {
		t.Fatalf("handler saw deadline %v for a call without one", sn.deadline)
	}
}

func TestDeadlines(t *testing.T) {
	entered := make(chan struct{}, 1)
	handlerErr := make(chan error, 1)
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "block" {
			entered <- struct{}{}
			<-ctx.Done()
			handlerErr <- ctx.Err()
			// A status: a bare ctx.Err() would reach the caller as
			// Unknown when the server's deadline fires first (see
			// TestReviewContextErrorFromHandler).
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c, _ := newClient(t, s.addr)
	// A deadline already past fails at once, sending nothing.
	past, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if _, err := list(past, c, "x"); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("past deadline: %v", err)
	}
	// A deadline that passes while the handler runs ends both ends.
	ctx, cancel2 := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel2()
	start := time.Now()
	if _, err := list(ctx, c, "block"); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("deadline: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("deadline of 200ms returned after %v", d)
	}
	<-entered
	select {
	case err := <-handlerErr:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("handler context ended with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end at the deadline")
	}
	r, err := list(testCtx(t), c, "after")
	wantEcho(t, r, err, "after")
}

func TestInterceptorFullMethod(t *testing.T) {
	var mu sync.Mutex
	var methods []string
	intercept := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		mu.Lock()
		methods = append(methods, info.FullMethod)
		mu.Unlock()
		if r, ok := req.(*pb.ListRequest); ok && r.Prefix == "deny" {
			return nil, status.Error(codes.PermissionDenied, "denied by the interceptor")
		}
		resp, err := h(ctx, req)
		if r, ok := resp.(*pb.ListResponse); ok && err == nil {
			r.Truncated = true // the interceptor's say on the reply
		}
		return resp, err
	}
	s := startServer(t, "127.0.0.1:0", &testMaster{}, intercept)
	c, fb := newClient(t, s.addr)
	ctx := testCtx(t)
	r, err := list(ctx, c, "a")
	wantEcho(t, r, err, "a")
	if !r.Truncated {
		t.Fatal("the interceptor's change to the reply did not arrive")
	}
	if _, err := list(ctx, c, "deny"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("denied call: %v", err)
	}
	if _, err := pb.NewMasterClient(c).Exists(ctx, &pb.KeysRequest{Keys: []string{"y"}}); err != nil {
		t.Fatal(err)
	}
	// Unimplemented methods of a registered service still pass it.
	if _, err := pb.NewMasterClient(c).Status(ctx, &pb.StatusRequest{}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("Status: %v", err)
	}
	mu.Lock()
	got := append([]string(nil), methods...)
	mu.Unlock()
	want := []string{pb.Master_List_FullMethodName, pb.Master_List_FullMethodName, pb.Master_Exists_FullMethodName, pb.Master_Status_FullMethodName}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("interceptor saw %v, want %v", got, want)
	}
	if fb.invokes.Load() != 0 {
		t.Fatal("calls took the fallback")
	}
}

func TestUnknownMethod(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c, fb := newClient(t, s.addr)
	ctx := testCtx(t)
	var reply pb.ListResponse
	for _, m := range []string{"/tidepool.v1.Nothing/List", "/tidepool.v1.Master/NoSuchMethod", "", "no slash"} {
		err := c.Invoke(ctx, m, &pb.ListRequest{}, &reply)
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("Invoke(%q) = %v, want Unimplemented", m, err)
		}
	}
	// The connection still serves.
	r, err := list(ctx, c, "still")
	wantEcho(t, r, err, "still")
	if fb.invokes.Load() != 0 {
		t.Fatal("calls took the fallback")
	}
	// A method name longer than the wire allows is refused locally.
	if err := c.Invoke(ctx, "/"+strings.Repeat("m", maxMethod), &pb.ListRequest{}, &reply); status.Code(err) != codes.Internal {
		t.Fatalf("long method: %v", err)
	}
	// Arguments and replies that are not protobuf messages.
	if err := c.Invoke(ctx, pb.Master_List_FullMethodName, "not a message", &reply); status.Code(err) != codes.Internal {
		t.Fatalf("non-proto args: %v", err)
	}
	var notMsg struct{}
	if err := c.Invoke(ctx, pb.Master_List_FullMethodName, &pb.ListRequest{}, &notMsg); status.Code(err) != codes.Internal {
		t.Fatalf("non-proto reply: %v", err)
	}
	r, err = list(ctx, c, "after")
	wantEcho(t, r, err, "after")
}

// ---------------------------------------------------------------------------
// Fallback and coexistence with gRPC.

func TestGRPCOnlyServerFallback(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterMasterServer(gs, &testMaster{})
	pb.RegisterAdminServer(gs, testAdmin{})
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(ln) }()
	t.Cleanup(func() { gs.Stop(); <-done })

	c, fb := newClient(t, ln.Addr().String())
	ctx := testCtx(t)
	start := time.Now()
	r, err := list(ctx, c, "a")
	wantEcho(t, r, err, "a")
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("the first call through the fallback took %v", d)
	}
	for i := range 5 {
		r, err := list(ctx, c, fmt.Sprint(i))
		wantEcho(t, r, err, fmt.Sprint(i))
	}
	if n := fb.invokes.Load(); n != 6 {
		t.Fatalf("fallback carried %d calls, want 6", n)
	}
	c.mu.Lock()
	unframed := c.mu.unframed
	c.mu.Unlock()
	if time.Until(unframed) < unframedFor/2 {
		t.Fatalf("client not marked unframed (until %v)", unframed)
	}
	if liveConn(c) != nil {
		t.Fatal("client holds a framed connection to a gRPC-only server")
	}
	// Trailers and statuses come through the fallback as well.
	var trailer metadata.MD
	if _, err := pb.NewMasterClient(c).Status(ctx, &pb.StatusRequest{}, grpc.Trailer(&trailer)); status.Code(err) != codes.Unimplemented {
		t.Fatalf("Status over the fallback: %v", err)
	}
}

func TestStreamsUseFallback(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c, fb := newClient(t, s.addr)
	ctx := testCtx(t)
	// A unary call first, so the framed connection is up.
	r, err := list(ctx, c, "a")
	wantEcho(t, r, err, "a")
	st, err := pb.NewAdminClient(c).Drain(ctx, &pb.DrainRequest{Node: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for {
		p, err := st.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if p.Done {
			got = append(got, 0)
		} else {
			got = append(got, p.ObjectsLeft)
		}
	}
	if fmt.Sprint(got) != "[3 2 1 0]" {
		t.Fatalf("Drain streamed %v", got)
	}
	if fb.streams.Load() != 1 || fb.invokes.Load() != 0 {
		t.Fatalf("fallback carried %d streams and %d calls, want 1 and 0", fb.streams.Load(), fb.invokes.Load())
	}
	// The framed connection is untouched.
	r, err = list(ctx, c, "b")
	wantEcho(t, r, err, "b")
}

func TestGRPCClientsThroughSplit(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	g := grpcConn(t, s.addr)
	c, _ := newClient(t, s.addr)
	ctx := testCtx(t)
	inParallel(t, 40, func(i int) error {
		cc, name := grpc.ClientConnInterface(g), "gRPC"
		if i%2 == 1 {
			cc, name = c, "framed"
		}
		p := fmt.Sprint(name, i)
		r, err := list(ctx, cc, p)
		if err == nil && r.Objects[0].Key != p {
			err = fmt.Errorf("%s got %v", name, r)
		}
		return err
	})
	st, err := pb.NewAdminClient(g).Drain(ctx, &pb.DrainRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for ; ; n++ {
		if _, err := st.Recv(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if n != 4 {
		t.Fatalf("gRPC Drain streamed %d messages", n)
	}
	// A second gRPC connection, after framed ones exist.
	g2 := grpcConn(t, s.addr)
	r, err := list(ctx, g2, "g2")
	wantEcho(t, r, err, "g2")
}

// ---------------------------------------------------------------------------
// Cancellation, Stop, Close, redial.

func TestCancelIsPromptAndConnStays(t *testing.T) {
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "block" {
			entered <- struct{}{}
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c, fb := newClient(t, s.addr)
	r, err := list(testCtx(t), c, "warm")
	wantEcho(t, r, err, "warm")
	cc := liveConn(c)

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := list(ctx, c, "block")
		errc <- err
	}()
	<-entered
	cancel()
	select {
	case err := <-errc:
		if status.Code(err) != codes.Canceled {
			t.Fatalf("cancelled call: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a cancelled call did not return")
	}
	if n := pendingCalls(cc); n != 0 {
		t.Fatalf("%d calls still pending after the cancel", n)
	}
	r, err = list(testCtx(t), c, "after")
	wantEcho(t, r, err, "after")
	if liveConn(c) != cc {
		t.Fatal("the cancel replaced the connection")
	}
	// The late answer of the cancelled call is dropped; the connection
	// serves on.
	close(release)
	for i := range 10 {
		r, err := list(testCtx(t), c, fmt.Sprint(i))
		wantEcho(t, r, err, fmt.Sprint(i))
	}
	if liveConn(c) != cc || fb.invokes.Load() != 0 {
		t.Fatal("the connection changed or calls fell back")
	}
	// A cancel while waiting for another call's dial.
	c2 := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c2.Close()
	c2.mu.Lock()
	c2.mu.dialing = &dialAttempt{done: make(chan struct{})} // a dial that never ends
	c2.mu.Unlock()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := list(ctx2, c2, "x"); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("call waiting for a dial: %v", err)
	}
}

func TestStopFailsInFlightAndWaitsForHandlers(t *testing.T) {
	entered := make(chan struct{}, 8)
	release := make(chan struct{})
	handlerDone := make(chan error, 8)
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix != "block" {
			return echo(req), nil
		}
		entered <- struct{}{}
		<-ctx.Done() // Stop cancels it
		<-release    // and still waits for it to return
		handlerDone <- ctx.Err()
		return nil, ctx.Err()
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	const n = 4
	errc := make(chan error, n)
	for range n {
		go func() {
			_, err := list(testCtx(t), c, "block")
			errc <- err
		}()
	}
	for range n {
		<-entered
	}
	stopped := make(chan struct{})
	go func() {
		s.framed.Stop()
		close(stopped)
	}()
	for range n {
		select {
		case err := <-errc:
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("in-flight call at Stop: %v, want Unavailable", err)
			}
		case <-time.After(3 * time.Second):
			t.Fatal("in-flight calls did not fail at Stop")
		}
	}
	select {
	case <-stopped:
		t.Fatal("Stop returned while handlers still ran")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case <-stopped:
	case <-time.After(3 * time.Second):
		t.Fatal("Stop did not return after the handlers did")
	}
	for range n {
		if err := <-handlerDone; !errors.Is(err, context.Canceled) {
			t.Fatalf("handler context ended with %v", err)
		}
	}
	// After Stop: new calls fail, Split of a new listener is closed.
	if _, err := list(testCtx(t), c, "x"); status.Code(err) != codes.Unavailable {
		t.Fatalf("call after Stop: %v", err)
	}
	s.stop()
	_ = c.Close()
	waitNoFramedGoroutines(t)
}

func TestStopLeavesNoGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fs := NewServer(nil, nil)
	pb.RegisterMasterServer(fs, &testMaster{})
	split := fs.Split(ln)
	// A gRPC-preface connection nobody accepts, one that sent half a
	// preface, and one that sent nothing: Stop must end all of them.
	var raws []net.Conn
	for _, first := range []string{http2Preface, preface[:10], ""} {
		conn, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		raws = append(raws, conn)
		if _, err := io.WriteString(conn, first); err != nil {
			t.Fatal(err)
		}
	}
	var clients []*Client
	for range 3 {
		c := NewClient(ln.Addr().String(), &failingConn{}, Credentials{})
		clients = append(clients, c)
		r, err := list(testCtx(t), c, "x")
		wantEcho(t, r, err, "x")
	}
	waitFor(t, 2*time.Second, "connections in sniff", func() bool {
		fs.mu.Lock()
		defer fs.mu.Unlock()
		return len(fs.mu.sniffing) == 2 // the HTTP/2 one waits in Split's channel
	})
	fs.Stop()
	if _, err := split.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("split Accept after Stop: %v", err)
	}
	for _, conn := range raws {
		_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
		if _, err := conn.Read(make([]byte, 64)); err == nil || isTimeout(err) {
			t.Fatalf("raw connection not closed by Stop: %v", err)
		}
		_ = conn.Close()
	}
	for _, c := range clients {
		if _, err := list(testCtx(t), c, "x"); status.Code(err) != codes.Unavailable {
			t.Fatalf("call after Stop: %v", err)
		}
		_ = c.Close()
	}
	waitNoFramedGoroutines(t)
	waitFor(t, 5*time.Second, "goroutines back to the count before", func() bool { return runtime.NumGoroutine() <= before })
	// Split after Stop hands back a closed listener and closes ln.
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Split(ln2).Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept of Split after Stop: %v", err)
	}
	if _, err := ln2.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("listener given to Split after Stop not closed: %v", err)
	}
	fs.Stop() // twice is fine
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestClientClose(t *testing.T) {
	entered := make(chan struct{}, 1)
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "block" {
			entered <- struct{}{}
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	// Close of a client never used.
	if err := NewClient(s.addr, &failingConn{}, Credentials{}).Close(); err != nil {
		t.Fatal(err)
	}
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	r, err := list(testCtx(t), c, "a")
	wantEcho(t, r, err, "a")
	errc := make(chan error, 1)
	go func() {
		_, err := list(testCtx(t), c, "block")
		errc <- err
	}()
	<-entered
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("in-flight call succeeded across Close")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("in-flight call did not end at Close")
	}
	if _, err := list(testCtx(t), c, "b"); status.Code(err) != codes.Canceled {
		t.Fatalf("call after Close: %v, want Canceled", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	// The server drops the connection.
	waitFor(t, 3*time.Second, "the server to drop the closed client's connection", func() bool {
		s.framed.mu.Lock()
		defer s.framed.mu.Unlock()
		return len(s.framed.mu.conns) == 0
	})
}

func TestRedialAfterServerRestart(t *testing.T) {
	m := &testMaster{}
	s := startServer(t, "127.0.0.1:0", m, nil)
	addr := s.addr
	fb := &failingConn{}
	c := NewClient(addr, fb, Credentials{})
	defer c.Close()
	r, err := list(testCtx(t), c, "one")
	wantEcho(t, r, err, "one")
	first := liveConn(c)

	s.stop()
	waitFor(t, 3*time.Second, "the client to see the connection close", func() bool { return liveConn(c) == nil })
	// While down: Unavailable, not the fallback.
	if _, err := list(testCtx(t), c, "down"); status.Code(err) != codes.Unavailable {
		t.Fatalf("call while the server is down: %v", err)
	}
	s2 := startServer(t, addr, m, nil)
	r, err = list(testCtx(t), c, "two")
	wantEcho(t, r, err, "two")
	if cc := liveConn(c); cc == nil || cc == first {
		t.Fatal("no new connection after the restart")
	}
	// A kill (the server's side of the connection closes under a call).
	s2.framed.mu.Lock()
	for sc := range s2.framed.mu.conns {
		_ = sc.conn.Close()
	}
	s2.framed.mu.Unlock()
	waitFor(t, 3*time.Second, "the client to see the connection close", func() bool { return liveConn(c) == nil })
	r, err = list(testCtx(t), c, "three")
	wantEcho(t, r, err, "three")
	if fb.used.Load() != 0 {
		t.Fatal("calls took the fallback")
	}
}

// ---------------------------------------------------------------------------
// Hostile clients.

// rawConn dials addr and, if handshake, exchanges the preface.
func rawConn(t *testing.T, addr string, handshake bool) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if handshake {
		if _, err := io.WriteString(conn, preface); err != nil {
			t.Fatal(err)
		}
		head := make([]byte, len(preface))
		_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
		if _, err := io.ReadFull(conn, head); err != nil || string(head) != preface {
			t.Fatalf("preface answer %q, %v", head, err)
		}
		_ = conn.SetReadDeadline(time.Time{})
	}
	return conn
}

// wantClosed checks that the server closes conn soon, sending nothing.
func wantClosed(t *testing.T, conn net.Conn) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, err := conn.Read(make([]byte, 64))
	if err == nil || isTimeout(err) {
		t.Fatalf("connection still open (read %d, %v)", n, err)
	}
}

func requestFrame(id uint64, timeout time.Duration, method string, msg []byte) []byte {
	return finish(append(appendRequestHead(nil, id, timeout, method), msg...))
}

func TestServerClosesGarbage(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()

	t.Run("not a preface", func(t *testing.T) {
		conn := rawConn(t, s.addr, false)
		if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		wantClosed(t, conn)
	})
	t.Run("preface then close", func(t *testing.T) {
		conn := rawConn(t, s.addr, true)
		_ = conn.Close()
	})
	t.Run("frame over maxFrame", func(t *testing.T) {
		conn := rawConn(t, s.addr, true)
		if _, err := conn.Write(binary.BigEndian.AppendUint32(nil, maxFrame+1)); err != nil {
			t.Fatal(err)
		}
		wantClosed(t, conn)
	})
	t.Run("frame of 2^32-1 bytes", func(t *testing.T) {
		conn := rawConn(t, s.addr, true)
		if _, err := conn.Write([]byte{0xff, 0xff, 0xff, 0xff}); err != nil {
			t.Fatal(err)
		}
		wantClosed(t, conn)
	})
	msg, _ := proto.Marshal(&pb.ListRequest{Prefix: "p"})
	good := requestFrame(1, 0, pb.Master_List_FullMethodName, msg)
	bad := map[string][]byte{
		"empty frame":           finish(make([]byte, 4)),
		"short head":            finish(make([]byte, 4+requestHead-1)),
		"method past the end":   finish(binary.BigEndian.AppendUint16(make([]byte, 4+16), 100)),
		"method over maxMethod": finish(append(binary.BigEndian.AppendUint16(make([]byte, 4+16), maxMethod+1), make([]byte, maxMethod+1)...)),
		"negative timeout":      finish(append(binary.BigEndian.AppendUint16(append(make([]byte, 4+8), 0x80, 0, 0, 0, 0, 0, 0, 0), 0), msg...)),
	}
	for name, frame := range bad {
		t.Run(name, func(t *testing.T) {
			conn := rawConn(t, s.addr, true)
			// A good call first: answered.
			if _, err := conn.Write(good); err != nil {
				t.Fatal(err)
			}
			fr := newFrameReader(conn, new(bufPool))
			body, err := fr.next(3 * time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if a, err := parseAnswer(body); err != nil || a.id != 1 || a.code != codes.OK {
				t.Fatalf("answer %+v, %v", a, err)
			}
			if _, err := conn.Write(frame); err != nil {
				t.Fatal(err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
			if n, err := conn.Read(make([]byte, 64)); err == nil || isTimeout(err) {
				t.Fatalf("connection still open after %s (read %d, %v)", name, n, err)
			}
			// The server serves others.
			r, err := list(testCtx(t), c, "others")
			wantEcho(t, r, err, "others")
		})
	}
	t.Run("bad message", func(t *testing.T) {
		// A message that is not a ListRequest is the call's error only.
		conn := rawConn(t, s.addr, true)
		frames := append(requestFrame(7, time.Second, pb.Master_List_FullMethodName, []byte{0xff, 0xff, 0xff}), good...)
		if _, err := conn.Write(frames); err != nil {
			t.Fatal(err)
		}
		fr := newFrameReader(conn, new(bufPool))
		got := map[uint64]codes.Code{}
		for range 2 {
			body, err := fr.next(3 * time.Second)
			if err != nil {
				t.Fatal(err)
			}
			a, err := parseAnswer(body)
			if err != nil {
				t.Fatal(err)
			}
			got[a.id] = a.code
		}
		if got[7] != codes.Internal || got[1] != codes.OK {
			t.Fatalf("answers %v", got)
		}
	})
	t.Run("announced body then silence", func(t *testing.T) {
		conn := rawConn(t, s.addr, true)
		if _, err := conn.Write(append(binary.BigEndian.AppendUint32(nil, maxFrame), make([]byte, 100)...)); err != nil {
			t.Fatal(err)
		}
		// The others are served meanwhile.
		r, err := list(testCtx(t), c, "others")
		wantEcho(t, r, err, "others")
	})
	r, err := list(testCtx(t), c, "end")
	wantEcho(t, r, err, "end")
}

// readSizes is a net.Conn that records the largest read asked of it.
type readSizes struct {
	net.Conn
	max atomic.Int64
}

func (r *readSizes) Read(p []byte) (int, error) {
	for {
		old := r.max.Load()
		if int64(len(p)) <= old || r.max.CompareAndSwap(old, int64(len(p))) {
			break
		}
	}
	return r.Conn.Read(p)
}

func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- conn
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { _ = client.Close(); _ = server.Close() })
	return client, server
}

func TestFrameReaderLargeAnnouncedBody(t *testing.T) {
	w, r := tcpPair(t)
	rs := &readSizes{Conn: r}
	fr := newFrameReader(rs, new(bufPool))
	// maxFrame announced, 1000 bytes sent, then the peer goes away.
	if _, err := w.Write(append(binary.BigEndian.AppendUint32(nil, maxFrame), make([]byte, 1000)...)); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := fr.next(3 * time.Second)
		errc <- err
	}()
	// The reader waits for more; the largest read it asked for, which is
	// what it allocated, is a small buffer, not the announced body.
	waitFor(t, 3*time.Second, "the reader to ask for the body", func() bool { return rs.max.Load() > 40<<10 })
	_ = w.Close()
	if err := <-errc; !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("next = %v, want ErrUnexpectedEOF", err)
	}
	if m := rs.max.Load(); m > 64<<10 {
		t.Fatalf("a read of %d bytes for a body of which 1000 arrived", m)
	}
}

func TestFrameReaderGrowsBody(t *testing.T) {
	w, r := tcpPair(t)
	rs := &readSizes{Conn: r}
	fr := newFrameReader(rs, new(bufPool))
	sizes := []int{0, 1, 5, 32 << 10, 64<<10 - 1, 64 << 10, 64<<10 + 1, 300<<10 + 7, 1 << 20}
	var frames [][]byte
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range sizes {
		body := make([]byte, n)
		for i := range body {
			body[i] = byte(rng.Uint32())
		}
		frames = append(frames, body)
	}
	go func() {
		// In uneven pieces, with pauses, so the reader takes its slow path.
		for _, body := range frames {
			b := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
			b = append(b, body...)
			for len(b) > 0 {
				k := min(len(b), 1+rng.IntN(20<<10))
				if _, err := w.Write(b[:k]); err != nil {
					return
				}
				b = b[k:]
				if rng.IntN(8) == 0 {
					time.Sleep(100 * time.Microsecond)
				}
			}
		}
	}()
	for i, want := range frames {
		got, err := fr.next(3 * time.Second)
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("frame %d of %d bytes read back as %d different bytes", i, len(want), len(got))
		}
	}
	// The idle bound: nothing more comes.
	if _, err := fr.next(20 * time.Millisecond); !errors.Is(err, errIdle) {
		t.Fatalf("next on a silent connection: %v", err)
	}
}

// ---------------------------------------------------------------------------
// Hostile servers.

// fakeServer accepts connections on a new port, answers the preface and
// hands each to serve.
func fakeServer(t *testing.T, serve func(conn net.Conn, fr *frameReader)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conn.Close()
				head := make([]byte, len(preface))
				if _, err := io.ReadFull(conn, head); err != nil || string(head) != preface {
					return
				}
				if _, err := io.WriteString(conn, preface); err != nil {
					return
				}
				serve(conn, newFrameReader(conn, new(bufPool)))
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func readRequest(fr *frameReader) (request, error) {
	body, err := fr.next(5 * time.Second)
	if err != nil {
		return request{}, err
	}
	return parseRequest(body)
}

func okAnswer(id uint64, m *pb.ListResponse) []byte {
	b, _ := new(Server).marshalAnswer(id, nil, m)
	return b
}

func TestHostileServerAnswers(t *testing.T) {
	frame := func(body []byte) []byte {
		return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	}
	head := func(id uint64, code uint32, text uint32) []byte {
		b := binary.BigEndian.AppendUint64(nil, id)
		b = binary.BigEndian.AppendUint32(b, code)
		return binary.BigEndian.AppendUint32(b, text)
	}
	cases := map[string]func(id uint64) []byte{
		"short answer":         func(uint64) []byte { return frame([]byte{1, 2, 3}) },
		"empty answer":         func(uint64) []byte { return frame(nil) },
		"text past the end":    func(id uint64) []byte { return frame(append(head(id, 0, 1000), 0, 0, 0, 0)) },
		"text of 2^32-1":       func(id uint64) []byte { return frame(append(head(id, 0, 0xffffffff), 0, 0, 0, 0)) },
		"trailer past the end": func(id uint64) []byte { return frame(append(head(id, 0, 0), 0, 0, 1, 0, 'k')) },
		"trailer over max": func(id uint64) []byte {
			return frame(append(append(head(id, 0, 0), 0, 1, 0, 1), make([]byte, maxTrailer+1)...))
		},
		"trailer key past end": func(id uint64) []byte { return frame(append(head(id, 0, 0), 0, 0, 0, 4, 0, 9, 'k', 'k')) },
		"trailer half a key size": func(id uint64) []byte {
			return frame(append(head(id, 0, 0), 0, 0, 0, 1, 0))
		},
		"trailer value past end": func(id uint64) []byte {
			return frame(append(head(id, 0, 0), 0, 0, 0, 8, 0, 1, 'k', 0, 0, 0, 9, 'v'))
		},
		"frame over maxFrame": func(uint64) []byte { return binary.BigEndian.AppendUint32(nil, maxFrame+1) },
		"unknown id, then close": func(id uint64) []byte {
			return okAnswer(id+1000, &pb.ListResponse{})
		},
		"garbage": func(uint64) []byte {
			return []byte("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
		},
	}
	for name, answer := range cases {
		t.Run(name, func(t *testing.T) {
			var served atomic.Int64
			addr := fakeServer(t, func(conn net.Conn, fr *frameReader) {
				n := served.Add(1)
				for {
					req, err := readRequest(fr)
					if err != nil {
						return
					}
					if n == 1 {
						_, _ = conn.Write(answer(req.id))
						return // and close
					}
					var lr pb.ListRequest
					_ = proto.Unmarshal(req.message, &lr)
					if _, err := conn.Write(okAnswer(req.id, echo(&lr))); err != nil {
						return
					}
				}
			})
			c := NewClient(addr, &failingConn{}, Credentials{})
			defer c.Close()
			_, err := list(testCtx(t), c, "x")
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("call answered by %s: %v, want Unavailable", name, err)
			}
			// The next call redials, and works.
			waitFor(t, 3*time.Second, "the broken connection to close", func() bool { return liveConn(c) == nil })
			r, err := list(testCtx(t), c, "y")
			wantEcho(t, r, err, "y")
		})
	}
	t.Run("unknown id, then the right one", func(t *testing.T) {
		addr := fakeServer(t, func(conn net.Conn, fr *frameReader) {
			for {
				req, err := readRequest(fr)
				if err != nil {
					return
				}
				var lr pb.ListRequest
				_ = proto.Unmarshal(req.message, &lr)
				b := okAnswer(req.id^0xffff, &pb.ListResponse{Truncated: true})
				b = append(b, okAnswer(req.id, echo(&lr))...)
				if _, err := conn.Write(b); err != nil {
					return
				}
			}
		})
		c := NewClient(addr, &failingConn{}, Credentials{})
		defer c.Close()
		for i := range 5 {
			r, err := list(testCtx(t), c, fmt.Sprint(i))
			wantEcho(t, r, err, fmt.Sprint(i))
			if r.Truncated {
				t.Fatal("got the answer of an unknown id")
			}
		}
	})
	t.Run("reply that is not the message", func(t *testing.T) {
		addr := fakeServer(t, func(conn net.Conn, fr *frameReader) {
			req, err := readRequest(fr)
			if err != nil {
				return
			}
			b := finish(append(appendAnswerHead(nil, req.id, codes.OK, "", nil), 0xff, 0xff))
			_, _ = conn.Write(b)
			_, _ = readRequest(fr) // hold the connection
		})
		c := NewClient(addr, &failingConn{}, Credentials{})
		defer c.Close()
		if _, err := list(testCtx(t), c, "x"); status.Code(err) != codes.Internal {
			t.Fatalf("undecodable reply: %v", err)
		}
	})
	t.Run("server never answers the preface", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			conn, err := ln.Accept()
			if err == nil {
				_, _ = io.Copy(io.Discard, conn) // until the client goes
				_ = conn.Close()
			}
		}()
		c := NewClient(ln.Addr().String(), &failingConn{}, Credentials{})
		defer c.Close()
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			time.Sleep(50 * time.Millisecond)
			cancel()
		}()
		if _, err := list(ctx, c, "x"); status.Code(err) != codes.Canceled {
			t.Fatalf("cancelled during the preface: %v", err)
		}
		c.mu.Lock()
		unframed := c.mu.unframed
		c.mu.Unlock()
		if !unframed.IsZero() {
			t.Fatal("a cancelled dial marked the server unframed")
		}
	})
}

// ---------------------------------------------------------------------------
// Load and sizes.

func TestConcurrentCallsPairAnswers(t *testing.T) {
	var handled atomic.Int64
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		handled.Add(1)
		if req.Limit%7 == 0 {
			runtime.Gosched() // some answers overtake others
		}
		if req.Limit%13 == 0 {
			return nil, status.Errorf(codes.NotFound, "%s", req.Prefix)
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c, fb := newClient(t, s.addr)
	const workers, calls = 64, 200
	ctx := testCtx(t)
	mc := pb.NewMasterClient(c)
	var wg sync.WaitGroup
	var failures atomic.Int64
	var firstErr atomic.Value
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range calls {
				prefix := fmt.Sprintf("w%d-c%d", w, i)
				limit := uint32(w*calls + i)
				r, err := mc.List(ctx, &pb.ListRequest{Prefix: prefix, Limit: limit})
				var bad error
				switch {
				case limit%13 == 0:
					if st := status.Convert(err); st.Code() != codes.NotFound || st.Message() != prefix {
						bad = fmt.Errorf("call %s: %v, want NotFound %q", prefix, err, prefix)
					}
				case err != nil:
					bad = fmt.Errorf("call %s: %v", prefix, err)
				case len(r.Objects) != 1 || r.Objects[0].Key != prefix || r.Objects[0].Size != uint64(limit):
					bad = fmt.Errorf("call %s got %v", prefix, r)
				}
				if bad != nil {
					failures.Add(1)
					firstErr.CompareAndSwap(nil, bad)
				}
			}
		}()
	}
	wg.Wait()
	if n := failures.Load(); n > 0 {
		t.Fatalf("%d calls failed or got another's answer; first: %v", n, firstErr.Load())
	}
	if handled.Load() != workers*calls || fb.invokes.Load() != 0 {
		t.Fatalf("handled %d, fallback %d", handled.Load(), fb.invokes.Load())
	}
	if cc := liveConn(c); cc == nil || pendingCalls(cc) != 0 {
		t.Fatal("no live connection, or calls left pending")
	}
}

// Frames of many sizes, across the buffer pool's tiers and past them, from
// several clients at once: each call gets its own bytes back intact (a
// buffer reused while still in use would show here, or to -race).
func TestConcurrentMixedSizesIntact(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	const clients, workers, calls = 3, 6, 20
	var cs []*Client
	for range clients {
		c := NewClient(s.addr, &failingConn{}, Credentials{})
		defer c.Close()
		cs = append(cs, c)
	}
	var wg sync.WaitGroup
	var failures atomic.Int64
	var firstErr atomic.Value
	for w := range clients * workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := cs[w%clients]
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range calls {
				n := 1 + rng.IntN(1<<rng.IntN(20)) // 1 B to 512 KiB, most small
				b := make([]byte, n)
				for j := range b {
					b[j] = byte('a' + (w+i+j)%26)
				}
				p := string(b)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				r, err := pb.NewMasterClient(c).List(ctx, &pb.ListRequest{Prefix: p, Limit: uint32(i)})
				cancel()
				if err == nil && (len(r.Objects) != 1 || r.Objects[0].Key != p || r.Objects[0].Size != uint64(i)) {
					err = fmt.Errorf("worker %d call %d: %d bytes came back different", w, i, n)
				}
				if err != nil {
					failures.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	wg.Wait()
	if n := failures.Load(); n > 0 {
		t.Fatalf("%d calls failed; first: %v", n, firstErr.Load())
	}
	s.framed.mu.Lock()
	n := len(s.framed.mu.conns)
	s.framed.mu.Unlock()
	if n != clients {
		t.Fatalf("%d server connections for %d clients", n, clients)
	}
}

func TestConcurrentFirstCallsShareOneDial(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	inParallel(t, 32, func(i int) error {
		r, err := list(testCtx(t), c, fmt.Sprint(i))
		if err == nil && r.Objects[0].Key != fmt.Sprint(i) {
			err = fmt.Errorf("got %v", r)
		}
		return err
	})
	s.framed.mu.Lock()
	n := len(s.framed.mu.conns)
	s.framed.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d framed connections for one client, want 1", n)
	}
}

func TestLargeMessages(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c, fb := newClient(t, s.addr)
	// Tens of MiB under the race detector on two busy cores: more than testCtx's 5 s.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, n := range []int{32<<10 - 1, 64 << 10, 1<<20 + 3, 6 << 20} {
		p := strings.Repeat(string(rune('a'+n%26)), n)
		r, err := list(ctx, c, p)
		wantEcho(t, r, err, p)
	}
	// Concurrent big ones share the connection with small ones.
	inParallel(t, 16, func(i int) error {
		p := fmt.Sprint(i)
		if i%4 == 0 {
			p += strings.Repeat("z", 2<<20)
		}
		r, err := list(ctx, c, p)
		if err == nil && r.Objects[0].Key != p {
			err = errors.New("wrong answer")
		}
		return err
	})
	cc := liveConn(c)
	// Over MaxMessage: refused here, the connection untouched.
	_, err := list(ctx, c, strings.Repeat("x", MaxMessage+1))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("request over MaxMessage: %v", err)
	}
	r, err := list(ctx, c, "small")
	wantEcho(t, r, err, "small")
	if liveConn(c) != cc || fb.invokes.Load() != 0 {
		t.Fatal("the connection changed, or calls fell back")
	}
}

func TestReplyOverMaxMessage(t *testing.T) {
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "huge" {
			return &pb.ListResponse{Objects: []*pb.ObjectInfo{{Key: strings.Repeat("h", MaxMessage)}}}, nil
		}
		return echo(req), nil
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	if _, err := list(testCtx(t), c, "huge"); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("reply over MaxMessage: %v", err)
	}
	r, err := list(testCtx(t), c, "small")
	wantEcho(t, r, err, "small")
}

// ---------------------------------------------------------------------------
// The wire.

func TestParseRequest(t *testing.T) {
	msg := []byte("the message")
	valid := requestFrame(0x0102030405060708, 1500*time.Millisecond, "/pkg.Svc/Method", msg)
	if int(binary.BigEndian.Uint32(valid)) != len(valid)-4 {
		t.Fatal("finish set a wrong size")
	}
	body := valid[4:]
	r, err := parseRequest(body)
	if err != nil || r.id != 0x0102030405060708 || r.timeout != 1500*time.Millisecond || r.method != "/pkg.Svc/Method" || string(r.message) != string(msg) {
		t.Fatalf("parseRequest = %+v, %v", r, err)
	}
	withHead := func(id uint64, timeout uint64, n uint16, rest []byte) []byte {
		b := binary.BigEndian.AppendUint64(nil, id)
		b = binary.BigEndian.AppendUint64(b, timeout)
		b = binary.BigEndian.AppendUint16(b, n)
		return append(b, rest...)
	}
	cases := []struct {
		name   string
		body   []byte
		ok     bool
		method string
		msg    string
	}{
		{"nil", nil, false, "", ""},
		{"short", make([]byte, requestHead-1), false, "", ""},
		{"head only", make([]byte, requestHead), true, "", ""},
		{"no method, a message", withHead(1, 0, 0, []byte("m")), true, "", "m"},
		{"method exactly to the end", withHead(1, 0, 3, []byte("abc")), true, "abc", ""},
		{"method one past the end", withHead(1, 0, 4, []byte("abc")), false, "", ""},
		{"method 0xffff", withHead(1, 0, 0xffff, []byte("abc")), false, "", ""},
		{"method maxMethod", withHead(1, 0, maxMethod, make([]byte, maxMethod)), true, string(make([]byte, maxMethod)), ""},
		{"method over maxMethod", withHead(1, 0, maxMethod+1, make([]byte, maxMethod+1)), false, "", ""},
		{"timeout 2^63", withHead(1, 1<<63, 0, nil), false, "", ""},
		{"timeout 2^64-1", withHead(1, ^uint64(0), 0, nil), false, "", ""},
		{"timeout 2^63-1", withHead(1, 1<<63-1, 0, nil), true, "", ""},
	}
	for _, tc := range cases {
		r, err := parseRequest(tc.body)
		if (err == nil) != tc.ok {
			t.Errorf("%s: parseRequest err = %v, want ok=%v", tc.name, err, tc.ok)
			continue
		}
		if err != nil {
			if !errors.Is(err, errFrame) {
				t.Errorf("%s: error %v is not errFrame", tc.name, err)
			}
			continue
		}
		if r.method != tc.method || string(r.message) != tc.msg {
			t.Errorf("%s: method %q message %q", tc.name, r.method, r.message)
		}
	}
	// Every truncation of a valid body: no panic; an error while the
	// method is cut.
	for i := 0; i <= len(body); i++ {
		r, err := parseRequest(body[:i])
		if i < requestHead+len("/pkg.Svc/Method") {
			if err == nil {
				t.Fatalf("truncation to %d parsed: %+v", i, r)
			}
		} else if err != nil || string(r.message) != string(msg[:i-requestHead-len("/pkg.Svc/Method")]) {
			t.Fatalf("truncation to %d: %+v, %v", i, r, err)
		}
	}
	// A message over MaxMessage.
	if _, err := parseRequest(withHead(1, 0, 0, make([]byte, MaxMessage+1))); !errors.Is(err, errFrame) {
		t.Fatalf("message over MaxMessage: %v", err)
	}
	// Random bodies and mutations of the valid one.
	rng := rand.New(rand.NewPCG(3, 4))
	for range 20000 {
		b := append([]byte(nil), body[:rng.IntN(len(body)+1)]...)
		for range rng.IntN(4) {
			if len(b) > 0 {
				b[rng.IntN(len(b))] = byte(rng.Uint32())
			}
		}
		if r, err := parseRequest(b); err == nil && (len(r.method) > maxMethod || r.timeout < 0) {
			t.Fatalf("parseRequest(%x) = %+v", b, r)
		}
	}
}

func TestParseAnswer(t *testing.T) {
	trailer := metadata.MD{"tidepool-leader": {"10.0.0.2:7000"}, "multi": {"a", "", "c"}, "blob-bin": {"\x00\x01\xff"}}
	msg := []byte("reply bytes")
	valid := finish(append(appendAnswerHead(nil, 42, codes.Unavailable, "not the leader", trailer), msg...))
	body := valid[4:]
	a, err := parseAnswer(body)
	if err != nil || a.id != 42 || a.code != codes.Unavailable || a.text != "not the leader" || string(a.message) != string(msg) {
		t.Fatalf("parseAnswer = %+v, %v", a, err)
	}
	if fmt.Sprint(a.trailer) != fmt.Sprint(trailer) {
		t.Fatalf("trailer %v, want %v", a.trailer, trailer)
	}
	// Empty: no text, no trailer, no message.
	a, err = parseAnswer(finish(appendAnswerHead(nil, 1, codes.OK, "", nil))[4:])
	if err != nil || a.id != 1 || a.code != codes.OK || a.text != "" || a.trailer != nil || len(a.message) != 0 {
		t.Fatalf("empty answer: %+v, %v", a, err)
	}
	ahead := func(text string, trailerSize uint32, rest ...byte) []byte {
		b := binary.BigEndian.AppendUint64(nil, 9)
		b = binary.BigEndian.AppendUint32(b, 0)
		b = binary.BigEndian.AppendUint32(b, uint32(len(text)))
		b = append(b, text...)
		b = binary.BigEndian.AppendUint32(b, trailerSize)
		return append(b, rest...)
	}
	bad := map[string][]byte{
		"nil":                     nil,
		"short":                   make([]byte, answerHead-1),
		"text past the end":       binary.BigEndian.AppendUint32(append(make([]byte, 12), 0, 0, 0, 5), 0),
		"text eats trailer size":  append(append(make([]byte, 12), 0, 0, 0, 2), 'a', 'b', 0, 0),
		"trailer past the end":    ahead("t", 3, 0, 1),
		"trailer over maxTrailer": ahead("", maxTrailer+1, make([]byte, maxTrailer+1)...),
		"trailer one byte":        ahead("", 1, 0),
		"trailer key past end":    ahead("", 4, 0, 5, 'k', 'k'),
		"trailer no value size":   ahead("", 5, 0, 1, 'k', 0, 0),
		"trailer value past end":  ahead("", 8, 0, 1, 'k', 0, 0, 0, 2, 'v'),
		"trailer value 2^32-1":    ahead("", 8, 0, 1, 'k', 0xff, 0xff, 0xff, 0xff, 'v'),
		"text 2^32-1":             append(append(make([]byte, 12), 0xff, 0xff, 0xff, 0xff), 0, 0, 0, 0),
	}
	for name, b := range bad {
		if a, err := parseAnswer(b); !errors.Is(err, errFrame) {
			t.Errorf("%s: parseAnswer = %+v, %v, want errFrame", name, a, err)
		}
	}
	if a, err := parseAnswer(ahead("", 0)); err != nil || a.trailer != nil {
		t.Fatalf("bare head: %+v, %v", a, err)
	}
	if _, err := parseAnswer(ahead("", maxTrailer, append(binary.BigEndian.AppendUint16(nil, 0), binary.BigEndian.AppendUint32(nil, maxTrailer-6)...)...)); err == nil {
		t.Fatal("trailer cut short parsed")
	}
	// Every truncation: no panic; an error while the trailer is cut.
	fixed := len(body) - len(msg)
	for i := 0; i <= len(body); i++ {
		a, err := parseAnswer(body[:i])
		if i < fixed {
			if err == nil {
				t.Fatalf("truncation to %d of %d parsed: %+v", i, len(body), a)
			}
		} else if err != nil || string(a.message) != string(msg[:i-fixed]) {
			t.Fatalf("truncation to %d: %+v, %v", i, a, err)
		}
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 20000 {
		b := append([]byte(nil), body[:rng.IntN(len(body)+1)]...)
		for range rng.IntN(4) {
			if len(b) > 0 {
				b[rng.IntN(len(b))] = byte(rng.Uint32())
			}
		}
		_, _ = parseAnswer(b)
	}
	for range 5000 {
		b := make([]byte, rng.IntN(64))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		_, _ = parseAnswer(b)
		_, _ = parseRequest(b)
	}
}

func TestAnswerRoundTripOfMarshal(t *testing.T) {
	reply := &pb.ListResponse{Objects: []*pb.ObjectInfo{{Key: "k", Size: 5}}, Truncated: true}
	b, err := new(Server).marshalAnswer(77, metadata.Pairs("a", "b"), reply)
	if err != nil {
		t.Fatal(err)
	}
	if int(binary.BigEndian.Uint32(b)) != len(b)-4 {
		t.Fatal("wrong frame size")
	}
	a, err := parseAnswer(b[4:])
	if err != nil || a.id != 77 || a.code != codes.OK || a.trailer.Get("a")[0] != "b" {
		t.Fatalf("%+v, %v", a, err)
	}
	var got pb.ListResponse
	if err := proto.Unmarshal(a.message, &got); err != nil || got.Objects[0].Key != "k" || !got.Truncated {
		t.Fatalf("%v, %v", &got, err)
	}
	if _, err := new(Server).marshalAnswer(1, nil, "not a message"); status.Code(err) != codes.Internal {
		t.Fatalf("non-proto reply: %v", err)
	}
}

func FuzzParseRequest(f *testing.F) {
	f.Add(requestFrame(1, time.Second, "/a/B", []byte("msg"))[4:])
	f.Add([]byte{})
	f.Add(make([]byte, requestHead))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseRequest(b)
		if err == nil && (len(r.method) > maxMethod || r.timeout < 0 || len(r.message) > MaxMessage) {
			t.Fatalf("%+v", r)
		}
	})
}

func FuzzParseAnswer(f *testing.F) {
	f.Add(finish(append(appendAnswerHead(nil, 1, codes.NotFound, "x", metadata.Pairs("k", "v")), 1, 2))[4:])
	f.Add([]byte{})
	f.Add(make([]byte, answerHead))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := parseAnswer(b)
		if err == nil && len(a.text)+len(a.message) > len(b) {
			t.Fatalf("%+v", a)
		}
	})
}

// inParallel runs fn(0..n-1) at once and fails t with the first error.
func inParallel(t *testing.T, n int, fn func(i int) error) {
	t.Helper()
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs <- fn(i) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}
