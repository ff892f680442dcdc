package leaderconn

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// fakeMaster answers Status: as the leader, or refusing with a trailer
// that names the leader.
type fakeMaster struct {
	pb.UnimplementedMasterServer
	leader string // empty: this one leads
	calls  atomic.Int32
}

func (f *fakeMaster) Status(ctx context.Context, _ *pb.StatusRequest) (*pb.StatusResponse, error) {
	f.calls.Add(1)
	if f.leader != "" {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(Trailer, f.leader))
		return nil, status.Error(codes.Unavailable, "not the leader")
	}
	return &pb.StatusResponse{LeaderId: "me"}, nil
}

func serve(t *testing.T, f *fakeMaster) string {
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

func status1(ctx context.Context, c *Conn) error {
	return c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		_, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, opts...)
		return err
	})
}

func TestFollowsLeaderTrailer(t *testing.T) {
	leader := &fakeMaster{}
	laddr := serve(t, leader)
	follower := &fakeMaster{leader: laddr}
	faddr := serve(t, follower)

	c, err := Dial([]string{faddr}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 3 {
		if err := status1(t.Context(), c); err != nil {
			t.Fatal(err)
		}
	}
	if f, l := follower.calls.Load(), leader.calls.Load(); f != 1 || l != 3 {
		t.Fatalf("follower answered %d calls and leader %d; want 1 and 3 (the redirect is remembered)", f, l)
	}
}

func TestSkipsDeadMaster(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	live := serve(t, &fakeMaster{})
	c, err := Dial([]string{dead, live}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := status1(t.Context(), c); err != nil {
		t.Fatal(err)
	}
}

func TestGivesUpWhenContextEnds(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	c, err := Dial([]string{dead}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err = status1(ctx, c)
	// Unavailable from the last attempt, or, on a loaded machine where no
	// attempt had failed yet when the context ended, the context's error.
	got := []codes.Code{status.Code(err), status.Code(errors.Unwrap(err))}
	if !slices.Contains(got, codes.Unavailable) && !slices.Contains(got, codes.DeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v, want Unavailable or the context's deadline", err)
	}
	if _, err := Dial(nil, Credentials{}); err == nil {
		t.Fatal("Dial with no addresses succeeded")
	}
}

func TestOtherErrorsReturnAtOnce(t *testing.T) {
	c, err := Dial([]string{serve(t, &fakeMaster{})}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	err = c.Do(t.Context(), func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return status.Error(codes.NotFound, "nope")
	})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("error %v, want NotFound", err)
	}
}
