package master

import (
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Watcher hears which complete objects enter and leave which tiers, as the
// FSM applies the log: on every master alike, so a subscriber may follow
// any of them. Its methods run under the FSM's lock and must not block;
// kvevents.Publisher is one.
type Watcher interface {
	// Stored: a complete object entered tier (became complete with a
	// replica there, or gained its first replica there).
	Stored(key, parent, tenant string, tier pb.Tier)
	// Removed: a complete object left tier.
	Removed(key, tenant string, tier pb.Tier)
	// Cleared: the state was replaced wholesale (a snapshot restored);
	// what it holds is Stored next.
	Cleared()
	// Flush ends one log entry's changes, at the entry's time (0 after a
	// restore, which has none).
	Flush(nowUnixNano int64)
}

// Watch makes w hear the FSM's changes from now on; call it before the
// FSM applies anything (before raft starts), nil for none.
func (f *FSM) Watch(w Watcher) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.watcher = w
}

// tierChange is the tiers a key's complete object was in before the
// first change of the entry being applied.
type tierChange struct {
	key, tenant string
	before      uint8
}

// tiersOf is the set of tiers o is complete in, one bit per pb.Tier.
func (f *FSM) tiersOf(o *object) uint8 {
	if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
		return 0
	}
	var m uint8
	for _, r := range f.exts(o) {
		if int(r.seg) < len(f.tierAt) && f.tierAt[r.seg] < 8 {
			m |= 1 << f.tierAt[r.seg]
		}
	}
	return m
}

// noteChange records, before the object of key changes, what the watcher
// saw of it, once per entry: the watcher hears the entry's net change per
// key, so a put's object, made complete and then set processing in one
// entry, is no event at all.
func (f *FSM) noteChange(key string) {
	if f.watcher == nil {
		return
	}
	if _, ok := f.changed[key]; ok {
		return
	}
	if f.changed == nil {
		f.changed = map[string]struct{}{}
	}
	f.changed[key] = struct{}{}
	c := tierChange{key: key}
	if o := f.objects.get(key); o != nil {
		c.tenant, c.before = f.tenantOf(o), f.tiersOf(o)
	}
	f.changes = append(f.changes, c)
}

// flushChanges tells the watcher the net changes of the entry applied.
func (f *FSM) flushChanges(now int64) {
	if f.watcher == nil {
		return
	}
	for _, c := range f.changes {
		o := f.objects.get(c.key)
		after := f.tiersOf(o)
		for t := range uint8(8) {
			bit := uint8(1) << t
			switch {
			case c.before&bit != 0 && after&bit == 0:
				f.watcher.Removed(c.key, c.tenant, pb.Tier(t))
			case c.before&bit == 0 && after&bit != 0:
				f.watcher.Stored(c.key, o.parent(), f.tenantOf(o), pb.Tier(t))
			}
		}
	}
	clear(f.changed)
	f.changes = f.changes[:0]
	f.watcher.Flush(now)
}

// restored tells the watcher the state was replaced by what the table
// holds now.
func (f *FSM) restored(now int64) {
	if f.watcher == nil {
		return
	}
	clear(f.changed)
	f.changes = f.changes[:0]
	f.watcher.Cleared()
	// In key order, each block after its ancestors: routers refuse a
	// block whose parent they do not hold, and every master then tells
	// the same story.
	keys := make([]string, 0, f.objects.len())
	for k := range f.objects.all() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	told := make(map[*object]bool, len(keys))
	var line []*object
	for _, k := range keys {
		line = line[:0]
		for o := f.objects.get(k); o != nil && !told[o] && len(line) < maxChainWalk; o = f.objects.get(o.parent()) {
			told[o] = true
			line = append(line, o)
		}
		for _, o := range slices.Backward(line) {
			m := f.tiersOf(o)
			for t := range uint8(8) {
				if m&(1<<t) != 0 {
					f.watcher.Stored(o.key(), o.parent(), f.tenantOf(o), pb.Tier(t))
				}
			}
		}
	}
	f.watcher.Flush(now)
}
