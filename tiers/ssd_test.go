package tiers

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine"
)

const ssdTestCapacity = 8 << 20

func newTestSSD(t testing.TB, dir string, capacity int64) *SSDTier {
	t.Helper()
	tier, err := NewSSD("ssd0", dir, capacity)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tier.Close() })
	return tier
}

// alignedBuf returns n bytes whose address is a multiple of ssdAlign.
func alignedBuf(n int) []byte {
	b := make([]byte, 2*ssdAlign+n)
	skip := int(-uintptr(unsafe.Pointer(&b[0])) & (ssdAlign - 1))
	return b[skip : skip+n : skip+n]
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>12)
	}
	return b
}

func TestSSD(t *testing.T) {
	dir := t.TempDir()
	tier, err := NewSSD("ssd0", dir, ssdTestCapacity)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%v", tier)
	seg := tier.Segment()
	if _, ok := seg.(engine.Mapped); ok {
		t.Error("an SSD segment must not be Mapped")
	}
	if s, ok := seg.(engine.Shareable); !ok || s.ShareFD() < 0 {
		t.Error("an SSD segment must be Shareable with an open fd")
	}
	if f, ok := seg.(engine.FileBacked); !ok || !f.FileBacked() {
		t.Error("an SSD segment must be FileBacked")
	}
	if tier.Name() != "ssd0" || tier.Path() != filepath.Join(dir, "ssd0.data") {
		t.Errorf("name %q path %q", tier.Name(), tier.Path())
	}
	st, err := os.Stat(tier.Path())
	if err != nil || st.Size() != ssdTestCapacity {
		t.Fatalf("data file: %v, %v; want %d bytes", st, err, ssdTestCapacity)
	}
	if _, err := os.Stat(tier.Path() + ".tmp"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary data file left behind: %v", err)
	}
	testTier(t, tier, SSD, ssdTestCapacity)
	if fd := tier.ShareFD(); fd != -1 {
		t.Errorf("ShareFD after Close = %d, want -1", fd)
	}
}

