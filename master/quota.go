package master

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync"
	"time"

	"github.com/tidepool-kv/tidepool/auth"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Quotas. A tenant's use of a tier is the bytes of its objects' replicas
// there and the objects with a replica there, kept by the FSM as replicas
// come and go (account), so a put's check costs no walk of the table. The
// limits are raft state (SetQuota), the same on every master. The leader
// enforces them: a put that would take its tenant over a limit first
// makes room from the tenant's own objects in that tier, in the policy's
// order (evictTenant: exactly the room it needs, from victims one walk of
// the table chose for the next puts too), and fails only if that is not
// enough; the sweep does the same for a tenant over a limit by other means
// (demotion, a lowered limit). Only named tenants are accounted.

// quotaKey names a tenant's use of one tier.
type quotaKey struct {
	tenant string
	tier   pb.Tier
}

// tenantUse is what a tenant holds in one tier, or its limits there.
type tenantUse struct{ bytes, objects uint64 }

func (u tenantUse) zero() bool { return u == tenantUse{} }

// account adds (sign 1) or takes back (-1) o's replicas in its tenant's
// use. Extents name their tier by segment index (tierAt), which outlives
// a dropped segment, so taking back matches what was added.
func (f *FSM) account(o *object, sign int) {
	tenant := f.tenantOf(o)
	if tenant == "" {
		return
	}
	var seen [8]bool
	for _, r := range f.exts(o) {
		if int(r.seg) >= len(f.tierAt) {
			continue
		}
		tier := f.tierAt[r.seg]
		k := quotaKey{tenant, tier}
		u := f.use[k]
		u.bytes += uint64(sign) * o.size // wraps back for -1
		if int(tier) < len(seen) && !seen[tier] {
			seen[tier] = true
			u.objects += uint64(sign)
		}
		if u.zero() {
			delete(f.use, k)
		} else {
			f.use[k] = u
		}
	}
}

// setQuota applies a SetQuota command.
func (f *FSM) setQuota(q *pb.TenantQuota) error {
	if err := validQuota(q); err != nil {
		return err
	}
	k := quotaKey{q.Tenant, q.Tier}
	if q.Bytes == 0 && q.Objects == 0 {
		delete(f.quotas, k)
	} else {
		f.quotas[k] = tenantUse{q.Bytes, q.Objects}
	}
	return nil
}

// maxQuotas bounds the limits the FSM keeps (a tenant and tier each).
const maxQuotas = 4 * maxTenants

func validQuota(q *pb.TenantQuota) error {
	switch {
	case q.Tenant == "":
		return fmt.Errorf("%w: a quota needs a tenant", ErrInvalidRequest)
	case auth.ValidTenant(q.Tenant) != nil:
		return fmt.Errorf("%w: %v", ErrInvalidRequest, auth.ValidTenant(q.Tenant))
	case q.Tier == pb.Tier_TIER_UNSPECIFIED || validTier(q.Tier) != nil:
		return fmt.Errorf("%w: a quota needs a tier (hbm, dram or ssd)", ErrInvalidRequest)
	}
	return nil
}

// quotaOf is tenant's limits and use in tier.
func (f *FSM) quotaOf(tenant string, tier pb.Tier) (limit, used tenantUse) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	k := quotaKey{tenant, tier}
	return f.quotas[k], f.use[k]
}

// overQuota lists the tenants and tiers whose use is above their limits.
func (f *FSM) overQuota() []quotaKey {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []quotaKey
	for k, l := range f.quotas {
		u := f.use[k]
		if l.bytes > 0 && u.bytes > l.bytes || l.objects > 0 && u.objects > l.objects {
			out = append(out, k)
		}
	}
	slices.SortFunc(out, func(a, b quotaKey) int { return cmp.Or(cmp.Compare(a.tenant, b.tenant), cmp.Compare(a.tier, b.tier)) })
	return out
}

