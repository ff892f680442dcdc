package master

import (
	"fmt"
	"strings"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func pageKeys(objs []*pb.ObjectInfo) string {
	var out []string
	for _, o := range objs {
		out = append(out, o.Key)
	}
	return strings.Join(out, " ")
}

// TestListingPages: pages after the first come from the listing's key
// order, bounded by prefix, start and limit, as a pass would answer them.
func TestListingPages(t *testing.T) {
	f := NewFSM()
	for _, k := range []string{"b/2", "a/1", "b/1", "b/3", "c/1", "b"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	s := &Server{fsm: f, listings: newListings()}
	now := time.Unix(0, t0)
	for _, tc := range []struct {
		prefix, after string
		limit         int
		want          string
		truncated     bool
	}{
		{"b/", "", 2, "b/1 b/2", true},
		{"b/", "b/2", 2, "b/3", false},
		{"b/", "b/1", 1, "b/2", true},
		{"b/", "a", 10, "b/1 b/2 b/3", false},
		{"b/", "b/22", 10, "b/3", false}, // a key between two
		{"b/", "b/3", 10, "", false},
		{"", "b/3", 10, "c/1", false},
		{"b", "b", 10, "b/1 b/2 b/3", false},
		{"d", "a", 10, "", false},
	} {
		objs, truncated := s.list(tc.prefix, tc.after, tc.limit, now)
		if got := pageKeys(objs); got != tc.want || truncated != tc.truncated {
			t.Errorf("list(%q, after %q, %d) = %q truncated %v, want %q %v", tc.prefix, tc.after, tc.limit, got, truncated, tc.want, tc.truncated)
		}
	}
}

// TestListingAge: a listing's order leaves out what is removed since it
// was built at once, and shows what is put since once it is older than
// listingAge.
func TestListingAge(t *testing.T) {
	f := NewFSM()
	for _, k := range []string{"p/1", "p/2", "p/3", "p/4"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	s := &Server{fsm: f, listings: newListings()}
	now := time.Unix(0, t0)
	if got, _ := s.list("p/", "p/1", 10, now); pageKeys(got) != "p/2 p/3 p/4" {
		t.Fatalf("second page: %q", pageKeys(got))
	}
	f.drop(f.objects.get("p/3"))
	f.newObject("p/5", 1, 0, 0, 0, "", "", nil)
	if got, more := s.list("p/", "p/1", 10, now.Add(time.Second)); pageKeys(got) != "p/2 p/4" || more {
		t.Errorf("after a removal and a put: %q (more %v), want p/2 p/4: the removed one left out, the new one not yet listed", pageKeys(got), more)
	}
	if got, _ := s.list("p/", "p/1", 10, now.Add(listingAge)); pageKeys(got) != "p/2 p/4 p/5" {
		t.Errorf("once the listing is %v old: %q, want p/2 p/4 p/5", listingAge, pageKeys(got))
	}
	// Removed objects at the end of a page leave it short, never empty
	// while more follow.
	f.drop(f.objects.get("p/4"))
	if got, more := s.list("p/", "p/2", 1, now.Add(listingAge)); pageKeys(got) != "p/5" || more {
		t.Errorf("past a removed key: %q (more %v), want p/5", pageKeys(got), more)
	}
}

// TestListingsBounded: at most maxListings prefixes keep an order.
func TestListingsBounded(t *testing.T) {
	f := NewFSM()
	s := &Server{fsm: f, listings: newListings()}
	now := time.Unix(0, t0)
	for i := range 3 * maxListings {
		s.list(fmt.Sprintf("p%d/", i), "a", 10, now.Add(time.Duration(i)))
	}
	if n := len(s.listings.byPrefix); n != maxListings {
		t.Fatalf("%d listings kept, want %d", n, maxListings)
	}
}

// BenchmarkListAll200k lists 200,000 keys in pages of 10,000, as
// `tidepool ls` does: with the listing's order, and with a pass per page.
func BenchmarkListAll200k(b *testing.B) {
	f := NewFSM()
	for i := range 200_000 {
		f.newObject(fmt.Sprintf("kv/vllm/%016x", i*7919), 64, 0, 0, 0, "", "", nil)
	}
	for _, tc := range []struct {
		name string
		page func(s *Server, after string, now time.Time) ([]*pb.ObjectInfo, bool)
	}{
		{"listing", func(s *Server, after string, now time.Time) ([]*pb.ObjectInfo, bool) {
			return s.list("kv/", after, 10000, now)
		}},
		{"pass-per-page", func(s *Server, after string, now time.Time) ([]*pb.ObjectInfo, bool) {
			return s.fsm.list("kv/", after, 10000)
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				s := &Server{fsm: f, listings: newListings()}
				after, n := "", 0
				for {
					objs, more := tc.page(s, after, time.Unix(0, t0))
					n += len(objs)
					if !more {
						break
					}
					after = objs[len(objs)-1].Key
				}
				if n != 200_000 {
					b.Fatalf("listed %d", n)
				}
			}
		})
	}
}