func TestSSDInvalid(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name     string
		capacity int64
	}{{"ssd0", 0}, {"ssd0", -1}, {"", 1 << 20}, {"a/b", 1 << 20}, {strings.Repeat("n", engine.MaxSegmentName+1), 1 << 20}} {
		if tier, err := NewSSD(tc.name, dir, tc.capacity); err == nil {
			tier.Close()
			t.Errorf("NewSSD(%q, %d) succeeded", tc.name, tc.capacity)
		}
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if tier, err := NewSSD("ssd0", file, 1<<20); err == nil {
		tier.Close()
		t.Error("NewSSD in a directory that is a file succeeded")
	}
	// A data file that is not a regular file.
	if err := os.Mkdir(filepath.Join(dir, "odd.data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if tier, err := NewSSD("odd", dir, 1<<20); err == nil {
		tier.Close()
		t.Error("NewSSD over a directory named like the data file succeeded")
	} else {
		t.Log(err)
	}
}

// TestSSDPaths checks which path serves an access: O_DIRECT from the
// caller's buffer for whole blocks from an aligned buffer, O_DIRECT through
// a bounce buffer for other reads and for writes that start on a block, the
// page cache only for writes that do not (where the filesystem allows
// O_DIRECT at all), and that all of them see each other's bytes.
func TestSSDPaths(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	t.Logf("O_DIRECT available: %v", tier.DirectIO())

	const (
		direct = iota
		bounced
		buffered
	)
	check := func(what string, want int, f func() error) {
		t.Helper()
		d0, bo0, b0 := tier.nDirect.Load(), tier.nBounced.Load(), tier.nBuffered.Load()
		if err := f(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		got := [3]int64{tier.nDirect.Load() - d0, tier.nBounced.Load() - bo0, tier.nBuffered.Load() - b0}
		if !tier.DirectIO() {
			want = buffered
		}
		var w [3]int64
		w[want] = 1
		if got != w {
			t.Errorf("%s: direct, bounced, buffered accesses %v, want %v", what, got, w)
		}
	}
	const n = 64 << 10
	want := pattern(n, 1)
	buf := alignedBuf(n)
	copy(buf, want)
	got := alignedBuf(n)

	check("aligned write", direct, func() error { _, err := tier.WriteAt(buf, 3*ssdAlign); return err })
	check("unaligned-offset read", bounced, func() error {
		p := make([]byte, n-1)
		if _, err := tier.ReadAt(p, 3*ssdAlign+1); err != nil {
			return err
		}
		if !bytes.Equal(p, want[1:]) {
			return errors.New("bounced read does not see the direct write")
		}
		return nil
	})
	check("aligned read", direct, func() error {
		if _, err := tier.ReadAt(got, 3*ssdAlign); err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return errors.New("bytes differ")
		}
		return nil
	})

	want2 := pattern(n, 9)
	check("unaligned-address write", bounced, func() error {
		p := alignedBuf(n + 1)[1:]
		copy(p, want2)
		_, err := tier.WriteAt(p, 3*ssdAlign)
		return err
	})
	check("aligned read after bounced write", direct, func() error {
		if _, err := tier.ReadAt(got, 3*ssdAlign); err != nil {
			return err
		}
		if !bytes.Equal(got, want2) {
			return errors.New("direct read does not see the bounced write")
		}
		return nil
	})
	check("unaligned-length read", bounced, func() error {
		_, err := tier.ReadAt(got[:n-100], 3*ssdAlign)
		return err
	})
	check("unaligned-offset write", buffered, func() error {
		_, err := tier.WriteAt(buf, 3*ssdAlign+512)
		return err
	})
	check("direct read after buffered write", direct, func() error {
		if _, err := tier.ReadAt(got, 3*ssdAlign+ssdAlign); err != nil {
			return err
		}
		if !bytes.Equal(got[:n-(ssdAlign-512)], want[ssdAlign-512:]) {
			return errors.New("direct read does not see the buffered write")
		}
		return nil
	})
	// A bounced write of a partial last block pads it with zeros, within the
	// file, and a read of a range that ends mid-block at the end of the file
	// reads what is there.
	tail := pattern(100, 5)
	check("write of the last bytes", bounced, func() error {
		_, err := tier.WriteAt(tail, ssdTestCapacity-ssdAlign)
		return err
	})
	check("read of the last bytes", bounced, func() error {
		p := make([]byte, 100)
		if _, err := tier.ReadAt(p, ssdTestCapacity-ssdAlign); err != nil || !bytes.Equal(p, tail) {
			return fmt.Errorf("read %x, %v", p[:8], err)
		}
		return nil
	})
}

// TestSSDNoFallocate is a filesystem that cannot preallocate: the data file
// is then only sized.
func TestSSDNoFallocate(t *testing.T) {
	calls := 0
	fallocate = func(int, uint32, int64, int64) error { calls++; return unix.EOPNOTSUPP }
	t.Cleanup(func() { fallocate = unix.Fallocate })
	tier := newTestSSD(t, t.TempDir(), 1<<20)
	if calls != 1 {
		t.Errorf("fallocate called %d times, want 1", calls)
	}
	if st, err := os.Stat(tier.Path()); err != nil || st.Size() != 1<<20 {
		t.Fatalf("data file: %v, %v", st, err)
	}
	testTier(t, tier, SSD, 1<<20)

	// Any other failure fails NewSSD and leaves no data file behind.
	fallocate = func(int, uint32, int64, int64) error { return unix.ENOSPC }
	dir := t.TempDir()
	if tier, err := NewSSD("ssd1", dir, 1<<20); err == nil {
		tier.Close()
		t.Fatal("NewSSD succeeded with fallocate failing ENOSPC")
	} else if !errors.Is(err, unix.ENOSPC) {
		t.Errorf("error %v, want ENOSPC", err)
	} else {
		t.Log(err)
	}
	for _, f := range []string{"ssd1.data", "ssd1.data.tmp"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind: %v", f, err)
		}
	}
}

// TestSSDBufferedOnly is a tier whose filesystem refused O_DIRECT (tmpfs):
// every access goes through the page cache.
func TestSSDBufferedOnly(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), 1<<20)
	if tier.mu.direct >= 0 {
		if err := unix.Close(tier.mu.direct); err != nil {
			t.Fatal(err)
		}
		tier.mu.direct = -1
	}
	if tier.DirectIO() || !strings.Contains(tier.String(), "buffered only") {
		t.Errorf("DirectIO %v, String %q", tier.DirectIO(), tier)
	}
	buf := alignedBuf(ssdAlign)
	copy(buf, pattern(ssdAlign, 3))
	if _, err := tier.WriteAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	got := alignedBuf(ssdAlign)
	if _, err := tier.ReadAt(got, 0); err != nil || !bytes.Equal(got, buf) {
		t.Fatalf("ReadAt: %v, equal %v", err, bytes.Equal(got, buf))
	}
	if d, b := tier.nDirect.Load(), tier.nBuffered.Load(); d != 0 || b != 2 {
		t.Errorf("%d direct, %d buffered; want 0, 2", d, b)
	}
}