// tenantUsage is every tenant's use and limits, by tenant and tier.
func (f *FSM) tenantUsage() []*pb.TenantUsage {
	f.mu.RLock()
	defer f.mu.RUnlock()
	keys := map[quotaKey]bool{}
	for k := range f.use {
		keys[k] = true
	}
	for k := range f.quotas {
		keys[k] = true
	}
	out := make([]*pb.TenantUsage, 0, len(keys))
	for k := range keys {
		u, l := f.use[k], f.quotas[k]
		out = append(out, &pb.TenantUsage{Tenant: k.tenant, Tier: k.tier, Bytes: u.bytes, Objects: u.objects, QuotaBytes: l.bytes, QuotaObjects: l.objects})
	}
	slices.SortFunc(out, func(a, b *pb.TenantUsage) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Tier, b.Tier))
	})
	return out
}

func (f *FSM) snapshotQuotas() []*pb.TenantQuota {
	var out []*pb.TenantQuota
	for k, l := range f.quotas {
		out = append(out, &pb.TenantQuota{Tenant: k.tenant, Tier: k.tier, Bytes: l.bytes, Objects: l.objects})
	}
	slices.SortFunc(out, func(a, b *pb.TenantQuota) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Tier, b.Tier))
	})
	return out
}

// wouldExceed reports by how much a tenant's use of tier would pass its
// limits with n more objects of bytes more: zero if it stays within.
func wouldExceed(limit, used tenantUse, n, bytes uint64) (overBytes, overObjects uint64) {
	if b := satAdd(used.bytes, bytes); limit.bytes > 0 && b > limit.bytes {
		overBytes = b - limit.bytes
	}
	if o := satAdd(used.objects, n); limit.objects > 0 && o > limit.objects {
		overObjects = o - limit.objects
	}
	return overBytes, overObjects
}

// hasQuota reports whether tenant has limits in tier.
func (f *FSM) hasQuota(tenant string, tier pb.Tier) bool {
	if tenant == "" {
		return false
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	return !f.quotas[quotaKey{tenant, tier}].zero()
}

// hasQuotas reports whether tenant has limits in any tier: a put of a
// tenant without is placed with no look at quotas.
func (f *FSM) hasQuotas(tenant string) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, t := range []pb.Tier{pb.Tier_TIER_HBM, pb.Tier_TIER_DRAM, pb.Tier_TIER_SSD} {
		if !f.quotas[quotaKey{tenant, t}].zero() {
			return true
		}
	}
	return false
}

// quotaCharge is what one put asks of its tenant's quota: in the tier it
// lands in, its size for each replica that tier can hold.
type quotaCharge struct {
	key   quotaKey
	bytes uint64
}

// admitBatch makes room within their tenants' quotas for a batch's puts
// (see admitQuota) and returns the error of each that does not fit, by
// index. charge says what put i asks of which quota; false for none (no
// quota there, or a put that fails for another reason or takes no room).
func (s *Server) admitBatch(ctx context.Context, n int, charge func(i int) (quotaCharge, bool)) (map[int]error, error) {
	type group struct {
		idx   []int
		bytes []uint64
	}
	var groups map[quotaKey]*group
	var order []quotaKey
	for i := range n {
		c, ok := charge(i)
		if !ok {
			continue
		}
		if groups == nil {
			groups = map[quotaKey]*group{}
		}
		g := groups[c.key]
		if g == nil {
			g = &group{}
			groups[c.key] = g
			order = append(order, c.key)
		}
		g.idx = append(g.idx, i)
		g.bytes = append(g.bytes, c.bytes)
	}
	var over map[int]error
	for _, k := range order {
		g := groups[k]
		fits, err := s.admitQuota(ctx, k.tenant, k.tier, g.bytes)
		if err != nil {
			return nil, err
		}
		limit, used := s.fsm.quotaOf(k.tenant, k.tier)
		for j, i := range g.idx {
			if fits[j] {
				continue
			}
			if over == nil {
				over = map[int]error{}
			}
			if limit.objects > 0 && uint64(len(g.idx)) > limit.objects {
				over[i] = fmt.Errorf("%w: a batch of %d puts in %s is more than tenant %s's whole quota there (%d objects)",
					ErrOverQuota, len(g.idx), k.tier.Name(), k.tenant, limit.objects)
				continue
			}
			if g.bytes[j] > limit.bytes && limit.bytes > 0 {
				over[i] = fmt.Errorf("%w: a put of %d bytes in %s is more than tenant %s's whole quota there (%d bytes)",
					ErrOverQuota, g.bytes[j], k.tier.Name(), k.tenant, limit.bytes)
				continue
			}
			over[i] = fmt.Errorf("%w: tenant %s holds %d objects, %d bytes in %s (quota %d objects, %d bytes; 0: none), "+
				"and none of its objects there can be evicted (hard-pinned, being copied, or puts not yet ended)",
				ErrOverQuota, k.tenant, used.objects, used.bytes, k.tier.Name(), limit.objects, limit.bytes)
		}
	}
	return over, nil
}

