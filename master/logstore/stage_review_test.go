package logstore

// Review of the staged leader write on the pebble store: these pin what was
// checked and found sound.

import (
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestReviewStagedReadersNeverMiss: as raft's replicators do, readers
// read up to the last index the leader published (after StageLogs, before
// StoreLogs returns) while the log is written batch by batch and
// compacted behind; GetLog must never miss an entry at or below it.
func TestReviewStagedReadersNeverMiss(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	if err := s.StoreLogs(testLogs(1, 4)); err != nil {
		t.Fatal(err)
	}
	var published atomic.Uint64
	published.Store(4)
	done := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				p := published.Load()
				i := p - min(p-1, uint64(rand.IntN(20)))
				var l raft.Log
				err := s.GetLog(i, &l)
				if first, _ := s.FirstIndex(); err != nil && i < first {
					continue // compacted meanwhile: raft would send a snapshot, rightly
				}
				if err != nil || l.Index != i {
					errs <- fmt.Errorf("GetLog(%d) with %d published: index %d, %v", i, p, l.Index, err)
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // compaction behind the readers, as after a snapshot
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
			if p := published.Load(); p > 60 {
				first, _ := s.FirstIndex()
				if err := s.DeleteRange(first, p-50); err != nil {
					errs <- err
					return
				}
			}
		}
	}()
	next := uint64(5)
	for range 150 {
		batch := testLogs(next, next+3)
		s.StageLogs(batch)
		published.Store(next + 3)
		if err := s.StoreLogs(batch); err != nil {
			t.Fatal(err)
		}
		next += 4
	}
	close(done)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// heldStore holds back one write of a command entry until released.
type heldStore struct {
	*Store
	mu      sync.Mutex
	armed   bool
	entered chan struct{}
	release chan error
	held    uint64
	stop    chan struct{}
}

func (h *heldStore) arm() (<-chan struct{}, chan<- error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.armed, h.entered, h.release = true, make(chan struct{}), make(chan error, 1)
	return h.entered, h.release
}

func (h *heldStore) StoreLogs(logs []*raft.Log) error {
	h.mu.Lock()
	gated := h.armed && len(logs) > 0 && logs[0].Type == raft.LogCommand
	if gated {
		h.armed, h.held = false, logs[len(logs)-1].Index
	}
	entered, release := h.entered, h.release
	h.mu.Unlock()
	if gated {
		close(entered)
		var err error
		select {
		case err = <-release:
		case <-h.stop:
			err = raft.ErrRaftShutdown
		}
		if err != nil {
			h.StageLogs(nil)
			return err
		}
	}
	return h.Store.StoreLogs(logs)
}

// TestReviewStagedPebbleCluster: three rafts on pebble stores; while the
// leader's write of an entry is held, the followers read it from the
// leader's stage and store it, nothing is applied, and the entry is
// applied everywhere once the write returns.
func TestReviewStagedPebbleCluster(t *testing.T) {
	type node struct {
		r     *raft.Raft
		store *heldStore
		fsm   *testFSM
	}
	var nodes []*node
	var trans []*raft.InmemTransport
	var conf raft.Configuration
	for i := range 3 {
		addr, tr := raft.NewInmemTransport(raft.ServerAddress(fmt.Sprintf("pn%d", i)))
		trans = append(trans, tr)
		conf.Servers = append(conf.Servers, raft.Server{ID: raft.ServerID(addr), Address: addr})
	}
	for _, a := range trans {
		for _, b := range trans {
			a.Connect(b.LocalAddr(), b)
		}
	}
	dir := t.TempDir()
	for i, tr := range trans {
		s, err := Open(filepath.Join(dir, fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		hs := &heldStore{Store: s, stop: make(chan struct{})}
		c := raft.DefaultConfig()
		c.LocalID = conf.Servers[i].ID
		c.HeartbeatTimeout, c.ElectionTimeout, c.LeaderLeaseTimeout = 100*time.Millisecond, 100*time.Millisecond, 100*time.Millisecond
		c.CommitTimeout = 5 * time.Millisecond
		c.LogOutput = io.Discard
		snaps := raft.NewInmemSnapshotStore()
		if err := raft.BootstrapCluster(c, hs, hs, snaps, tr, conf); err != nil {
			t.Fatal(err)
		}
		fsm := &testFSM{}
		r, err := raft.NewRaft(c, fsm, hs, hs, snaps, tr)
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, &node{r, hs, fsm})
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			close(n.store.stop)
		}
		for _, n := range nodes {
			_ = n.r.Shutdown().Error()
			_ = n.store.Close()
		}
	})
	var l *node
	waitFor(t, "a leader", func() bool {
		for _, n := range nodes {
			if n.r.State() == raft.Leader {
				l = n
				return true
			}
		}
		return false
	})
	if err := l.r.Apply([]byte("a"), 5*time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	entered, release := l.store.arm()
	f := l.r.Apply([]byte("b"), 5*time.Second)
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the leader's write never started")
	}
	l.store.mu.Lock()
	held := l.store.held
	l.store.mu.Unlock()
	waitFor(t, "the followers to store b", func() bool {
		for _, n := range nodes {
			if last, _ := n.store.LastIndex(); n != l && last < held {
				return false
			}
		}
		return true
	})
	if last, _ := l.store.LastIndex(); last >= held {
		t.Fatalf("leader's log has %d before its write returned", last)
	}
	for _, n := range nodes {
		if got := n.fsm.entries(); len(got) != 1 {
			t.Fatalf("applied %q while the leader's write is held", got)
		}
	}
	release <- nil
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "b applied everywhere", func() bool {
		for _, n := range nodes {
			if len(n.fsm.entries()) != 2 {
				return false
			}
		}
		return true
	})
}
