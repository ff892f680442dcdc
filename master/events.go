package master

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Event is something the leader did that an operator wants to see on the
// status page: eviction rounds, a drain begun, canceled or finished, a store
// declared dead, leadership taken.
type Event struct {
	At   time.Time
	Kind string // eviction, drain, store, leader
	Text string
}

const (
	// maxEvents is how many recent events a leader keeps.
	maxEvents = 64
	// mergeEvictions is how long one segment's eviction rounds make one
	// event: a full pool evicts every sweep, and one line a round would
	// push every other event out within a minute.
	mergeEvictions = time.Minute
)

// events is the leader's recent events, newest last. It is leader-local:
// a master that takes or loses leadership starts it afresh, so a follower
// lists none and a new leader starts with its election.
type events struct {
	mu   sync.Mutex
	list []event
}

type event struct {
	Event
	// An eviction event's rounds, from its first (At is its last).
	about          string // what an eviction's rounds merge by
	objects, bytes uint64
	rounds         int
	since          time.Time
}

func (e *events) push(ev event) {
	if len(e.list) == maxEvents {
		e.list = slices.Delete(e.list, 0, 1)
	}
	e.list = append(e.list, ev)
}

func (e *events) add(at time.Time, kind, format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.push(event{Event: Event{At: at, Kind: kind, Text: fmt.Sprintf(format, args...)}})
}

// evicted records an eviction round of a segment, merged into that
// segment's event if its first round was less than mergeEvictions ago.
func (e *events) evicted(at time.Time, segment string, objects, bytes uint64) {
	e.evictedTo(at, "from "+segment+" to its watermark", objects, bytes)
}

// evictedQuota records an eviction round of a tenant's objects in a tier
// to its quota, merged as evicted's.
func (e *events) evictedQuota(at time.Time, tenant, tier string, objects, bytes uint64) {
	e.evictedTo(at, fmt.Sprintf("of tenant %s from %s to its quota", tenant, tier), objects, bytes)
}

// evictedTo records an eviction round; what says whose and why, and
// rounds of the same what merge.
func (e *events) evictedTo(at time.Time, what string, objects, bytes uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ev := event{Event: Event{At: at, Kind: "eviction"}, about: what, objects: objects, bytes: bytes, rounds: 1, since: at}
	if i := slices.IndexFunc(e.list, func(p event) bool { return p.about == what && at.Sub(p.since) < mergeEvictions }); i >= 0 {
		p := e.list[i]
		ev.objects, ev.bytes, ev.rounds, ev.since = p.objects+objects, p.bytes+bytes, p.rounds+1, p.since
		e.list = slices.Delete(e.list, i, i+1)
	}
	ev.Text = fmt.Sprintf("evicted %d objects (%d bytes) %s", ev.objects, ev.bytes, what)
	if ev.rounds > 1 {
		ev.Text += fmt.Sprintf(" in %d rounds over %v", ev.rounds, at.Sub(ev.since).Round(time.Second))
	}
	e.push(ev)
}

// reset forgets every event: leadership changed hands.
func (e *events) reset() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.list = nil
}

// newest is the kept events, newest first.
func (e *events) newest() []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]Event, len(e.list))
	for i, ev := range e.list {
		out[len(out)-1-i] = ev.Event
	}
	return out
}

// Events is this master's recent events as leader, newest first: eviction
// rounds, drains, stores declared dead and its election. A follower has
// none.
func (s *Server) Events() []Event { return s.events.newest() }

// Status answers as the Status call does, for callers in this process (the
// status page).
func (s *Server) Status(ctx context.Context) (*pb.StatusResponse, error) {
	return (&masterService{s: s}).Status(ctx, &pb.StatusRequest{})
}