// satAdd and satMul saturate instead of wrapping: a quota compares sums
// a caller chose.
func satAdd(a, b uint64) uint64 {
	if s, carry := bits.Add64(a, b, 0); carry == 0 {
		return s
	}
	return math.MaxUint64
}

func satMul(a, b uint64) uint64 {
	if hi, lo := bits.Mul64(a, b); hi == 0 {
		return lo
	}
	return math.MaxUint64
}

// maxQuotaRounds bounds how often one admission evicts and looks again:
// concurrent puts may take the room it made, or evict its victims first.
const maxQuotaRounds = 8

// admitQuota makes room within tenant's limits in tier for puts of sizes
// bytes each, evicting the tenant's own least recently used objects
// there, and reports which fit (the ones that fit in order, a put larger
// than the whole quota never). A new leader that may not yet evict what
// an earlier one leased waits for that, once, as a put finding no room
// does. It fails only if raft failed.
func (s *Server) admitQuota(ctx context.Context, tenant string, tier pb.Tier, sizes []uint64) ([]bool, error) {
	limit, _ := s.fsm.quotaOf(tenant, tier)
	// What the puts that can fit at all ask for.
	var total, n uint64
	for _, sz := range sizes {
		if limit.bytes == 0 || sz <= limit.bytes {
			total = satAdd(total, sz)
			n++
		}
	}
	waited := false
	for round := 0; round < maxQuotaRounds; round++ {
		limit, used := s.fsm.quotaOf(tenant, tier)
		ob, oo := wouldExceed(limit, used, n, total)
		if ob == 0 && oo == 0 {
			break
		}
		// Victims are chosen down to the limit less the evict ratio, so
		// that the next puts find theirs without a walk of the table
		// each, but evicted only as puts need the room.
		slack := tenantUse{uint64(float64(limit.bytes) * s.cfg.EvictRatio), uint64(float64(limit.objects) * s.cfg.EvictRatio)}
		ob, oo = min(ob, used.bytes), min(oo, used.objects)
		evicted, err := s.evictTenant(ctx, tenant, tier, tenantUse{ob, oo}, slack)
		if err != nil {
			return nil, err
		}
		// Look again after evicting (concurrent puts that ended meanwhile
		// may have taken the room), or when the use went down (another
		// admission evicted first).
		if evicted > 0 {
			continue
		}
		if _, now := s.fsm.quotaOf(tenant, tier); now.bytes < used.bytes || now.objects < used.objects {
			continue
		}
		if waited || !s.awaitEvictable(ctx, s.cfg.Now().Add(s.cfg.PutTimeout)) {
			break
		}
		waited = true
	}
	limit, used := s.fsm.quotaOf(tenant, tier)
	fits := make([]bool, len(sizes))
	var b, k uint64
	for i, sz := range sizes {
		if ob, oo := wouldExceed(limit, used, k+1, satAdd(b, sz)); ob > 0 || oo > 0 {
			continue
		}
		fits[i] = true
		k++
		b = satAdd(b, sz)
	}
	return fits, nil
}