func TestSSDRestart(t *testing.T) {
	dir := t.TempDir()
	tier, err := NewSSD("ssd0", dir, ssdTestCapacity)
	if err != nil {
		t.Fatal(err)
	}
	aligned := alignedBuf(2 * ssdAlign)
	copy(aligned, pattern(len(aligned), 5))
	unaligned := pattern(1000, 77)
	if _, err := tier.WriteAt(aligned, ssdAlign); err != nil {
		t.Fatal(err)
	}
	if _, err := tier.WriteAt(unaligned, 5*ssdAlign+3); err != nil {
		t.Fatal(err)
	}
	objs := []SSDObject{
		{Key: "a", Offset: ssdAlign, Size: uint64(len(aligned)), Checksum: 0xdeadbeef},
		{Key: "b", Offset: 5*ssdAlign + 3, Size: uint64(len(unaligned)), Checksum: 42},
	}
	if err := tier.Index().Put(objs...); err != nil {
		t.Fatal(err)
	}
	// A second tier on the same directory is refused while the first is open.
	if other, err := NewSSD("ssd0", dir, ssdTestCapacity); err == nil {
		other.Close()
		t.Fatal("a second NewSSD on an open tier succeeded")
	} else {
		t.Logf("second open: %v", err)
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}

	tier = newTestSSD(t, dir, ssdTestCapacity)
	got := make([]byte, len(aligned))
	if _, err := tier.ReadAt(got, ssdAlign); err != nil || !bytes.Equal(got, aligned) {
		t.Errorf("aligned bytes after restart: %v, equal %v", err, bytes.Equal(got, aligned))
	}
	got = make([]byte, len(unaligned))
	if _, err := tier.ReadAt(got, 5*ssdAlign+3); err != nil || !bytes.Equal(got, unaligned) {
		t.Errorf("unaligned bytes after restart: %v, equal %v", err, bytes.Equal(got, unaligned))
	}
	if all, err := tier.Index().All(); err != nil || !slices.Equal(all, objs) {
		t.Errorf("index after restart = %v, %v; want %v", all, err, objs)
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}

	// Another capacity is refused, and the file is left as it was.
	for _, c := range []int64{ssdTestCapacity / 2, ssdTestCapacity * 2} {
		other, err := NewSSD("ssd0", dir, c)
		if err == nil {
			other.Close()
			t.Fatalf("NewSSD with capacity %d over a %d-byte file succeeded", c, ssdTestCapacity)
		}
		msg := err.Error()
		if !strings.Contains(msg, fmt.Sprint(ssdTestCapacity)) || !strings.Contains(msg, "remove") {
			t.Errorf("capacity error %q does not say how to fix it", msg)
		}
		t.Logf("capacity %d: %v", c, err)
	}
	if st, err := os.Stat(filepath.Join(dir, "ssd0.data")); err != nil || st.Size() != ssdTestCapacity {
		t.Fatalf("data file after refused opens: %v, %v", st, err)
	}

	// Still usable with the right capacity after the refusals.
	tier = newTestSSD(t, dir, ssdTestCapacity)
	if all, err := tier.Index().All(); err != nil || len(all) != 2 {
		t.Errorf("index after refused opens = %v, %v", all, err)
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}

	// A lost data file takes its index entries with it.
	if err := os.Remove(filepath.Join(dir, "ssd0.data")); err != nil {
		t.Fatal(err)
	}
	tier = newTestSSD(t, dir, ssdTestCapacity)
	if all, err := tier.Index().All(); err != nil || len(all) != 0 {
		t.Errorf("index of a new data file = %v, %v; want empty", all, err)
	}
}

