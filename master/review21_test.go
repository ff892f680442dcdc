package master

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// r21Put puts key whole for tenant (a pool without security names the
// tenant in the request), continuing parent if set.
func r21Put(ctx context.Context, m *member, tenant, key, parent string, size uint64) error {
	r, err := m.master().PutStart(ctx, &pb.PutStartRequest{Key: key, Size: size, Checksum: uint32(size), Tenant: tenant, Parent: parent})
	if err != nil {
		return err
	}
	if r.Exists || len(r.Replicas) != 1 {
		return fmt.Errorf("put start %q = %v", key, r)
	}
	resp, err := m.master().PutEnd(ctx, &pb.KeysRequest{Keys: []string{key}, PutIds: []uint64{r.PutId}})
	if err != nil {
		return err
	}
	if c := resp.Results[0].Code; c != 0 {
		return status.Error(codes.Code(c), resp.Results[0].Message)
	}
	return nil
}

func r21MustPut(t *testing.T, m *member, tenant, key, parent string, size uint64) {
	t.Helper()
	if err := r21Put(rpcCtx(t), m, tenant, key, parent, size); err != nil {
		t.Fatalf("put %q of tenant %s: %v", key, tenant, err)
	}
}

func r21Quota(t *testing.T, m *member, tenant string, objects uint64) {
	t.Helper()
	if _, err := pb.NewAdminClient(m.conn).SetQuota(rpcCtx(t), &pb.TenantQuota{Tenant: tenant, Tier: pb.Tier_TIER_DRAM, Objects: objects}); err != nil {
		t.Fatalf("set quota of %s: %v", tenant, err)
	}
}

func r21Obj(m *member, key string) *object {
	m.srv.fsm.mu.RLock()
	defer m.srv.fsm.mu.RUnlock()
	return m.srv.fsm.objects.get(key)
}

// TestReview21QuotaVictimListIgnoresSoftPinSinceWalk: a victim list
// outlives the walk that chose it by up to victimListTTL, and take's
// unchanged check compares use, segments, put id and the hard pin, but
// not the soft pin. An object soft-pinned after the walk is taken (and
// evicted, allowSoft) while the tenant still holds older unpinned
// objects: the pin protects nothing against quota eviction.
func TestReview21QuotaVictimListIgnoresSoftPinSinceWalk(t *testing.T) {
	e := newEvictEnv(t, func(cfg *Config) { cfg.EvictRatio = 0.5 }) // slack: 2 of 4 objects
	m := e.m
	e.waitEvictable(t)
	r21Quota(t, m, "t", 4)
	for _, k := range []string{"k0", "k1", "k2", "k3"} {
		r21MustPut(t, m, "t", k, "", 4*kib)
	}
	// The walk chooses k0 (taken now), then k1, k2 for the next puts.
	r21MustPut(t, m, "t", "n1", "", 4*kib)
	if got := exists(t, m, "k0", "k1", "k2"); got[0] || !got[1] || !got[2] {
		t.Fatalf("after the first admission k0, k1, k2 exist: %v; want k0 evicted", got)
	}
	if _, err := e.admin().Pin(rpcCtx(t), &pb.PinRequest{Key: "k1", TtlMs: 60_000}); err != nil {
		t.Fatal(err)
	}
	r21MustPut(t, m, "t", "n2", "", 4*kib)
	if got := exists(t, m, "k1", "k2"); !got[0] || got[1] {
		t.Errorf("k1 (soft-pinned) exists: %v, k2 (older, unpinned) exists: %v; want the unpinned k2 evicted and k1 kept", got[0], got[1])
	}
}

// TestReview21QuotaVictimListSoftTailBeforeNewerPuts: a walk fills its
// list's slack with soft-pinned objects when the tenant has too few
// unpinned ones at that moment. The next admission takes the soft-pinned
// object from the list although the tenant now holds an unpinned object
// (put since): tenantCandidates' "soft-pinned ones after the rest" holds
// only for the first admission of a list.
func TestReview21QuotaVictimListSoftTailBeforeNewerPuts(t *testing.T) {
	e := newEvictEnv(t, func(cfg *Config) { cfg.EvictRatio = 0.5 }) // slack: 2 of 4 objects
	m := e.m
	e.waitEvictable(t)
	r21Quota(t, m, "t", 4)
	for _, k := range []string{"k0", "p1", "p2", "p3"} {
		r21MustPut(t, m, "t", k, "", 4*kib)
	}
	for _, k := range []string{"p1", "p2", "p3"} {
		if _, err := e.admin().Pin(rpcCtx(t), &pb.PinRequest{Key: k, TtlMs: 60_000}); err != nil {
			t.Fatal(err)
		}
	}
	r21MustPut(t, m, "t", "n1", "", 4*kib) // evicts k0, the one unpinned object; list: p1, p2
	if got := exists(t, m, "k0", "n1"); got[0] || !got[1] {
		t.Fatalf("after the first admission: k0 %v, n1 %v; want k0 evicted, n1 put", got[0], got[1])
	}
	r21MustPut(t, m, "t", "n2", "", 4*kib)
	if got := exists(t, m, "p1", "n1"); !got[0] || got[1] {
		t.Errorf("p1 (soft-pinned) exists: %v, n1 (unpinned) exists: %v; want n1 evicted before any soft-pinned object", got[0], got[1])
	}
}

