package framed

// Tests of bugs found in review. Each fails on the code as reviewed; the
// comment above each says what it shows and where.

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// gate is a Master whose List blocks while its prefix is "block", until
// release is closed or the call's context ends.
type gate struct {
	testMaster
	release  chan struct{}
	blocked  atomic.Int64 // handlers waiting now
	entered  atomic.Int64 // handlers ever entered
	ctxEnded atomic.Int64 // handlers that returned because their context ended
}

func newGate() *gate {
	g := &gate{release: make(chan struct{})}
	g.list = func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix != "block" {
			return &pb.ListResponse{Objects: []*pb.ObjectInfo{{Key: req.Prefix[:min(len(req.Prefix), 16)]}}}, nil
		}
		g.entered.Add(1)
		g.blocked.Add(1)
		defer g.blocked.Add(-1)
		select {
		case <-g.release:
			return echo(req), nil
		case <-ctx.Done():
			g.ctxEnded.Add(1)
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	return g
}

// fillSlots starts maxInFlight calls that block in the handler and waits
// until they all run: the server then reads no more requests from the
// connection ("then its requests wait in the socket"). It returns their
// errors once they end.
func fillSlots(t *testing.T, c *Client, g *gate) <-chan error {
	t.Helper()
	errs := make(chan error, maxInFlight)
	for range maxInFlight {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err := list(ctx, c, "block")
			errs <- err
		}()
	}
	waitFor(t, 5*time.Second, "every slot of the connection busy", func() bool { return g.blocked.Load() == maxInFlight })
	return errs
}

// shrinkBuffers makes the socket buffers of the client's framed connection
// (its send side, the server's receive side) small, so that a few MiB of
// requests fill them as a busy server's would.
func shrinkBuffers(t *testing.T, c *Client, s *testServer) {
	t.Helper()
	cc := liveConn(c)
	if cc == nil {
		t.Fatal("no framed connection")
	}
	if err := cc.conn.(*net.TCPConn).SetWriteBuffer(64 << 10); err != nil {
		t.Fatal(err)
	}
	s.framed.mu.Lock()
	defer s.framed.mu.Unlock()
	for sc := range s.framed.mu.conns {
		if err := sc.conn.(*net.TCPConn).SetReadBuffer(64 << 10); err != nil {
			t.Fatal(err)
		}
	}
}

// Found in review: a caller's cancel is not honoured while its request waits to be
// written. When the server's maxInFlight slots are busy, its reader stops
// and the socket fills (as doc.go intends); a call then blocks in
// clientConn.write (waiting for wmu, or in conn.Write), which looks at ctx
// only for a deadline (client.go, clientConn.write: SetWriteDeadline of the
// ctx deadline or bodyDeadline, no ctx.Done), so a cancelled call without a
// deadline returns only when the socket drains or bodyDeadline (10 s + 1 s
// per MiB) passes; and then cc.close fails every call on the connection.
func TestReviewCancelWhileWriteBlocked(t *testing.T) {
	g := newGate()
	s := startServer(t, "127.0.0.1:0", g, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	if _, err := list(testCtx(t), c, "warm"); err != nil {
		t.Fatal(err)
	}
	shrinkBuffers(t, c, s)
	slotErrs := fillSlots(t, c, g)
	cc := liveConn(c)

	const n = 8
	big := strings.Repeat("b", 1<<20)
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, n)
	for range n {
		go func() {
			_, err := list(ctx, c, big)
			errs <- err
		}()
	}
	waitFor(t, 5*time.Second, "the big calls to be sent", func() bool { return pendingCalls(cc) == maxInFlight+n })
	cancel()
	returned, wrong := 0, 0
	timeout := time.After(time.Second)
wait:
	for returned < n {
		select {
		case err := <-errs:
			returned++
			if status.Code(err) != codes.Canceled {
				wrong++
			}
		case <-timeout:
			break wait
		}
	}
	if returned < n {
		t.Errorf("%d of %d cancelled calls still blocked 1s after their cancel (in clientConn.write)", n-returned, n)
	}
	if wrong > 0 {
		t.Errorf("%d cancelled calls returned another code than Canceled", wrong)
	}
	close(g.release) // the server reads again; the rest end
	for ; returned < n; returned++ {
		<-errs
	}
	for range maxInFlight {
		<-slotErrs
	}
}