func TestSSDIndex(t *testing.T) {
	o := func(key string, off, size uint64, sum uint32) SSDObject {
		return SSDObject{Key: key, Offset: off, Size: size, Checksum: sum}
	}
	meta := func(o SSDObject, hard bool, soft int64, parent, tenant string) SSDObject {
		o.HardPinned, o.SoftPinUntil, o.Parent, o.Tenant = hard, soft, parent, tenant
		return o
	}
	big := strings.Repeat("k", MaxSSDIndexKey)
	type step struct {
		put     []SSDObject
		del     []string
		replace []SSDObject
		isRepl  bool
		want    []SSDObject
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"empty", []step{{want: nil}}},
		{"put sorts", []step{{put: []SSDObject{o("c", 3, 3, 3), o("a", 1, 1, 1), o("b", 2, 2, 2)},
			want: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2), o("c", 3, 3, 3)}}}},
		{"put overwrites, last wins", []step{
			{put: []SSDObject{o("a", 1, 1, 1)}},
			{put: []SSDObject{o("a", 5, 5, 5), o("a", 6, 6, 6)}, want: []SSDObject{o("a", 6, 6, 6)}}}},
		{"put nothing", []step{{put: []SSDObject{}, want: nil}}},
		{"extremes", []step{{put: []SSDObject{o(big, 0, ssdTestCapacity, ^uint32(0)), o("\x00\xff", ssdTestCapacity, 0, 0)},
			want: []SSDObject{o("\x00\xff", ssdTestCapacity, 0, 0), o(big, 0, ssdTestCapacity, ^uint32(0))}}}},
		{"delete", []step{
			{put: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2), o("c", 3, 3, 3)}},
			{del: []string{"b", "missing", "a"}, want: []SSDObject{o("c", 3, 3, 3)}}}},
		{"replace empty with objects", []step{
			{isRepl: true, replace: []SSDObject{o("z", 1, 1, 1), o("y", 2, 2, 2)},
				want: []SSDObject{o("y", 2, 2, 2), o("z", 1, 1, 1)}}}},
		{"replace deletes, keeps, changes, adds", []step{
			{put: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2), o("c", 3, 3, 3), o("e", 5, 5, 5)}},
			{isRepl: true, replace: []SSDObject{o("f", 6, 6, 6), o("c", 3, 3, 9), o("b", 2, 2, 2), o("d", 4, 4, 4)},
				want: []SSDObject{o("b", 2, 2, 2), o("c", 3, 3, 9), o("d", 4, 4, 4), o("f", 6, 6, 6)}}}},
		{"replace with nothing", []step{
			{put: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2)}},
			{isRepl: true, replace: nil, want: nil}}},
		{"replace with the same", []step{
			{put: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2)}},
			{isRepl: true, replace: []SSDObject{o("b", 2, 2, 2), o("a", 1, 1, 1)},
				want: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2)}}}},
		{"metadata round trips", []step{
			{put: []SSDObject{meta(o("a", 1, 1, 1), true, 5, "p", "t"), o("b", 2, 2, 2)},
				want: []SSDObject{meta(o("a", 1, 1, 1), true, 5, "p", "t"), o("b", 2, 2, 2)}}}},
		{"replace changes metadata only", []step{
			{put: []SSDObject{meta(o("a", 1, 1, 1), true, 0, "", ""), o("b", 2, 2, 2), meta(o("c", 3, 3, 3), false, 9, "p", "t"), o("d", 4, 4, 4)}},
			{isRepl: true, replace: []SSDObject{o("a", 1, 1, 1), meta(o("b", 2, 2, 2), false, 7, "", ""),
				meta(o("c", 3, 3, 3), false, 9, "q", "t"), meta(o("d", 4, 4, 4), false, 0, "", "u")},
				want: []SSDObject{o("a", 1, 1, 1), meta(o("b", 2, 2, 2), false, 7, "", ""),
					meta(o("c", 3, 3, 3), false, 9, "q", "t"), meta(o("d", 4, 4, 4), false, 0, "", "u")}}}},
		{"replace then put and delete", []step{
			{isRepl: true, replace: []SSDObject{o("a", 1, 1, 1), o("b", 2, 2, 2)}},
			{put: []SSDObject{o("c", 3, 3, 3)}},
			{del: []string{"a"}, want: []SSDObject{o("b", 2, 2, 2), o("c", 3, 3, 3)}}}},
	}
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	x := tier.Index()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := x.Replace(nil); err != nil {
				t.Fatal(err)
			}
			for i, s := range tc.steps {
				var err error
				switch {
				case s.isRepl:
					err = x.Replace(s.replace)
				case s.put != nil:
					err = x.Put(s.put...)
				case s.del != nil:
					err = x.Delete(s.del...)
				}
				if err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
			}
			got, err := x.All()
			if err != nil {
				t.Fatal(err)
			}
			if want := tc.steps[len(tc.steps)-1].want; !slices.Equal(got, want) {
				t.Errorf("All() = %v, want %v", got, want)
			}
		})
	}
}

