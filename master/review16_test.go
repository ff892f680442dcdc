package master

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review16Under recomputes FSM.under from the table: the complete objects
// on fewer distinct nodes than their put asked for. f.mu must be held.
func review16Under(f *FSM) []string {
	var out []string
	for k, o := range f.objects.all() {
		if !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			continue
		}
		var nodes []string
		for _, e := range f.exts(o) {
			if s := f.seg(e); s != nil && !slices.Contains(nodes, s.node) {
				nodes = append(nodes, s.node)
			}
		}
		if len(nodes) < f.want(o) {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// review16CheckUnder fails unless f.under is exactly what the table says,
// and names no object out of the table.
func review16CheckUnder(t *testing.T, f *FSM, step int, what string) {
	t.Helper()
	f.mu.RLock()
	defer f.mu.RUnlock()
	want := review16Under(f)
	var got []string
	for o := range f.under {
		if o.gone() || f.objects.get(o.key()) != o {
			t.Fatalf("step %d (%s): the under set holds %q, which left the table", step, what, o.key())
		}
		got = append(got, o.key())
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("step %d (%s): under set %v, the table says %v", step, what, got, want)
	}
}

// review16Fuzz drives one FSM with random commands of every kind that
// changes an object's replicas or state, choosing arguments from the FSM's
// own state so that most of them take effect.
type review16Fuzz struct {
	t     *testing.T
	d     *fsmDriver
	rng   *rand.Rand
	now   int64
	nodes []string
	keys  []string
}

func (z *review16Fuzz) segs() []segmentView { return z.d.f.segmentViews() }

func (z *review16Fuzz) seg() (segmentView, bool) {
	v := z.segs()
	if len(v) == 0 {
		return segmentView{}, false
	}
	slices.SortFunc(v, func(a, b segmentView) int { return compareStr(a.id, b.id) })
	return v[z.rng.IntN(len(v))], true
}

func compareStr(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (z *review16Fuzz) key() string { return z.keys[z.rng.IntN(len(z.keys))] }

// object reads what the fuzz needs of a key's object.
func (z *review16Fuzz) object(key string) (segs []string, size uint64, checksum uint32, putID uint64, copies []uint64, complete, ok bool) {
	f := z.d.f
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.objects.get(key)
	if o == nil {
		return
	}
	for _, e := range f.exts(o) {
		if s := f.seg(e); s != nil {
			segs = append(segs, s.id)
		}
	}
	for _, c := range f.copies(o) {
		copies = append(copies, c.Id)
	}
	return segs, o.size, o.checksum, o.putID, copies, o.is(pb.ObjectState_OBJECT_STATE_COMPLETE), true
}

func (z *review16Fuzz) epoch(node string) uint64 {
	f := z.d.f
	f.mu.RLock()
	defer f.mu.RUnlock()
	if n := f.nodes[node]; n != nil {
		return n.epoch
	}
	return 0
}

func (z *review16Fuzz) step() string {
	d, rng := z.d, z.rng
	z.now += 1 + rng.Int64N(20)
	now := z.now
	switch p := rng.IntN(100); {
	case p < 6: // a node (re)registers, adopting kept objects
		node := z.nodes[rng.IntN(len(z.nodes))]
		cmd := &pb.RegisterCmd{Node: node, Endpoint: node + ":1", Segments: []*pb.SegmentSpec{dram("a", 1<<17), ssd("b", 1<<18)}}
		for range rng.IntN(4) {
			k := z.key()
			segs, size, sum, _, _, _, ok := z.object(k)
			if !ok || len(segs) == 0 {
				size, sum = uint64(1+rng.IntN(5000)), rng.Uint32()
			}
			cmd.Adopt = append(cmd.Adopt, &pb.AdoptedObject{Key: k, Segment: "b", Offset: uint64(rng.IntN(60)) * 4096, Size: size, Checksum: sum})
		}
		d.apply(now, &pb.Command{Op: &pb.Command_Register{Register: cmd}})
		return "register " + node
	case p < 9:
		node := z.nodes[rng.IntN(len(z.nodes))]
		d.nodeDown(now, node, z.epoch(node))
		return "node down " + node
	case p < 25: // a put through the legacy path, asking for 1-3 replicas
		k := z.key()
		var cands []string
		for range 1 + rng.IntN(4) {
			if v, ok := z.seg(); ok {
				cands = append(cands, v.id)
			}
		}
		d.apply(now, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
			Key: k, Size: uint64(1 + rng.IntN(6000)), Checksum: rng.Uint32(), Replicas: uint32(rng.IntN(4)),
			Candidates: cands, DeadlineUnixNano: now + 1000,
		}}}}})
		if rng.IntN(4) > 0 {
			d.putEnd(now, k)
		}
		return "put start " + k
	case p < 32:
		d.putEnd(now, z.key())
		return "put end"
	case p < 45: // reserve on a few segments and publish, asking for 1-3
		k := z.key()
		size := uint64(1 + rng.IntN(6000))
		it := &pb.PublishItem{Key: k, Size: size, Checksum: rng.Uint32(), PutId: uint64(now), ReplicasWanted: uint32(rng.IntN(4))}
		for range 1 + rng.IntN(3) {
			v, ok := z.seg()
			if !ok {
				break
			}
			out := d.apply(now, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
				Segment: v.id, Bytes: size, MinSpan: size, AllocUntilUnixNano: now + 1e6, ReleaseAfterUnixNano: now + 1e6,
			}}})
			r, _ := out.(ReserveResult)
			if r.Err != nil || len(r.Spans) == 0 {
				continue
			}
			it.Replicas = append(it.Replicas, &pb.Extent{Segment: v.id, Offset: r.Spans[0].off, Length: size})
			it.Reservations = append(it.Reservations, r.ID)
		}
		d.apply(now, &pb.Command{Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: []*pb.PublishItem{it}}}})
		return "publish " + k
	case p < 58: // a copy starts, of any reason
		k := z.key()
		segs, _, _, putID, _, complete, ok := z.object(k)
		if !ok || !complete || len(segs) == 0 {
			return "no copy"
		}
		var cands []string
		for range 1 + rng.IntN(3) {
			if v, ok := z.seg(); ok {
				cands = append(cands, v.id)
			}
		}
		reasons := []pb.CopyReason{pb.CopyReason_COPY_REASON_DEMOTE, pb.CopyReason_COPY_REASON_DRAIN, pb.CopyReason_COPY_REASON_PROMOTE,
			pb.CopyReason_COPY_REASON_WRITEBACK, pb.CopyReason_COPY_REASON_REPAIR}
		d.apply(now, &pb.Command{Op: &pb.Command_CopyStart{CopyStart: &pb.CopyStartCmd{Items: []*pb.CopyStartItem{{
			Key: k, PutId: putID, Source: segs[rng.IntN(len(segs))], Candidates: cands,
			DeadlineUnixNano: now + 200, Reason: reasons[rng.IntN(len(reasons))],
		}}}}})
		return "copy start " + k
	case p < 70: // a copy ends: done, failed or expired
		var k string
		var copies []uint64
		for _, c := range z.keys {
			if _, _, _, _, cs, _, ok := z.object(c); ok && len(cs) > 0 {
				k, copies = c, cs
				break
			}
		}
		if k == "" {
			return "no copy end"
		}
		it := &pb.CopyEndItem{Key: k, CopyId: copies[0], Failed: rng.IntN(5) == 0, OnlyExpired: rng.IntN(6) == 0}
		d.apply(now, &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: &pb.CopyEndCmd{Items: []*pb.CopyEndItem{it}, FreeAfterUnixNano: now + rng.Int64N(100)}}})
		return "copy end " + k
	case p < 78: // a replica dropped: corrupt, demoted, drained
		k := z.key()
		segs, _, sum, _, _, _, ok := z.object(k)
		if !ok || len(segs) == 0 {
			return "no drop"
		}
		d.apply(now, &pb.Command{Op: &pb.Command_DropReplicas{DropReplicas: &pb.DropReplicasCmd{Items: []*pb.DropReplicaCmd{{
			Key: k, Segment: segs[rng.IntN(len(segs))], Checksum: sum, KeepLast: rng.IntN(2) == 0, FreeAfterUnixNano: now + rng.Int64N(50),
		}}}}})
		return "drop replica " + k
	case p < 83: // a put that reclaims written-back replicas of a full segment
		v, ok := z.seg()
		if !ok {
			return "no reclaim"
		}
		var rec []*pb.Reclaimable
		for _, k := range z.keys {
			if segs, _, _, _, _, _, ok := z.object(k); ok && slices.Contains(segs, v.id) {
				rec = append(rec, &pb.Reclaimable{Key: k, Segment: v.id})
			}
		}
		k := z.key()
		d.apply(now, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Reclaim: rec, Items: []*pb.PutStartItem{{
			Key: k, Size: v.capacity - uint64(rng.IntN(4096)), Checksum: 1, Candidates: []string{v.id}, DeadlineUnixNano: now + 1000,
		}}}}})
		return "reclaim on " + v.id
	case p < 90:
		d.remove(now, z.key(), now+rng.Int64N(50))
		return "remove"
	case p < 95:
		d.evict(now, z.key(), now+rng.Int64N(50), true)
		return "evict"
	case p < 97:
		d.revoke(now, z.key())
		return "revoke"
	default:
		d.tick(now)
		return "tick"
	}
}