// Found in review: one call's deadline passing while its request is being written
// closes the connection under every other call. clientConn.write bounds
// the write by the call's deadline; a write that times out part way leaves
// half a frame on the connection, so call() closes it (client.go, call:
// "if err := cc.write(...); err != nil { cc.close(err) ...}"), failing all
// pending calls with Unavailable, here the maxInFlight calls the server is
// still running and would answer, and the timed-out call itself gets
// Unavailable instead of DeadlineExceeded. gRPC queues the message (flow
// control) and only that call ends.
func TestReviewDeadlineWhileWriteBlocked(t *testing.T) {
	g := newGate()
	s := startServer(t, "127.0.0.1:0", g, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	if _, err := list(testCtx(t), c, "warm"); err != nil {
		t.Fatal(err)
	}
	shrinkBuffers(t, c, s)
	slotErrs := fillSlots(t, c, g)

	big := strings.Repeat("b", 1<<20)
	var lastErr error
	for range 12 { // 12 MiB: well past the buffers
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := list(ctx, c, big)
		cancel()
		if status.Code(err) != codes.DeadlineExceeded {
			lastErr = err
			break
		}
	}
	if lastErr != nil {
		t.Errorf("a call whose deadline passed returned %v, want DeadlineExceeded", lastErr)
	}
	close(g.release)
	failed := 0
	var first error
	for range maxInFlight {
		if err := <-slotErrs; err != nil {
			if failed++; first == nil {
				first = err
			}
		}
	}
	if failed > 0 {
		t.Errorf("%d of %d calls the server was running failed after another call's deadline passed: %v", failed, maxInFlight, first)
	}
}

// Found in review: a trailer over maxTrailer (64 KiB) breaks the connection. The server
// sends it (server.go, handle / wire.go, appendAnswerHead: no bound on the
// trailer, and a key's size is cut to uint16), the client refuses the
// answer (wire.go, parseAnswer: "n > maxTrailer" is errFrame) and closes the
// connection, so that call and every other call in flight on the
// connection fail with Unavailable. Over gRPC the same trailer arrives
// (the client's header list limit is 16 MiB).
func TestReviewLargeTrailer(t *testing.T) {
	g := newGate()
	inner := g.list
	g.list = func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "trailer" {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("big", strings.Repeat("t", 70<<10)))
			return echo(req), nil
		}
		return inner(ctx, req)
	}
	s := startServer(t, "127.0.0.1:0", g, nil)

	// gRPC carries it.
	var gtr metadata.MD
	if _, err := list(testCtx(t), grpcConn(t, s.addr), "trailer", grpc.Trailer(&gtr)); err != nil || len(gtr.Get("big")) != 1 {
		t.Fatalf("over gRPC: %v, trailer of %d values", err, len(gtr.Get("big")))
	}

	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	other := make(chan error, 1)
	go func() {
		_, err := list(testCtx(t), c, "block")
		other <- err
	}()
	waitFor(t, 3*time.Second, "the other call to run", func() bool { return g.blocked.Load() == 1 })
	var tr metadata.MD
	_, err := list(testCtx(t), c, "trailer", grpc.Trailer(&tr))
	if err != nil || len(tr.Get("big")) != 1 {
		t.Errorf("framed call with a 70 KiB trailer: %v, trailer of %d values (gRPC: OK)", err, len(tr.Get("big")))
	}
	close(g.release)
	if err := <-other; err != nil {
		t.Errorf("another call in flight on the connection failed: %v", err)
	}
}

