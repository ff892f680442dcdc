package agent

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// counters are what Stats answers and the tidepool_agent_* metrics export:
// one source for both.
type counters struct {
	lookups    atomic.Uint64 // Lookup and BatchExists requests answered
	probed     atomic.Uint64 // keys they asked about
	matched    atomic.Uint64 // keys of the prefixes they found
	gets       atomic.Uint64 // values read into regions
	getBytes   atomic.Uint64
	leasedGets atomic.Uint64 // of gets, those read under a lookup's lease
	puts       atomic.Uint64 // values stored (or found present) from regions
	putBytes   atomic.Uint64
	removed    atomic.Uint64 // objects removed by Remove and Clear
	errors     atomic.Uint64 // failed requests and items, misses excepted
	opened     atomic.Uint64 // sessions opened
	expired    atomic.Uint64 // sessions ended idle
	orphaned   atomic.Uint64 // sessions ended because their process exited
}

func (s *Server) statsResponse() *pb.AgentStatsResponse {
	n, _ := s.sessionCount()
	c := &s.stats
	return &pb.AgentStatsResponse{
		Lookups: c.lookups.Load(), BlocksProbed: c.probed.Load(), BlocksMatched: c.matched.Load(),
		Gets: c.gets.Load(), GetBytes: c.getBytes.Load(), Puts: c.puts.Load(), PutBytes: c.putBytes.Load(),
		Errors: c.errors.Load(), Sessions: uint64(n),
	}
}

// collector exports the counters at scrape time.
type collector struct {
	s        *Server
	counters []counterDesc
	sessions *prometheus.Desc
	bytes    *prometheus.Desc
}

type counterDesc struct {
	desc *prometheus.Desc
	v    *atomic.Uint64
}

func newCollector(s *Server) *collector {
	c := &s.stats
	counter := func(name, help string, v *atomic.Uint64) counterDesc {
		return counterDesc{prometheus.NewDesc("tidepool_agent_"+name, help, nil, nil), v}
	}
	return &collector{
		s: s,
		counters: []counterDesc{
			counter("lookups_total", "Lookup and BatchExists requests answered.", &c.lookups),
			counter("blocks_probed_total", "Keys that lookups asked about.", &c.probed),
			counter("blocks_matched_total", "Keys of the cached prefixes lookups found.", &c.matched),
			counter("gets_total", "Values read into sessions' regions.", &c.gets),
			counter("get_bytes_total", "Bytes of the values read into sessions' regions.", &c.getBytes),
			counter("leased_gets_total", "Values read under a lookup's lease, without asking the master.", &c.leasedGets),
			counter("puts_total", "Values stored from sessions' regions (or found already present).", &c.puts),
			counter("put_bytes_total", "Bytes of the values stored from sessions' regions.", &c.putBytes),
			counter("removed_total", "Objects removed by Remove and Clear.", &c.removed),
			counter("errors_total", "Failed requests and failed items of batches; a missing key is not counted.", &c.errors),
			counter("sessions_opened_total", "Sessions opened.", &c.opened),
			counter("sessions_expired_total", "Sessions ended because they were idle too long.", &c.expired),
			counter("sessions_orphaned_total", "Sessions ended because the process that opened them exited.", &c.orphaned),
		},
		sessions: prometheus.NewDesc("tidepool_agent_sessions", "Open sessions.", nil, nil),
		bytes:    prometheus.NewDesc("tidepool_agent_session_bytes", "Bytes of the open sessions' shared-memory regions.", nil, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.counters {
		ch <- d.desc
	}
	ch <- c.sessions
	ch <- c.bytes
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	for _, d := range c.counters {
		ch <- prometheus.MustNewConstMetric(d.desc, prometheus.CounterValue, float64(d.v.Load()))
	}
	n, bytes := c.s.sessionCount()
	ch <- prometheus.MustNewConstMetric(c.sessions, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.GaugeValue, float64(bytes))
}
