package master

import (
	"fmt"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// BenchmarkSegmentObjectsSync pages through the objects of one SSD segment
// of 200k, as a store's index sync does (50000 a page): each page is a pass
// over the table under the read lock, then a selection of the page.
func BenchmarkSegmentObjectsSync(b *testing.B) {
	const n = 200_000
	d := newDriver(b)
	d.register(t0, "n1", "ep1", ssd("b", n*4096))
	var adopt []*pb.AdoptedObject
	for i := range n {
		adopt = append(adopt, &pb.AdoptedObject{Key: fmt.Sprintf("kv/vllm/model/tenant/%064d", i), Segment: "b", Offset: uint64(i) * 4096, Size: 4096, Checksum: 1})
	}
	d.apply(t0, &pb.Command{Op: &pb.Command_Adopt{Adopt: &pb.AdoptCmd{Node: "n1", Epoch: 1, Objects: adopt, Done: true}}})
	for b.Loop() {
		after := ""
		for {
			objs, more := d.f.segmentObjects("n1/b@1", "b", after, 50000)
			if !more {
				break
			}
			after = objs[len(objs)-1].Key
		}
	}
}
