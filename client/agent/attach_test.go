package agent_test

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/client/agent"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// memfd is a memfd of the calling process, mapped by it, as a process that
// attaches its own memory has one.
type memfd struct {
	name string // unique: what /proc/self/maps and /proc/self/fd name it by
	fd   int
	path string // /proc/PID/fd/N, what Attach is given
	size uint64
	mem  []byte // nil when not mapped
}

var memfdSeq atomic.Uint64

// newMemfd creates a memfd of size bytes with flags, mapped read-write
// unless nomap; it is unmapped and closed when the test ends.
func newMemfd(t *testing.T, size int, flags int, nomap bool) *memfd {
	t.Helper()
	name := fmt.Sprintf("tp-attach-%d", memfdSeq.Add(1))
	fd, err := unix.MemfdCreate(name, flags)
	if err != nil {
		t.Fatalf("memfd_create: %v", err)
	}
	m := &memfd{name: name, fd: fd, path: fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd), size: uint64(size)}
	t.Cleanup(func() {
		if m.mem != nil {
			unix.Munmap(m.mem)
		}
		unix.Close(fd)
	})
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatalf("ftruncate memfd to %d: %v", size, err)
	}
	if !nomap && size > 0 {
		if m.mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
			t.Fatalf("mmap memfd: %v", err)
		}
	}
	return m
}

// sealable is a mapped memfd that the agent can seal.
func sealable(t *testing.T, size int) *memfd {
	t.Helper()
	return newMemfd(t, size, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING, false)
}

func (m *memfd) seals(t *testing.T) int {
	t.Helper()
	seals, err := unix.FcntlInt(uintptr(m.fd), unix.F_GET_SEALS, 0)
	if err != nil {
		t.Fatalf("F_GET_SEALS: %v", err)
	}
	return seals
}

// held counts this process's mappings of m and descriptors of it: the
// test's own are one of each, the agent's (same process) come on top.
func (m *memfd) held(t *testing.T) (maps, fds int) {
	t.Helper()
	target := "/memfd:" + m.name + " (deleted)"
	data, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if strings.HasSuffix(line, target) {
			maps++
		}
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && l == target {
			fds++
		}
	}
	return maps, fds
}

// checkHeld fails unless the process holds m exactly as often as want:
// the test's own mapping and descriptor, plus the agent's.
func (m *memfd) checkHeld(t *testing.T, wantMaps, wantFDs int) {
	t.Helper()
	if maps, fds := m.held(t); maps != wantMaps || fds != wantFDs {
		t.Fatalf("memfd %s: %d mappings and %d descriptors, want %d and %d", m.name, maps, fds, wantMaps, wantFDs)
	}
}

// attach attaches m to session sess and returns its region id.
func attach(t *testing.T, f *fixture, sess uint64, m *memfd) uint32 {
	t.Helper()
	resp, err := f.ac.Attach(testCtx(t), &pb.AttachRequest{Session: sess, Path: m.path, Size: m.size})
	if err != nil {
		t.Fatalf("Attach(%s, %d bytes): %v", m.path, m.size, err)
	}
	if resp.Region == 0 {
		t.Fatalf("Attach(%s) answered region 0, the session's own", m.path)
	}
	return resp.Region
}

// put stores keys from spans through the agent and wants every item OK.
func put(t *testing.T, f *fixture, req *pb.AgentPutRequest) {
	t.Helper()
	resp, err := f.ac.BatchPut(testCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, resp.Results, codes.OK)
}

// present is the agent's Exists for keys.
func present(t *testing.T, f *fixture, keys ...string) []bool {
	t.Helper()
	resp, err := f.ac.Exists(testCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Exists) != len(keys) {
		t.Fatalf("Exists answered %d for %d keys", len(resp.Exists), len(keys))
	}
	return resp.Exists
}

func allTrue(bs []bool) bool { return !slices.Contains(bs, false) }