// TestReview16UnderMatchesTable: after every command of random streams
// that publish, put, adopt, copy (moves too), reclaim, drop, remove,
// evict, revoke and take nodes down, FSM.under is exactly the complete
// objects below their count; and so it is in an FSM restored from a
// snapshot at any point.
func TestReview16UnderMatchesTable(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			z := &review16Fuzz{t: t, d: newDriver(t), rng: rand.New(rand.NewPCG(seed, 16)), now: t0,
				nodes: []string{"n0", "n1", "n2", "n3"}, keys: keyNames("k", 24)}
			for _, n := range z.nodes {
				z.d.register(t0, n, n+":1", dram("a", 1<<17), ssd("b", 1<<18))
			}
			peak := 0
			for i := range 3000 {
				what := z.step()
				review16CheckUnder(t, z.d.f, i, what)
				peak = max(peak, z.d.f.repairs().under)
				if i%250 == 0 {
					f := restored(t, snapshotBytes(t, z.d.f))
					review16CheckUnder(t, f, i, "restored: "+what)
					if a, b := z.d.f.repairs().under, f.repairs().under; a != b {
						t.Fatalf("step %d: %d under-replicated, %d after a restore", i, a, b)
					}
				}
			}
			if peak == 0 {
				t.Fatal("no object was ever under-replicated: the stream exercises too little")
			}
		})
	}
}