// Found in review: Client.Close fails the calls in flight with codes.Unavailable
// ("connection lost: client closed", client.go: Close -> cc.close ->
// errLost -> cc.lost), where a grpc.ClientConn's Close gives
// codes.Canceled, as Client itself does for calls after Close. Unavailable
// is the code callers retry: leaderconn.Conn.Do does, so a Do in flight
// across Conn.Close rotates, dials a new master connection (current() finds
// the map Close emptied) and keeps calling after Close, leaking that
// connection.
func TestReviewCloseCancelsInFlight(t *testing.T) {
	g := newGate()
	s := startServer(t, "127.0.0.1:0", g, nil)

	inFlightAtClose := func(cc grpc.ClientConnInterface, closeIt func()) error {
		before := g.entered.Load()
		errc := make(chan error, 1)
		go func() {
			_, err := list(testCtx(t), cc, "block")
			errc <- err
		}()
		waitFor(t, 3*time.Second, "the call to run", func() bool { return g.entered.Load() == before+1 })
		closeIt()
		select {
		case err := <-errc:
			return err
		case <-time.After(3 * time.Second):
			t.Fatal("the call did not end at Close")
			return nil
		}
	}
	gc := grpcConn(t, s.addr)
	gerr := inFlightAtClose(gc, func() { _ = gc.Close() })
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	ferr := inFlightAtClose(c, func() { _ = c.Close() })
	if status.Code(gerr) != codes.Canceled {
		t.Logf("note: grpc.ClientConn gave %v", gerr)
	}
	if status.Code(ferr) != status.Code(gerr) {
		t.Errorf("call in flight at Close: framed %v; grpc.ClientConn %v", ferr, gerr)
	}
}

// Found in review: a cancelled call's handler is never told. Nothing carries a cancel
// to the server (the wire has no cancel frame; client.go, call: on
// ctx.Done it only forgets the id), so the handler's context ends only at
// the call's deadline or when the connection closes, while under gRPC
// (RST_STREAM) it ends at once; doc.go promises a handler cannot tell the
// two apart.
func TestReviewCancelReachesHandler(t *testing.T) {
	g := newGate()
	s := startServer(t, "127.0.0.1:0", g, nil)
	cancelOne := func(cc grpc.ClientConnInterface) bool {
		before, ended := g.entered.Load(), g.ctxEnded.Load()
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := list(ctx, cc, "block")
			errc <- err
		}()
		waitFor(t, 3*time.Second, "the call to run", func() bool { return g.entered.Load() == before+1 })
		cancel()
		if err := <-errc; status.Code(err) != codes.Canceled {
			t.Fatalf("cancelled call: %v", err)
		}
		deadline := time.Now().Add(time.Second)
		for time.Now().Before(deadline) {
			if g.ctxEnded.Load() == ended+1 {
				return true
			}
			time.Sleep(2 * time.Millisecond)
		}
		return false
	}
	if !cancelOne(grpcConn(t, s.addr)) {
		t.Fatal("over gRPC the handler's context did not end at the cancel")
	}
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	if !cancelOne(c) {
		t.Error("framed: the handler's context did not end within 1s of the caller's cancel (gRPC: at once)")
	}
}

// Found in review, the consequence of the one above: calls their callers gave up on
// keep the connection's maxInFlight slots, so after maxInFlight cancelled
// calls whose handlers wait (on a lock, a raft apply, ...) the connection
// serves nothing until their deadlines, though no one waits for them. Over
// gRPC the cancels free the handlers.
func TestReviewCancelledCallsFreeSlots(t *testing.T) {
	g := newGate()
	s := startServer(t, "127.0.0.1:0", g, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range maxInFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = list(ctx, c, "block")
		}()
	}
	waitFor(t, 5*time.Second, "every slot busy", func() bool { return g.blocked.Load() == maxInFlight })
	cancel()
	wg.Wait() // every caller has given up
	short, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	if _, err := list(short, c, "after"); err != nil {
		t.Errorf("a call after %d cancelled ones: %v (their handlers still hold the slots: %d running)", maxInFlight, err, g.blocked.Load())
	}
	close(g.release)
}

