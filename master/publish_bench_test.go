package master

import (
	"fmt"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// BenchmarkFollowerPublish128 is a follower's share of a batch put of
// 128 x 4 KiB: applying the leader's PublishColumnsCmd from its encoding
// (the leader applies the command it proposed without decoding it). The
// table grows as a bench row's does, and between batches 64 MiB are
// written, as the client, the store and the other masters sharing a
// host's cache do: a row's table is not in cache either.
func BenchmarkFollowerPublish128(b *testing.B) {
	d := newDriver(b)
	next := batchPublisher(b, d)
	others := make([]byte, 64<<20)
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		data, _, release := next()
		sweep(others)
		b.StartTimer()
		errs, ok := d.applyEncoded(data).([]error)
		if !ok || len(errs) != publishBatch || errs[0] != nil || errs[publishBatch-1] != nil {
			b.Fatalf("publish: %v", errs)
		}
		b.StopTimer()
		release()
		b.StartTimer()
	}
}

// BenchmarkRemove128 is a master's apply of a removal of 128 keys put
// long before, in a table of 256,000 objects, with the cache swept as in
// BenchmarkFollowerPublish128.
func BenchmarkRemove128(b *testing.B) {
	d := newDriver(b)
	next := batchPublisher(b, d)
	var batches [][]string
	publish := func() {
		data, keys, release := next()
		d.applyEncoded(data)
		release()
		batches = append(batches, keys)
	}
	for range 2000 {
		publish()
	}
	others := make([]byte, 64<<20)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		publish()
		data := d.encode(batchNow, &pb.Command{Op: &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: batches[i]}}})
		sweep(others)
		b.StartTimer()
		errs, ok := d.applyEncoded(data).([]error)
		if !ok || errs[0] != nil || errs[publishBatch-1] != nil {
			b.Fatalf("remove: %v", errs)
		}
	}
}

const publishBatch = 128

// batchNow is when batchPublisher's batches are published.
const batchNow = t0 + 1000

// batchPublisher registers a store in d and returns a function that
// encodes the next publish of publishBatch new keys of 4 KiB, each batch
// in a reservation of its own, with its keys and a function that releases
// the reservation once published, as the leader's sweep does (a segment
// holds a few at a time).
func batchPublisher(b *testing.B, d *fsmDriver) func() (data []byte, keys []string, release func()) {
	const size = 4096
	d.register(t0, "n1", "ep1", dram("a", 1<<40))
	var seq int
	return func() ([]byte, []string, func()) {
		r, ok := d.apply(batchNow, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
			Segment: "n1/a@1", Bytes: publishBatch * size, MinSpan: size, AllocUntilUnixNano: batchNow + 1e12, ReleaseAfterUnixNano: batchNow + 2e12,
		}}}).(ReserveResult)
		if !ok || r.Err != nil || len(r.Spans) != 1 {
			b.Fatalf("reserve: %+v", r)
		}
		its := make([]*pb.PublishItem, publishBatch)
		keys := make([]string, publishBatch)
		for i := range its {
			seq++
			keys[i] = fmt.Sprintf("bench/put/%d", seq)
			its[i] = &pb.PublishItem{Key: keys[i], Size: size, Checksum: uint32(seq), PutId: uint64(seq),
				Replicas: []*pb.Extent{{Segment: "n1/a@1", Offset: r.Spans[0].off + uint64(i*size), Length: size}}, Reservations: []uint64{r.ID}}
		}
		data := d.encode(batchNow, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: columnsOf(its)}})
		release := func() {
			d.apply(batchNow, &pb.Command{Op: &pb.Command_Release{Release: &pb.ReleaseCmd{Segment: "n1/a@1", Ids: []uint64{r.ID}}}})
		}
		return data, keys, release
	}
}

// sweep writes a line of each 64 bytes of mem, as other processes do to
// the cache.
func sweep(mem []byte) {
	for i := 0; i < len(mem); i += 64 {
		mem[i]++
	}
}
