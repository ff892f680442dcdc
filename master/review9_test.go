package master

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review9Follower is a raft voter that grants every vote and answers
// heartbeats, and, unless healed, fails every AppendEntries that carries
// or checks log entries: what a real follower answers while its log store
// fails (disk full, I/O error). Its heartbeats keep the leader's lease, so
// the leader never steps down, and nothing commits.
type review9Follower struct {
	id     raft.ServerID
	addr   raft.ServerAddress
	tr     *raft.InmemTransport
	healed atomic.Bool
	silent atomic.Bool // answers nothing at all: the leader loses its lease
	last   atomic.Uint64
	stop   chan struct{}
	done   chan struct{}
}

func newReview9Follower(t *testing.T, id string) *review9Follower {
	addr, tr := raft.NewInmemTransport("")
	f := &review9Follower{id: raft.ServerID(id), addr: addr, tr: tr, stop: make(chan struct{}), done: make(chan struct{})}
	go f.serve()
	t.Cleanup(func() { close(f.stop); <-f.done; tr.Close() })
	return f
}

func (f *review9Follower) serve() {
	defer close(f.done)
	hdr := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(f.id), Addr: []byte(f.addr)}
	for {
		select {
		case <-f.stop:
			return
		case rpc := <-f.tr.Consumer():
			if f.silent.Load() {
				continue // never answered: the sender times out
			}
			switch req := rpc.Command.(type) {
			case *raft.RequestPreVoteRequest:
				rpc.Respond(&raft.RequestPreVoteResponse{RPCHeader: hdr, Term: req.Term, Granted: true}, nil)
			case *raft.RequestVoteRequest:
				rpc.Respond(&raft.RequestVoteResponse{RPCHeader: hdr, Term: req.Term, Granted: true}, nil)
			case *raft.AppendEntriesRequest:
				heartbeat := len(req.Entries) == 0 && req.PrevLogEntry == 0
				switch {
				case heartbeat:
					rpc.Respond(&raft.AppendEntriesResponse{RPCHeader: hdr, Term: req.Term, LastLog: f.last.Load(), Success: true}, nil)
				case f.healed.Load():
					last := req.PrevLogEntry + uint64(len(req.Entries))
					f.last.Store(last)
					rpc.Respond(&raft.AppendEntriesResponse{RPCHeader: hdr, Term: req.Term, LastLog: last, Success: true}, nil)
				default:
					rpc.Respond(&raft.AppendEntriesResponse{RPCHeader: hdr, Term: req.Term, LastLog: f.last.Load(), Success: false}, nil)
				}
			default:
				rpc.Respond(nil, fmt.Errorf("review9 follower: %T not supported", req))
			}
		}
	}
}

// review9Stuck starts m0 as the leader of {m0, f1, f2} where f1 and f2 keep
// its lease but store nothing: it stays raft leader and commits nothing.
func review9Stuck(t *testing.T) (*member, []*review9Follower) {
	fs := []*review9Follower{newReview9Follower(t, "f1"), newReview9Follower(t, "f2")}
	addr, tr := raft.NewInmemTransport("")
	peers := []raft.Server{{ID: "m0", Address: addr}}
	for _, f := range fs {
		tr.Connect(f.addr, f.tr)
		f.tr.Connect(addr, tr)
		peers = append(peers, raft.Server{ID: f.id, Address: f.addr})
	}
	cfg := Config{ID: "m0", Dir: t.TempDir(), Peers: peers, Transport: tr}
	fastTimings(&cfg)
	m := start(t, cfg)
	waitFor(t, 10*time.Second, "m0 raft leader", func() error {
		if m.srv.raft.State() != raft.Leader {
			return fmt.Errorf("state %v", m.srv.raft.State())
		}
		return nil
	})
	// Well past the leader lease (250 ms): it keeps leading, with nothing
	// committed, so catchUp's barrier has not answered.
	time.Sleep(time.Second)
	if st := m.srv.raft.State(); st != raft.Leader {
		t.Fatalf("m0 is %v, want a leader that keeps its lease", st)
	}
	if m.srv.IsLeader() {
		t.Fatal("m0 caught up although nothing can commit")
	}
	return m, fs
}

// review9Close runs Close and reports whether it returned within limit; if
// not, it heals the followers (so raft commits) and waits for it, so the
// test can end.
func review9Close(t *testing.T, s *Server, fs []*review9Follower, limit time.Duration) (time.Duration, bool) {
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
		return time.Since(start), true
	case <-time.After(limit):
	}
	for _, f := range fs {
		f.healed.Store(true)
	}
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close still hangs after the followers healed")
	}
	return time.Since(start), false
}