func TestSSDIndexInvalid(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	x := tier.Index()
	if err := x.Put(SSDObject{Key: "keep", Offset: 1, Size: 2, Checksum: 3}); err != nil {
		t.Fatal(err)
	}
	bad := []SSDObject{
		{Key: ""},
		{Key: strings.Repeat("k", MaxSSDIndexKey+1)},
		{Key: "past the end", Offset: ssdTestCapacity - 1, Size: 2},
		{Key: "offset past the end", Offset: ssdTestCapacity + 1},
		{Key: "overflow", Offset: ^uint64(0), Size: 2},
		{Key: "long parent", Parent: strings.Repeat("p", MaxSSDIndexKey+1)},
		{Key: "long tenant", Tenant: strings.Repeat("t", MaxSSDIndexKey+1)},
	}
	for _, o := range bad {
		if err := x.Put(SSDObject{Key: "fine"}, o); err == nil {
			t.Errorf("Put(%.20q at %d+%d) succeeded", o.Key, o.Offset, o.Size)
		}
		if err := x.Replace([]SSDObject{o}); err == nil {
			t.Errorf("Replace(%.20q at %d+%d) succeeded", o.Key, o.Offset, o.Size)
		}
	}
	if err := x.Delete("fine", ""); err == nil {
		t.Error("Delete of an empty key succeeded")
	}
	if err := x.Replace([]SSDObject{{Key: "a"}, {Key: "b"}, {Key: "a", Offset: 1}}); err == nil {
		t.Error("Replace with a key twice succeeded")
	}
	// A refused call changes nothing.
	if all, err := x.All(); err != nil || !slices.Equal(all, []SSDObject{{Key: "keep", Offset: 1, Size: 2, Checksum: 3}}) {
		t.Errorf("All() after refused calls = %v, %v", all, err)
	}
}

