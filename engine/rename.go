package engine

// Rename serves seg under another name, keeping the fast paths its optional
// interfaces (Mapped, Shareable, FileBacked) give it: a store serves its
// tiers under the names the master hands out.
func Rename(seg Segment, name string) Segment { return renamed{seg, name} }

// renamed implements every optional interface and delegates; where seg
// lacks one it answers as if absent: no bytes, no fd, not file backed.
type renamed struct {
	Segment
	name string
}

func (r renamed) Name() string { return r.name }

func (r renamed) Bytes() []byte {
	if m, ok := r.Segment.(Mapped); ok {
		return m.Bytes()
	}
	return nil
}

func (r renamed) ShareFD() int {
	if s, ok := r.Segment.(Shareable); ok {
		return s.ShareFD()
	}
	return -1
}

func (r renamed) FileBacked() bool {
	f, ok := r.Segment.(FileBacked)
	return ok && f.FileBacked()
}
