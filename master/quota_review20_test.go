package master

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// r20Quota sets tenant's limits in DRAM as the admin.
func r20Quota(t *testing.T, m *member, tenant string, bytes, objects uint64) {
	t.Helper()
	_, err := pb.NewAdminClient(m.conn).SetQuota(r19Ctx(t, r19Admin), &pb.TenantQuota{Tenant: tenant, Tier: pb.Tier_TIER_DRAM, Bytes: bytes, Objects: objects})
	if err != nil {
		t.Fatalf("set quota of %s: %v", tenant, err)
	}
}

// r20Put puts key whole as token's caller.
func r20Put(t *testing.T, m *member, token, key string, size uint64) {
	t.Helper()
	r := r19PutStart(t, m, token, key, size)
	resp, err := m.master().PutEnd(r19Ctx(t, token), &pb.KeysRequest{Keys: []string{key}, PutIds: []uint64{r.PutId}})
	if err != nil || resp.Results[0].Code != 0 {
		t.Fatalf("put end %q: %v %v", key, resp, err)
	}
}

// r20Use is tenant's use of DRAM as the FSM keeps it.
func r20Use(m *member, tenant string) tenantUse {
	_, used := m.srv.fsm.quotaOf(tenant, pb.Tier_TIER_DRAM)
	return used
}

// TestReview20QuotaBatchSumWraps: admitQuota sums a batch's sizes in a
// uint64 without a check, so an item whose size wraps the sum (it fails
// later anyway, as too large) lets the rest of the batch through
// unchecked: a 4 MiB put under a 1 MiB quota is placed.
func TestReview20QuotaBatchSumWraps(t *testing.T) {
	m := r19Pool(t)
	r20Quota(t, m, "a", 1<<20, 0)
	const size = 4 << 20
	resp, err := m.master().BatchPutStart(r19Ctx(t, r19TenantA), &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{
		{Key: "wrap", Size: ^uint64(0) - size + 1, Checksum: 1}, // 2^64 - 4 MiB: the sum of the batch is 0
		{Key: "big", Size: size, Checksum: 1},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[1]; r.Status.Code == 0 {
		t.Errorf("a put of %d bytes under a quota of %d bytes was placed (%d replicas): the batch's sum wrapped", size, 1<<20, len(r.Replicas))
	} else if codes.Code(r.Status.Code) != codes.ResourceExhausted {
		t.Errorf("the 4 MiB put: %v %s, want ResourceExhausted", codes.Code(r.Status.Code), r.Status.Message)
	}
}

// TestReview20QuotaReplicasProductWraps: admitBatch charges a put
// Size*Replicas, unchecked: 8 GiB with 2^31 replicas is charged 0 bytes,
// so an 8 GiB put passes a 1 GiB quota and is placed.
func TestReview20QuotaReplicasProductWraps(t *testing.T) {
	m := r19Pool(t)
	_, err := m.registry().Register(r19Ctx(t, r19Store), &pb.RegisterRequest{Node: "s1", Endpoint: "127.0.0.1:10",
		Segments: []*pb.SegmentSpec{{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 16 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	r20Quota(t, m, "a", 1<<30, 0)
	const size = 8 << 30
	r, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "huge", Size: size, Replicas: 1 << 31, Checksum: 1})
	if err == nil {
		t.Errorf("a put of 8 GiB x 2^31 replicas under a quota of 1 GiB was placed (%d replicas): Size*Replicas wrapped to 0", len(r.Replicas))
	} else if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("the 8 GiB put: %v, want ResourceExhausted", err)
	}
}

// TestReview20QuotaPutLargerThanQuotaEvictsAll: a put that cannot fit
// the quota even with the tenant's tier empty still has admitQuota evict
// every evictable object of the tenant there (needBytes is capped by the
// use, not refused), and is then refused anyway.
func TestReview20QuotaPutLargerThanQuotaEvictsAll(t *testing.T) {
	m := r19Pool(t)
	r20Quota(t, m, "a", 1<<20, 0)
	for i := range 3 {
		r20Put(t, m, r19TenantA, fmt.Sprintf("kept%d", i), 256<<10)
	}
	before := r20Use(m, "a")
	_, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "too-big", Size: 2 << 20, Checksum: 1})
	if err == nil {
		t.Fatal("a 2 MiB put under a 1 MiB quota was placed")
	}
	after := r20Use(m, "a")
	if after != before {
		t.Errorf("a put larger than the quota itself (refused: %v) evicted the tenant's objects: use %+v before, %+v after", err, before, after)
	}
}

// TestReview20QuotaChargesUnplaceableReplicas: admitBatch charges a put
// Size times the replicas asked for, though a pool places at most one
// per node: in a pool of one store node a 512 KiB put asking 3 replicas
// is placed (one replica, 512 KiB), yet under a 1 MiB quota with nothing
// held it is refused, as if it needed 1.5 MiB.
func TestReview20QuotaChargesUnplaceableReplicas(t *testing.T) {
	m := r19Pool(t)
	const size = 512 << 10
	// Without a quota the put is placed, with its one replica.
	r, err := m.master().PutStart(r19Ctx(t, r19TenantB), &pb.PutStartRequest{Key: "free", Size: size, Replicas: 3, Checksum: 1})
	if err != nil || len(r.Replicas) != 1 {
		t.Fatalf("tenant b's put without a quota: %v, %v", r, err)
	}
	r20Quota(t, m, "a", 1<<20, 0)
	if _, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "k", Size: size, Replicas: 3, Checksum: 1}); err != nil {
		t.Errorf("a %d-byte put asking 3 replicas in a one-node pool, under a quota of 1 MiB with nothing held: %v", size, err)
	}
}