// review16Drain drains node through the admin service until it is out.
func review16Drain(t *testing.T, e *tierEnv, node string) {
	t.Helper()
	stream, err := e.admin().Drain(rpcCtx(t), &pb.DrainRequest{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	for {
		p, err := stream.Recv()
		if err != nil {
			t.Fatalf("drain %s: %v", node, err)
		}
		if p.Done {
			return
		}
	}
}

// TestReview16DrainKeepsCountWithAvoidedNode: one client's report that it
// could not reach store w must not make a drain of u drop replicas of
// objects put on two nodes: w is alive and heartbeating, and can take the
// copies. candidates() falls back to avoided nodes only when no node is
// left at all, before candidatesBeside takes out the nodes that hold the
// object, so here the drain sees no candidate and drops.
func TestReview16DrainKeepsCountWithAvoidedNode(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	for _, n := range []string{"u", "v", "w"} {
		startFakeStore(t, m, n, reportOK, dram("a", segCap))
	}
	keys := keyNames("k", 12)
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...)
	if _, err := m.master().ReportUnreachable(rpcCtx(t), &pb.UnreachableReport{Segments: []string{"w/a@1"}}); err != nil {
		t.Fatal(err)
	}
	review16Drain(t, e, "u")
	var short []string
	for k, segs := range placement(t, m, keys...) {
		if nodes := nodesOfSegments(segs); len(nodes) < 2 {
			short = append(short, fmt.Sprintf("%s on %v", k, nodes))
		}
	}
	slices.Sort(short)
	under, _ := repairStatus(t, m)
	if len(short) > 0 || under != 0 {
		t.Fatalf("after draining u with w reported unreachable once: %d under-replicated: %v", under, short)
	}
}

// TestReview16AvoidedNodesKeepReplicaCount: after one client reports
// stores u and v unreachable, a put asking for two replicas on a pool of
// three live stores is still placed on two nodes: the fallback keeps
// avoided nodes in only when none is left, not when too few are left for
// the replicas asked for, so every client's puts are left on one node for
// a node TTL (and re-replication avoids u and v too, so nothing repairs
// them meanwhile).
func TestReview16AvoidedNodesKeepReplicaCount(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	for _, n := range []string{"u", "v", "w"} {
		startFakeStore(t, m, n, reportOK, dram("a", segCap))
	}
	if _, err := m.master().ReportUnreachable(rpcCtx(t), &pb.UnreachableReport{Segments: []string{"u/a@1", "v/a@1"}}); err != nil {
		t.Fatal(err)
	}
	keys := keyNames("p", 4)
	var short []string
	for i, r := range putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...) {
		if len(r.Replicas) < 2 {
			short = append(short, fmt.Sprintf("%s on %d node(s)", keys[i], len(r.Replicas)))
		}
	}
	if len(short) > 0 {
		under, _ := repairStatus(t, m)
		t.Fatalf("puts asking for 2 replicas with 3 live stores, 2 of them reported once: %v; %d under-replicated", short, under)
	}
}