// TestReview9CloseLeaderKeepsLeaseCommitsNothing: a leader whose quorum
// answers heartbeats but cannot append (a follower's disk full or failing)
// keeps its lease, so raft never answers its barrier or applies with
// ErrLeadershipLost, and leaderLoop waits in catchUp's barrier (Barrier's
// timeout bounds only the enqueue). Close must still return: after its
// grace it shuts raft down, which answers those futures.
func TestReview9CloseLeaderKeepsLeaseCommitsNothing(t *testing.T) {
	m, fs := review9Stuck(t)
	took, ok := review9Close(t, m.srv, fs, 5*time.Second)
	if !ok {
		t.Errorf("Close did not return within 5s on a leader that cannot commit (returned %v after, once the followers healed)", took.Round(time.Millisecond))
	}
}

// TestReview9CloseHandlerApplyCommitsNothing: the same leader, and a
// Register (no leaderOnly check) whose apply waits on an entry that cannot
// commit; the client's deadline ends the RPC, not the handler (apply reads
// the deadline as raft's enqueue timeout only), and grpc.Stop with
// WaitForHandlers(true) waits for that handler: Close must still return.
func TestReview9CloseHandlerApplyCommitsNothing(t *testing.T) {
	m, fs := review9Stuck(t)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, err := m.registry().Register(ctx, &pb.RegisterRequest{Node: "s1", Endpoint: "ep1", Segments: []*pb.SegmentSpec{dram("a", 1<<20)}})
	t.Logf("Register: %v", err)
	took, ok := review9Close(t, m.srv, fs, 5*time.Second)
	if !ok {
		t.Errorf("Close did not return within 5s with a handler waiting on an uncommittable apply (returned %v after, once the followers healed)", took.Round(time.Millisecond))
	}
}

// TestReview9CloseLeaderLosesQuorum: followers that go silent (heartbeats
// too) make the leader step down after LeaderLeaseTimeout, and raft answers
// the inflight barrier and applies with ErrLeadershipLost: Close is prompt.
func TestReview9CloseLeaderLosesQuorum(t *testing.T) {
	m, fs := review9Stuck(t)
	var wg sync.WaitGroup
	wg.Add(1)
	if !m.srv.goOwned(func() {
		defer wg.Done()
		_, err := m.srv.apply(context.Background(), &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{"k"}, OnlyExpired: true}}})
		t.Logf("apply: %v", err)
	}) {
		t.Fatal("closing")
	}
	for _, f := range fs {
		f.silent.Store(true)
	}
	took, ok := review9Close(t, m.srv, fs, 5*time.Second)
	wg.Wait()
	if !ok {
		t.Errorf("Close took %v although the leader lost its quorum", took)
	}
	t.Logf("Close took %v", took.Round(time.Millisecond))
}

// TestReview9CloseWaitsForCanceledUnpin: Unpin applies once per key, up to
// MaxBatchKeys; grpc.Stop cancels the handler's context and Close waits for
// the handler (WaitForHandlers), so apply must propose nothing once its
// context is done or the server is closing, or Close would wait for every
// remaining raft round of a request whose client is gone.
func TestReview9CloseWaitsForCanceledUnpin(t *testing.T) {
	m := newCluster(t, 1, nil).leader()
	s := m.srv
	keys := make([]string, MaxBatchKeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rpcDone := make(chan error, 1)
	before := s.raft.AppliedIndex()
	go func() {
		_, err := pb.NewAdminClient(m.conn).Unpin(ctx, &pb.KeysRequest{Keys: keys})
		rpcDone <- err
	}()
	waitUnpinUnderWay(t, s, before)
	start := time.Now()
	atClose := s.raft.AppliedIndex()
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	// Close cancels the handler's context at once (grpc.Stop).
	select {
	case <-rpcDone:
	case <-time.After(5 * time.Second):
		t.Fatal("the client's Unpin did not end after Close began")
	}
	select {
	case <-closed:
	case <-time.After(120 * time.Second):
		t.Fatal("Close hangs")
	}
	after := s.raft.AppliedIndex() - atClose
	t.Logf("Close took %v; %d entries applied after it began (the Unpin had done %d)", time.Since(start).Round(time.Millisecond), after, atClose-before)
	if after > 10 {
		t.Errorf("a canceled Unpin went on for %d more raft rounds after Close began, and Close waited %v for them", after, time.Since(start).Round(time.Millisecond))
	}
}

// waitUnpinUnderWay waits until an Unpin begun at applied index before has
// applied 20 of its entries.
func waitUnpinUnderWay(t *testing.T, s *Server, before uint64) {
	t.Helper()
	waitFor(t, 10*time.Second, "Unpin under way", func() error {
		if s.raft.AppliedIndex() < before+20 {
			return fmt.Errorf("applied %d", s.raft.AppliedIndex()-before)
		}
		return nil
	})
}
