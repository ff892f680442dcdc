// Copyright (c) Tidepool authors
// SPDX-License-Identifier: MPL-2.0

package raft

// Review of the staged leader write (stage.go), by fresh eyes. Three tests
// failed on the first version, each fixed since: a configuration entry
// committed under the old configuration's quorum, a stepped-down leader
// sent a follower ahead of it a stale snapshot after a failed write, and a
// failed write answered a definite error for an entry that may commit. The
// others pin behaviour that was checked and found sound.

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// holdStore holds back one StoreLogs whose first entry has the armed type,
// until the test sends the write's outcome on release. It stages through
// the embedded InmemStore, so raft treats it as a LogStager.
type holdStore struct {
	*InmemStore
	mu      sync.Mutex
	armed   bool
	typ     LogType
	entered chan struct{}
	release chan error
	held    uint64
	stop    chan struct{} // closed at cleanup: a held write fails
}

func newHoldStore() *holdStore {
	return &holdStore{InmemStore: NewInmemStore(), stop: make(chan struct{})}
}

func (h *holdStore) hold(typ LogType) (entered <-chan struct{}, release chan<- error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.armed, h.typ = true, typ
	h.entered, h.release = make(chan struct{}), make(chan error, 1)
	return h.entered, h.release
}

func (h *holdStore) heldIndex() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held
}

func (h *holdStore) StoreLogs(logs []*Log) error {
	h.mu.Lock()
	gated := h.armed && len(logs) > 0 && logs[0].Type == h.typ
	if gated {
		h.armed = false
		h.held = logs[len(logs)-1].Index
	}
	entered, release := h.entered, h.release
	h.mu.Unlock()
	if gated {
		close(entered)
		var err error
		select {
		case err = <-release:
		case <-h.stop:
			err = ErrRaftShutdown
		}
		if err != nil {
			return err
		}
	}
	return h.InmemStore.StoreLogs(logs)
}

// filterTransport lets a test answer or fail AppendEntries in place of
// the peer, and counts the snapshots sent. It refuses pipelines so that
// every AppendEntries goes through the hook.
type filterTransport struct {
	*InmemTransport
	mu        sync.Mutex
	hook      func(target ServerAddress, req *AppendEntriesRequest, resp *AppendEntriesResponse) (handled bool, err error)
	snapshots map[ServerAddress]int
}

func (f *filterTransport) setHook(h func(ServerAddress, *AppendEntriesRequest, *AppendEntriesResponse) (bool, error)) {
	f.mu.Lock()
	f.hook = h
	f.mu.Unlock()
}

func (f *filterTransport) snapshotsTo(a ServerAddress) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.snapshots[a]
}

func (f *filterTransport) AppendEntriesPipeline(ServerID, ServerAddress) (AppendPipeline, error) {
	return nil, ErrPipelineReplicationNotSupported
}

func (f *filterTransport) AppendEntries(id ServerID, target ServerAddress, args *AppendEntriesRequest, resp *AppendEntriesResponse) error {
	f.mu.Lock()
	h := f.hook
	f.mu.Unlock()
	if h != nil {
		if handled, err := h(target, args, resp); handled {
			return err
		}
	}
	return f.InmemTransport.AppendEntries(id, target, args, resp)
}

func (f *filterTransport) InstallSnapshot(id ServerID, target ServerAddress, args *InstallSnapshotRequest, resp *InstallSnapshotResponse, data io.Reader) error {
	f.mu.Lock()
	f.snapshots[target]++
	f.mu.Unlock()
	return f.InmemTransport.InstallSnapshot(id, target, args, resp, data)
}

type reviewNode struct {
	r     *Raft
	id    ServerID
	addr  ServerAddress
	store *holdStore
	trans *filterTransport
	fsm   *MockFSM
}

