package master

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// metrics are the master's Prometheus metrics. A nil *metrics records
// nothing, so a master without a registerer needs no checks.
type metrics struct {
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	revokes  prometheus.Counter
	putFails *prometheus.CounterVec
	corrupts prometheus.Counter
	evicts   *prometheus.CounterVec
	evBytes  *prometheus.CounterVec
	evAge    prometheus.Histogram
	copies   *prometheus.CounterVec
	cpBytes  *prometheus.CounterVec
	drops    *prometheus.CounterVec
	held     prometheus.Counter
	probed   prometheus.Counter
	matched  *prometheus.CounterVec

	// Per tenant (an authenticated client's, or the tenant a put names).
	tenantCalls   *prometheus.CounterVec // tenant, method
	tenantProbed  *prometheus.CounterVec // tenant
	tenantMatched *prometheus.CounterVec // tenant, tier
	tenantEvicts  *prometheus.CounterVec // tenant, reason
}

func newMetrics(reg prometheus.Registerer, s *Server) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_master_requests_total",
			Help: "gRPC requests served by the master, by method and status code.",
		}, []string{"method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tidepool_master_request_duration_seconds",
			Help:    "Latency of gRPC requests served by the master, by method.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}, []string{"method"}),
		revokes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_master_puts_expired_total",
			Help: "Puts revoked by the leader because they were neither ended nor revoked in time.",
		}),
	}
	m.putFails = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_put_failures_total",
		Help: "Puts PutStart refused, by reason (the gRPC code: ResourceExhausted is no room, OutOfRange too large, ...).",
	}, []string{"reason"})
	m.corrupts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tidepool_master_corrupt_replicas_total",
		Help: "Replicas dropped because a reader found their bytes did not match the checksum.",
	})
	m.evicts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_evictions_total",
		Help: "Objects evicted (forgotten, not demoted), by reason (watermark, allocation, demotion: room for a demotion, admin) and the tier whose room was wanted (any for admin).",
	}, []string{"reason", "tier"})
	m.evBytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_evicted_bytes_total",
		Help: "Bytes evicted, by reason and tier.",
	}, []string{"reason", "tier"})
	m.evAge = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tidepool_master_eviction_age_seconds",
		Help:    "Time since an evicted object was last read or written.",
		Buckets: prometheus.ExponentialBuckets(1, 4, 10), // 1 s .. 3 days
	})
	m.copies = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_copies_total",
		Help: "Replica copies made by stores for the leader, by reason (demote: DRAM or HBM to SSD, promote: SSD to DRAM, drain, writeback: an SSD copy ahead of need) and result (ok, failed, expired).",
	}, []string{"reason", "result"})
	m.cpBytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_copied_bytes_total",
		Help: "Bytes of replica copies that ended well, by reason.",
	}, []string{"reason"})
	m.drops = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_replica_drops_total",
		Help: "Replicas dropped while the object kept another, by reason (demote, drain, reclaim, and the eviction reasons for a replica evicted from one tier while another tier keeps the object).",
	}, []string{"reason"})
	m.held = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tidepool_master_puts_held_total",
		Help: "Puts of a removed key whose answer waited for the lookup leases on the removed incarnation to end (clients may answer those from their caches until then).",
	})
	m.probed = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tidepool_master_lookup_blocks_probed_total",
		Help: "Block keys that lookups (and count-only lookups, SGLang's batch exists) asked about.",
	})
	m.matched = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_master_lookup_blocks_matched_total",
		Help: "Blocks of the cached prefixes lookups found, by the tier of each block's fastest replica (unlocated: count-only lookups, which read no replicas); over probed blocks, the prefix hit ratio.",
	}, []string{"tier"})
	m.tenantCalls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_tenant_requests_total",
		Help: "Requests of an authenticated tenant's clients, by tenant and method (BatchPutEnd: puts, GetReplicas: gets, Lookup: lookups).",
	}, []string{"tenant", "method"})
	m.tenantProbed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_tenant_lookup_blocks_probed_total",
		Help: "Block keys an authenticated tenant's lookups asked about.",
	}, []string{"tenant"})
	m.tenantMatched = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_tenant_lookup_blocks_matched_total",
		Help: "Blocks an authenticated tenant's lookups found, by the tier of each block's fastest replica; over probed blocks, its hit ratio per tier.",
	}, []string{"tenant", "tier"})
	m.tenantEvicts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_tenant_evictions_total",
		Help: "Objects of a tenant evicted, by tenant and reason (quota: to the tenant's own quota; the others as tidepool_master_evictions_total).",
	}, []string{"tenant", "reason"})
	for _, c := range []prometheus.Collector{m.requests, m.latency, m.revokes, m.putFails, m.corrupts, m.evicts, m.evBytes, m.evAge, m.copies, m.cpBytes, m.drops, m.held, m.probed, m.matched,
		m.tenantCalls, m.tenantProbed, m.tenantMatched, m.tenantEvicts, stateCollector{s}} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *metrics) request(method string, c codes.Code, d time.Duration) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(method, c.String()).Inc()
	m.latency.WithLabelValues(method).Observe(d.Seconds())
}

