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