// TestAttachPutGet: values put from one attached region read back byte for
// byte into another attached region and into the session's own region,
// from the master and under a lookup's lease, and nothing past a value's
// bytes is written.
func TestAttachPutGet(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("attach", 1<<20)
	src, dst := sealable(t, 1<<20), sealable(t, 2<<20)
	srcID, dstID := attach(t, f, r.id, src), attach(t, f, r.id, dst)
	if srcID == dstID {
		t.Fatalf("two attachments answered the same region %d", srcID)
	}
	src.checkHeld(t, 2, 2) // the test's and the agent's

	// Five values from the attached region, one from the session's, at
	// unaligned offsets and sizes.
	const n = 6
	keys := make([]string, n)
	lens := make([]int, n)
	puts := make([]*pb.Span, n)
	off := 3
	for i := range n {
		keys[i] = fmt.Sprintf("att/%02d", i)
		lens[i] = 1000 + 7777*i
		if i == n-1 {
			copy(r.mem[off:], value(uint64(i), lens[i]))
			puts[i] = &pb.Span{Offset: uint64(off), Length: uint64(lens[i])}
		} else {
			copy(src.mem[off:], value(uint64(i), lens[i]))
			puts[i] = &pb.Span{Offset: uint64(off), Length: uint64(lens[i]), Region: srcID}
		}
		off += lens[i] + 13
	}
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: keys, Spans: puts, Chain: true})

	// The pool holds exactly the bytes of the spans.
	desc, err := f.ac.Describe(ctx, &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range desc.Results {
		if codes.Code(d.Status.GetCode()) != codes.OK || d.Size != uint64(lens[i]) || d.Checksum != client.Checksum(value(uint64(i), lens[i])) {
			t.Fatalf("%s described as %v, want %d bytes with checksum %08x", keys[i], d, lens[i], client.Checksum(value(uint64(i), lens[i])))
		}
	}

	const fill = 0xa5
	// get reads every key into region rid of mem at offsets spread apart,
	// with room to spare, and checks the bytes and what lies past them.
	get := func(t *testing.T, rid uint32, mem []byte) {
		t.Helper()
		for i := range mem {
			mem[i] = fill
		}
		spans := make([]*pb.Span, n)
		at := make([]int, n)
		o := 1
		for i := range n {
			at[i] = o
			spans[i] = &pb.Span{Offset: uint64(o), Length: uint64(lens[i] + 100), Region: rid}
			o += lens[i] + 100 + 1
		}
		resp, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: keys, Spans: spans})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK)
		for i := range n {
			got := mem[at[i] : at[i]+lens[i]]
			if resp.Sizes[i] != uint64(lens[i]) || !bytes.Equal(got, value(uint64(i), lens[i])) {
				t.Fatalf("%s into region %d: %d bytes that differ from the value put", keys[i], rid, resp.Sizes[i])
			}
			if mem[at[i]-1] != fill || mem[at[i]+lens[i]] != fill {
				t.Fatalf("%s into region %d: written outside the value", keys[i], rid)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		rid    uint32
		mem    []byte
		leased bool
	}{
		{"AttachedFromMaster", dstID, dst.mem, false},
		{"SessionFromMaster", 0, r.mem, false},
		{"AttachedLeased", dstID, dst.mem, true},
		{"SessionLeased", 0, r.mem, true},
		{"SourceRegionLeased", srcID, src.mem, true}, // a region puts left from takes gets too
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.metric("tidepool_agent_leased_gets_total")
			if tc.leased {
				if resp, err := f.ac.Lookup(ctx, &pb.LookupRequest{Keys: keys}); err != nil || resp.Matched != n {
					t.Fatalf("Lookup = %v, %v", resp, err)
				}
			}
			get(t, tc.rid, tc.mem)
			want := before
			if tc.leased {
				want += n
			}
			if got := f.metric("tidepool_agent_leased_gets_total"); got != want {
				t.Fatalf("leased gets went from %v to %v, want %v", before, got, want)
			}
		})
	}

	// The test's own writes to the region reach the agent's mapping: a put
	// after them stores the new bytes.
	copy(src.mem, value(99, 4096))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"att/late"}, Spans: []*pb.Span{{Length: 4096, Region: srcID}}})
	d, err := f.ac.Describe(ctx, &pb.KeysRequest{Keys: []string{"att/late"}})
	if err != nil || d.Results[0].Checksum != client.Checksum(value(99, 4096)) {
		t.Fatalf("Describe(att/late) = %v, %v", d, err)
	}
}

// TestAttachSpanErrors: a span outside its attached region, or naming a
// region the session has not attached, fails that key alone with
// INVALID_ARGUMENT; the other keys of the request are put or read, and the
// objects stay.
func TestAttachSpanErrors(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("spans", 1<<20)
	const size = 64 << 10
	m := sealable(t, size)
	rid := attach(t, f, r.id, m)
	// Another session's region is no region of this one.
	other := f.open("other", 4096)
	otherID := attach(t, f, other.id, sealable(t, size))
	copy(m.mem, value(1, size))

	t.Run("Put", func(t *testing.T) {
		keys := []string{"e/ok", "e/past", "e/overflow", "e/unknown", "e/other", "e/long", "e/last"}
		resp, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: keys, Spans: []*pb.Span{
			{Offset: 0, Length: 100, Region: rid},
			{Offset: size - 10, Length: 11, Region: rid},
			{Offset: math.MaxUint64, Length: 2, Region: rid},
			{Offset: 0, Length: 100, Region: rid + 100},
			{Offset: 0, Length: 100, Region: otherID + 1000}, // not attached here
			{Offset: 0, Length: size + 1, Region: rid},
			{Offset: size - 100, Length: 100, Region: rid}, // fine: the last bytes
		}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK, codes.InvalidArgument, codes.InvalidArgument, codes.InvalidArgument,
			codes.InvalidArgument, codes.InvalidArgument, codes.OK)
		if msg := resp.Results[3].Message; !strings.Contains(msg, fmt.Sprintf("no attached region %d", rid+100)) {
			t.Errorf("unknown region: %q", msg)
		}
		objs, err := f.cl.List(ctx, "e/")
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, o := range objs {
			got = append(got, o.Key)
		}
		if !slices.Equal(got, []string{"e/last", "e/ok"}) {
			t.Fatalf("List(e/) = %v, want only the two good keys", got)
		}
	})

	t.Run("Get", func(t *testing.T) {
		clear(m.mem[size/2:])
		resp, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id,
			Keys: []string{"e/ok", "e/ok", "e/ok", "e/last", "e/ok", "e/ok", "e/last", "e/ok"},
			Spans: []*pb.Span{
				{Offset: size - 50, Length: 100, Region: rid},    // past the end
				{Offset: 0, Length: 100, Region: rid + 100},      // unknown region
				{Offset: math.MaxUint64, Length: 2, Region: rid}, // offset overflows
				{Offset: size - 100, Length: 100, Region: rid},   // fine: the last bytes
				{Offset: size / 2, Length: 100, Region: rid},     // fine
				{Offset: 0, Length: 100, Region: otherID + 1000},
				{Offset: size / 2, Length: 99, Region: rid + 1}, // neither is region rid+1 attached
				{Offset: 0, Length: 100},                        // the session's region: fine
			}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.InvalidArgument, codes.InvalidArgument, codes.InvalidArgument, codes.OK,
			codes.OK, codes.InvalidArgument, codes.InvalidArgument, codes.OK)
		if !bytes.Equal(m.mem[size-100:], value(1, size)[size-100:]) || !bytes.Equal(m.mem[size/2:size/2+100], value(1, 100)) ||
			!bytes.Equal(r.mem[:100], value(1, 100)) {
			t.Fatal("a good get's bytes differ")
		}
		for i, s := range resp.Sizes {
			if want := []uint64{0, 0, 0, 100, 100, 0, 0, 100}[i]; s != want {
				t.Fatalf("sizes %v", resp.Sizes)
			}
		}
		// A short span of an attached region is OUT_OF_RANGE, as in the
		// session's.
		short, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{"e/ok"}, Spans: []*pb.Span{{Length: 99, Region: rid}}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, short.Results, codes.OutOfRange)
		if !allTrue(present(t, f, "e/ok", "e/last")) {
			t.Fatal("a refused get removed an object")
		}
	})
}

