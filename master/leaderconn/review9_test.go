package leaderconn

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review9Big echoes sizes: Exists takes a large request, List answers a
// large response.
type review9Big struct {
	pb.UnimplementedMasterServer
}

func (review9Big) Exists(_ context.Context, req *pb.KeysRequest) (*pb.ExistsResponse, error) {
	return &pb.ExistsResponse{Exists: make([]bool, len(req.Keys))}, nil
}

func (review9Big) List(_ context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
	resp := &pb.ListResponse{}
	key := strings.Repeat("k", 4000)
	for range req.Limit {
		resp.Objects = append(resp.Objects, &pb.ObjectInfo{Key: key})
	}
	return resp, nil
}

// TestReview9LargeMessagesFixedWindows: with the fixed 4 MiB stream and
// 16 MiB connection windows on both ends, messages larger than either
// window flow both ways, several at once on one connection.
func TestReview9LargeMessagesFixedWindows(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(append(ServerOptions(), grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20))...)
	pb.RegisterMasterServer(gs, review9Big{})
	go gs.Serve(ln)
	t.Cleanup(gs.Stop)
	c, err := Dial([]string{ln.Addr().String()}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	const n = 5000 // 5000 keys of 4000 bytes: about 19 MiB a message, above both windows
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%04d", i) + strings.Repeat("x", 3996)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 3 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			errs <- c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
				resp, err := pb.NewMasterClient(cc).Exists(ctx, &pb.KeysRequest{Keys: keys}, opts...)
				if err == nil && len(resp.Exists) != n {
					err = fmt.Errorf("exists: %d answers", len(resp.Exists))
				}
				return err
			})
		}()
		go func() {
			defer wg.Done()
			errs <- c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
				resp, err := pb.NewMasterClient(cc).List(ctx, &pb.ListRequest{Limit: n}, opts...)
				if err == nil && len(resp.Objects) != n {
					err = fmt.Errorf("list: %d objects", len(resp.Objects))
				}
				return err
			})
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}