// TestReview21QuotaRefusedWhileVictimInFlight: an admission whose
// victims another admission has taken but not yet evicted (its Evict is
// in raft) walks the table again, but tenantCandidates returns exactly
// need+slack objects in order, the taken ones included, and take skips
// those: with no slack (a quota under 20 objects at the default evict
// ratio) the second admission evicts nothing, the tenant's use has not
// gone down yet, so the put is refused as over quota although the tenant
// holds three more evictable objects.
func TestReview21QuotaRefusedWhileVictimInFlight(t *testing.T) {
	e := newEvictEnv(t, nil) // EvictRatio 0.05: no slack for 4 objects
	m := e.m
	e.waitEvictable(t)
	r21Quota(t, m, "t", 4)
	for _, k := range []string{"k0", "k1", "k2", "k3"} {
		r21MustPut(t, m, "t", k, "", 4*kib)
	}
	// A concurrent admission, as evictTenant does it: walk, take; its
	// Evict is still in flight.
	s := m.srv
	l := s.leadership()
	now := s.cfg.Now()
	segTier := map[string]pb.Tier{}
	for _, v := range s.fsm.segmentViews() {
		segTier[v.id] = v.tier
	}
	inTier := func(id string) bool { return segTier[id] == pb.Tier_TIER_DRAM }
	k := quotaKey{"t", pb.Tier_TIER_DRAM}
	need := tenantUse{0, 1}
	s.quotaVictims.put(k, l.term, now, s.tenantCandidates("t", inTier, l, now, need, need, s.quotaVictims.isTaken))
	var got tenantUse
	inFlight := s.quotaVictims.take(k, l.term, now, need, &got, inTier, s.fsm.unchanged)
	if len(inFlight) != 1 {
		t.Fatalf("the concurrent admission took %d victims, want 1", len(inFlight))
	}
	defer s.quotaVictims.done(inFlight)

	err := r21Put(rpcCtx(t), m, "t", "n", "", 4*kib)
	if err != nil {
		t.Errorf("a put of tenant t at its quota of 4 objects, 3 of them evictable and not taken (%s is being evicted by another admission): %v", inFlight[0].key, err)
	}
}

// TestReview21VictimListsOutliveTenants: victimLists drops a list only
// when an admission of the same tenant and tier takes from it; the lists
// of tenants that went away (quota removed, objects evicted) stay for
// good, each with its unused victims, long after victimListTTL: memory
// grows with every tenant ever admitted (bench replay makes a tenant per
// run and capacity).
func TestReview21VictimListsOutliveTenants(t *testing.T) {
	var skew atomic.Int64
	e := newEvictEnv(t, func(cfg *Config) {
		cfg.EvictRatio = 0.5
		cfg.Now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	})
	m := e.m
	e.waitEvictable(t)
	const tenants = 8
	for i := range tenants {
		tenant := fmt.Sprintf("gone%d", i)
		r21Quota(t, m, tenant, 4)
		for j := range 5 { // the fifth admission walks, leaving 2 on the list
			r21MustPut(t, m, tenant, fmt.Sprintf("%s/k%d", tenant, j), "", 4*kib)
		}
		r21Quota(t, m, tenant, 0)
		if _, err := e.admin().Evict(rpcCtx(t), &pb.EvictRequest{Tenant: tenant}); err != nil {
			t.Fatal(err)
		}
	}
	skew.Store(int64(2 * victimListTTL)) // every list is stale
	r21Quota(t, m, "live", 4)
	for j := range 5 {
		r21MustPut(t, m, "live", fmt.Sprintf("live/k%d", j), "", 4*kib)
	}
	s := m.srv
	s.quotaVictims.mu.Lock()
	lists := len(s.quotaVictims.m)
	var held int
	for _, l := range s.quotaVictims.m {
		held += len(l.objs)
	}
	s.quotaVictims.mu.Unlock()
	if lists > 1 {
		t.Errorf("victimLists holds %d lists (%d victims) after %d tenants went away and their lists went stale; want at most the live tenant's", lists, held, tenants)
	}
}