// tenantRequest counts a call of an authenticated tenant's client.
func (m *metrics) tenantRequest(tenant, method string) {
	if m == nil || tenant == "" {
		return
	}
	if i := strings.LastIndexByte(method, '/'); i >= 0 {
		method = method[i+1:]
	}
	m.tenantCalls.WithLabelValues(tenant, method).Inc()
}

func (m *metrics) evicted(tenant, reason, tier string, bytes uint64, age time.Duration) {
	if m == nil {
		return
	}
	if tenant != "" {
		m.tenantEvicts.WithLabelValues(tenant, reason).Inc()
	}
	m.evicts.WithLabelValues(reason, tier).Inc()
	m.evBytes.WithLabelValues(reason, tier).Add(float64(bytes))
	m.evAge.Observe(age.Seconds())
}

func (m *metrics) copied(reason pb.CopyReason, result string, bytes uint64) {
	if m == nil {
		return
	}
	r := copyReason(reason)
	m.copies.WithLabelValues(r, result).Inc()
	if result == "ok" {
		m.cpBytes.WithLabelValues(r).Add(float64(bytes))
	}
}

// looked counts a lookup of probed keys whose matched blocks' fastest
// replicas are in the tiers byTier counts (indexed by pb.Tier), or, if
// byTier is nil, unlocated matched blocks.
func (m *metrics) looked(tenant string, probed, unlocated int, byTier []int) {
	if m == nil {
		return
	}
	m.probed.Add(float64(probed))
	if tenant != "" {
		m.tenantProbed.WithLabelValues(tenant).Add(float64(probed))
	}
	add := func(tier string, n int) {
		m.matched.WithLabelValues(tier).Add(float64(n))
		if tenant != "" {
			m.tenantMatched.WithLabelValues(tenant, tier).Add(float64(n))
		}
	}
	if unlocated > 0 {
		add("unlocated", unlocated)
	}
	for t, n := range byTier {
		if n > 0 {
			add(pb.Tier(t).Name(), n)
		}
	}
}

// LookupHits is this master's lookup counters since it started: the block
// keys lookups asked it about, and the blocks they matched by tier (as
// tidepool_master_lookup_blocks_*_total count them). Zero without metrics.
func (s *Server) LookupHits() (probed uint64, matched map[string]uint64) {
	m := s.metrics
	if m == nil {
		return 0, nil
	}
	value := func(c prometheus.Counter) uint64 {
		var d dto.Metric
		if c.Write(&d) != nil {
			return 0
		}
		return uint64(d.GetCounter().GetValue())
	}
	matched = map[string]uint64{}
	for _, t := range []string{pb.Tier_TIER_HBM.Name(), pb.Tier_TIER_DRAM.Name(), pb.Tier_TIER_SSD.Name(), "unlocated"} {
		if n := value(m.matched.WithLabelValues(t)); n > 0 {
			matched[t] = n
		}
	}
	return value(m.probed), matched
}