// Found in review: a handler returning a context error (not a status) reaches a framed
// caller as codes.Unknown, and a gRPC caller as DeadlineExceeded or
// Canceled: server.go, handle uses status.Convert(err), where grpc-go's
// server falls back to status.FromContextError for non-status errors. The
// common "return nil, ctx.Err()" at a deadline hits it whenever the
// server's deadline fires before the caller's own timer (seen in
// TestDeadlines before its handler returned a status). The master's
// interceptor maps its errors itself, so its own calls are not hit; a
// server without that interceptor is.
func TestReviewContextErrorFromHandler(t *testing.T) {
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		if req.Prefix == "canceled" {
			return nil, context.Canceled
		}
		return nil, errorsJoin("lookup", context.DeadlineExceeded)
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	gc := grpcConn(t, s.addr)
	for _, p := range []string{"deadline", "canceled"} {
		_, ferr := list(testCtx(t), c, p)
		_, gerr := list(testCtx(t), gc, p)
		if status.Code(ferr) != status.Code(gerr) {
			t.Errorf("handler returning a context error (%s): framed %v, gRPC %v", p, ferr, gerr)
		}
	}
}

func errorsJoin(what string, err error) error { return errors.Join(errors.New(what), err) }

// Found in review: status details are dropped. handle sends only the code and message
// (server.go: appendAnswerHead(..., sts.Code(), sts.Message(), ...)) and
// Invoke rebuilds status.Error(a.code, a.text), so errdetails a handler
// attaches (status.WithDetails) reach gRPC callers but not framed ones.
func TestReviewStatusDetails(t *testing.T) {
	m := &testMaster{list: func(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
		st, err := status.New(codes.FailedPrecondition, "with details").WithDetails(&pb.ItemStatus{Code: 9, Message: "detail"})
		if err != nil {
			return nil, err
		}
		return nil, st.Err()
	}}
	s := startServer(t, "127.0.0.1:0", m, nil)
	c := NewClient(s.addr, &failingConn{}, Credentials{})
	defer c.Close()
	_, gerr := list(testCtx(t), grpcConn(t, s.addr), "x")
	_, ferr := list(testCtx(t), c, "x")
	if g := len(status.Convert(gerr).Details()); g != 1 {
		t.Fatalf("gRPC carried %d details", g)
	}
	if f := len(status.Convert(ferr).Details()); f != 1 {
		t.Errorf("framed carried %d status details, gRPC 1", f)
	}
}

// Found in review: a call whose deadline passes during the preface exchange marks a
// framed server unframed for unframedFor (a minute), about half the time:
// dial sets the connection's deadline to the caller's deadline, and when
// the read times out it tells "the caller's context ended" from "the peer
// does not speak framed" by ctx.Err(), but the context's timer and the
// socket deadline fire at the same instant and the read often returns
// first (client.go, dial: "if ctx.Err() != nil {...} return errUnframed").
// A master slow to echo the preface (busy, a GC pause) thus loses framed
// for every caller of the client for a minute, and this call goes to the
// fallback with a context already past its deadline.
func TestReviewDeadlineDuringPreface(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { // a framed server too slow to answer in time
				defer wg.Done()
				_, _ = io.Copy(io.Discard, conn)
				_ = conn.Close()
			}()
		}
	}()
	marked := 0
	const tries = 40
	for range tries {
		fb := &failingConn{}
		c := NewClient(ln.Addr().String(), fb, Credentials{})
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Millisecond)
		_, _ = list(ctx, c, "x")
		cancel()
		c.mu.Lock()
		if !c.mu.unframed.IsZero() {
			marked++
		}
		c.mu.Unlock()
		_ = c.Close()
	}
	if marked > 0 {
		t.Errorf("%d of %d calls whose deadline passed during the preface marked the server unframed for %v", marked, tries, unframedFor)
	}
}
