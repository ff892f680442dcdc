package master

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// r14Clear runs the agent's Clear loop (client/agent/service.go Clear with
// client.ListPage) against the master's List and Remove RPCs, in pages of
// page, and returns the keys it removed.
func r14Clear(t *testing.T, m *member, prefix string, page uint32) []string {
	t.Helper()
	var removed []string
	after := ""
	for range 1000 {
		resp, err := m.master().List(rpcCtx(t), &pb.ListRequest{Prefix: prefix, StartAfter: after, Limit: page})
		if err != nil {
			t.Fatal(err)
		}
		more := resp.Truncated && len(resp.Objects) > 0 // client.ListPage
		var keys []string
		for _, o := range resp.Objects {
			if o.State == pb.ObjectState_OBJECT_STATE_COMPLETE {
				keys = append(keys, o.Key)
			}
		}
		if len(keys) > 0 {
			items(t, m, "remove", m.master().Remove, keys...)
			removed = append(removed, keys...)
		}
		if !more {
			return removed
		}
		after = resp.Objects[len(resp.Objects)-1].Key
	}
	t.Fatal("clear did not end in 1000 pages")
	return nil
}

// r14Left lists, in one pass (a first page, which is never served from a
// kept order), the keys with prefix that exist.
func r14Left(m *member, prefix string) []string {
	objs, _ := m.srv.fsm.list(prefix, "", 1<<20)
	var out []string
	for _, o := range objs {
		out = append(out, o.Key)
	}
	return out
}

// TestReview14ClearMissesObjectsPutBeforeIt: a Clear (or a `tidepool ls`)
// of a prefix leaves the master holding that prefix's key order for 30 s.
// Objects put after that, but before a second Clear of the prefix starts,
// are complete objects with the prefix when the Clear begins; before
// listing.go every page was a pass over the table and the Clear removed
// them all. Now only the first page is a pass; the later ones come from
// the old order, which lacks the new keys, so the Clear reports success
// and leaves them in place.
func TestReview14ClearMissesObjectsPutBeforeIt(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	for i := range 5 {
		if err := tryPut(rpcCtx(t), m, fmt.Sprintf("p/a%d", i), 64); err != nil {
			t.Fatal(err)
		}
	}
	if got := r14Clear(t, m, "p/", 2); len(got) != 5 {
		t.Fatalf("the first clear removed %v", got)
	}
	// New objects, put and complete before the second Clear starts.
	for i := range 5 {
		if err := tryPut(rpcCtx(t), m, fmt.Sprintf("p/b%d", i), 64); err != nil {
			t.Fatal(err)
		}
	}
	removed := r14Clear(t, m, "p/", 2)
	if left := r14Left(m, "p/"); len(left) > 0 {
		t.Errorf("a Clear of p/ that started after these objects were put left %v in place (it removed %v and reported success)", left, removed)
	}
}