func TestSSDIndexGarbage(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	x := tier.Index()
	good := SSDObject{Key: "good", Offset: 4096, Size: 300, Checksum: 7}
	for _, v := range [][]byte{
		nil,
		{3, 1, 1, 0, 0, 0, 0},   // unknown version
		{0, 1, 1, 0, 0, 0, 0},   // unknown version
		{ssdValueVersion},       // no offset
		{ssdValueVersion, 0x80}, // truncated varint
		{ssdValueVersion, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, // varint overflow
		{ssdValueVersion, 1},                      // no size
		{ssdValueVersion, 1, 2, 3, 4, 5},          // short checksum
		{ssdValueV1, 1, 2, 3, 4, 5, 6, 7},         // trailing byte
		{ssdValueVersion, 1, 2, 3, 4, 5, 6},       // no flags
		{ssdValueVersion, 1, 2, 3, 4, 5, 6, 1, 0}, // no parent
		bytes.Repeat([]byte{0xff}, 100),
	} {
		if _, err := decodeObjectValue(v); !errors.Is(err, errBadValue) {
			t.Errorf("decode(%x) = %v, want errBadValue", v, err)
		}
		if err := x.Replace([]SSDObject{good}); err != nil {
			t.Fatal(err)
		}
		if err := x.db.Set(appendObjectKey(nil, "bad"), v, pebble.Sync); err != nil {
			t.Fatal(err)
		}
		all, err := x.All()
		if !errors.Is(err, errBadValue) || !strings.Contains(fmt.Sprint(err), `"bad"`) {
			t.Errorf("All() over value %x = %v, %v; want an error naming the entry", v, all, err)
		}
		// Replace repairs it.
		if err := x.Replace([]SSDObject{good, {Key: "bad", Offset: 1, Size: 1}}); err != nil {
			t.Fatal(err)
		}
		if all, err := x.All(); err != nil || len(all) != 2 || all[0].Key != "bad" || all[1] != good {
			t.Errorf("All() after Replace = %v, %v", all, err)
		}
	}
}

// TestSSDIndexValue checks the value encoding: version 2 round trips,
// version 1 values (written by the previous release) still decode, and
// malformed values are refused.
func TestSSDIndexValue(t *testing.T) {
	long := strings.Repeat("p", MaxSSDIndexKey)
	for _, o := range []SSDObject{
		{},
		{Offset: 4096, Size: 300, Checksum: 7},
		{Offset: ^uint64(0), Size: ^uint64(0), Checksum: ^uint32(0)},
		{HardPinned: true},
		{SoftPinUntil: 1_700_000_000_000_000_000},
		{SoftPinUntil: -1},
		{SoftPinUntil: math.MinInt64},
		{SoftPinUntil: math.MaxInt64},
		{Parent: "parent", Tenant: "tenant"},
		{Parent: "\x00\xff", Tenant: "ü"},
		{Offset: ^uint64(0), Size: ^uint64(0), Checksum: ^uint32(0), HardPinned: true, SoftPinUntil: math.MinInt64, Parent: long, Tenant: long},
	} {
		v := appendObjectValue(nil, o)
		if v[0] != ssdValueVersion {
			t.Errorf("encode(%.40v) has version %d, want %d", o, v[0], ssdValueVersion)
		}
		if got, err := decodeObjectValue(v); err != nil || got != o {
			t.Errorf("decode(encode(%.40v)) = %.40v, %v", o, got, err)
		}
	}
	t.Logf("largest value without parent and tenant: %d bytes",
		len(appendObjectValue(nil, SSDObject{Offset: ^uint64(0), Size: ^uint64(0), HardPinned: true, SoftPinUntil: math.MinInt64})))

	v1 := []struct {
		name string
		v    []byte
		want SSDObject
	}{
		{"zeros", []byte{ssdValueV1, 0, 0, 0, 0, 0, 0}, SSDObject{}},
		{"small", []byte{ssdValueV1, 0x80, 0x20, 0xac, 0x02, 7, 0, 0, 0}, SSDObject{Offset: 4096, Size: 300, Checksum: 7}},
		{"largest", []byte{ssdValueV1,
			0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
			0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
			0x78, 0x56, 0x34, 0x12},
			SSDObject{Offset: ^uint64(0), Size: ^uint64(0), Checksum: 0x12345678}},
	}
	for _, tc := range v1 {
		t.Run("v1 "+tc.name, func(t *testing.T) {
			got, err := decodeObjectValue(tc.v)
			if err != nil || got != tc.want {
				t.Fatalf("decode(%x) = %v, %v; want %v", tc.v, got, err, tc.want)
			}
			if got, err := decodeObjectValue(appendObjectValue(nil, got)); err != nil || got != tc.want {
				t.Errorf("re-encoded as version %d: %v, %v", ssdValueVersion, got, err)
			}
		})
	}

	// v2 is a valid version 2 value up to and including its checksum.
	v2 := func(tail ...byte) []byte { return append([]byte{ssdValueVersion, 1, 2, 3, 4, 5, 6}, tail...) }
	maxUvarint := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01} // 1<<64 - 1
	overflow := bytes.Repeat([]byte{0xff}, 11)                                       // more than 64 bits
	tooLong := binary.AppendUvarint(nil, MaxSSDIndexKey+1)
	tooLong = append(tooLong, bytes.Repeat([]byte{'p'}, MaxSSDIndexKey+1)...)
	malformed := []struct {
		name string
		v    []byte
	}{
		{"v1 with v2 fields", []byte{ssdValueV1, 1, 2, 3, 4, 5, 6, 1, 0, 0, 0}},
		{"short checksum", []byte{ssdValueVersion, 1, 2, 3, 4, 5}},
		{"no flags", v2()},
		{"truncated flags", v2(0x80)},
		{"unknown flag", v2(2, 0, 0, 0)},
		{"no soft pin", v2(1)},
		{"truncated soft pin", v2(1, 0x80)},
		{"soft pin overflows", v2(append(append([]byte{1}, overflow...), 0, 0)...)},
		{"no parent length", v2(1, 0)},
		{"truncated parent length", v2(1, 0, 0x80)},
		{"parent past the end", v2(1, 0, 5, 'p', 'a')},
		{"parent length overflows", v2(append(append([]byte{1, 0}, overflow...), 0)...)},
		{"parent length huge", v2(append([]byte{1, 0}, maxUvarint...)...)},
		{"parent too long", v2(append(append([]byte{1, 0}, tooLong...), 0)...)},
		{"no tenant length", v2(1, 0, 1, 'p')},
		{"truncated tenant length", v2(1, 0, 1, 'p', 0x80)},
		{"tenant past the end", v2(1, 0, 1, 'p', 3, 't')},
		{"tenant length past the end by one", v2(1, 0, 0, 2, 't')},
		{"tenant length overflows", v2(append([]byte{1, 0, 0}, overflow...)...)},
		{"tenant length huge", v2(append([]byte{1, 0, 0}, maxUvarint...)...)},
		{"tenant too long", v2(append([]byte{1, 0, 0}, tooLong...)...)},
		{"trailing byte", v2(1, 0, 1, 'p', 1, 't', 9)},
	}
	if _, err := decodeObjectValue(v2(1, 0, 1, 'p', 1, 't')); err != nil {
		t.Fatalf("the base of the malformed values does not decode: %v", err)
	}
	for _, tc := range malformed {
		t.Run("malformed "+tc.name, func(t *testing.T) {
			if got, err := decodeObjectValue(tc.v); !errors.Is(err, errBadValue) {
				t.Errorf("decode(%.40x) = %.40v, %v; want errBadValue", tc.v, got, err)
			}
		})
	}
}