// evictTenant makes room for tenant in tier: its objects with a replica
// there, in the policy's order (byRecency), never hard-pinned ones, until
// need (bytes of its replicas there, objects) went. An object that keeps
// its replica count elsewhere (a written-back SSD copy) loses only its
// replicas in tier; the others are evicted. It returns how many objects
// left the tier.
//
// The victims come from a list one walk of the table chose, worth need
// and slack more: later admissions take theirs from it without a walk,
// skipping what changed since (touched, read, pinned, gone), and a walk
// happens when it runs out.
func (s *Server) evictTenant(ctx context.Context, tenant string, tier pb.Tier, need, slack tenantUse) (int, error) {
	now := s.cfg.Now()
	l := s.leadership()
	if !l.leading {
		return 0, ErrNotLeader
	}
	segTier := map[string]pb.Tier{}
	for _, v := range s.fsm.segmentViews() {
		segTier[v.id] = v.tier
	}
	inTier := func(id string) bool { return segTier[id] == tier }
	k := quotaKey{tenant, tier}
	var victims []evictable
	var got tenantUse
	for walked := false; got.bytes < need.bytes || got.objects < need.objects; walked = true {
		for _, o := range s.quotaVictims.take(k, l.term, now, need, &got, inTier, s.fsm.unchanged) {
			victims = append(victims, o)
		}
		if got.bytes >= need.bytes && got.objects >= need.objects || walked {
			break
		}
		want := tenantUse{satAdd(need.bytes, slack.bytes), satAdd(need.objects, slack.objects)}
		s.quotaVictims.put(k, l.term, now, s.tenantCandidates(tenant, inTier, l, now, need, want, s.quotaVictims.isTaken))
	}
	if len(victims) == 0 {
		return 0, nil
	}
	defer s.quotaVictims.done(victims)
	nodeOf := s.segmentNodes()
	var drops []drop
	whole := victims[:0:0]
	for _, o := range victims {
		if !s.keepsCountWithout(o, inTier, nodeOf) {
			whole = append(whole, o)
			continue
		}
		for _, id := range o.segments {
			if inTier(id) {
				drops = append(drops, drop{o, id})
			}
		}
	}
	dropped := s.dropReplicas(ctx, drops, "quota")
	evicted, freed, err := s.evictObjects(ctx, whole, true, "quota", tier.Name())
	if gone := dropped + evicted; gone > 0 {
		s.log.Info("made room within a tenant's quota", "tenant", tenant, "tier", tier.Name(), "evicted", evicted, "bytes", freed, "replicas_dropped", dropped)
		s.events.evictedQuota(now, tenant, tier.Name(), uint64(gone), freed)
	}
	return dropped + evicted, err
}

// enforceQuotas is the sweep's part: tenants over a limit (a lowered
// limit, objects demoted into a tier) come down to it.
func (s *Server) enforceQuotas(ctx context.Context) {
	if s.cfg.Now().Before(s.evictableFrom()) {
		return
	}
	for _, k := range s.fsm.overQuota() {
		if _, err := s.admitQuota(ctx, k.tenant, k.tier, nil); err != nil {
			s.log.Warn("evict to a tenant's quota", "tenant", k.tenant, "tier", k.tier.Name(), "err", err)
			return
		}
	}
}

// SetQuota sets a tenant's limits in one tier through raft; the sweep
// brings a tenant over them down within a second.
func (a *adminService) SetQuota(ctx context.Context, req *pb.TenantQuota) (*pb.QuotasResponse, error) {
	if err := validQuota(req); err != nil {
		return nil, err
	}
	if err := a.s.leaderOnly(); err != nil {
		return nil, err
	}
	if _, err := a.s.apply(ctx, &pb.Command{Op: &pb.Command_SetQuota{SetQuota: req}}); err != nil {
		return nil, err
	}
	return &pb.QuotasResponse{Tenants: a.s.fsm.tenantUsage()}, nil
}

// Quotas answers on any master, from its FSM.
func (a *adminService) Quotas(context.Context, *pb.QuotasRequest) (*pb.QuotasResponse, error) {
	return &pb.QuotasResponse{Tenants: a.s.fsm.tenantUsage()}, nil
}

