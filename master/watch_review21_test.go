package master

import (
	"bytes"
	"fmt"
	"io"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// storeOrder is a Watcher that writes down the order of what is stored.
type storeOrder struct {
	stored  []string          // keys, in the order heard
	parents map[string]string // key: its parent
}

func (w *storeOrder) Stored(key, parent, _ string, _ pb.Tier) {
	w.stored = append(w.stored, key)
	w.parents[key] = parent
}
func (w *storeOrder) Removed(string, string, pb.Tier) {}
func (w *storeOrder) Cleared()                        { w.stored = nil; clear(w.parents) }
func (w *storeOrder) Flush(int64)                     {}

// TestReview21RestoreStoresParentsFirst: a restore tells the watcher the
// restored table block by block, and a consumer of vLLM's events takes a
// BlockStored whose parent it does not hold yet as an error: Dynamo's
// radix tree refuses it ("Failed to find parent block; skipping store
// operation", ParentBlockNotFound), and llm-d maps an engine key to its
// request key through the parent's. So a restored chain must be heard
// parent first, as live puts are. restored() walks f.objects.all(), whose
// order is the table's per-process hash seed: children come before their
// parents, and differently on every master.
func TestReview21RestoreStoresParentsFirst(t *testing.T) {
	d := newDriver(t)
	reg := d.register(1, "n1", "e1", dram("d", 1<<24))
	seg := reg.SegmentIDs[0]
	const n = 40
	var items []*pb.PutStartItem
	var keys []string
	for i := range n {
		key, parent := fmt.Sprintf("chain/%02d", i), ""
		if i > 0 {
			parent = keys[i-1]
		}
		keys = append(keys, key)
		items = append(items, &pb.PutStartItem{Key: key, Size: 4096, Candidates: []string{seg}, DeadlineUnixNano: 1e12, Parent: parent})
	}
	for _, r := range d.apply(2, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: items}}}).([]PutStartResult) {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	d.apply(3, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: keys}}})

	live := &storeOrder{parents: map[string]string{}}
	f := NewFSM()
	f.Watch(live)
	if err := f.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, d.f)))); err != nil {
		t.Fatal(err)
	}
	if len(live.stored) != n {
		t.Fatalf("restore: heard %d stored, want %d", len(live.stored), n)
	}
	seen := map[string]bool{}
	for i, k := range live.stored {
		if p := live.parents[k]; p != "" && !seen[p] {
			t.Fatalf("restore: %s heard (as #%d of %d) before its parent %s: a consumer refuses a block whose parent it does not hold\norder: %v",
				k, i, n, p, live.stored)
		}
		seen[k] = true
	}
}