// TestReview16DemotionRepairThrash: u has DRAM only, v DRAM and SSD; objects
// put with two replicas lie on u's DRAM and v's DRAM. u's DRAM above the
// watermark demotes its coldest objects to the only colder segment, v's
// SSD: a node that already holds them. They are then on one node, so
// re-replication copies them back into u's DRAM, which crosses the
// watermark again: demotion and repair copy the same objects round and
// round. A steady state takes a bounded number of copies.
func TestReview16DemotionRepairThrash(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "u", reportOK, dram("a", segCap))
	startFakeStore(t, m, "v", reportOK, dram("a", 8*segCap), ssd("b", 8*segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 15) // 0.94 of u's DRAM
	for i, r := range putBatch(t, m, sized(64*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...) {
		if n := nodesOfSegments([]string{r.Replicas[0].Segment, r.Replicas[1].Segment}); len(r.Replicas) != 2 || len(n) != 2 ||
			r.Replicas[0].Tier != pb.Tier_TIER_DRAM || r.Replicas[1].Tier != pb.Tier_TIER_DRAM {
			t.Fatalf("%s placed on %v, want the DRAM of u and of v", keys[i], r.Replicas)
		}
	}
	copies := func() (demote, repair float64) {
		return e.count(t, "tidepool_master_copies_total", "reason", "demote"), e.count(t, "tidepool_master_copies_total", "reason", "repair")
	}
	time.Sleep(4 * time.Second) // some 200 sweeps
	d, r := copies()
	under, _ := repairStatus(t, m)
	t.Logf("after 4 s: %v demotion copies, %v repair copies, %d under-replicated", d, r, under)
	if d+r > 4 {
		t.Fatalf("%v demotion and %v repair copies in 4 s for 2 objects over the watermark: demotion and re-replication undo each other", d, r)
	}
}

// review16Cluster is newCluster with in-memory transport addresses that
// look like host:port, as AddMember (and so a follower's announcement)
// wants them: with newCluster's bare ids no follower's gRPC address is
// ever recorded.
func review16Cluster(t *testing.T, n int, prefix string) *cluster {
	t.Helper()
	c := &cluster{t: t, members: make([]*member, n), trans: make([]*raft.InmemTransport, n), down: make([]bool, n)}
	var peers []raft.Server
	for i := range n {
		addr, tr := raft.NewInmemTransport(raft.ServerAddress(fmt.Sprintf("%s%d.raft:7000", prefix, i)))
		c.trans[i] = tr
		peers = append(peers, raft.Server{ID: raft.ServerID(fmt.Sprintf("m%d", i)), Address: addr})
	}
	for i, a := range c.trans {
		for j, b := range c.trans {
			if i != j {
				a.Connect(b.LocalAddr(), b)
			}
		}
	}
	if n == 1 {
		peers = nil
	}
	for i := range n {
		cfg := Config{ID: fmt.Sprintf("m%d", i), Dir: t.TempDir(), Peers: peers, Transport: c.trans[i]}
		fastTimings(&cfg)
		c.members[i] = start(t, cfg)
	}
	return c
}

// review16Joiner starts a master with Join on an in-memory transport
// connected to every transport of c (and they to it).
func review16Joiner(t *testing.T, c *cluster, id string) (*member, *raft.InmemTransport) {
	t.Helper()
	_, tr := raft.NewInmemTransport(raft.ServerAddress(id + ".raft:7000"))
	for _, o := range c.trans {
		tr.Connect(o.LocalAddr(), o)
		o.Connect(tr.LocalAddr(), tr)
	}
	cfg := Config{ID: id, Dir: t.TempDir(), Join: true, Transport: tr}
	fastTimings(&cfg)
	return start(t, cfg), tr
}

// review16Known waits until l's FSM has every member's gRPC address, as
// the followers' announcements bring them.
func review16Known(t *testing.T, c *cluster, l *member) {
	t.Helper()
	waitFor(t, 10*time.Second, "every master's address recorded", func() error {
		for i, m := range c.members {
			if c.down[i] {
				continue
			}
			if got := l.srv.fsm.member(m.srv.cfg.ID); got != m.addr {
				return fmt.Errorf("%s recorded at %q, want %q", m.srv.cfg.ID, got, m.addr)
			}
		}
		return nil
	})
}

// review16Voters lists m's raft voters' ids.
func review16Voters(t *testing.T, m *member) []string {
	t.Helper()
	servers, err := m.srv.voters()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range servers {
		out = append(out, string(s.ID))
	}
	return out
}

// review16Led reports whether any member of ms leads within d.
func review16Led(ms []*member, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		for _, m := range ms {
			if m.srv.IsLeader() {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// TestReview16AddMemberWrongRaftAddress: AddMember checks that the new
// master answers at its gRPC address, not that raft can reach it at the
// raft address given. An operator's typo in RAFTADDR makes the one-master
// cluster a two-voter one whose second voter never answers: the leader
// loses its lease, and no master can be elected again (recovery needs
// peers.json by hand).
func TestReview16AddMemberWrongRaftAddress(t *testing.T) {
	c := review16Cluster(t, 1, "m")
	l := c.leader()
	j, _ := review16Joiner(t, c, "j1")
	_, err := pb.NewAdminClient(l.conn).AddMember(rpcCtx(t), &pb.AddMemberRequest{Id: "j1", RaftAddress: "127.0.0.1:1", GrpcAddress: j.addr})
	t.Logf("AddMember with a raft address nobody listens on: %v", err)
	if !review16Led([]*member{l, j}, 5*time.Second) {
		t.Fatalf("no leader 5 s after adding a voter at a wrong raft address (AddMember: %v); voters %v", err, review16Voters(t, l))
	}
}

// TestReview16AddMemberOfAnotherCluster: the guard against adding a master
// that belongs to another cluster compares leader ids only. Two clusters
// whose leaders have the same id (every `tidepool up` names its first
// master m1) pass it, and the other cluster's leader becomes a voter here.
func TestReview16AddMemberOfAnotherCluster(t *testing.T) {
	a := review16Cluster(t, 1, "a")
	b := review16Cluster(t, 1, "b")
	la, lb := a.leader(), b.leader()
	if la.srv.cfg.ID != lb.srv.cfg.ID {
		t.Fatalf("leaders %s and %s: want one id", la.srv.cfg.ID, lb.srv.cfg.ID)
	}
	a.trans[0].Connect(b.trans[0].LocalAddr(), b.trans[0])
	b.trans[0].Connect(a.trans[0].LocalAddr(), a.trans[0])
	_, err := pb.NewAdminClient(la.conn).AddMember(rpcCtx(t), &pb.AddMemberRequest{
		Id: "other", RaftAddress: string(b.trans[0].LocalAddr()), GrpcAddress: lb.addr,
	})
	t.Logf("AddMember of the other cluster's leader: %v", err)
	if voters := review16Voters(t, la); len(voters) != 1 || err == nil {
		t.Fatalf("adding the leader of another cluster: AddMember %v; voters now %v", err, voters)
	}
}

// TestReview16ConcurrentRemovesKeepQuorum: each RemoveMember checks quorum
// against the configuration it read, and hands raft no prevIndex, so two
// removals running at once both pass: of four masters with one down,
// removing two of the three that answer leaves two voters, one of them
// down, and the cluster can elect no leader.
func TestReview16ConcurrentRemovesKeepQuorum(t *testing.T) {
	c := review16Cluster(t, 4, "m")
	l := c.leader()
	review16Known(t, c, l)
	var fs []int
	for i, m := range c.members {
		if m != l {
			fs = append(fs, i)
		}
	}
	down := fs[2]
	c.kill(down)
	// The stopped master's gRPC address now answers nothing: a probe of it
	// takes the whole probe timeout, so both removals are checked before
	// either commits.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { conn.Close() })
		}
	}()
	if err := l.srv.recordMember(rpcCtx(t), c.members[down].srv.cfg.ID, ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, f := range fs[:2] {
		wg.Go(func() {
			_, errs[i] = pb.NewAdminClient(l.conn).RemoveMember(rpcCtx(t), &pb.RemoveMemberRequest{Id: c.members[f].srv.cfg.ID})
		})
	}
	wg.Wait()
	t.Logf("removals: %v", errs)
	var live []*member
	for i, m := range c.members {
		if i != down {
			live = append(live, m)
		}
	}
	time.Sleep(time.Second) // past the leader's lease
	if !review16Led(live, 5*time.Second) {
		t.Fatalf("no leader after two concurrent removals (%v) with a master down; %s's configuration names %v", errs, l.srv.cfg.ID, review16Voters(t, l))
	}
}

// TestReview16RemoveLeaderItself: the leader may remove itself; the call
// answers the new membership, and the rest elect a leader among them.
func TestReview16RemoveLeaderItself(t *testing.T) {
	c := review16Cluster(t, 3, "m")
	l := c.leader()
	review16Known(t, c, l)
	resp, err := pb.NewAdminClient(l.conn).RemoveMember(rpcCtx(t), &pb.RemoveMemberRequest{Id: l.srv.cfg.ID})
	if err != nil {
		t.Fatalf("remove the leader %s through itself: %v", l.srv.cfg.ID, err)
	}
	for _, m := range resp.Members {
		if m.Id == l.srv.cfg.ID {
			t.Fatalf("members after removing %s: %v", l.srv.cfg.ID, resp.Members)
		}
	}
	var rest []*member
	for _, m := range c.members {
		if m != l {
			rest = append(rest, m)
		}
	}
	if !review16Led(rest, 10*time.Second) {
		t.Fatal("the two masters left elect no leader")
	}
}

// review16FreePort returns a loopback port nothing listens on now.
func review16FreePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestReview16AnnounceWithHostnamePeers: masters whose --peers and --raft
// name hosts rather than IPs (localhost here; DNS names in a deployment).
// A follower announces its raft address as its TCP transport reports it,
// resolved to an IP, so AddMember finds the same id at another raft
// address and refuses, every 500 ms, forever: the follower's gRPC address
// is never recorded, status and the clients' refresh never learn it, and
// the quorum checks count it as down.
func TestReview16AnnounceWithHostnamePeers(t *testing.T) {
	var peers []raft.Server
	var rafts []string
	for i := range 2 {
		rafts = append(rafts, fmt.Sprintf("localhost:%d", review16FreePort(t)))
		peers = append(peers, raft.Server{ID: raft.ServerID(fmt.Sprintf("m%d", i)), Address: raft.ServerAddress(rafts[i])})
	}
	c := &cluster{t: t, members: make([]*member, 2), down: make([]bool, 2)}
	for i := range 2 {
		// The transport New makes of RaftAddr, made here so that the test
		// can close its pooled connections (NetworkTransport.Close leaves
		// them, and the peer's reader goroutines with them).
		addr, err := net.ResolveTCPAddr("tcp", rafts[i])
		if err != nil {
			t.Fatal(err)
		}
		tr, err := raft.NewTCPTransport(rafts[i], addr, 4, 10*time.Second, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(tr.CloseStreams)
		cfg := Config{ID: fmt.Sprintf("m%d", i), Dir: t.TempDir(), Peers: peers, RaftAddr: rafts[i], Transport: tr}
		fastTimings(&cfg)
		c.members[i] = start(t, cfg)
	}
	l := c.leader()
	waitFor(t, 5*time.Second, "the follower's gRPC address recorded", func() error {
		for _, m := range c.members {
			if got := l.srv.fsm.member(m.srv.cfg.ID); got != m.addr {
				return fmt.Errorf("%s recorded at %q, want %q (raft transport reports %s)", m.srv.cfg.ID, got, m.addr, m.srv.trans.LocalAddr())
			}
		}
		return nil
	})
}

// TestReview16CloseDuringAnnounce: a follower's announcement runs on a
// context of its own (probeTimeout, 2 s) that Close does not cancel, and
// Close waits for it: a follower whose leader hangs takes the whole
// timeout to close, the closeGrace with it, after which Close shuts raft
// down under work still in flight.
func TestReview16CloseDuringAnnounce(t *testing.T) {
	c := review16Cluster(t, 2, "m")
	l := c.leader()
	review16Known(t, c, l)
	f := c.followers()[0]
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { conn.Close() })
		}
	}()
	// The follower's own address is forgotten, and the leader's now points
	// at a master that answers nothing: the follower announces, and hangs.
	if err := l.srv.recordMember(rpcCtx(t), f.srv.cfg.ID, ""); err != nil {
		t.Fatal(err)
	}
	if err := l.srv.recordMember(rpcCtx(t), l.srv.cfg.ID, ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the follower sees the change", func() error {
		if f.srv.fsm.member(l.srv.cfg.ID) != ln.Addr().String() {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	time.Sleep(announceEvery + 100*time.Millisecond) // an announcement is in flight
	start := time.Now()
	f.stop(t)
	if d := time.Since(start); d > time.Second {
		t.Fatalf("closing a follower took %v: it waited for its announcement to a hung leader", d)
	}
}

// TestReview16RepairNotStarvedByUnrepairable: each sweep takes up to
// maxRepairPerSweep objects of the under set, in map order, and gives up on
// those it cannot copy (no node left that holds none, no tier to copy to)
// without looking further. Objects that cannot be repaired (here 3000 that
// asked for four nodes, after one of the four died) then fill each sweep's
// window, and the few that could be repaired at once wait their turn at
// random: each sweep reaches about limit/len(under) of them.
func TestReview16RepairNotStarvedByUnrepairable(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, func(cfg *Config) { cfg.NoWriteBack, cfg.SweepInterval = true, time.Hour })
	m := e.m
	// v and w join after the puts asking for two replicas, which land on
	// x and u.
	x := startFakeStore(t, m, "x", holdCopies, dram("a", segCap))
	startFakeStore(t, m, "u", holdCopies, dram("a", segCap))
	two := keyNames("two", 20)
	for i, r := range putBatch(t, m, sized(64, &pb.PutStartRequest{Replicas: 2}, two...)...) {
		if n := nodesOfSegments([]string{r.Replicas[0].Segment, r.Replicas[1].Segment}); !slices.Equal(n, []string{"u", "x"}) {
			t.Fatalf("%s on %v, want u and x", two[i], n)
		}
	}
	startFakeStore(t, m, "v", holdCopies, dram("a", segCap))
	startFakeStore(t, m, "w", holdCopies, dram("a", segCap))
	four := keyNames("four", 3000)
	for chunk := range slices.Chunk(four, 500) {
		putBatch(t, m, sized(64, &pb.PutStartRequest{Replicas: 4}, chunk...)...)
	}
	declareDead(t, m, x)
	if under, _ := repairStatus(t, m); under != uint64(len(two)+len(four)) {
		t.Fatalf("%d under-replicated, want %d", under, len(two)+len(four))
	}
	m.srv.repair(rpcCtx(t)) // one sweep's re-replication, 256 copies allowed
	if _, repairing := repairStatus(t, m); repairing != uint64(len(two)) {
		t.Fatalf("one sweep started %d repair copies; %d objects could be copied to v or w at once (%d allowed per sweep)",
			repairing, len(two), maxRepairPerSweep)
	}
}

// TestReview16EvictionRepairThrash: a DRAM-only pool at its watermark (the
// steady state of a cache) with objects put on two nodes. Eviction frees
// room by dropping a replica of an object that keeps another one, which
// leaves it below its count; re-replication copies it back into the
// segment eviction just freed, which crosses the watermark again. Drops
// and copies of the same objects go on every sweep.
func TestReview16EvictionRepairThrash(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "u", reportOK, dram("a", segCap))
	startFakeStore(t, m, "v", reportOK, dram("a", segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 15) // 0.94 of each segment
	putBatch(t, m, sized(64*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...)
	time.Sleep(4 * time.Second) // some 200 sweeps
	drops := e.count(t, "tidepool_master_replica_drops_total")
	repairs := e.count(t, "tidepool_master_copies_total", "reason", "repair")
	evicted := e.count(t, "tidepool_master_evictions_total")
	under, _ := repairStatus(t, m)
	t.Logf("after 4 s: %v replicas dropped, %v repair copies, %v objects evicted, %d under-replicated", drops, repairs, evicted, under)
	if drops+repairs > 8 {
		t.Fatalf("%v replica drops and %v repair copies in 4 s to bring two segments 4%% down: eviction and re-replication undo each other", drops, repairs)
	}
}