// TestSSDIndexReadsV1 checks that an index written by the previous release
// (version 1 values) is read, and that Replace rewrites its entries in the
// current version once.
func TestSSDIndexReadsV1(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	x := tier.Index()
	old := SSDObject{Key: "old", Offset: 4096, Size: 300, Checksum: 7}
	if err := x.db.Set(appendObjectKey(nil, old.Key), []byte{ssdValueV1, 0x80, 0x20, 0xac, 0x02, 7, 0, 0, 0}, pebble.Sync); err != nil {
		t.Fatal(err)
	}
	if all, err := x.All(); err != nil || !slices.Equal(all, []SSDObject{old}) {
		t.Fatalf("All() over a version 1 entry = %v, %v", all, err)
	}
	walIn := func() uint64 { return x.db.Metrics().WAL.BytesIn }
	before := walIn()
	if err := x.Replace([]SSDObject{old}); err != nil {
		t.Fatal(err)
	}
	if walIn() == before {
		t.Error("Replace left a version 1 entry as it was")
	}
	v, closer, err := x.db.Get(appendObjectKey(nil, old.Key))
	if err != nil {
		t.Fatal(err)
	}
	if v[0] != ssdValueVersion {
		t.Errorf("entry after Replace has version %d, want %d", v[0], ssdValueVersion)
	}
	_ = closer.Close()
	before = walIn()
	if err := x.Replace([]SSDObject{old}); err != nil {
		t.Fatal(err)
	}
	if walIn() != before {
		t.Error("a second Replace with the same object wrote")
	}
}

// TestSSDIndexReplaceWritesChangesOnly checks that a Replace with the index's
// own content writes nothing, as the store calls it periodically.
func TestSSDIndexReplaceWritesChangesOnly(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	x := tier.Index()
	var objs []SSDObject
	for i := range 100 {
		objs = append(objs, SSDObject{Key: fmt.Sprintf("key%03d", i), Offset: uint64(i) * 4096, Size: 4096, Checksum: uint32(i)})
	}
	if err := x.Put(objs...); err != nil {
		t.Fatal(err)
	}
	walIn := func() uint64 { return x.db.Metrics().WAL.BytesIn }
	before := walIn()
	if err := x.Replace(slices.Clone(objs)); err != nil {
		t.Fatal(err)
	}
	if after := walIn(); after != before {
		t.Errorf("Replace with the same objects wrote %d WAL bytes", after-before)
	}
	objs[50].Checksum++
	if err := x.Replace(objs[1:]); err != nil {
		t.Fatal(err)
	}
	if d := walIn() - before; d == 0 || d > 200 {
		t.Errorf("Replace of one changed and one removed object wrote %d WAL bytes, want a few dozen", d)
	} else {
		t.Logf("one change and one delete: %d WAL bytes", d)
	}
	if all, err := x.All(); err != nil || !slices.Equal(all, objs[1:]) {
		t.Errorf("All() = %d objects, %v", len(all), err)
	}
	// A change of a pin alone is a change.
	objs[60].HardPinned = true
	before = walIn()
	if err := x.Replace(objs[1:]); err != nil {
		t.Fatal(err)
	}
	if walIn() == before {
		t.Error("Replace of an object pinned since wrote nothing")
	}
	if all, err := x.All(); err != nil || !all[59].HardPinned {
		t.Errorf("All() after pinning = %v", err)
	}
}

