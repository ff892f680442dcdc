package master

import (
	"fmt"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// BenchmarkFollowerPublish128 is a follower's share of a batch put of
// 128 x 4 KiB: applying the leader's PublishColumnsCmd from its encoding
// (the leader applies the command it proposed without decoding it). The
// table grows as a bench row's does, and between batches 64 MiB are
// written, as the client, the store and the other masters sharing a
// host's cache do: a row's table is not in cache either.
func BenchmarkFollowerPublish128(b *testing.B) {
	const n, size = 128, 4096
	d := newDriver(b)
	d.register(t0, "n1", "ep1", dram("a", 1<<40))
	now := t0 + 1000
	var seq int
	// A reservation a batch, released once published, as the leader's
	// sweep does: a segment holds a few at a time.
	var resv uint64
	encode := func() []byte {
		r, ok := d.apply(now, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
			Segment: "n1/a@1", Bytes: n * size, MinSpan: size, AllocUntilUnixNano: now + 1e12, ReleaseAfterUnixNano: now + 2e12,
		}}}).(ReserveResult)
		if !ok || r.Err != nil || len(r.Spans) != 1 {
			b.Fatalf("reserve: %+v", r)
		}
		resv = r.ID
		its := make([]*pb.PublishItem, n)
		for i := range its {
			seq++
			its[i] = &pb.PublishItem{Key: fmt.Sprintf("bench/put/%d", seq), Size: size, Checksum: uint32(seq), PutId: uint64(seq),
				Replicas: []*pb.Extent{{Segment: "n1/a@1", Offset: r.Spans[0].off + uint64(i*size), Length: size}}, Reservations: []uint64{r.ID}}
		}
		data, err := proto.Marshal(&pb.Command{NowUnixNano: now, Op: &pb.Command_PublishColumns{PublishColumns: columnsOf(its)}})
		if err != nil {
			b.Fatal(err)
		}
		return data
	}
	others := make([]byte, 64<<20)
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		data := encode()
		d.index++
		for i := 0; i < len(others); i += 64 {
			others[i]++
		}
		b.StartTimer()
		errs, ok := d.f.Apply(&raft.Log{Index: d.index, Term: 1, Type: raft.LogCommand, Data: data}).([]error)
		if !ok || len(errs) != n || errs[0] != nil || errs[n-1] != nil {
			b.Fatalf("publish: %v", errs)
		}
		b.StopTimer()
		d.apply(now, &pb.Command{Op: &pb.Command_Release{Release: &pb.ReleaseCmd{Segment: "n1/a@1", Ids: []uint64{resv}}}})
		b.StartTimer()
	}
}