// TestAttachOverlap: gets whose spans overlap in one attached region are
// refused; equal offsets in different regions are not an overlap.
func TestAttachOverlap(t *testing.T) {
	f := newFixture(t, agent.Config{LeasedBlocks: -1})
	ctx := testCtx(t)
	r := f.open("overlap", 1<<20)
	const n = 32 << 10
	a, b := sealable(t, 4*n), sealable(t, 4*n)
	aID, bID := attach(t, f, r.id, a), attach(t, f, r.id, b)
	keys := []string{"ov/a", "ov/b", "ov/c"}
	for i := range keys {
		copy(r.mem[i*n:], value(uint64(i), n))
	}
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: keys,
		Spans: []*pb.Span{{Offset: 0, Length: n}, {Offset: n, Length: n}, {Offset: 2 * n, Length: n}}})

	for _, tc := range []struct {
		name  string
		spans []*pb.Span
		want  []codes.Code
	}{
		{"same region, partly", []*pb.Span{{Offset: 0, Length: n, Region: aID}, {Offset: n / 2, Length: n, Region: aID}, {Offset: 2 * n, Length: n, Region: aID}},
			[]codes.Code{codes.InvalidArgument, codes.InvalidArgument, codes.OK}},
		{"same region, same span", []*pb.Span{{Offset: n, Length: n, Region: bID}, {Offset: n, Length: n, Region: bID}, {Offset: 0, Length: n, Region: aID}},
			[]codes.Code{codes.InvalidArgument, codes.InvalidArgument, codes.OK}},
		{"one span inside another", []*pb.Span{{Offset: 0, Length: 3 * n, Region: aID}, {Offset: 3 * n, Length: n, Region: aID}, {Offset: n, Length: n, Region: aID}},
			[]codes.Code{codes.InvalidArgument, codes.OK, codes.InvalidArgument}},
		{"equal offsets, three regions", []*pb.Span{{Offset: n, Length: n, Region: aID}, {Offset: n, Length: n, Region: bID}, {Offset: n, Length: n}},
			[]codes.Code{codes.OK, codes.OK, codes.OK}},
		{"adjacent", []*pb.Span{{Offset: 0, Length: n, Region: aID}, {Offset: n, Length: n, Region: aID}, {Offset: 2 * n, Length: n, Region: aID}},
			[]codes.Code{codes.OK, codes.OK, codes.OK}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(a.mem)
			clear(b.mem)
			got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: keys, Spans: tc.spans})
			if err != nil {
				t.Fatal(err)
			}
			checkItems(t, got.Results, tc.want...)
			mems := map[uint32][]byte{aID: a.mem, bID: b.mem}
			for i, sp := range tc.spans {
				if tc.want[i] != codes.OK {
					continue
				}
				mem := r.mem
				if sp.Region != 0 {
					mem = mems[sp.Region]
				}
				if !bytes.Equal(mem[sp.Offset:sp.Offset+n], value(uint64(i), n)) {
					t.Fatalf("%s in region %d: bytes differ", keys[i], sp.Region)
				}
			}
			if !allTrue(present(t, f, keys...)) {
				t.Fatal("an object was dropped: a healthy replica was reported corrupt")
			}
		})
	}
}

