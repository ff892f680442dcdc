package client

import (
	"errors"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// unsparse takes both forms of a BatchPutEnd answer (a master that
// predates sparse results answers every item) and refuses one that does
// not fit the request.
func TestUnsparse(t *testing.T) {
	bad := &pb.ItemStatus{Code: 9, Message: "refused"}
	tests := []struct {
		name   string
		resp   *pb.BatchPutEndResponse
		n      int
		failed []int // items answered with bad; nil results elsewhere
		err    bool
	}{
		{name: "every item, as older masters answer", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{{}, bad, {}}}, n: 3, failed: []int{1}},
		{name: "all succeeded", resp: &pb.BatchPutEndResponse{}, n: 3},
		{name: "some failed", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{0, 2}}, n: 3, failed: []int{0, 2}},
		{name: "all failed", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{0, 1}}, n: 2, failed: []int{0, 1}},
		{name: "holds per item", resp: &pb.BatchPutEndResponse{HoldMs: []uint32{0, 5}}, n: 2},
		{name: "too few of every item", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{{}, {}}}, n: 3, err: true},
		{name: "failed item past the request", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad}, Failed: []uint32{3}}, n: 3, err: true},
		{name: "failed items out of order", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{2, 1}}, n: 3, err: true},
		{name: "failed item twice", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{1, 1}}, n: 3, err: true},
		{name: "more results than failed items", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{1}}, n: 3, err: true},
		{name: "fewer results than failed items", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad}, Failed: []uint32{0, 1}}, n: 3, err: true},
		{name: "holds not per item", resp: &pb.BatchPutEndResponse{HoldMs: []uint32{5}}, n: 2, err: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := unsparse(tt.resp, tt.n)
			if tt.err {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("unsparse = %v; want ErrProtocol", err)
				}
				return
			}
			if err != nil || len(tt.resp.Results) != tt.n {
				t.Fatalf("unsparse = %v, %d results; want nil, %d", err, len(tt.resp.Results), tt.n)
			}
			for i, st := range tt.resp.Results {
				want := 0
				for _, f := range tt.failed {
					if f == i {
						want = 9
					}
				}
				if got := st.GetCode(); got != int32(want) {
					t.Errorf("item %d: code %d, want %d", i, got, want)
				}
			}
		})
	}
}
