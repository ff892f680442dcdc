package engine

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestMemSegment(t *testing.T) {
	m := NewMemSegment("s", make([]byte, 8))
	if _, err := m.WriteAt([]byte("abcd"), 2); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4)
	if n, err := m.ReadAt(p, 2); err != nil || n != 4 || string(p) != "abcd" {
		t.Fatalf("ReadAt = %d, %v, %q", n, err, p)
	}
	if !bytes.Equal(m.Bytes()[2:6], []byte("abcd")) {
		t.Errorf("Bytes does not alias the segment")
	}
	for _, off := range []int64{-1, 5, 9} {
		if _, err := m.ReadAt(p, off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("ReadAt(off %d) err = %v", off, err)
		}
		if _, err := m.WriteAt(p, off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("WriteAt(off %d) err = %v", off, err)
		}
	}
}

func TestRegister(t *testing.T) {
	e := New(Config{})
	defer e.Close()
	if err := e.Register(NewMemSegment("a", nil)); err != nil {
		t.Fatal(err)
	}
	if err := e.Register(NewMemSegment("a", nil)); !errors.Is(err, ErrExists) {
		t.Errorf("duplicate: err = %v", err)
	}
	for _, name := range []string{"", strings.Repeat("n", MaxSegmentName+1)} {
		if err := e.Register(NewMemSegment(name, nil)); !errors.Is(err, ErrInvalid) {
			t.Errorf("name of %d bytes: err = %v", len(name), err)
		}
	}
	e.Unregister("a")
	if err := e.Register(NewMemSegment("a", nil)); err != nil {
		t.Errorf("re-register after Unregister: %v", err)
	}
}