// TestAttachRefusals: Attach maps only a memfd of the announced size that it
// can seal, of a session that exists; what it refuses it leaves as it was,
// holding no descriptor or mapping of it.
func TestAttachRefusals(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("refusals", 4096)
	closed := f.open("closed", 4096)
	if _, err := f.ac.Close(ctx, &pb.SessionRef{Session: closed.id}); err != nil {
		t.Fatal(err)
	}
	pid := os.Getpid()
	// Refused before the agent opens the path: the memfd must keep its
	// seals as they were.
	early := map[string]bool{"size 0": true, "size implausible": true, "unknown session": true, "closed session": true, "no session": true}

	for _, tc := range []struct {
		name string
		// setup answers the request, and the memfd it names if any.
		setup func(t *testing.T) (req *pb.AttachRequest, m *memfd)
		code  codes.Code
		msg   string
	}{
		{"regular file", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			file, err := os.CreateTemp(t.TempDir(), "region")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { file.Close() })
			if err := file.Truncate(4096); err != nil {
				t.Fatal(err)
			}
			return &pb.AttachRequest{Session: r.id, Path: fmt.Sprintf("/proc/%d/fd/%d", pid, file.Fd()), Size: 4096}, nil
		}, codes.InvalidArgument, "not a memfd"},
		{"regular file by name", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			path := filepath.Join(t.TempDir(), "region")
			if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
				t.Fatal(err)
			}
			return &pb.AttachRequest{Session: r.id, Path: path, Size: 4096}, nil
		}, codes.InvalidArgument, "not a memfd"},
		{"pipe", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(p[0]); unix.Close(p[1]) })
			return &pb.AttachRequest{Session: r.id, Path: fmt.Sprintf("/proc/%d/fd/%d", pid, p[0]), Size: 4096}, nil
		}, codes.InvalidArgument, "not a memfd"},
		{"directory", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			return &pb.AttachRequest{Session: r.id, Path: t.TempDir(), Size: 4096}, nil
		}, codes.InvalidArgument, "open"},
		{"memfd larger than announced", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 8192)
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 4096}, m
		}, codes.InvalidArgument, "the memfd is 8192 bytes, not 4096"},
		{"memfd smaller than announced", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 8192}, m
		}, codes.InvalidArgument, "the memfd is 4096 bytes, not 8192"},
		{"empty memfd", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 0)
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 4096}, m
		}, codes.InvalidArgument, "not 4096"},
		{"memfd without sealing", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := newMemfd(t, 4096, unix.MFD_CLOEXEC, false)
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 4096}, m
		}, codes.InvalidArgument, "MFD_ALLOW_SEALING"},
		{"memfd sealed against sealing only", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			if _, err := unix.FcntlInt(uintptr(m.fd), unix.F_ADD_SEALS, unix.F_SEAL_SEAL); err != nil {
				t.Fatal(err)
			}
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 4096}, m
		}, codes.InvalidArgument, "cannot seal"},
		{"memfd sealed against shrinking only", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			if _, err := unix.FcntlInt(uintptr(m.fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
				t.Fatal(err)
			}
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 4096}, m
		}, codes.InvalidArgument, "cannot seal"},
		{"nonexistent path", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			return &pb.AttachRequest{Session: r.id, Path: filepath.Join(t.TempDir(), "none"), Size: 4096}, nil
		}, codes.InvalidArgument, "open"},
		{"closed descriptor", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			fd, err := unix.MemfdCreate("tp-closed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
			if err != nil {
				t.Fatal(err)
			}
			unix.Close(fd)
			return &pb.AttachRequest{Session: r.id, Path: fmt.Sprintf("/proc/%d/fd/%d", pid, fd), Size: 4096}, nil
		}, codes.InvalidArgument, "open"},
		{"empty path", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			return &pb.AttachRequest{Session: r.id, Size: 4096}, nil
		}, codes.InvalidArgument, ""},
		{"size 0", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Session: r.id, Path: m.path}, m
		}, codes.InvalidArgument, "attach 0 bytes"},
		{"size implausible", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Session: r.id, Path: m.path, Size: 1<<50 + 1}, m
		}, codes.InvalidArgument, "want 1 to"},
		{"unknown session", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Session: r.id + 1, Path: m.path, Size: 4096}, m
		}, codes.NotFound, "unknown session"},
		{"closed session", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Session: closed.id, Path: m.path, Size: 4096}, m
		}, codes.NotFound, "unknown session"},
		{"no session", func(t *testing.T) (*pb.AttachRequest, *memfd) {
			m := sealable(t, 4096)
			return &pb.AttachRequest{Path: m.path, Size: 4096}, m
		}, codes.NotFound, "unknown session"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, m := tc.setup(t)
			var seals int
			if m != nil {
				seals = m.seals(t)
			}
			resp, err := f.ac.Attach(ctx, req)
			if st := status.Convert(err); st.Code() != tc.code || !strings.Contains(st.Message(), tc.msg) {
				t.Fatalf("Attach = %v, %v; want %v containing %q", resp, err, tc.code, tc.msg)
			}
			if m == nil {
				return
			}
			// Refused, the memfd is the caller's alone, and as it was.
			wantMaps := 1
			if m.mem == nil {
				wantMaps = 0
			}
			m.checkHeld(t, wantMaps, 1)
			if got := m.seals(t); early[tc.name] && got != seals {
				t.Fatalf("a refused memfd's seals went from %#x to %#x", seals, got)
			}
		})
	}

	// Sealed against writes, a memfd cannot be mapped for gets: refused,
	// and nothing kept. (The agent answers INTERNAL for it, as for any
	// mmap failure, though the memfd is the caller's mistake.)
	t.Run("write-sealed memfd", func(t *testing.T) {
		m := newMemfd(t, 4096, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING, true)
		if _, err := unix.FcntlInt(uintptr(m.fd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE); err != nil {
			t.Fatal(err)
		}
		_, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: m.path, Size: m.size})
		if status.Code(err) == codes.OK {
			t.Fatal("a write-sealed memfd was attached")
		}
		t.Logf("write-sealed memfd: %v", err)
		m.checkHeld(t, 0, 1)
	})

	// The session is untouched: a good memfd attaches as its first region.
	if id := attach(t, f, r.id, sealable(t, 4096)); id != 1 {
		t.Fatalf("after the refusals the first region is %d", id)
	}
}

