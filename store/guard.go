package store

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/ticket"
)

// guard is the engine's check of peers' requests: each must carry a ticket
// the master signed for its segment, operation and bytes, still valid. The
// node key is made once per process and handed to the master with every
// registration; segment keys follow from it and the ids the master gave.
type guard struct {
	nodeKey []byte
	keys    atomic.Pointer[map[string]*ticket.Key] // by segment id; nil: none registered
}

func newGuard() (*guard, error) {
	k, err := ticket.NewNodeKey()
	if err != nil {
		return nil, err
	}
	return &guard{nodeKey: k}, nil
}

// serve makes ids the segments whose tickets are admitted, or none if
// ids is empty.
func (g *guard) serve(ids []string) error {
	if len(ids) == 0 {
		g.keys.Store(nil)
		return nil
	}
	keys := make(map[string]*ticket.Key, len(ids))
	for _, id := range ids {
		k, err := ticket.SegmentKey(g.nodeKey, id)
		if err != nil {
			return err
		}
		keys[id] = k
	}
	g.keys.Store(&keys)
	return nil
}

// Admit implements engine.Guard.
func (g *guard) Admit(kind engine.OpKind, segment string, off, n uint64, t []byte) (time.Time, error) {
	op := ticket.Read
	if kind == engine.OpWrite {
		op = ticket.Write
	}
	var k *ticket.Key
	if keys := g.keys.Load(); keys != nil {
		k = (*keys)[segment]
	}
	if k == nil {
		return time.Time{}, fmt.Errorf("%w: segment %q is not registered with the master", engine.ErrForbidden, segment)
	}
	if len(t) == 0 {
		return time.Time{}, fmt.Errorf("%w: %s of %q [%d, +%d) without a ticket", engine.ErrForbidden, op, segment, off, n)
	}
	got, err := k.Check(t, op, off, n, time.Now().UnixNano())
	if err != nil {
		return time.Time{}, fmt.Errorf("%w: %s of %q [%d, +%d): %w", engine.ErrForbidden, op, segment, off, n, err)
	}
	return time.Unix(0, got.Expiry), nil
}
