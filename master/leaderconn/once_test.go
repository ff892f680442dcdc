package leaderconn

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// lossyMaster fails Status as a lost connection does (Unavailable, no
// trailer), or as a master refusing with an empty leader trailer.
type lossyMaster struct {
	fakeMaster
	refuse bool
}

func (f *lossyMaster) Status(ctx context.Context, _ *pb.StatusRequest) (*pb.StatusResponse, error) {
	f.calls.Add(1)
	if f.refuse {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(Trailer, ""))
	}
	return nil, status.Error(codes.Unavailable, "gone")
}

// TestDoOnceDoesNotRetryAfterSending: a call in flight when its master
// failed is not sent again by DoOnce (Do sends it again); one a master
// refused is.
func TestDoOnceDoesNotRetryAfterSending(t *testing.T) {
	for _, tc := range []struct {
		name   string
		refuse bool
		once   bool
		retry  bool
	}{
		{"lost, DoOnce", false, true, false},
		{"lost, Do", false, false, true},
		{"refused, DoOnce", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &lossyMaster{refuse: tc.refuse}
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
			defer c.Close()
			ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
			defer cancel()
			call := func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
				_, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, opts...)
				return err
			}
			if tc.once {
				err = c.DoOnce(ctx, call)
			} else {
				err = c.Do(ctx, call)
			}
			if status.Code(err) != codes.Unavailable && ctx.Err() == nil {
				t.Fatalf("err %v", err)
			}
			if n := f.calls.Load(); (n > 1) != tc.retry {
				t.Fatalf("%d calls; retried: want %v", n, tc.retry)
			}
		})
	}
}