// TestAttachSealed: once attached, the memfd cannot shrink or grow, so the
// caller cannot fault the agent's mapping; it stays writable. A memfd the
// caller sealed that way itself attaches too.
func TestAttachSealed(t *testing.T) {
	f := newFixture(t, agent.Config{})
	r := f.open("sealed", 4096)
	const size = 1 << 20

	m := sealable(t, size)
	if s := m.seals(t); s != 0 {
		t.Fatalf("a fresh memfd has seals %#x", s)
	}
	rid := attach(t, f, r.id, m)
	const want = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW
	if s := m.seals(t); s&want != want {
		t.Fatalf("after Attach the seals are %#x, want %#x set", s, want)
	}
	if s := m.seals(t); s&(unix.F_SEAL_WRITE|unix.F_SEAL_FUTURE_WRITE) != 0 {
		t.Fatalf("after Attach the seals are %#x: the caller may no longer write", s)
	}
	for _, n := range []int64{0, size / 2, size + 1, 2 * size} {
		if err := unix.Ftruncate(m.fd, n); err == nil {
			t.Fatalf("an attached memfd of %d bytes was truncated to %d", size, n)
		}
		if err := os.Truncate(m.path, n); err == nil {
			t.Fatalf("an attached memfd of %d bytes was truncated to %d by path", size, n)
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(m.fd, &st); err != nil || st.Size != size {
		t.Fatalf("fstat = %d bytes, %v", st.Size, err)
	}
	// Still a working region: the caller writes, the agent puts from it.
	copy(m.mem[size-5000:], value(3, 5000))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"sealed/a"}, Spans: []*pb.Span{{Offset: size - 5000, Length: 5000, Region: rid}}})

	// Sealed by the caller already, F_SEAL_SEAL included: nothing left to
	// add, and nothing can change its size.
	pre := sealable(t, 4096)
	if _, err := unix.FcntlInt(uintptr(pre.fd), unix.F_ADD_SEALS, want|unix.F_SEAL_SEAL); err != nil {
		t.Fatal(err)
	}
	if id := attach(t, f, r.id, pre); id == rid {
		t.Fatalf("a second attachment answered region %d again", id)
	}
}

// TestAttachLimit: a session attaches at most MaxAttached regions; one
// more is RESOURCE_EXHAUSTED and leaves the memfd alone, and detaching
// makes room. Region ids are not reused.
func TestAttachLimit(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("limit", 4096)
	ids := map[uint32]bool{}
	for range agent.MaxAttached {
		id := attach(t, f, r.id, sealable(t, 4096))
		if ids[id] {
			t.Fatalf("region %d answered twice", id)
		}
		ids[id] = true
	}
	extra := sealable(t, 4096)
	_, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: extra.path, Size: extra.size})
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "too many attached regions") {
		t.Fatalf("Attach beyond %d: %v, want %v", agent.MaxAttached, err, codes.ResourceExhausted)
	}
	extra.checkHeld(t, 1, 1)
	if s := extra.seals(t); s != 0 {
		t.Fatalf("a refused memfd got seals %#x", s)
	}

	// The limit is per session.
	other := f.open("other", 4096)
	attach(t, f, other.id, sealable(t, 4096))

	var first uint32 = math.MaxUint32
	for id := range ids {
		first = min(first, id)
	}
	if _, err := f.ac.Detach(ctx, &pb.DetachRequest{Session: r.id, Region: first}); err != nil {
		t.Fatal(err)
	}
	id := attach(t, f, r.id, extra)
	if ids[id] {
		t.Fatalf("region id %d reused: a stale id would reach the new region", id)
	}
	// At the limit, attaching what is attached answers its region (a retry);
	// new memory is refused.
	if resp, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: extra.path, Size: extra.size}); err != nil || resp.Region != id {
		t.Fatalf("Attach of region %d again at the limit: %v, %v", id, resp, err)
	}
	more := sealable(t, 4096)
	if _, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: more.path, Size: more.size}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Attach beyond %d again: %v", agent.MaxAttached, err)
	}
}

// TestDetach: a detached region is unmapped and closed by the agent (the
// caller's mapping stays), spans naming it fail, and detaching what is not
// attached is NOT_FOUND.
func TestDetach(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("detach", 1<<20)
	const size = 64 << 10
	m, keep := sealable(t, size), sealable(t, size)
	rid, keepID := attach(t, f, r.id, m), attach(t, f, r.id, keep)
	copy(m.mem, value(5, size))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"det/a"}, Spans: []*pb.Span{{Length: size, Region: rid}}})
	m.checkHeld(t, 2, 2)

	if _, err := f.ac.Detach(ctx, &pb.DetachRequest{Session: r.id, Region: rid}); err != nil {
		t.Fatal(err)
	}
	m.checkHeld(t, 1, 1)
	keep.checkHeld(t, 2, 2)
	// The caller's mapping is its own.
	if !bytes.Equal(m.mem, value(5, size)) {
		t.Fatal("the caller's mapping changed on Detach")
	}
	m.mem[0] ^= 0xff

	got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{"det/a", "det/a", "det/a"},
		Spans: []*pb.Span{{Length: size, Region: rid}, {Length: size, Region: keepID}, {Length: size}}})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, got.Results, codes.InvalidArgument, codes.OK, codes.OK)
	if !bytes.Equal(keep.mem, value(5, size)) || !bytes.Equal(r.mem[:size], value(5, size)) {
		t.Fatal("bytes differ")
	}
	pr, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: []string{"det/b", "det/c"},
		Spans: []*pb.Span{{Length: 100, Region: rid}, {Length: 100, Region: keepID}}})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, pr.Results, codes.InvalidArgument, codes.OK)

	for _, tc := range []struct {
		name string
		req  *pb.DetachRequest
		code codes.Code
	}{
		{"again", &pb.DetachRequest{Session: r.id, Region: rid}, codes.NotFound},
		{"unknown region", &pb.DetachRequest{Session: r.id, Region: keepID + 100}, codes.NotFound},
		{"the session's own region", &pb.DetachRequest{Session: r.id, Region: 0}, codes.NotFound},
		{"unknown session", &pb.DetachRequest{Session: r.id + 1, Region: keepID}, codes.NotFound},
	} {
		if _, err := f.ac.Detach(ctx, tc.req); status.Code(err) != tc.code {
			t.Errorf("Detach %s: %v, want %v", tc.name, err, tc.code)
		}
	}
	keep.checkHeld(t, 2, 2) // none of those touched it

	// Detached, the memfd may be attached again (its seals are already
	// there), under a new id.
	if id := attach(t, f, r.id, m); id == rid || id == keepID {
		t.Fatalf("attached again as region %d", id)
	}
	m.checkHeld(t, 2, 2)
}

