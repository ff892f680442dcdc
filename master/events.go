package master

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Event is something the leader did that an operator wants to see on the
// status page: an eviction round, a drain begun, canceled or finished, a
// store declared dead, leadership taken.
type Event struct {
	At   time.Time
	Kind string // eviction, drain, store, leader
	Text string
}

// maxEvents is how many recent events a master keeps.
const maxEvents = 64

// events is the leader's recent events, newest last; leader-local, so a
// new leader's list starts with its own election.
type events struct {
	mu   sync.Mutex
	ring [maxEvents]Event
	n    int // events ever added
}

func (e *events) add(at time.Time, kind, format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.ring[e.n%maxEvents] = Event{At: at, Kind: kind, Text: fmt.Sprintf(format, args...)}
	e.n++
}

// list is the kept events, newest first.
func (e *events) list() []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]Event, 0, min(e.n, maxEvents))
	for i := e.n - 1; i >= 0 && i >= e.n-maxEvents; i-- {
		out = append(out, e.ring[i%maxEvents])
	}
	return out
}

// Events is this master's recent events, newest first: eviction rounds,
// drains, stores declared dead and its elections.
func (s *Server) Events() []Event { return s.events.list() }

// Status answers as the Status call does, for callers in this process (the
// status page).
func (s *Server) Status(ctx context.Context) (*pb.StatusResponse, error) {
	return (&masterService{s: s}).Status(ctx, &pb.StatusRequest{})
}