func (m *metrics) dropped(reason string) {
	if m != nil {
		m.drops.WithLabelValues(reason).Inc()
	}
}

// copyReason is the metric label of a copy reason: demote, promote, drain.
func copyReason(r pb.CopyReason) string {
	return strings.ToLower(strings.TrimPrefix(r.String(), "COPY_REASON_"))
}

func (m *metrics) corrupt() {
	if m != nil {
		m.corrupts.Inc()
	}
}

func (m *metrics) putFailed(c codes.Code) {
	if m != nil {
		m.putFails.WithLabelValues(c.String()).Inc()
	}
}

func (m *metrics) putsHeld(n int) {
	if m != nil {
		m.held.Add(float64(n))
	}
}

func (m *metrics) revoked(n int) {
	if m != nil {
		m.revokes.Add(float64(n))
	}
}

// stateCollector reads gauges from the FSM at scrape time, so they can never
// drift from the replicated state.
type stateCollector struct{ s *Server }

var (
	descObjects      = prometheus.NewDesc("tidepool_master_objects", "Objects in the table, by state.", []string{"state"}, nil)
	descBytes        = prometheus.NewDesc("tidepool_master_object_bytes", "Bytes of complete objects.", nil, nil)
	descCapacity     = prometheus.NewDesc("tidepool_segment_capacity_bytes", "Capacity of a store segment.", []string{"segment", "node", "tier"}, nil)
	descUsed         = prometheus.NewDesc("tidepool_segment_used_bytes", "Allocated bytes of a store segment.", []string{"segment", "node", "tier"}, nil)
	descSegObjs      = prometheus.NewDesc("tidepool_segment_objects", "Objects with a replica on a store segment.", []string{"segment", "node", "tier"}, nil)
	descLeader       = prometheus.NewDesc("tidepool_master_is_leader", "1 if this master is the raft leader.", nil, nil)
	descTerm         = prometheus.NewDesc("tidepool_master_raft_term", "Current raft term.", nil, nil)
	descUnder        = prometheus.NewDesc("tidepool_master_objects_under_replicated", "Complete objects on fewer nodes than their put asked for (a store died, a replica was corrupt): re-replication copies them.", nil, nil)
	descRepairs      = prometheus.NewDesc("tidepool_master_repairs_in_flight", "Re-replication copies started and not yet ended.", nil, nil)
	descTenantBytes  = prometheus.NewDesc("tidepool_tenant_bytes", "Bytes of a tenant's replicas in a tier (what its bytes quota there counts).", []string{"tenant", "tier"}, nil)
	descTenantObjs   = prometheus.NewDesc("tidepool_tenant_objects", "Objects of a tenant with a replica in a tier (what its objects quota there counts).", []string{"tenant", "tier"}, nil)
	descQuotaBytes   = prometheus.NewDesc("tidepool_tenant_quota_bytes", "A tenant's bytes quota in a tier (absent: none).", []string{"tenant", "tier"}, nil)
	descQuotaObjects = prometheus.NewDesc("tidepool_tenant_quota_objects", "A tenant's objects quota in a tier (absent: none).", []string{"tenant", "tier"}, nil)
	descLogDisk      = prometheus.NewDesc("tidepool_master_raft_log_disk_failing", "1 while the raft log's disk is full or failing (flushes fail) and this master refuses writes.", nil, nil)
)

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descObjects, descBytes, descCapacity, descUsed, descSegObjs, descLeader, descTerm, descUnder, descRepairs, descLogDisk,
		descTenantBytes, descTenantObjs, descQuotaBytes, descQuotaObjects} {
		ch <- d
	}
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	processing, complete, bytes := c.s.fsm.objectStats()
	processing += c.s.puts.open()
	ch <- prometheus.MustNewConstMetric(descObjects, prometheus.GaugeValue, float64(processing), "processing")
	ch <- prometheus.MustNewConstMetric(descObjects, prometheus.GaugeValue, float64(complete), "complete")
	ch <- prometheus.MustNewConstMetric(descBytes, prometheus.GaugeValue, float64(bytes))
	for _, v := range c.s.fsm.segmentViews() {
		tier := v.tier.Name()
		ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(v.capacity), v.id, v.node, tier)
		ch <- prometheus.MustNewConstMetric(descUsed, prometheus.GaugeValue, float64(v.used), v.id, v.node, tier)
		ch <- prometheus.MustNewConstMetric(descSegObjs, prometheus.GaugeValue, float64(v.objects), v.id, v.node, tier)
	}
	leader := 0.0
	if c.s.IsLeader() {
		leader = 1
	}
	ch <- prometheus.MustNewConstMetric(descLeader, prometheus.GaugeValue, leader)
	ch <- prometheus.MustNewConstMetric(descTerm, prometheus.GaugeValue, float64(c.s.raft.CurrentTerm()))
	rs := c.s.fsm.repairs()
	ch <- prometheus.MustNewConstMetric(descUnder, prometheus.GaugeValue, float64(rs.under))
	ch <- prometheus.MustNewConstMetric(descRepairs, prometheus.GaugeValue, float64(rs.repairing))
	failing := 0.0
	if c.s.diskError() != nil {
		failing = 1
	}
	ch <- prometheus.MustNewConstMetric(descLogDisk, prometheus.GaugeValue, failing)
	for _, u := range c.s.fsm.tenantUsage() {
		tier := u.Tier.Name()
		ch <- prometheus.MustNewConstMetric(descTenantBytes, prometheus.GaugeValue, float64(u.Bytes), u.Tenant, tier)
		ch <- prometheus.MustNewConstMetric(descTenantObjs, prometheus.GaugeValue, float64(u.Objects), u.Tenant, tier)
		if u.QuotaBytes > 0 {
			ch <- prometheus.MustNewConstMetric(descQuotaBytes, prometheus.GaugeValue, float64(u.QuotaBytes), u.Tenant, tier)
		}
		if u.QuotaObjects > 0 {
			ch <- prometheus.MustNewConstMetric(descQuotaObjects, prometheus.GaugeValue, float64(u.QuotaObjects), u.Tenant, tier)
		}
	}
}