// TestAttachSessionEnds: however a session ends, the agent unmaps and
// closes its attached regions; the caller's own mappings stay valid.
func TestAttachSessionEnds(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  agent.Config
		end  func(t *testing.T, f *fixture, r region)
	}{
		{"Close", agent.Config{}, func(t *testing.T, f *fixture, r region) {
			if _, err := f.ac.Close(testCtx(t), &pb.SessionRef{Session: r.id}); err != nil {
				t.Fatal(err)
			}
		}},
		{"Idle", agent.Config{SessionIdle: 300 * time.Millisecond}, func(t *testing.T, f *fixture, r region) {
			waitFor(t, 10*time.Second, "the idle session to end", func() bool {
				st, err := f.ac.Stats(testCtx(t), &pb.SessionRef{})
				return err == nil && st.Sessions == 0
			})
		}},
		{"AgentClose", agent.Config{}, func(t *testing.T, f *fixture, r region) {
			if err := f.agent.Close(); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.cfg)
			r := f.open("ends", 4096)
			ms := []*memfd{sealable(t, 64<<10), sealable(t, 128<<10)}
			for i, m := range ms {
				attach(t, f, r.id, m)
				copy(m.mem, value(uint64(i), len(m.mem)))
				m.checkHeld(t, 2, 2)
			}
			tc.end(t, f, r)
			for i, m := range ms {
				waitFor(t, 10*time.Second, "the agent to let go of "+m.name, func() bool {
					maps, fds := m.held(t)
					return maps == 1 && fds == 1
				})
				if !bytes.Equal(m.mem, value(uint64(i), len(m.mem))) {
					t.Fatalf("memfd %d: the caller's bytes changed", i)
				}
				m.mem[len(m.mem)-1] = 1 // and it is still writable
			}
			if tc.name == "AgentClose" {
				return
			}
			extra := sealable(t, 4096)
			if _, err := f.ac.Attach(testCtx(t), &pb.AttachRequest{Session: r.id, Path: extra.path, Size: extra.size}); status.Code(err) != codes.NotFound {
				t.Fatalf("Attach to an ended session: %v", err)
			}
			if _, err := f.ac.Detach(testCtx(t), &pb.DetachRequest{Session: r.id, Region: 1}); status.Code(err) != codes.NotFound {
				t.Fatalf("Detach of an ended session: %v", err)
			}
			extra.checkHeld(t, 1, 1)
		})
	}
}

// TestExistsDescribe: Exists answers per key, an invalid key absent;
// Describe answers each key's size, checksum and replicas, NOT_FOUND for
// an absent key and INVALID_ARGUMENT for an invalid one.
func TestExistsDescribe(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("exists", 1<<20)
	copy(r.mem, value(1, 1000))
	copy(r.mem[4096:], value(2, 5000))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"ex/a", "ex/b"},
		Spans: []*pb.Span{{Length: 1000}, {Offset: 4096, Length: 5000}}})
	long := strings.Repeat("k", client.MaxKeyLen+1)

	t.Run("Exists", func(t *testing.T) {
		keys := []string{"ex/a", "ex/none", "", "ex/b", long, "ex/a", "ex/"}
		want := []bool{true, false, false, true, false, true, false}
		got := present(t, f, keys...)
		if !slices.Equal(got, want) {
			t.Fatalf("Exists(%q) = %v, want %v", keys, got, want)
		}
		direct, err := f.cl.Present(ctx, keys)
		if err != nil || !slices.Equal(direct, want) {
			t.Fatalf("client Present = %v, %v; want %v", direct, err, want)
		}
		if got := present(t, f, ""); !slices.Equal(got, []bool{false}) {
			t.Fatalf("Exists(\"\") = %v", got)
		}
		if _, err := f.ac.Exists(ctx, &pb.KeysRequest{}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Exists without keys: %v", err)
		}
		if _, err := f.ac.Exists(ctx, &pb.KeysRequest{Keys: make([]string, agent.MaxBatchKeys+1)}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Exists of too many keys: %v", err)
		}
	})

	t.Run("Describe", func(t *testing.T) {
		keys := []string{"ex/a", "ex/none", "", "ex/b", long}
		resp, err := f.ac.Describe(ctx, &pb.KeysRequest{Keys: keys})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Results) != len(keys) {
			t.Fatalf("%d results for %d keys", len(resp.Results), len(keys))
		}
		items := make([]*pb.ItemStatus, len(keys))
		for i, d := range resp.Results {
			items[i] = d.Status
		}
		checkItems(t, items, codes.OK, codes.NotFound, codes.InvalidArgument, codes.OK, codes.InvalidArgument)
		for i, want := range map[int][]byte{0: value(1, 1000), 3: value(2, 5000)} {
			d := resp.Results[i]
			if d.Size != uint64(len(want)) || d.Checksum != client.Checksum(want) {
				t.Fatalf("%s: %d bytes, checksum %08x; want %d, %08x", keys[i], d.Size, d.Checksum, len(want), client.Checksum(want))
			}
			if len(d.Replicas) != 1 || d.Replicas[0].Node != "s0" || d.Replicas[0].Tier != pb.Tier_TIER_DRAM || d.Replicas[0].Endpoint == "" {
				t.Fatalf("%s: replicas %v, want one in DRAM on s0", keys[i], d.Replicas)
			}
		}
		for _, i := range []int{1, 2, 4} {
			if d := resp.Results[i]; d.Size != 0 || d.Checksum != 0 || len(d.Replicas) != 0 {
				t.Fatalf("%q: a failed item describes %v", keys[i], d)
			}
		}
		if _, err := f.ac.Describe(ctx, &pb.KeysRequest{}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Describe without keys: %v", err)
		}
	})
}

