package master

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestCloseWithEntriesCommittedNotApplied: hashicorp/raft drops the
// entries that are committed but not yet applied when it shuts down, and
// their futures never answer. Close must end the leader's work (here ten
// applies, each its own committed entry queued behind an FSM held busy)
// before it shuts raft down, or it waits for them forever.
func TestCloseWithEntriesCommittedNotApplied(t *testing.T) {
	m := newCluster(t, 1, nil).leader()
	s := m.srv
	const n = 10
	answered := make(chan error, n)
	cmd := func() *pb.Command {
		return &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{"none"}, OnlyExpired: true}}}
	}
	s.fsm.mu.Lock() // FSM.Apply waits: the committed entries queue up
	locked := true
	defer func() {
		if locked {
			s.fsm.mu.Unlock()
		}
	}()
	for range n {
		before := s.raft.CommitIndex()
		if !s.goOwned(func() {
			_, err := s.apply(context.Background(), cmd())
			answered <- err
		}) {
			t.Fatal("server closing")
		}
		waitFor(t, 10*time.Second, "entry committed", func() error {
			if s.raft.CommitIndex() <= before {
				return errors.New("not yet")
			}
			return nil
		})
	}
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	// Give raft the chance to shut down with the entries queued (it does
	// at once when Close shuts it down first); Close must not, within its
	// grace.
	deadline := time.Now().Add(closeGrace / 4)
	for time.Now().Before(deadline) && s.raft.State() != raft.Shutdown {
		time.Sleep(10 * time.Millisecond)
	}
	s.fsm.mu.Unlock()
	locked = false
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Close hangs: an apply waits on an entry raft dropped at shutdown")
	}
	for range n {
		if err := <-answered; err != nil {
			t.Errorf("apply: %v", err)
		}
	}
}