// newReviewCluster starts n voters and the given number of nonvoters
// after them; tune, when set, adjusts each node's config.
func newReviewCluster(t *testing.T, voters, nonvoters int, tune func(i int, c *Config)) []*reviewNode {
	t.Helper()
	var nodes []*reviewNode
	var conf Configuration
	for i := range voters + nonvoters {
		addr, tr := NewInmemTransport(ServerAddress(fmt.Sprintf("rnode%d", i)))
		s := Server{ID: ServerID(addr), Address: addr, Suffrage: Voter}
		if i >= voters {
			s.Suffrage = Nonvoter
		}
		conf.Servers = append(conf.Servers, s)
		nodes = append(nodes, &reviewNode{id: s.ID, addr: addr, store: newHoldStore(), fsm: &MockFSM{},
			trans: &filterTransport{InmemTransport: tr, snapshots: map[ServerAddress]int{}}})
	}
	for _, a := range nodes {
		for _, b := range nodes {
			a.trans.Connect(b.addr, b.trans.InmemTransport)
		}
	}
	for i, n := range nodes {
		cfg := inmemConfig(t)
		cfg.LocalID = n.id
		if tune != nil {
			tune(i, cfg)
		}
		snaps := NewInmemSnapshotStore()
		if err := BootstrapCluster(cfg, n.store, n.store, snaps, n.trans, conf); err != nil {
			t.Fatal(err)
		}
		r, err := NewRaft(cfg, n.fsm, n.store, n.store, snaps, n.trans)
		if err != nil {
			t.Fatal(err)
		}
		n.r = r
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			n.trans.setHook(nil)
			close(n.store.stop)
		}
		for _, n := range nodes {
			_ = n.r.Shutdown().Error()
		}
	})
	return nodes
}

// reviewLeader waits for a leader among nodes and returns its position.
func reviewLeader(t *testing.T, nodes []*reviewNode) int {
	t.Helper()
	var l int
	waitFor(t, "a leader", func() bool {
		for i, n := range nodes {
			if n.r.State() == Leader {
				l = i
				return true
			}
		}
		return false
	})
	return l
}

func recv[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

func (n *reviewNode) lastStored() uint64 {
	last, _ := n.store.LastIndex()
	return last
}

func (n *reviewNode) appliedCount() int { return len(n.fsm.Logs()) }

// matchOf reads the leader's commitment for id. Only call it while the
// leader's main goroutine is held in StoreLogs (after entered): the
// commitment pointer is then stable and the close of entered orders it.
func matchOf(r *Raft, id ServerID) (match, commit uint64) {
	c := r.leaderState.commitment
	c.Lock()
	defer c.Unlock()
	return c.matchIndexes[id], c.commitIndex
}

func others(nodes []*reviewNode, l int) (a, b *reviewNode) {
	var o []*reviewNode
	for i, n := range nodes {
		if i != l {
			o = append(o, n)
		}
	}
	return o[0], o[1]
}

// TestReviewStagedCommitWaitsForLeaderDisk pins the rule the change rests
// on: with one follower cut off from the entries, the other follower's
// copy is not a majority, so nothing commits while the leader's own write
// is held, even after that follower's ack is counted; the entry commits
// once the leader's write returns.
func TestReviewStagedCommitWaitsForLeaderDisk(t *testing.T) {
	nodes := newReviewCluster(t, 3, 0, nil)
	l := reviewLeader(t, nodes)
	L := nodes[l]
	if err := L.r.Apply([]byte("a"), 5*time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	f1, f2 := others(nodes, l)
	L.trans.setHook(func(target ServerAddress, req *AppendEntriesRequest, _ *AppendEntriesResponse) (bool, error) {
		if target == f2.addr && len(req.Entries) > 0 {
			return true, errors.New("review: partitioned from the entries")
		}
		return false, nil
	})
	entered, release := L.store.hold(LogCommand)
	fut := L.r.Apply([]byte("b"), 5*time.Second)
	recv(t, "the leader's write", entered)
	held := L.store.heldIndex()
	waitFor(t, "the leader to count f1's copy", func() bool {
		m, _ := matchOf(L.r, f1.id)
		return m >= held
	})
	if _, commit := matchOf(L.r, f1.id); commit >= held {
		t.Fatalf("index %d committed with one follower of three on disk (commit %d)", held, commit)
	}
	if m, _ := matchOf(L.r, L.id); m >= held {
		t.Fatalf("leader counted itself at %d before its write returned", m)
	}
	release <- nil
	if err := fut.Error(); err != nil {
		t.Fatal(err)
	}
	if got := f2.lastStored(); got >= held {
		t.Fatalf("f2 stored %d though partitioned", got)
	}
	L.trans.setHook(nil)
	waitFor(t, "b applied everywhere", func() bool {
		for _, n := range nodes {
			if n.appliedCount() != 2 {
				return false
			}
		}
		return true
	})
}

// TestReviewConfigEntryNotCommittedUnderOldConfiguration: the leader counts
// itself in dispatchStaged, but appendConfigurationEntry switches the
// commitment to the new configuration only after dispatchLogs returns. So
// a configuration entry that the followers acked during the leader's write
// commits under the OLD configuration's quorum. Here the leader removes
// itself from {L, f1, f2}: the new configuration is {f1, f2}, and the
// removal must not be acknowledged until both hold it; with f2 cut off
// from the entries it is acknowledged with only L and f1 holding it (L is
// leaving; upstream and the thesis count the entry against C_new).
func TestReviewConfigEntryNotCommittedUnderOldConfiguration(t *testing.T) {
	nodes := newReviewCluster(t, 3, 0, nil)
	l := reviewLeader(t, nodes)
	L := nodes[l]
	if err := L.r.Apply([]byte("a"), 5*time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	f1, f2 := others(nodes, l)
	// f2 keeps its heartbeats (no election, no lease loss) but gets no
	// entries: as if its disk or link to the leader were stuck.
	L.trans.setHook(func(target ServerAddress, req *AppendEntriesRequest, _ *AppendEntriesResponse) (bool, error) {
		if target == f2.addr && len(req.Entries) > 0 {
			return true, errors.New("review: entries to f2 dropped")
		}
		return false, nil
	})
	entered, release := L.store.hold(LogConfiguration)
	fut := L.r.RemoveServer(L.id, 0, 5*time.Second)
	recv(t, "the leader's write of the configuration entry", entered)
	held := L.store.heldIndex()
	// Let f1's ack be counted, if the entry goes out during the write at
	// all (a fix that stops staging configuration entries sends it after).
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if m, _ := matchOf(L.r, f1.id); m >= held {
			break
		}
	}
	release <- nil
	done := make(chan error, 1)
	go func() { done <- fut.Error() }()
	select {
	case err := <-done:
		if err == nil && f2.lastStored() < held {
			t.Errorf("RemoveServer(leader) acknowledged: configuration entry %d (new voters %s, %s) is on %s only of the new configuration, not a majority of it",
				held, f1.id, f2.id, f1.id)
		}
	case <-time.After(3 * time.Second):
		// Not committed while f2 lacks it: as it should be.
	}
}

// inReplicatorBackoff reports whether some goroutine waits in the backoff
// select at the start of replicateTo (the only select in that function).
// Runtime frames are left out of the trace, so a goroutine blocked there
// reads "goroutine N [select...]:" followed by the replicateTo frame.
func inReplicatorBackoff() bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		lines := strings.SplitN(g, "\n", 3)
		if len(lines) >= 2 && strings.Contains(lines[0], "[select") &&
			strings.Contains(lines[1], "raft.(*Raft).replicateTo(") {
			return true
		}
	}
	return false
}