// keysOf lists every key of the pool with the prefix.
func keysOf(t *testing.T, f *fixture, prefix string) []string {
	t.Helper()
	objs, err := f.cl.List(testCtx(t), prefix)
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, len(objs))
	for i, o := range objs {
		keys[i] = o.Key
	}
	return keys
}

// TestClearRegex: Clear narrows its prefix by a regex matched anywhere in
// the key, or clears the whole pool with all; it refuses a bad regex and a
// request with neither prefix nor all, removing nothing.
func TestClearRegex(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	all := []string{"clr/a1", "clr/a2", "clr/b1", "clr/b2", "clr/xa1", "clrx/a1", "keep/a1", "keep/b1"}
	vals := make([][]byte, len(all))
	for i := range vals {
		vals[i] = value(uint64(i), 64)
	}
	for i, err := range f.cl.BatchPut(ctx, all, vals) {
		if err != nil {
			t.Fatalf("put %s: %v", all[i], err)
		}
	}

	for _, tc := range []struct {
		name    string
		req     *pb.ClearRequest
		code    codes.Code
		removed uint64
		left    []string
	}{
		{"bad regex", &pb.ClearRequest{Prefix: "clr/", Regex: "a("}, codes.InvalidArgument, 0, all},
		{"bad regex with all", &pb.ClearRequest{All: true, Regex: "[z-a]"}, codes.InvalidArgument, 0, all},
		{"neither prefix nor all", &pb.ClearRequest{}, codes.InvalidArgument, 0, all},
		{"a regex alone", &pb.ClearRequest{Regex: "."}, codes.InvalidArgument, 0, all},
		{"no match", &pb.ClearRequest{Prefix: "clr/", Regex: "zzz"}, codes.OK, 0, all},
		{"prefix and regex", &pb.ClearRequest{Prefix: "clr/", Regex: "/a[0-9]$"}, codes.OK, 2,
			[]string{"clr/b1", "clr/b2", "clr/xa1", "clrx/a1", "keep/a1", "keep/b1"}},
		{"regex sees the whole key", &pb.ClearRequest{Prefix: "clr/", Regex: "^clr/x"}, codes.OK, 1,
			[]string{"clr/b1", "clr/b2", "clrx/a1", "keep/a1", "keep/b1"}},
		{"all narrowed by regex", &pb.ClearRequest{All: true, Regex: "b1$"}, codes.OK, 2,
			[]string{"clr/b2", "clrx/a1", "keep/a1"}},
		{"all narrowed by prefix", &pb.ClearRequest{All: true, Prefix: "clr"}, codes.OK, 2,
			[]string{"keep/a1"}},
		{"all", &pb.ClearRequest{All: true}, codes.OK, 1, nil},
		{"all of nothing", &pb.ClearRequest{All: true}, codes.OK, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := f.ac.Clear(ctx, tc.req)
			if status.Code(err) != tc.code {
				t.Fatalf("Clear(%v) = %v, %v; want %v", tc.req, resp, err, tc.code)
			}
			if err == nil && resp.Removed != tc.removed {
				t.Fatalf("Clear(%v) removed %d, want %d", tc.req, resp.Removed, tc.removed)
			}
			if left := keysOf(t, f, ""); !slices.Equal(left, tc.left) {
				t.Fatalf("after Clear(%v) the pool holds %v, want %v", tc.req, left, tc.left)
			}
		})
	}
}

