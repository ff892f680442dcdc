package engine

import (
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics holds the engine's Prometheus collectors. A nil *metrics records nothing, so call sites
// need no checks when the engine has no Registerer.
type metrics struct {
	tasks     *prometheus.CounterVec   // op, state
	bytes     *prometheus.CounterVec   // op: moved by this engine's tasks (client side)
	served    *prometheus.CounterVec   // op: read or written by peers in our segments (server side)
	latency   *prometheus.HistogramVec // op: Submit to terminal state
	malformed prometheus.Counter
	refusals  *prometheus.CounterVec // op: requests the Guard refused
	dropped   *prometheus.CounterVec // reason: server connections closed by a bound

	classBytes    *prometheus.CounterVec   // class: bytes of slices that finished
	classRequests *prometheus.CounterVec   // class, result: requests through the scheduler
	queueWait     *prometheus.HistogramVec // class: slice enqueue to dispatch
	service       *prometheus.HistogramVec // class: slice dispatch to completion
	retries       prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, log *slog.Logger) *metrics {
	if reg == nil {
		return nil
	}
	return &metrics{
		tasks: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_tasks_total",
			Help: "Transfer tasks by op and terminal state.",
		}, []string{"op", "state"})),
		bytes: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_transferred_bytes_total",
			Help: "Bytes moved by tasks that finished done, by op (client side).",
		}, []string{"op"})),
		served: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_served_bytes_total",
			Help: "Bytes peers read from or wrote to this node's segments, by op (server side).",
		}, []string{"op"})),
		latency: register(reg, log, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tidepool_engine_task_duration_seconds",
			Help:    "Time from Submit to a task's terminal state, by op.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10), // 50us .. 13s
		}, []string{"op"})),
		malformed: register(reg, log, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_engine_malformed_frames_total",
			Help: "Requests the server could not parse; each dropped its connection.",
		})),
		refusals: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_refused_requests_total",
			Help: "Peer requests the server's guard refused (no valid ticket for their bytes), by op.",
		}, []string{"op"})),
		dropped: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_server_conns_dropped_total",
			Help: "Server connections closed by a bound, by reason: idle (past the idle timeout), evicted (the longest idle, for a new one at the cap, or at its peer host's cap), refused (at a cap, none idle), stalled (a request's peer sent nothing within the stall timeout), busy (no staging buffer freed in time), tls (a TLS handshake failed or timed out).",
		}, []string{"reason"})),
		classBytes: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_class_bytes_total",
			Help: "Bytes moved over rails, by QoS class.",
		}, []string{"class"})),
		classRequests: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_engine_class_requests_total",
			Help: "Requests scheduled over rails, by QoS class and result (ok, failed).",
		}, []string{"class", "result"})),
		queueWait: register(reg, log, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tidepool_engine_queue_wait_seconds",
			Help:    "Time a slice waited for a rail, by QoS class.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 4, 10), // 10us .. 2.6s
		}, []string{"class"})),
		service: register(reg, log, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tidepool_engine_transfer_seconds",
			Help:    "Time a slice took on its rail from dispatch, by QoS class.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 4, 10),
		}, []string{"class"})),
		retries: register(reg, log, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_engine_slice_retries_total",
			Help: "Slices retried on another rail after a rail error.",
		})),
	}
}

// slice records one slice's queue wait and transfer time.
func (m *metrics) slice(class Priority, n int, wait, service time.Duration, ok bool) {
	if m == nil {
		return
	}
	c := class.String()
	m.queueWait.WithLabelValues(c).Observe(wait.Seconds())
	m.service.WithLabelValues(c).Observe(service.Seconds())
	if ok {
		m.classBytes.WithLabelValues(c).Add(float64(n))
	}
}

func (m *metrics) request(class Priority, err error) {
	if m == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.classRequests.WithLabelValues(class.String(), result).Inc()
}

func (m *metrics) retry() {
	if m != nil {
		m.retries.Inc()
	}
}

// railCollector reads every rail's state at scrape time.
type railCollector struct{ e *Engine }

var (
	descRailInflight = prometheus.NewDesc("tidepool_engine_rail_inflight_bytes", "Bytes in flight on a rail.", []string{"peer", "rail"}, nil)
	descRailBW       = prometheus.NewDesc("tidepool_engine_rail_bandwidth_bytes_per_second", "EWMA of a rail's observed bandwidth.", []string{"peer", "rail"}, nil)
	descRailErrors   = prometheus.NewDesc("tidepool_engine_rail_errors_total", "Errors a rail has had.", []string{"peer", "rail"}, nil)
	descRailState    = prometheus.NewDesc("tidepool_engine_rail_state", "1 for a rail's current state (up, probing, paused).", []string{"peer", "rail", "state"}, nil)
)

func (c railCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descRailInflight, descRailBW, descRailErrors, descRailState} {
		ch <- d
	}
}

func (c railCollector) Collect(ch chan<- prometheus.Metric) {
	for _, r := range c.e.Rails() {
		ch <- prometheus.MustNewConstMetric(descRailInflight, prometheus.GaugeValue, float64(r.InflightBytes), r.Peer, r.Addr)
		ch <- prometheus.MustNewConstMetric(descRailBW, prometheus.GaugeValue, r.Bandwidth, r.Peer, r.Addr)
		ch <- prometheus.MustNewConstMetric(descRailErrors, prometheus.CounterValue, float64(r.Errors), r.Peer, r.Addr)
		ch <- prometheus.MustNewConstMetric(descRailState, prometheus.GaugeValue, 1, r.Peer, r.Addr, r.State)
	}
}

// register registers c, or reuses the collector already registered under its name, so several
// engines can share one registry (tests, a store and a client in one process).
func register[C prometheus.Collector](reg prometheus.Registerer, log *slog.Logger, c C) C {
	err := reg.Register(c)
	if err == nil {
		return c
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing
		}
	}
	// Metrics are not worth failing the engine over; the collector works, it is just not exported.
	log.Warn("engine: metric not registered", "err", err)
	return c
}

func (m *metrics) task(kind OpKind, s State, n int, d time.Duration) {
	if m == nil {
		return
	}
	op := kind.String()
	m.tasks.WithLabelValues(op, s.String()).Inc()
	m.latency.WithLabelValues(op).Observe(d.Seconds())
	if s == Done {
		m.bytes.WithLabelValues(op).Add(float64(n))
	}
}

func (m *metrics) serve(wireOp byte, n int64) {
	if m == nil {
		return
	}
	op := OpRead
	if wireOp == opWrite {
		op = OpWrite
	}
	m.served.WithLabelValues(op.String()).Add(float64(n))
}

func (m *metrics) malformedFrame() {
	if m == nil {
		return
	}
	m.malformed.Inc()
}

func (m *metrics) refused(kind OpKind) {
	if m == nil {
		return
	}
	m.refusals.WithLabelValues(kind.String()).Inc()
}

func (m *metrics) droppedConn(reason string) {
	if m == nil {
		return
	}
	m.dropped.WithLabelValues(reason).Inc()
}