func inReplicatorBackoffWithin(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !inReplicatorBackoff() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// TestReviewFailedWriteSendsNoStaleSnapshot: a replicator that picked up
// the staged lastIndex and then sleeps in its failure backoff wakes after
// the leader's write failed and StoreLogs dropped the staged entries:
// GetLog answers ErrLogNotFound, which replicateTo takes for a compacted
// log, and it sends the latest snapshot (goto SEND_SNAP, never checking
// stopCh) to a follower that is AHEAD of it, in the old term, which the
// follower still accepts (the stepped-down leader's heartbeat goroutine
// lives on while the replicator does). The follower rolls its FSM back
// to the snapshot, and its configuration back to the snapshot's, for good:
// the configuration entries after the snapshot are never processed again.
func TestReviewFailedWriteSendsNoStaleSnapshot(t *testing.T) {
	slow := 3 * time.Second
	nodes := newReviewCluster(t, 3, 1, func(i int, c *Config) {
		if i != 0 { // node 0 becomes the leader
			c.HeartbeatTimeout, c.ElectionTimeout = slow, slow
		}
	})
	L := nodes[reviewLeader(t, nodes)]
	if L != nodes[0] {
		t.Skip("node 0 did not win the first election")
	}
	// Once leader, node 0 too waits long before an election, so the
	// cluster stays in this term until the test lets it go.
	cfg := L.r.config()
	rc := ReloadableConfig{TrailingLogs: cfg.TrailingLogs, SnapshotInterval: cfg.SnapshotInterval,
		SnapshotThreshold: cfg.SnapshotThreshold, HeartbeatTimeout: 5 * time.Second, ElectionTimeout: 5 * time.Second}
	if err := L.r.ReloadConfig(rc); err != nil {
		t.Fatal(err)
	}
	f1, f2, x := nodes[1], nodes[2], nodes[3]
	for i := range 5 {
		if err := L.r.Apply(fmt.Appendf(nil, "a%d", i), 5*time.Second).Error(); err != nil {
			t.Fatal(err)
		}
	}
	if err := L.r.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	// A configuration change after the snapshot: x leaves.
	if err := L.r.RemoveServer(x.id, 0, 5*time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	_ = x.r.Shutdown().Error()
	for i := range 3 {
		if err := L.r.Apply(fmt.Appendf(nil, "b%d", i), 5*time.Second).Error(); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "f1 and f2 to apply 8 entries", func() bool { return f1.appliedCount() == 8 && f2.appliedCount() == 8 })
	hasX := func(n *reviewNode) bool {
		f := n.r.GetConfiguration()
		if f.Error() != nil {
			return false
		}
		for _, s := range f.Configuration().Servers {
			if s.ID == x.id {
				return true
			}
		}
		return false
	}
	if hasX(f1) {
		t.Fatal("f1 still has x in its configuration")
	}

	// f1 refuses every entry (a lagging or slow follower): its replicator
	// stays in replicateTo, backing off longer each time. Heartbeats pass.
	var mu sync.Mutex
	refused := 0
	L.trans.setHook(func(target ServerAddress, req *AppendEntriesRequest, resp *AppendEntriesResponse) (bool, error) {
		if target != f1.addr || len(req.Entries) == 0 {
			return false, nil
		}
		mu.Lock()
		refused++
		mu.Unlock()
		*resp = AppendEntriesResponse{RPCHeader: RPCHeader{ID: []byte(f1.id), Addr: []byte(f1.addr)},
			Term: req.Term, LastLog: req.Entries[len(req.Entries)-1].Index, Success: false}
		return true, nil
	})
	entered, release := L.store.hold(LogCommand)
	fut := L.r.Apply([]byte("y"), 5*time.Second)
	recv(t, "the leader's write of y", entered)
	held := L.store.heldIndex()
	waitFor(t, "f2 to store y", func() bool { return f2.lastStored() >= held })
	waitFor(t, "f1's replicator to back off long", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return refused >= 7 // the next backoff is 10ms<<5
	})
	if !inReplicatorBackoffWithin(10 * time.Second) {
		t.Fatal("timed out waiting for f1's replicator to sleep in its backoff")
	}
	disk := errors.New("review: disk gone")
	release <- disk
	if err := fut.Error(); err == nil {
		t.Fatal("apply of y succeeded though the leader's write failed")
	}
	deadline := time.Now().Add(3 * time.Second)
	for L.trans.snapshotsTo(f1.addr) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	sent := L.trans.snapshotsTo(f1.addr)
	if sent > 0 {
		t.Errorf("the stepped-down leader sent %d snapshot(s) to f1, which had every entry the snapshot holds", sent)
	}

	// Let the cluster elect again and commit something.
	L.trans.setHook(nil)
	rc.HeartbeatTimeout, rc.ElectionTimeout = 50*time.Millisecond, 50*time.Millisecond
	for _, n := range nodes[:3] {
		if err := n.r.ReloadConfig(rc); err != nil {
			t.Fatal(err)
		}
	}
	var next *reviewNode
	waitFor(t, "a new leader to commit z", func() bool {
		for _, n := range nodes[:3] {
			if n.r.State() == Leader && n.r.Apply([]byte("z"), time.Second).Error() == nil {
				next = n
				return true
			}
		}
		return false
	})
	want := next.appliedCount()
	waitFor(t, "every node to apply as much as the leader", func() bool {
		return f1.appliedCount() == want && f2.appliedCount() == want && L.appliedCount() == want
	})
	if a, b := hasX(f1), hasX(f2); a != b {
		t.Errorf("configurations diverged: x in f1's: %v, in f2's: %v (f1 rolled back to the snapshot's; leader now %s)", a, b, next.id)
	}
}

// TestReviewFailedWriteAnswersOutcomeUnknown: the futures of a failed
// staged write are answered with the store's error, which upstream only
// ever returned for an entry no one else had; here the entry was already
// sent and may commit (it does below). Callers such as master.apply take
// any error other than ErrLeadershipLost as "not applied" (they answer
// codes.Internal, not ErrOutcomeUnknown).
func TestReviewFailedWriteAnswersOutcomeUnknown(t *testing.T) {
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
	c.stores[l].release <- errors.New("disk gone")
	err := f.Error()
	next := c.leader(t, l)
	if err := c.rafts[next].Apply([]byte("z"), 0).Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "y and z applied on every node", func() bool { return c.applied("y", "z") })
	if !errors.Is(err, ErrLeadershipLost) {
		t.Errorf("y was committed and applied, but its Apply answered %q, not an outcome-unknown error (ErrLeadershipLost)", err)
	}
}