// TestReview21LookupLeavesAncestorsLessRecent: FSM.touch refreshes a
// block's ancestors ("no block is less recent than its descendants"),
// but a Lookup records use with o.used.Store on the blocks it matched
// alone (FSM.lookup), as does a get (FSM.replicas). A Go client with a
// lookup cache answers a chain's head from the cache and asks the master
// for the rest only, so the master sees a lookup of [child]: the child
// becomes more recent than its root, and eviction takes the root first,
// leaving the child unmatchable.
func TestReview21LookupLeavesAncestorsLessRecent(t *testing.T) {
	e := newEvictEnv(t, nil)
	m := e.m
	r21MustPut(t, m, "", "root", "", 4*kib)
	r21MustPut(t, m, "", "child", "root", 4*kib)
	if _, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"root", "child"}}); err != nil {
		t.Fatal(err)
	}
	first := r21Obj(m, "child").used.Load()
	waitFor(t, 5*time.Second, "the clock moves", func() error {
		if m.srv.cfg.Now().UnixNano() <= first {
			return fmt.Errorf("still %d", first)
		}
		return nil
	})
	// What a caching client sends once root is in its cache.
	if _, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"child"}}); err != nil {
		t.Fatal(err)
	}
	root, child := r21Obj(m, "root").used.Load(), r21Obj(m, "child").used.Load()
	if root < child {
		t.Errorf("after a lookup of the child: root used %d < child used %d: the ancestor is less recent than its descendant", root, child)
	}
	waitFor(t, 5*time.Second, "the leases end", func() error {
		if l := r21Obj(m, "child").lease.Load() &^ leaseCached; l > m.srv.cfg.Now().UnixNano() {
			return fmt.Errorf("leased until %d", l)
		}
		return nil
	})
	victims, _ := m.srv.pickVictims(m.srv.fsm.completeOn(evictSeg), 1, m.srv.cfg.Now())
	if len(victims) != 1 || victims[0].key != "child" {
		var keys []string
		for _, v := range victims {
			keys = append(keys, v.key)
		}
		t.Errorf("eviction would take %v first; want the chain's leaf, child, before its root", keys)
	}
}

// TestReview21ScoreCountsBlocksBeingRemoved: ScoreResponse.matched is
// documented as "what a Lookup at the same moment would match and
// lease", but a Lookup refuses to lease a key whose removal or eviction
// is in flight (Server.lease) and stops its match there, while Score
// counts the key: a router is told of a block the pool is evicting.
func TestReview21ScoreCountsBlocksBeingRemoved(t *testing.T) {
	e := newEvictEnv(t, nil)
	m := e.m
	r21MustPut(t, m, "", "a", "", 4*kib)
	r21MustPut(t, m, "", "b", "", 4*kib)
	_, done := m.srv.startRemove([]string{"b"}) // an eviction of b in raft
	defer done()
	chain := &pb.LookupRequest{Keys: []string{"a", "b"}}
	s, err := m.master().Score(rpcCtx(t), &pb.ScoreRequest{Chain: chain})
	if err != nil {
		t.Fatal(err)
	}
	l, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"a", "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if s.Matched != l.Matched {
		t.Errorf("with b's eviction in flight: score matched %d, lookup matched %d", s.Matched, l.Matched)
	}
}

// TestReview21TenantLookupOverLimitRefusedFirst: a tenant's packed lookup
// of more keys than a batch may hold is refused before the rewrite copies
// them with the tenant's prefix.
func TestReview21TenantLookupOverLimitRefusedFirst(t *testing.T) {
	n := newNamespace("t")
	for _, req := range []any{
		&pb.LookupRequest{KeyLengths: make([]uint32, MaxBatchKeys+1)},
		&pb.ScoreRequest{Chain: &pb.LookupRequest{KeyLengths: make([]uint32, MaxBatchKeys+1)}},
	} {
		if err := n.request(req); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("%T of %d keys: %v, want ErrInvalidRequest", req, MaxBatchKeys+1, err)
		}
	}
}

// TestGetWaitsForRemovalInFlight: a get of a key whose removal is in
// flight is not answered not found (the removal may never commit, as when
// its leader dies): it waits, and finds the object if the removal ends
// without removing it.
func TestGetWaitsForRemovalInFlight(t *testing.T) {
	e := newEvictEnv(t, nil)
	m := e.m
	putObject(t, m, "k", 4096)
	_, done := m.srv.startRemove([]string{"k"})
	got := make(chan *pb.GetReplicasResponse, 1)
	go func() {
		r, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k"}})
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	select {
	case r := <-got:
		t.Fatalf("answered %v while the removal was in flight", r)
	case <-time.After(100 * time.Millisecond): // no answer yet, as wanted
	}
	done() // the removal ends without having removed k
	if r := <-got; r == nil || r.Results[0].Status.GetCode() != 0 || len(r.Results[0].Replicas) != 1 {
		t.Fatalf("after the removal ended: %v, want k found", r)
	}
}
