package engine

import "testing"

func TestRenameKeepsFastPaths(t *testing.T) {
	mem := NewMemSegment("mem", make([]byte, 64))
	r := Rename(mem, "node/mem@1")
	if r.Name() != "node/mem@1" || r.Size() != 64 {
		t.Fatalf("renamed segment is %q of %d bytes", r.Name(), r.Size())
	}
	if b, ok := mapped(r, 0, 64); !ok || &b[0] != &mem.Bytes()[0] {
		t.Fatal("a renamed Mapped segment must expose the same memory")
	}
	if fd := r.(Shareable).ShareFD(); fd != -1 {
		t.Fatalf("ShareFD of a segment that cannot be shared = %d, want -1", fd)
	}
	if r.(FileBacked).FileBacked() {
		t.Fatal("a memory segment is not file backed")
	}
	plain := Rename(readerOnly{mem}, "plain")
	if _, ok := mapped(plain, 0, 1); ok {
		t.Fatal("a renamed segment without Mapped must not claim memory")
	}
}

// readerOnly hides MemSegment's optional interfaces.
type readerOnly struct{ Segment }
