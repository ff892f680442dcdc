package leaderconn

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review16Master leads and answers Status with the members it is given.
type review16Master struct {
	pb.UnimplementedMasterServer
	members atomic.Pointer[[]*pb.MemberInfo]
}

func (f *review16Master) Status(context.Context, *pb.StatusRequest) (*pb.StatusResponse, error) {
	resp := &pb.StatusResponse{LeaderId: "me"}
	if m := f.members.Load(); m != nil {
		resp.Members = *m
	}
	return resp, nil
}

func review16Serve(t *testing.T, f *review16Master) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterMasterServer(gs, f)
	go gs.Serve(ln)
	t.Cleanup(gs.Stop)
	return ln.Addr().String()
}

// review16Refresh makes c refresh on its next call, makes one, and waits
// for the refresh to end.
func review16Refresh(t *testing.T, c *Conn) {
	t.Helper()
	c.mu.Lock()
	c.mu.refreshed = time.Time{}
	c.mu.Unlock()
	if err := status1(t.Context(), c); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.mu.Lock()
		busy := c.mu.refreshing
		c.mu.Unlock()
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("refresh did not end")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestReview16RefreshLearnsReplacedMasters: masters replaced one at a time
// (add one, remove one: the documented way) are learned by the refresh,
// but the ones removed are never forgotten and the rotation stops growing
// at maxAddrs. After a few replacements a Conn no longer learns the new
// masters, and rotates through addresses of masters long gone; once the
// masters it was dialled with are gone too, it reaches none.
func TestReview16RefreshLearnsReplacedMasters(t *testing.T) {
	f := &review16Master{}
	addr := review16Serve(t, f)
	c, err := Dial([]string{addr}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	members := []*pb.MemberInfo{{Id: "m0", Address: addr, Leader: true}, {Id: "m1", Address: "10.0.0.1:7000"}, {Id: "m2", Address: "10.0.0.2:7000"}}
	for r := range 20 {
		// Replace the oldest follower with a new master.
		members = append(slices.Clone(members[:1]), append(members[2:], &pb.MemberInfo{Id: fmt.Sprintf("n%d", r), Address: fmt.Sprintf("10.0.1.%d:7000", r)})...)
		f.members.Store(&members)
		review16Refresh(t, c)
		got := c.addrs()
		for _, m := range members {
			if !slices.Contains(got, m.Address) {
				t.Fatalf("after %d replacements the Conn does not know current master %s at %s; it rotates through %d addresses: %v",
					r+1, m.Id, m.Address, len(got), got)
			}
		}
	}
}

// review16Hang answers its first Status, then hangs every later one until
// the test ends.
type review16Hang struct {
	pb.UnimplementedMasterServer
	calls atomic.Int32
	quit  chan struct{}
}

func (f *review16Hang) Status(ctx context.Context, _ *pb.StatusRequest) (*pb.StatusResponse, error) {
	if f.calls.Add(1) > 1 {
		select {
		case <-ctx.Done():
		case <-f.quit:
		}
		return nil, ctx.Err()
	}
	return &pb.StatusResponse{LeaderId: "me"}, nil
}

// TestReview16CloseDoesNotWaitForRefresh: Close waits for a refresh in
// flight, and the refresh runs on a context of its own (2 s) that Close
// does not cancel: a daemon shutting down while its master hangs waits
// the whole refresh timeout.
func TestReview16CloseDoesNotWaitForRefresh(t *testing.T) {
	f := &review16Hang{quit: make(chan struct{})}
	defer close(f.quit)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterMasterServer(gs, f)
	go gs.Serve(ln)
	defer gs.Stop()
	c, err := Dial([]string{ln.Addr().String()}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.mu.refreshed = time.Time{}
	c.mu.Unlock()
	if err := status1(t.Context(), c); err != nil { // answered; starts a refresh, which hangs
		t.Fatal(err)
	}
	for f.calls.Load() < 2 {
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	c.Close()
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("Close took %v: it waited out the refresh's own timeout", d)
	}
}
