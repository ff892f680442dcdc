package master

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestValidRegister: names that would make ambiguous segment ids, ids the
// engine cannot carry, unknown tiers and too many segments are refused.
func TestValidRegister(t *testing.T) {
	seg := func(name string) *pb.SegmentSpec {
		return &pb.SegmentSpec{Name: name, Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20}
	}
	many := make([]*pb.SegmentSpec, MaxSegmentsPerNode+1)
	for i := range many {
		many[i] = seg(fmt.Sprintf("d%d", i))
	}
	for _, tc := range []struct {
		name string
		req  *pb.RegisterRequest
		ok   bool
	}{
		{"plain", &pb.RegisterRequest{Node: "store-0", Endpoint: "127.0.0.1:1", Segments: []*pb.SegmentSpec{seg("dram0"), seg("ssd0")}}, true},
		{"host name and dots", &pb.RegisterRequest{Node: "gpu-07.rack3.example", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("hbm.0")}}, true},
		{"longest id", &pb.RegisterRequest{Node: strings.Repeat("n", 200), Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg(strings.Repeat("s", 255-200-2-20))}}, true},
		{"one byte longer", &pb.RegisterRequest{Node: strings.Repeat("n", 200), Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg(strings.Repeat("s", 255-200-2-20+1))}}, false},
		{"slash", &pb.RegisterRequest{Node: "a", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("b/c")}}, false},
		{"at", &pb.RegisterRequest{Node: "a@2", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("c")}}, false},
		{"control byte", &pb.RegisterRequest{Node: "a\n", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("c")}}, false},
		{"non-ASCII", &pb.RegisterRequest{Node: "ä", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("c")}}, false},
		{"empty node", &pb.RegisterRequest{Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("c")}}, false},
		{"duplicate segment", &pb.RegisterRequest{Node: "a", Endpoint: "h:1", Segments: []*pb.SegmentSpec{seg("c"), seg("c")}}, false},
		{"too many segments", &pb.RegisterRequest{Node: "a", Endpoint: "h:1", Segments: many}, false},
		{"unknown tier", &pb.RegisterRequest{Node: "a", Endpoint: "h:1", Segments: []*pb.SegmentSpec{{Name: "c", Tier: 7, Capacity: 1 << 20}}}, false},
		{"long endpoint", &pb.RegisterRequest{Node: "a", Endpoint: strings.Repeat("h", 5000), Segments: []*pb.SegmentSpec{seg("c")}}, false},
	} {
		err := validRegister(tc.req)
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidRequest)) {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

// TestRegisterRefusesTakenSegmentID: an entry that would give a second
// node a segment id another node owns (as an older master could accept)
// is refused in Apply, and the first node's segment keeps its allocator.
func TestRegisterRefusesTakenSegmentID(t *testing.T) {
	d := newDriver(t)
	d.register(1, "a", "ep-a", &pb.SegmentSpec{Name: "b/c", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20})
	before := d.f.segments["a/b/c@1"]
	out := d.apply(2, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "a/b", Endpoint: "ep-ab",
		Segments: []*pb.SegmentSpec{{Name: "c", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20}}}}})
	if err, ok := out.(error); !ok || !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("register of a taken id: %v, want invalid argument", out)
	}
	if d.f.segments["a/b/c@1"] != before || before.node != "a" {
		t.Fatalf("the taken segment changed: %+v", d.f.segments["a/b/c@1"])
	}
}

