package master

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// BenchmarkDryRunEvict100k selects a chain of 100,000 blocks by prefix, as
// `tidepool evict --dry-run` does, and encodes the answer.
func BenchmarkDryRunEvict100k(b *testing.B) {
	const n = 100_000
	d := newDriver(b)
	d.register(t0, "n1", "ep1", ssd("a", n*4096))
	adopt := make([]*pb.AdoptedObject, n)
	for i := range adopt {
		adopt[i] = &pb.AdoptedObject{Key: fmt.Sprintf("chain/%07d", i), Segment: "a", Offset: uint64(i) * 4096, Size: 64, Checksum: 1}
		if i > 0 {
			adopt[i].Parent = adopt[i-1].Key
		}
	}
	d.apply(t0, &pb.Command{Op: &pb.Command_Adopt{Adopt: &pb.AdoptCmd{Node: "n1", Epoch: 1, Objects: adopt, Done: true}}})
	s := &Server{fsm: d.f}
	req := &pb.EvictRequest{Prefix: "chain/", DryRun: true}
	now := time.Unix(0, t0)
	b.ReportAllocs()
	for b.Loop() {
		victims, _, _, err := s.adminVictims(req, now)
		if err != nil || len(victims) != n {
			b.Fatalf("%d victims, %v", len(victims), err)
		}
		keys := make([]string, len(victims))
		for i, v := range victims {
			keys[i] = v.key
		}
		if _, err := proto.Marshal(&pb.EvictResponse{Objects: d.f.infos(keys)}); err != nil {
			b.Fatal(err)
		}
	}
}