// TestReview14ListAfterLsMissesOlderObjects: the same through a listing:
// `tidepool ls p/` (client.List), run twice a few seconds apart, misses in
// the second run objects put between the two, past its first page, though
// they were complete before it started.
func TestReview14ListAfterLsMissesOlderObjects(t *testing.T) {
	f := NewFSM()
	s := &Server{fsm: f, listings: newListings()}
	now := time.Unix(0, t0)
	listAll := func(now time.Time) []string {
		var out []string
		after := ""
		for {
			objs, more := s.list("p/", after, 2, now)
			for _, o := range objs {
				out = append(out, o.Key)
			}
			if !more || len(objs) == 0 {
				return out
			}
			after = objs[len(objs)-1].Key
		}
	}
	for _, k := range []string{"p/1", "p/3", "p/5"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	if got := listAll(now); !slices.Equal(got, []string{"p/1", "p/3", "p/5"}) {
		t.Fatalf("first ls: %v", got)
	}
	for _, k := range []string{"p/4", "p/6"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	want := []string{"p/1", "p/3", "p/4", "p/5", "p/6"}
	if got := listAll(now.Add(5 * time.Second)); !slices.Equal(got, want) {
		t.Errorf("ls started 5 s after p/4 and p/6 were put lists %v, want %v", got, want)
	}
}

// TestReview14PageEdges: start-after is exclusive (a key equal to after is
// left out), a re-put key is listed once with its new record, removed keys
// are left out without an empty page that says more follow, and the
// truncated flag is right at the end. (Passes: checked correct.)
func TestReview14PageEdges(t *testing.T) {
	f := NewFSM()
	s := &Server{fsm: f, listings: newListings()}
	now := time.Unix(0, t0)
	for _, k := range []string{"k/a", "k/b", "k/c", "k/d", "k/e", "k/f"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	if got, more := s.list("k/", "k/b", 2, now); pageKeys(got) != "k/c k/d" || !more {
		t.Fatalf("after k/b: %q %v", pageKeys(got), more)
	}
	// Re-put k/c with a new size, remove k/d and k/e: the kept order still
	// holds the old records.
	f.drop(f.objects.get("k/c"))
	f.newObject("k/c", 7, 0, 0, 0, "", "", nil)
	f.drop(f.objects.get("k/d"))
	f.drop(f.objects.get("k/e"))
	got, more := s.list("k/", "k/b", 2, now)
	if pageKeys(got) != "k/c k/f" || more || got[0].Size != 7 {
		t.Errorf("after the re-put and removals: %q (more %v)", pageKeys(got), more)
	}
	if got, more := s.list("k/", "k/c", 1, now); pageKeys(got) != "k/f" || more {
		t.Errorf("past two removed keys: %q (more %v), want k/f and no more", pageKeys(got), more)
	}
	if got, more := s.list("k/", "k/f", 5, now); len(got) != 0 || more {
		t.Errorf("after the last key: %q %v", pageKeys(got), more)
	}
	// All after a point removed: a full page with more, then an empty last
	// page without: the caller is not stopped early and does not loop.
	f.drop(f.objects.get("k/f"))
	if got, more := s.list("k/", "k/b", 5, now); pageKeys(got) != "k/c" || more {
		t.Errorf("with the tail removed: %q %v", pageKeys(got), more)
	}
}

// TestReview14ListingRace: pages served from a kept order (whose records
// are read outside the FSM lock, through key()) while Apply-like writers
// add, remove and re-put objects under f.mu, and the order is rebuilt
// (now moves past listingAge): no race, each listing is strictly
// increasing, and every key that exists throughout is in every listing.
// (Passes under -race: the key bytes and keyLen are written once, before
// the record is published, and never again.)
func TestReview14ListingRace(t *testing.T) {
	f := NewFSM()
	s := &Server{fsm: f, listings: newListings()}
	stable := map[string]bool{}
	for i := range 300 {
		k := fmt.Sprintf("r/%04d", i)
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
		if i%3 == 0 {
			stable[k] = true
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			k := fmt.Sprintf("r/%04d", i%300)
			if stable[k] {
				k = fmt.Sprintf("r/%04dx", i%300)
			}
			f.mu.Lock()
			if o := f.objects.get(k); o != nil {
				f.drop(o)
			} else {
				f.newObject(k, uint64(i), 0, 0, 0, "", "", nil)
			}
			f.mu.Unlock()
		}
	}()
	var rwg sync.WaitGroup
	for r := range 2 {
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			for round := range 30 {
				now := time.Unix(0, t0).Add(time.Duration(round*(r+1)) * listingAge / 3)
				seen := map[string]bool{}
				after, prev := "", ""
				for {
					objs, more := s.list("r/", after, 17, now)
					for _, o := range objs {
						if o.Key <= prev {
							t.Errorf("listing out of order: %q after %q", o.Key, prev)
						}
						prev = o.Key
						seen[o.Key] = true
					}
					if !more || len(objs) == 0 {
						break
					}
					after = objs[len(objs)-1].Key
				}
				for k := range stable {
					if !seen[k] {
						t.Errorf("round %d: stable key %q not listed", round, k)
					}
				}
			}
		}()
	}
	rwg.Wait()
	close(stop)
	wg.Wait()
}
