package leaderconn

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/master/framed"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review10Server is a fake master served as the real one is: gRPC and
// framed on one port (framed.Server.Split).
type review10Server struct {
	addr string
	gs   *grpc.Server
	fs   *framed.Server
	done chan struct{}
}

func review10Serve(t *testing.T, addr string, f *fakeMaster) *review10Server {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var ln net.Listener
	var err error
	for range 100 { // a restart may find the port briefly held
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	s := &review10Server{addr: ln.Addr().String(), gs: grpc.NewServer(ServerOptions()...), fs: framed.NewServer(nil, nil), done: make(chan struct{})}
	pb.RegisterMasterServer(s.gs, f)
	pb.RegisterMasterServer(s.fs, f)
	go func() {
		defer close(s.done)
		_ = s.gs.Serve(s.fs.Split(ln))
	}()
	t.Cleanup(s.stop)
	return s
}

func (s *review10Server) stop() {
	s.gs.Stop()
	s.fs.Stop()
	<-s.done
}

// usedGRPC reports whether c's gRPC connection to addr was ever used
// (framed calls leave it idle).
func review10UsedGRPC(c *Conn, addr string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.mu.conns[addr]
	return m != nil && m.grpc.GetState() != connectivity.Idle
}

func review10Status(ctx context.Context, c *Conn, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return status1(ctx, c)
}

// TestReview10FramedFollowsLeaderTrailer: a follower served framed refuses
// with Unavailable and the leader trailer; Conn follows it, framed, and
// remembers it.
func TestReview10FramedFollowsLeaderTrailer(t *testing.T) {
	leader := &fakeMaster{}
	l := review10Serve(t, "", leader)
	follower := &fakeMaster{leader: l.addr}
	f := review10Serve(t, "", follower)
	c, err := Dial([]string{f.addr}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 3 {
		if err := review10Status(t.Context(), c, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if fc, lc := follower.calls.Load(), leader.calls.Load(); fc != 1 || lc != 3 {
		t.Fatalf("follower answered %d calls and leader %d; want 1 and 3", fc, lc)
	}
	for _, a := range []string{f.addr, l.addr} {
		if review10UsedGRPC(c, a) {
			t.Errorf("calls to %s went over gRPC, want framed", a)
		}
	}
}

// TestReview10RestartSamePort: a master stopped and started again on the
// same port is called again (its framed connection broke), framed.
func TestReview10RestartSamePort(t *testing.T) {
	f := &fakeMaster{}
	s := review10Serve(t, "", f)
	c, err := Dial([]string{s.addr}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := review10Status(t.Context(), c, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	s.stop()
	if err := review10Status(t.Context(), c, 300*time.Millisecond); status.Code(err) == codes.OK {
		t.Fatal("a call to a stopped master succeeded")
	}
	review10Serve(t, s.addr, f)
	if err := review10Status(t.Context(), c, 10*time.Second); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	if review10UsedGRPC(c, s.addr) {
		t.Errorf("after the restart calls went over gRPC, want framed")
	}
}

// TestReview10HungMasterShortDeadlines: the first master accepts TCP
// connections (the kernel does, into its backlog) but never answers: a
// master process that is stopped (SIGSTOP, a debugger), wedged, or still
// starting (the daemon listens before master.New replays the log). Calls
// with deadlines shorter than framed's dial timeout (5 s) must still
// reach the healthy second master. Framed dials afresh for every call and
// the caller's deadline ends each dial, which Do reads as DeadlineExceeded
// and returns without trying the next master: every such call fails, for
// as long as the first master hangs. (Over gRPC, before, the channel went
// TRANSIENT_FAILURE after its connect timeout, calls failed fast with
// Unavailable, and Do moved on.)
func TestReview10HungMasterShortDeadlines(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close() // never accepts
	live := &fakeMaster{}
	l := review10Serve(t, "", live)
	c, err := Dial([]string{hung.Addr().String(), l.addr}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var last error
	const attempts = 25
	for i := range attempts {
		if last = review10Status(t.Context(), c, time.Second); last == nil {
			t.Logf("call %d reached the live master", i+1)
			return
		}
	}
	t.Fatalf("%d calls of 1 s deadlines never reached the live master (it answered %d); last error: %v",
		attempts, live.calls.Load(), last)
}
