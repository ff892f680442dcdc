package master

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// recorder is a Watcher that writes down what it hears.
type recorder struct{ got []string }

func (r *recorder) Stored(key, parent, tenant string, tier pb.Tier) {
	r.got = append(r.got, fmt.Sprintf("stored %s %s parent=%s tenant=%s", key, tier.Name(), parent, tenant))
}
func (r *recorder) Removed(key, tenant string, tier pb.Tier) {
	r.got = append(r.got, fmt.Sprintf("removed %s %s tenant=%s", key, tier.Name(), tenant))
}
func (r *recorder) Cleared()             { r.got = append(r.got, "cleared") }
func (r *recorder) Flush(now int64)      { r.got = append(r.got, fmt.Sprintf("flush %d", now)) }
func (r *recorder) take() (out []string) { out, r.got = r.got, nil; return out }

// TestWatcher: the watcher hears each entry's net change of which tiers
// complete objects are in: nothing for a put in flight, a put's end, a
// demotion, a removal, a node lost, and a restored snapshot as a clear
// and the table.
func TestWatcher(t *testing.T) {
	d := newDriver(t)
	w := &recorder{}
	d.f.Watch(w)
	reg := d.register(1, "n1", "e1", dram("d", 1<<20), ssd("s", 1<<20))
	dramSeg, ssdSeg := reg.SegmentIDs[0], reg.SegmentIDs[1]
	w.take()
	check := func(what string, want ...string) {
		t.Helper()
		if got := w.take(); !slices.Equal(got, want) {
			t.Fatalf("%s: heard %q, want %q", what, got, want)
		}
	}

	out := d.apply(10, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{
		{Key: "a", Size: 4096, Candidates: []string{dramSeg}, DeadlineUnixNano: 1e12, Tenant: "t"},
		{Key: "b", Size: 4096, Candidates: []string{dramSeg}, DeadlineUnixNano: 1e12, Parent: "a", Tenant: "t"},
	}}}})
	if res := out.([]PutStartResult); res[0].Err != nil || res[1].Err != nil {
		t.Fatalf("put start: %+v", res)
	}
	check("put start", "flush 10")
	if err := d.keys(11, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{"a"}}}}); err != nil {
		t.Fatal(err)
	}
	check("put end", "stored a dram parent= tenant=t", "flush 11")
	if err := d.putEnd(12, "b"); err != nil {
		t.Fatal(err)
	}
	check("put end of a child", "stored b dram parent=a tenant=t", "flush 12")

	c := d.startCopy(13, "a", dramSeg, demote, 1e12, ssdSeg)
	check("copy start", "flush 13")
	if r := d.copyEnd(14, 0, &pb.CopyEndItem{Key: "a", CopyId: c.Id})[0]; r.Err != nil || !r.Done {
		t.Fatalf("copy end: %+v", r)
	}
	check("demotion", "removed a dram tenant=t", "stored a ssd parent= tenant=t", "flush 14")

	if err := d.remove(15, "b", 0); err != nil {
		t.Fatal(err)
	}
	check("remove", "removed b dram tenant=t", "flush 15")

	snap := snapshotBytes(t, d.f)
	d.nodeDown(16, "n1", reg.Epoch)
	check("node down", "removed a ssd tenant=t", "flush 16")

	f := NewFSM()
	f.Watch(w)
	if err := f.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	check("restore", "cleared", "stored a ssd parent= tenant=t", "flush 0")
}