// TestParentLoops: a put naming itself, or a parent that descends from
// it (through the table or the batch's earlier items), is refused; depths
// follow chains, and a loop that concurrent puts made ends the walk.
func TestParentLoops(t *testing.T) {
	f := NewFSM()
	add := func(key, parent string) *object { return f.newObject(key, 1, 0, 0, 0, parent, "", nil) }
	loops := func(pairs ...string) []bool {
		return f.loopingParents(len(pairs)/2, func(i int) (string, string) { return pairs[2*i], pairs[2*i+1] })
	}
	add("a", "b") // b is not there yet
	add("c", "a")
	for _, tc := range []struct {
		name  string
		pairs []string
		want  []bool
	}{
		{"itself", []string{"x", "x"}, []bool{true}},
		{"b under its grandchild", []string{"b", "c"}, []bool{true}},
		{"b under a stranger", []string{"b", "z"}, []bool{false}},
		{"a new leaf", []string{"d", "c"}, []bool{false}},
		{"a loop within the batch", []string{"p", "q", "q", "p"}, []bool{false, true}},
		{"a chain in order", []string{"k1", "", "k2", "k1", "k3", "k2"}, []bool{false, false, false}},
		{"a refused item adds no link", []string{"s", "s", "t", "s"}, []bool{true, false}},
	} {
		if got := loops(tc.pairs...); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	// A loop made anyway (as two concurrent puts can): b under c closes
	// a <- c <- b <- a. Depths end there; the rest follow their chains.
	add("b", "c")
	add("orphan", "missing")
	add("r", "")
	add("r1", "r")
	add("r2", "r1")
	memo := map[*object]int{}
	for key, want := range map[string]int{"r": 0, "r2": 2, "r1": 1, "orphan": 0} {
		if got := f.depth(f.objects.get(key), memo); got != want {
			t.Errorf("depth(%s) = %d, want %d", key, got, want)
		}
	}
	for _, k := range []string{"a", "b", "c"} {
		if d := f.depth(f.objects.get(k), memo); d < 0 || d > 3 {
			t.Errorf("depth(%s) in a loop = %d", k, d)
		}
	}
}

// TestListPages: pages come in key order from the ordered index, bounded
// by prefix, start and limit.
func TestListPages(t *testing.T) {
	f := NewFSM()
	for _, k := range []string{"b/2", "a/1", "b/1", "b/3", "c/1", "b"} {
		f.newObject(k, 1, 0, 0, 0, "", "", nil)
	}
	keys := func(objs []*pb.ObjectInfo) (out []string) {
		for _, o := range objs {
			out = append(out, o.Key)
		}
		return out
	}
	for _, tc := range []struct {
		prefix, after string
		limit         int
		want          string
		truncated     bool
	}{
		{"b/", "", 10, "b/1 b/2 b/3", false},
		{"b/", "", 2, "b/1 b/2", true},
		{"b/", "b/2", 2, "b/3", false},
		{"b/", "a", 10, "b/1 b/2 b/3", false},
		{"", "b/3", 10, "c/1", false},
		{"b", "", 10, "b b/1 b/2 b/3", false},
		{"d", "", 10, "", false},
	} {
		objs, truncated := f.list(tc.prefix, tc.after, tc.limit)
		if got := strings.Join(keys(objs), " "); got != tc.want || truncated != tc.truncated {
			t.Errorf("list(%q, after %q, %d) = %q truncated %v, want %q %v", tc.prefix, tc.after, tc.limit, got, truncated, tc.want, tc.truncated)
		}
	}
}

// TestLoopAboveIsNoLoopOfTheKey: a loop of links that concurrent puts
// made above a chain does not get a put under that chain refused.
func TestLoopAboveIsNoLoopOfTheKey(t *testing.T) {
	f := NewFSM()
	f.newObject("x", 1, 0, 0, 0, "y", "", nil)
	f.newObject("y", 1, 0, 0, 0, "x", "", nil) // the loop x <- y <- x
	f.newObject("c", 1, 0, 0, 0, "x", "", nil)
	f.newObject("child", 1, 0, 0, 0, "k", "", nil) // so k's put walks
	if got := f.loopingParents(1, func(int) (string, string) { return "k", "c" }); got[0] {
		t.Fatal("a put of k under c, below a loop k is not on, was judged a loop")
	}
	if got := f.loopingParents(1, func(int) (string, string) { return "k", "child" }); !got[0] {
		t.Fatal("k under its own child was not judged a loop")
	}
}

// BenchmarkLoopingParentsChain: a batch of 128 blocks of one chain, as an
// engine saves a request's prefix, costs the loop check no map.
func BenchmarkLoopingParentsChain(b *testing.B) {
	f := NewFSM()
	keys := make([]string, 128)
	for i := range keys {
		keys[i] = fmt.Sprintf("kv/xxh3/%016x", i)
	}
	b.ReportAllocs()
	for b.Loop() {
		f.loopingParents(len(keys), func(i int) (string, string) {
			if i == 0 {
				return keys[0], "kv/root"
			}
			return keys[i], keys[i-1]
		})
	}
}
