// Copyright (c) Tidepool authors
// SPDX-License-Identifier: MPL-2.0

package raft

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// gatedStore holds back one write of a command entry, armed by arm, until
// the test releases it with the write's outcome.
type gatedStore struct {
	*InmemStore
	mu      sync.Mutex
	armed   bool
	entered chan struct{}
	release chan error
	stop    chan struct{} // closed at the test's end: a held write fails
	held    uint64        // the last index of the held write
}

func (g *gatedStore) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed, g.entered, g.release = true, make(chan struct{}), make(chan error)
}

func (g *gatedStore) StoreLogs(logs []*Log) error {
	g.mu.Lock()
	gated := g.armed && logs[0].Type == LogCommand
	if gated {
		g.armed = false
	}
	entered, release := g.entered, g.release
	if gated {
		g.held = logs[len(logs)-1].Index
	}
	g.mu.Unlock()
	if gated {
		close(entered)
		var err error
		select {
		case err = <-release:
		case <-g.stop:
			err = ErrRaftShutdown
		}
		if err != nil {
			return err
		}
	}
	return g.InmemStore.StoreLogs(logs)
}

type stagedCluster struct {
	rafts  []*Raft
	stores []*gatedStore
	fsms   []*MockFSM
}

func newStagedCluster(t *testing.T) *stagedCluster {
	t.Helper()
	c := &stagedCluster{}
	var trans []*InmemTransport
	var conf Configuration
	for i := range 3 {
		addr, tr := NewInmemTransport(ServerAddress(fmt.Sprintf("node%d", i)))
		trans = append(trans, tr)
		conf.Servers = append(conf.Servers, Server{ID: ServerID(addr), Address: addr})
	}
	for _, a := range trans {
		for _, b := range trans {
			a.Connect(b.LocalAddr(), b)
		}
	}
	for i, tr := range trans {
		cfg := inmemConfig(t)
		cfg.LocalID = conf.Servers[i].ID
		store := &gatedStore{InmemStore: NewInmemStore(), stop: make(chan struct{})}
		fsm := &MockFSM{}
		if err := BootstrapCluster(cfg, store, store, NewInmemSnapshotStore(), tr, conf); err != nil {
			t.Fatal(err)
		}
		r, err := NewRaft(cfg, fsm, store, store, NewInmemSnapshotStore(), tr)
		if err != nil {
			t.Fatal(err)
		}
		c.rafts, c.stores, c.fsms = append(c.rafts, r), append(c.stores, store), append(c.fsms, fsm)
	}
	t.Cleanup(func() {
		for _, s := range c.stores {
			close(s.stop)
		}
		for _, r := range c.rafts {
			_ = r.Shutdown().Error()
		}
	})
	return c
}

// leader waits for a leader other than not (-1: any) and returns its index.
func (c *stagedCluster) leader(t *testing.T, not int) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for i, r := range c.rafts {
			if i != not && r.State() == Leader {
				return i
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("no leader elected")
	return -1
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// applied reports whether every FSM has exactly want, in order.
func (c *stagedCluster) applied(want ...string) bool {
	for _, f := range c.fsms {
		logs := f.Logs()
		if len(logs) != len(want) {
			return false
		}
		for i, l := range logs {
			if !bytes.Equal(l, []byte(want[i])) {
				return false
			}
		}
	}
	return true
}

// TestStagedEntriesReplicateWhileLeaderWrites: the followers store a new
// entry while the leader's own write of it has not returned, and the entry
// is applied everywhere once that write is done.
func TestStagedEntriesReplicateWhileLeaderWrites(t *testing.T) {
	c := newStagedCluster(t)
	l := c.leader(t, -1)
	c.stores[l].arm()
	f := c.rafts[l].Apply([]byte("x"), 0)
	<-c.stores[l].entered
	want := c.stores[l].held
	waitFor(t, "the followers to store the entry the leader is still writing", func() bool {
		for i, s := range c.stores {
			if last, _ := s.LastIndex(); i != l && last < want {
				return false
			}
		}
		return true
	})
	if last, _ := c.stores[l].InmemStore.LastIndex(); last >= want {
		t.Fatalf("leader's store has index %d before its write returned", last)
	}
	c.stores[l].release <- nil
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "x applied on every node", func() bool { return c.applied("x") })
}

// TestStagedWriteFailureStepsDown: a leader whose write fails answers the
// error and steps down; the entry its followers already hold is kept by
// the next leader, and every node applies the same log after.
func TestStagedWriteFailureStepsDown(t *testing.T) {
	c := newStagedCluster(t)
	l := c.leader(t, -1)
	c.stores[l].arm()
	f := c.rafts[l].Apply([]byte("y"), 0)
	<-c.stores[l].entered
	want := c.stores[l].held
	waitFor(t, "the followers to store the entry", func() bool {
		for i, s := range c.stores {
			if last, _ := s.LastIndex(); i != l && last < want {
				return false
			}
		}
		return true
	})
	term := c.rafts[l].getCurrentTerm()
	disk := errors.New("disk gone")
	c.stores[l].release <- disk
	if err := f.Error(); !errors.Is(err, disk) || !errors.Is(err, ErrLeadershipLost) {
		t.Fatalf("apply answered %v, want the write's error as a lost leadership", err)
	}
	// Unless a new leader has sent it the entry since (in a later term).
	if last, _ := c.rafts[l].getLastLog(); last >= want && c.rafts[l].getCurrentTerm() == term {
		t.Fatalf("failed leader still claims index %d", last)
	}
	next := c.leader(t, l)
	if err := c.rafts[next].Apply([]byte("z"), 0).Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "y and z applied on every node", func() bool { return c.applied("y", "z") })
}
