package engine

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
)

// errNotLocal is the local transport's answer for every op it cannot serve: one value, so a miss
// costs no allocation.
var errNotLocal = fmt.Errorf("%w: target is not served by this engine", ErrUnsupported)

// localTransport is the same-process Transport. When an op's target is a segment this engine
// serves itself (the segment is registered here, and one of the target's rails is one of the
// engine's own listener addresses), the op is a plain copy to or from the segment: Mapped
// segments copy to or from Bytes(), others use ReadAt and WriteAt. No connection, no server, no
// system call of its own.
//
// Any other op fails with an error wrapping ErrUnsupported, after a map lookup (and, for a
// segment name this engine also serves, a scan of its few addresses), with no allocation.
type localTransport struct {
	segs   *segments
	self   atomic.Pointer[[]selfAddr] // the engine's listener addresses; nil before the first Serve
	closed atomic.Bool
}

// selfAddr is one of the engine's listener addresses.
type selfAddr struct {
	addr string // as the listener reports it: "127.0.0.1:7000", "[::]:7000"
	// port is set when the listener is on the unspecified address (0.0.0.0 or ::): then a
	// loopback host ("127.0.0.1", "::1", "localhost") with this port reaches it too.
	port string
}

func newLocalTransport(segs *segments) *localTransport {
	return &localTransport{segs: segs}
}

func (t *localTransport) Name() string { return "local" }

// Do copies op.Buf to or from the engine's own segment.
func (t *localTransport) Do(ctx context.Context, op *Op) error {
	if t.closed.Load() {
		return ErrClosed
	}
	seg := t.segs.lookup(op.Target.Segment)
	if seg == nil || !t.ours(op.Target.Endpoint) {
		return errNotLocal
	}
	if op.Kind != OpRead && op.Kind != OpWrite {
		return fmt.Errorf("%w: op kind %d", ErrInvalid, op.Kind)
	}
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	n := int64(len(op.Buf))
	if size := seg.Size(); !inRange(op.Offset, n, size) {
		return fmt.Errorf("%w: %s %d+%d of %q (size %d)", ErrOutOfRange, op.Kind, op.Offset, n, seg.Name(), size)
	}
	if b, ok := mapped(seg, op.Offset, n); ok {
		if op.Kind == OpRead {
			copy(op.Buf, b)
		} else {
			copy(b, op.Buf)
		}
		return nil
	}
	var (
		m   int
		err error
	)
	if op.Kind == OpRead {
		m, err = seg.ReadAt(op.Buf, op.Offset)
	} else {
		m, err = seg.WriteAt(op.Buf, op.Offset)
	}
	if err == nil && int64(m) < n {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		return fmt.Errorf("%w: local %s %d+%d of %q: %w", ErrRemote, op.Kind, op.Offset, n, seg.Name(), err)
	}
	return nil
}

// ours reports whether one of endpoint's rails is one of the engine's listener addresses.
func (t *localTransport) ours(endpoint string) bool {
	self := t.self.Load()
	if self == nil {
		return false
	}
	for rest := endpoint; rest != ""; {
		var rail string
		rail, rest, _ = strings.Cut(rest, ",")
		for _, a := range *self {
			if rail == a.addr || a.port != "" && loopbackPort(rail, a.port) {
				return true
			}
		}
	}
	return false
}

// loopbackPort reports whether addr is a loopback host with the given port.
func loopbackPort(addr, port string) bool {
	i := strings.LastIndexByte(addr, ':')
	if i < 0 || addr[i+1:] != port {
		return false
	}
	host := strings.TrimSuffix(strings.TrimPrefix(addr[:i], "["), "]")
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// setAddrs records the engine's listener addresses.
func (t *localTransport) setAddrs(addrs []string) {
	self := make([]selfAddr, 0, len(addrs))
	for _, a := range addrs {
		s := selfAddr{addr: a}
		if ap, err := netip.ParseAddrPort(a); err == nil && ap.Addr().IsUnspecified() {
			s.port = a[strings.LastIndexByte(a, ':')+1:]
		}
		self = append(self, s)
	}
	t.self.Store(&self)
}

// Close makes later Do fail with ErrClosed.
func (t *localTransport) Close() error {
	t.closed.Store(true)
	return nil
}

// Addrs returns the addresses of the listeners the engine is serving, sorted: what a peer in
// this process may target to reach it without a connection (see the local transport).
func (e *Engine) Addrs() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.listenAddrs()
}

// listenAddrs lists the listeners' addresses; e.mu must be held.
func (e *Engine) listenAddrs() []string {
	addrs := make([]string, 0, len(e.mu.listeners))
	for ln := range e.mu.listeners {
		if a := ln.Addr(); a != nil {
			addrs = append(addrs, a.String())
		}
	}
	slices.Sort(addrs)
	return addrs
}

// publishAddrs tells the local transport the engine's listener addresses; e.mu must be held.
func (e *Engine) publishAddrs() {
	if e.local != nil {
		e.local.setAddrs(e.listenAddrs())
	}
}