// tenantCandidates walks the table for tenant's objects with a replica in
// the tier inTier names, in the policy's order, worth want: never
// hard-pinned ones nor those taken (being evicted by another admission),
// soft-pinned ones after the rest and only as far as need goes (the next
// puts should find newer unpinned ones first), and in the first lease
// TTL of a leadership only what this leader made.
func (s *Server) tenantCandidates(tenant string, inTier func(string) bool, l leadershipState, now time.Time, need, want tenantUse, taken func(string) bool) []evictable {
	objs := filterObjects(s.fsm.scanTenant(tenant), func(o evictable) bool {
		return !o.copying && !o.hard && !taken(o.key) && slices.ContainsFunc(o.segments, inTier) && (!now.Before(l.evictable) || o.madeIn(l.term))
	})
	s.byRecency(objs, now)
	var out []evictable
	var got tenantUse
	picked := map[string]bool{}
	for _, soft := range []bool{false, true} {
		if soft {
			want = need
		}
		for _, o := range objs {
			if got.bytes >= want.bytes && got.objects >= want.objects {
				break
			}
			if picked[o.key] || (!soft && o.softPin > now.UnixNano()) {
				continue
			}
			picked[o.key] = true
			out = append(out, o)
			got.add(o, inTier)
		}
	}
	return out
}

// add counts o, as evicting its replicas in the tier inTier names frees.
func (u *tenantUse) add(o evictable, inTier func(string) bool) {
	u.objects++
	for _, id := range o.segments {
		if inTier(id) {
			u.bytes += o.size
		}
	}
}

// victimListTTL bounds how long a walk's choice of victims serves:
// objects put since are newer than all of them, but ones whose reads or
// pins changed are only skipped, so the order drifts slowly.
const victimListTTL = 10 * time.Second

// victimLists keeps, per tenant and tier, the victims a walk chose that
// no admission took yet, in the order to take them, and the victims
// taken and not yet evicted, which no list offers again.
type victimLists struct {
	mu    sync.Mutex
	m     map[quotaKey]*victimList
	taken map[string]struct{}
}

type victimList struct {
	term uint64 // the leadership it was chosen in
	at   time.Time
	objs []evictable
}

func (v *victimLists) put(k quotaKey, term uint64, now time.Time, objs []evictable) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.m == nil {
		v.m = map[quotaKey]*victimList{}
	}
	// Lists no admission will take from go: tenants come and go.
	for old, l := range v.m {
		if l.term != term || now.Sub(l.at) > victimListTTL {
			delete(v.m, old)
		}
	}
	v.m[k] = &victimList{term: term, at: now, objs: objs}
}

// isTaken reports whether an admission took key and has not evicted it
// yet.
func (v *victimLists) isTaken(key string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	_, ok := v.taken[key]
	return ok
}

// take pops victims off k's list until got reaches need, skipping those
// unchanged says changed since the walk (so concurrent admissions never
// take the same one).
func (v *victimLists) take(k quotaKey, term uint64, now time.Time, need tenantUse, got *tenantUse, inTier func(string) bool, unchanged func(evictable) bool) []evictable {
	v.mu.Lock()
	defer v.mu.Unlock()
	l := v.m[k]
	if l == nil {
		return nil
	}
	if l.term != term || now.Sub(l.at) > victimListTTL {
		delete(v.m, k)
		return nil
	}
	var out []evictable
	for len(l.objs) > 0 && (got.bytes < need.bytes || got.objects < need.objects) {
		o := l.objs[0]
		l.objs = l.objs[1:]
		if _, ok := v.taken[o.key]; !ok && unchanged(o) {
			if v.taken == nil {
				v.taken = map[string]struct{}{}
			}
			v.taken[o.key] = struct{}{}
			out = append(out, o)
			got.add(o, inTier)
		}
	}
	if len(l.objs) == 0 {
		delete(v.m, k)
	}
	return out
}

// done ends what take began for victims: evicted, or left.
func (v *victimLists) done(victims []evictable) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, o := range victims {
		delete(v.taken, o.key)
	}
}