// TestReview20QuotaTooLargePutEvicts: admission runs before a put's own
// checks, so a put that fails anyway (larger than any segment) first
// evicts the tenant's objects.
func TestReview20QuotaTooLargePutEvicts(t *testing.T) {
	m := r19Pool(t) // one 64 MiB DRAM segment
	r20Quota(t, m, "a", 128<<20, 0)
	for i := range 3 {
		r20Put(t, m, r19TenantA, fmt.Sprintf("kept%d", i), 16<<20)
	}
	before := r20Use(m, "a")
	_, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "too-large", Size: 100 << 20, Checksum: 1})
	if status.Code(err) != codes.OutOfRange {
		t.Fatalf("a put larger than any segment: %v, want OutOfRange", err)
	}
	if after := r20Use(m, "a"); after != before {
		t.Errorf("a put refused as too large evicted the tenant's objects: use %+v before, %+v after", before, after)
	}
}

// TestReview20QuotaRefusedAfterFailover: a new leader evicts only what it
// made itself in its first lease TTL, and admitQuota does not wait for
// the rest as makeRoom does (awaitEvictable): after every leader change a
// tenant at its quota has its puts refused for a lease TTL (10 s by
// default), although every object it holds is evictable.
func TestReview20QuotaRefusedAfterFailover(t *testing.T) {
	tokens := r19Tokens(t)
	c := newClusterOf(t, 3, func(cfg *Config) {
		cfg.Security = Security{Tokens: tokens, PeerToken: r19Master}
		cfg.LeaseTTL = 3 * time.Second
	}, r19Start)
	m := c.leader()
	_, err := m.registry().Register(r19Ctx(t, r19Store), &pb.RegisterRequest{Node: "s0", Endpoint: "127.0.0.1:9",
		Segments: []*pb.SegmentSpec{{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 64 << 20}}})
	if err != nil {
		t.Fatal(err)
	}
	r20Quota(t, m, "a", 1<<20, 0)
	for i := range 4 {
		r20Put(t, m, r19TenantA, fmt.Sprintf("kept%d", i), 256<<10)
	}
	for i, x := range c.members {
		if x == m {
			c.kill(i)
		}
	}
	m = c.leader()
	r, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "next", Size: 256 << 10, Checksum: 1})
	if err != nil {
		t.Errorf("a put of tenant a, at its quota with 4 evictable objects, on the new leader: %v", err)
	} else if len(r.Replicas) != 1 {
		t.Errorf("put start: %v", r)
	}
}