// TenantStat is one tenant's lookup counters on this master since it
// started and its use of each tier, for the status page.
type TenantStat struct {
	Tenant  string
	Probed  uint64
	Matched map[string]uint64 // by tier, as tidepool_tenant_lookup_blocks_matched_total
	Usage   []*pb.TenantUsage
}

// TenantStats is every tenant with lookups counted or objects held, by
// name.
func (s *Server) TenantStats() []TenantStat {
	byName := map[string]*TenantStat{}
	get := func(t string) *TenantStat {
		if byName[t] == nil {
			byName[t] = &TenantStat{Tenant: t, Matched: map[string]uint64{}}
		}
		return byName[t]
	}
	if m := s.metrics; m != nil {
		eachCounter(m.tenantProbed, func(labels map[string]string, v float64) { get(labels["tenant"]).Probed = uint64(v) })
		eachCounter(m.tenantMatched, func(labels map[string]string, v float64) {
			get(labels["tenant"]).Matched[labels["tier"]] = uint64(v)
		})
	}
	for _, u := range s.fsm.tenantUsage() {
		t := get(u.Tenant)
		t.Usage = append(t.Usage, u)
	}
	out := make([]TenantStat, 0, len(byName))
	for _, t := range byName {
		out = append(out, *t)
	}
	slices.SortFunc(out, func(a, b TenantStat) int { return cmp.Compare(a.Tenant, b.Tenant) })
	return out
}

// eachCounter calls fn with the labels and value of each of c's counters.
func eachCounter(c *prometheus.CounterVec, fn func(labels map[string]string, v float64)) {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	for m := range ch {
		var d dto.Metric
		if m.Write(&d) != nil {
			continue
		}
		labels := map[string]string{}
		for _, l := range d.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		fn(labels, d.GetCounter().GetValue())
	}
}