func TestSSDConcurrent(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), ssdTestCapacity)
	const workers, span, rounds = 8, 256 << 10, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := int64(w) * span
			for r := range rounds {
				// Alternate aligned (direct) and unaligned (buffered) accesses
				// to the worker's own range.
				var p []byte
				off := base
				if r%2 == 0 {
					p = alignedBuf(64 << 10)
				} else {
					p = make([]byte, 64<<10-17)
					off += 17
				}
				copy(p, pattern(len(p), byte(w*31+r)))
				if _, err := tier.WriteAt(p, off); err != nil {
					errs <- err
					return
				}
				got := alignedBuf(len(p))
				if _, err := tier.ReadAt(got, off); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(got, p) {
					errs <- fmt.Errorf("worker %d round %d: bytes differ", w, r)
					return
				}
				if err := tier.Index().Put(SSDObject{Key: fmt.Sprintf("w%d", w), Offset: uint64(off), Size: uint64(len(p))}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if all, err := tier.Index().All(); err != nil || len(all) != workers {
		t.Errorf("index: %d objects, %v; want %d", len(all), err, workers)
	}
	t.Logf("%d direct, %d buffered accesses", tier.nDirect.Load(), tier.nBuffered.Load())
}

func TestSSDClosed(t *testing.T) {
	tier, err := NewSSD("ssd0", t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tier.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, p := range [][]byte{make([]byte, 10), alignedBuf(ssdAlign)} {
		if _, err := tier.ReadAt(p, 0); !errors.Is(err, engine.ErrClosed) {
			t.Errorf("ReadAt after Close: %v, want engine.ErrClosed", err)
		}
		if _, err := tier.WriteAt(p, 0); !errors.Is(err, engine.ErrClosed) {
			t.Errorf("WriteAt after Close: %v, want engine.ErrClosed", err)
		}
	}
	if err := tier.Sync(); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("Sync after Close: %v, want engine.ErrClosed", err)
	}
	if tier.ShareFD() != -1 || tier.DirectIO() {
		t.Errorf("ShareFD %d DirectIO %v after Close", tier.ShareFD(), tier.DirectIO())
	}
	x := tier.Index()
	if err := x.Put(SSDObject{Key: "a"}); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("Put after Close: %v", err)
	}
	if err := x.Delete("a"); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("Delete after Close: %v", err)
	}
	if _, err := x.All(); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("All after Close: %v", err)
	}
	if err := x.Replace(nil); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("Replace after Close: %v", err)
	}
}

func TestSSDSync(t *testing.T) {
	tier := newTestSSD(t, t.TempDir(), 1<<20)
	if _, err := tier.WriteAt([]byte("hello"), 100); err != nil {
		t.Fatal(err)
	}
	if err := tier.Sync(); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkSSDRead4MiB reads 4 MiB blocks, aligned, so through O_DIRECT where
// the filesystem allows it.
func BenchmarkSSDRead4MiB(b *testing.B) {
	const block = 4 << 20
	const capacity = 16 * block
	tier := newTestSSD(b, b.TempDir(), capacity)
	buf := alignedBuf(block)
	copy(buf, pattern(block, 1))
	for off := int64(0); off < capacity; off += block {
		if _, err := tier.WriteAt(buf, off); err != nil {
			b.Fatal(err)
		}
	}
	if err := tier.Sync(); err != nil {
		b.Fatal(err)
	}
	b.Logf("O_DIRECT: %v", tier.DirectIO())
	b.SetBytes(block)
	for i := 0; b.Loop(); i++ {
		if _, err := tier.ReadAt(buf, int64(i%16)*block); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSSDOnTmpfs runs the suite on tmpfs where the host has one at /dev/shm:
// older kernels refuse O_DIRECT there, and the tier must then serve every
// access buffered.
func TestSSDOnTmpfs(t *testing.T) {
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Skip("no tmpfs at /dev/shm")
	}
	dir, err := os.MkdirTemp("/dev/shm", "tidepool-ssd-test-")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	tier, err := NewSSD("ssd0", dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%v", tier)
	buf := alignedBuf(ssdAlign)
	copy(buf, pattern(ssdAlign, 4))
	if _, err := tier.WriteAt(buf, ssdAlign); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, ssdAlign)
	if _, err := tier.ReadAt(got, ssdAlign); err != nil || !bytes.Equal(got, buf) {
		t.Fatalf("ReadAt: %v, equal %v", err, bytes.Equal(got, buf))
	}
	testTier(t, tier, SSD, 1<<20)
}