// TestClearPages: Clear walks the table a page at a time (1000 objects), so
// it removes everything matching however many pages that takes.
func TestClearPages(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("pages", 1<<20)
	const n, size, batch = 2500, 16, 1000
	keys := make([]string, n)
	spans := make([]*pb.Span, n)
	for i := range n {
		keys[i] = fmt.Sprintf("page/%04d", i)
		spans[i] = &pb.Span{Offset: uint64(i * size), Length: size}
		copy(r.mem[i*size:], value(uint64(i), size))
	}
	for i := 0; i < n; i += batch {
		j := min(i+batch, n)
		put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: keys[i:j], Spans: spans[i:j]})
	}
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"pagex/0", "pag"}, Spans: spans[:2]})
	if got := len(keysOf(t, f, "page/")); got != n {
		t.Fatalf("%d objects put, want %d", got, n)
	}

	// Every other key, over three pages.
	resp, err := f.ac.Clear(ctx, &pb.ClearRequest{Prefix: "page/", Regex: "[13579]$"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Removed != n/2 {
		t.Fatalf("Clear of the odd keys removed %d, want %d", resp.Removed, n/2)
	}
	left := keysOf(t, f, "page/")
	if len(left) != n/2 || left[0] != "page/0000" || left[len(left)-1] != "page/2498" {
		t.Fatalf("%d keys left, from %v", len(left), left[:min(3, len(left))])
	}
	for _, k := range left {
		if strings.ContainsAny(k[len(k)-1:], "13579") {
			t.Fatalf("%s is left", k)
		}
	}

	resp, err = f.ac.Clear(ctx, &pb.ClearRequest{Prefix: "page/"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Removed != n/2 {
		t.Fatalf("Clear of the rest removed %d, want %d", resp.Removed, n/2)
	}
	if left := keysOf(t, f, "page"); !slices.Equal(left, []string{"pagex/0"}) {
		t.Fatalf("after Clear(page/) the pool holds %v under page", left)
	}
	if ex := present(t, f, keys[0], keys[999], keys[1000], keys[2000], keys[n-1]); slices.Contains(ex, true) {
		t.Fatalf("Exists after Clear = %v", ex)
	}

	// And all=true over pages, everything at once.
	for i := 0; i < n; i += batch {
		j := min(i+batch, n)
		put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: keys[i:j], Spans: spans[i:j]})
	}
	resp, err = f.ac.Clear(ctx, &pb.ClearRequest{All: true})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Removed != n+2 {
		t.Fatalf("Clear(all) removed %d, want %d", resp.Removed, n+2)
	}
	if left := keysOf(t, f, ""); len(left) != 0 {
		t.Fatalf("after Clear(all) %d keys are left, from %v", len(left), left[:min(3, len(left))])
	}
}

// TestPutReplicas: AgentPutRequest.replicas asks for copies on distinct
// store nodes; with fewer nodes than asked the put still succeeds, with one
// copy per node.
func TestPutReplicas(t *testing.T) {
	f := newFixture(t, agent.Config{}) // one store, s0
	ctx := testCtx(t)
	r := f.open("replicas", 1<<20)
	const size = 8192
	copy(r.mem, value(7, size))
	span := []*pb.Span{{Length: size}}

	// replicas puts key with that many replicas and answers the nodes of
	// its copies.
	replicas := func(t *testing.T, key string, n uint32) []string {
		t.Helper()
		put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{key}, Spans: span, Replicas: n})
		d, err := f.ac.Describe(ctx, &pb.KeysRequest{Keys: []string{key}})
		if err != nil {
			t.Fatal(err)
		}
		o := d.Results[0]
		if codes.Code(o.Status.GetCode()) != codes.OK || o.Size != size || o.Checksum != client.Checksum(value(7, size)) {
			t.Fatalf("%s described as %v", key, o)
		}
		var nodes []string
		for _, rep := range o.Replicas {
			nodes = append(nodes, rep.Node)
		}
		slices.Sort(nodes)
		if len(slices.Compact(slices.Clone(nodes))) != len(nodes) {
			t.Fatalf("%s: two replicas on one node: %v", key, nodes)
		}
		// It reads back.
		got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{key}, Spans: []*pb.Span{{Offset: 1 << 19, Length: size}}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, got.Results, codes.OK)
		if !bytes.Equal(r.mem[1<<19:1<<19+size], value(7, size)) {
			t.Fatalf("%s: bytes differ", key)
		}
		return nodes
	}

	for _, n := range []uint32{0, 1, 2, 3} {
		if nodes := replicas(t, fmt.Sprintf("rep/one-store/%d", n), n); !slices.Equal(nodes, []string{"s0"}) {
			t.Fatalf("one store, %d replicas asked: on %v", n, nodes)
		}
	}

	// Two more stores in the same cluster.
	st, err := f.cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"s1", "s2"} {
		mastertest.StartStore(t, []string{st.LeaderAddress}, id, 64<<20, nil)
	}
	waitFor(t, 10*time.Second, "three live segments", func() bool {
		st, err := f.cl.Status(ctx)
		return err == nil && len(st.Segments) == 3
	})
	for _, tc := range []struct {
		n    uint32
		want int
	}{{0, 1}, {1, 1}, {2, 2}, {3, 3}, {5, 3}} {
		if nodes := replicas(t, fmt.Sprintf("rep/three-stores/%d", tc.n), tc.n); len(nodes) != tc.want {
			t.Fatalf("three stores, %d replicas asked: on %v, want %d", tc.n, nodes, tc.want)
		}
	}
}

// TestAttachResizeRace: a caller that resizes its memfd while Attach runs
// must not leave the agent mapping more than the sealed file holds (a
// transfer past its end would fault the agent with SIGBUS). Attach either
// refuses, or the memfd it attached is sealed at the announced size. The
// test never touches an attached region, so a failure is reported, not a
// crash.
func TestAttachResizeRace(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("resize", 4096)
	const size = 1 << 20
	attached := 0
	for try := range 200 {
		m := newMemfd(t, size, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING, true)
		var stop atomic.Bool
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := 0; !stop.Load(); i++ {
				n := int64(size)
				if i%2 == 1 {
					n = 4096
				}
				if unix.Ftruncate(m.fd, n) != nil {
					return // sealed
				}
			}
		}()
		resp, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: m.path, Size: size})
		stop.Store(true)
		<-done
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("try %d: Attach = %v, want OK or %v", try, err, codes.InvalidArgument)
			}
			continue
		}
		attached++
		var st unix.Stat_t
		if err := unix.Fstat(m.fd, &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != size {
			t.Fatalf("try %d: region %d attached as %d bytes, but the memfd it sealed is %d bytes: "+
				"Attach checked the size before sealing, and a span past %d would fault the agent",
				try, resp.Region, size, st.Size, st.Size)
		}
		if _, err := f.ac.Detach(ctx, &pb.DetachRequest{Session: r.id, Region: resp.Region}); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d of 200 racing attachments succeeded, all at the announced size", attached)
}

// TestAttachAliases: memory that is already a region of the session is the
// same region again (the same memfd by another path: a retry of an Attach
// whose answer was lost), and the session's own region is refused: two
// regions over the same bytes would let two gets of one request land in
// one place, past the overlap check.
func TestAttachAliases(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("aliases", 1<<20)
	m := sealable(t, 1<<20)
	rid := attach(t, f, r.id, m)
	dup, err := unix.Dup(m.fd)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dup)
	for name, path := range map[string]string{"same path": m.path, "another fd": fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), dup)} {
		resp, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: path, Size: m.size})
		if err != nil || resp.Region != rid {
			t.Errorf("%s: Attach = %v, %v; want region %d again", name, resp, err, rid)
		}
	}
	m.checkHeld(t, 2, 3) // the test's mapping, fd and dup, and the agent's one region: nothing more
	_, err = f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: r.path, Size: r.size})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("its own region: Attach = %v, want InvalidArgument", err)
	}
	// Another session may attach it: its requests are checked on their own.
	other := f.open("aliases-2", 1<<20)
	attach(t, f, other.id, m)
}