// TestReview20QuotaEvictionDropsOtherTiers: a DRAM object that write-back
// gave an SSD replica is evicted whole when its tenant's DRAM quota needs
// room (evictTenant uses evictObjects, not free's keepsCount): the SSD
// copy, which the DRAM quota does not count, is lost with it, where the
// watermark's eviction drops only the DRAM replica.
func TestReview20QuotaEvictionDropsOtherTiers(t *testing.T) {
	c := newClusterOf(t, 1, func(cfg *Config) {
		cfg.Security = Security{Tokens: r19Tokens(t)}
		cfg.NoWriteBack, cfg.PromoteAfter = true, -1 // the test gives the SSD replicas itself
	}, r19Start)
	m := c.leader()
	reg, err := m.registry().Register(r19Ctx(t, r19Store), &pb.RegisterRequest{Node: "s0", Endpoint: "127.0.0.1:9",
		Segments: []*pb.SegmentSpec{{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 64 << 20}, {Name: "ssd0", Tier: pb.Tier_TIER_SSD, Capacity: 256 << 20}}})
	if err != nil {
		t.Fatal(err)
	}
	dram, ssd := reg.SegmentIds[0], reg.SegmentIds[1]
	r20Quota(t, m, "a", 1<<20, 0)
	now := time.Now().UnixNano()
	for i := range 4 {
		key := fmt.Sprintf("kept%d", i)
		r20Put(t, m, r19TenantA, key, 256<<10)
		// Write-back: an SSD replica beside the DRAM one.
		out, err := m.srv.apply(rpcCtx(t), &pb.Command{Op: &pb.Command_CopyStart{CopyStart: &pb.CopyStartCmd{Items: []*pb.CopyStartItem{{
			Key: "a/" + key, Source: dram, Candidates: []string{ssd}, DeadlineUnixNano: now + 60e9, Reason: pb.CopyReason_COPY_REASON_WRITEBACK,
		}}}}})
		if err != nil || out.([]CopyStartResult)[0].Err != nil {
			t.Fatalf("copy start of %s: %v %v", key, out, err)
		}
		id := out.([]CopyStartResult)[0].Copy.Id
		end, err := m.srv.apply(rpcCtx(t), &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: &pb.CopyEndCmd{Items: []*pb.CopyEndItem{{Key: "a/" + key, CopyId: id}}}}})
		if err != nil || !end.([]CopyEndResult)[0].Done {
			t.Fatalf("copy end of %s: %v %v", key, end, err)
		}
	}
	_, ssdBefore := m.srv.fsm.quotaOf("a", pb.Tier_TIER_SSD)
	r20Put(t, m, r19TenantA, "next", 256<<10) // takes tenant a over its DRAM quota: kept0 gives up its DRAM replica
	_, ssdAfter := m.srv.fsm.quotaOf("a", pb.Tier_TIER_SSD)
	m.srv.fsm.mu.RLock()
	gone := m.srv.fsm.objects.get("a/kept0") == nil
	m.srv.fsm.mu.RUnlock()
	if gone || ssdAfter != ssdBefore {
		t.Errorf("room in tenant a's DRAM quota evicted a/kept0 whole (gone: %v): its use of SSD, which has no quota, went from %+v to %+v", gone, ssdBefore, ssdAfter)
	}
}

// TestReview20QuotaSpillBypass: admission checks the quota of the tier a
// put asks for, but placement spills into other tiers: in a pool without
// HBM, a put asking for HBM lands in DRAM, past the tenant's DRAM quota,
// with no check at all.
func TestReview20QuotaSpillBypass(t *testing.T) {
	m := r19Pool(t) // DRAM only
	r20Quota(t, m, "a", 1<<20, 0)
	r, err := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "spilled", Size: 4 << 20, Tier: pb.Tier_TIER_HBM, Checksum: 1})
	if err == nil && len(r.Replicas) > 0 && r.Replicas[0].Tier == pb.Tier_TIER_DRAM {
		t.Errorf("a 4 MiB put asking for HBM was placed in DRAM, past tenant a's DRAM quota of 1 MiB")
	}
}
