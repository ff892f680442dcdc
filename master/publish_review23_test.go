package master

import (
	"fmt"
	"slices"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview23PublishColumnsOfOlderLog: a PublishColumnsCmd in the form
// earlier leaders wrote to the raft log (keys as field 1 and parents as
// field 7, repeated strings) still publishes its items when a master
// replays that log after an upgrade. (Once, fields 1 and 7 were reserved
// and such an entry published nothing.)
func TestReview23PublishColumnsOfOlderLog(t *testing.T) {
	now := t0 + 1000
	d := fuzzFSM(t)
	r := d.f.segments["n2/a@1"].resv[0]
	id, at := r.id, r.spans[0].off
	its := []*pb.PublishItem{
		{Key: "old0", Size: 64, Replicas: []*pb.Extent{{Segment: "n2/a@1", Offset: at, Length: 64}}, Reservations: []uint64{id}},
		{Key: "old1", Size: 64, Parent: "old0", Replicas: []*pb.Extent{{Segment: "n2/a@1", Offset: at + 64, Length: 64}}, Reservations: []uint64{id}},
	}
	c := columnsOf(its)
	// The previous release's encoding of the keys and parents.
	var old []byte
	for _, it := range its {
		old = protowire.AppendString(protowire.AppendTag(old, 1, protowire.BytesType), it.Key)
	}
	for _, it := range its {
		old = protowire.AppendString(protowire.AppendTag(old, 7, protowire.BytesType), it.Parent)
	}
	c.Keys, c.KeyLengths, c.Parents, c.ParentLengths = nil, nil, nil, nil
	c.ProtoReflect().SetUnknown(old)

	out := d.apply(now, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: c}})
	errs, ok := out.([]error)
	if !ok || len(errs) != len(its) {
		t.Fatalf("replaying an older log's PublishColumnsCmd of %d items: Apply = %T %v, want %d results", len(its), out, out, len(its))
	}
	for i, it := range its {
		if errs[i] != nil || d.f.objects.get(it.Key) == nil {
			t.Errorf("%q: %v, published %v; want it published", it.Key, errs[i], d.f.objects.get(it.Key) != nil)
		}
	}
}

// TestReview23GrantAsksKeepTenants: grants asked one a request (clients
// before grant_asks) by a caller that sees the whole key space may name
// different tenants; grantAsks must not merge consecutive requests of one
// shape but different tenants into one ask of the first's tenant (the
// second tenant's grants would be placed, and published, as the first's).
func TestReview23GrantAsksKeepTenants(t *testing.T) {
	req := &pb.BatchPutEndRequest{Grants: []*pb.PutStartRequest{
		{Size: 4096, Tenant: "a"},
		{Size: 4096, Tenant: "b"},
	}}
	n := map[string]uint32{}
	for _, a := range grantAsks(req) {
		n[a.Tenant] += a.Count
	}
	if n["a"] != 1 || n["b"] != 1 {
		t.Fatalf("grants asked by tenant %v, want a:1 b:1", n)
	}
}

// TestReview23GrantAskBounds: asks are answered as a prefix, never more
// grants than asked, at most maxGrants and maxGrantBytes a request
// whatever the counts say, nothing for a zero size or from it on.
func TestReview23GrantAskBounds(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	mc := m.master()
	register(t, m, "s", "ep", dram("a", 256<<20))
	key := 0
	ask := func(asks ...*pb.GrantAsk) []*pb.GrantRun {
		t.Helper()
		key++
		k := fmt.Sprint("k", key)
		r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: k, Size: 100})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{Key: k, PutId: r.PutId, Size: 100}}, GrantAsks: asks})
		if err != nil {
			t.Fatal(err)
		}
		var ids []uint64
		for _, run := range resp.Grants {
			for i := range uint64(run.Count) {
				ids = append(ids, run.FirstPutId+i)
			}
		}
		if len(ids) > 0 {
			if _, err := mc.PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: make([]string, len(ids)), PutIds: ids}); err != nil {
				t.Fatal(err)
			}
		}
		return resp.Grants
	}
	sizes := func(runs []*pb.GrantRun) (out []uint64) {
		for _, run := range runs {
			for range run.Count {
				out = append(out, run.Replicas[0].Length)
			}
		}
		return out
	}
	// A huge count: maxGrants, and none of the next ask.
	if got := sizes(ask(&pb.GrantAsk{Size: 4096, Count: 1 << 31}, &pb.GrantAsk{Size: 8192, Count: 1})); len(got) != maxGrants || slices.Contains(got, 8192) {
		t.Errorf("an ask of 2^31 grants then one more: %d grants (%d of 8192 bytes), want %d of 4096 alone", len(got), len(got)-slices.Index(got, 8192), maxGrants)
	}
	// Bytes: at most maxGrantBytes.
	if got := sizes(ask(&pb.GrantAsk{Size: 1 << 20, Count: 100})); len(got) != maxGrantBytes>>20 {
		t.Errorf("an ask of 100 grants of 1 MiB: %d, want %d", len(got), maxGrantBytes>>20)
	}
	// Exactly what is asked, across asks of one shape and of two.
	if got := sizes(ask(&pb.GrantAsk{Size: 4096, Count: 3}, &pb.GrantAsk{Size: 4096, Count: 2}, &pb.GrantAsk{Size: 8192, Count: 1})); !slices.Equal(got, []uint64{4096, 4096, 4096, 4096, 4096, 8192}) {
		t.Errorf("asks of 3, 2 and 1: %v", got)
	}
	// A zero size stops the answer there.
	if got := sizes(ask(&pb.GrantAsk{Size: 4096, Count: 1}, &pb.GrantAsk{Size: 0, Count: 3}, &pb.GrantAsk{Size: 4096, Count: 2})); !slices.Equal(got, []uint64{4096}) {
		t.Errorf("asks of 1, of a zero size, then 2: %v", got)
	}
}
