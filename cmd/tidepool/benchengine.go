package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/enginetest"
	"github.com/tidepool-kv/tidepool/tiers"
)

// runBenchEngine measures the transfer engine alone, in one process, over
// real TCP rails on loopback shaped by enginetest.Shaper.
func runBenchEngine(ctx context.Context, e *env, args []string) error {
	fs := newFlags("bench engine", "[flags]", `Measure the transfer engine in one process over TCP rails on loopback:
  spray  four rails shaped to unequal bandwidth (4:2:1:1 of --unit) plus a noisy one: the
         sprayer against round-robin
  kill   one of four rails killed mid-run (listener and connections closed): lost requests,
         the dip and the time to reroute
  qos    HIGH 64 KiB reads alone, then beside LOW bulk reads saturating shaped rails
  shm    same-host reads through shared memory against memcpy
  tcp    one unshaped rail, no shared memory`, e.stderr)
	scenarios := listFlag{}
	fs.Var(&scenarios, "scenario", "scenarios to run: spray, kill, qos, shm, tcp (default all)")
	sizeFlag := fs.String("size", "4MiB", "request size of the bulk traffic")
	conc := fs.Int("concurrency", 8, "concurrent bulk requests")
	duration := fs.Duration("duration", 3*time.Second, "how long each measured run lasts")
	unitFlag := fs.String("unit", "64MiB", "bandwidth, per second, of the slowest shaped rail")
	asJSON := fs.Bool("json", false, "print one JSON object per row")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return err
	}
	size, err := tiers.ParseSize(*sizeFlag)
	if err != nil {
		return fmt.Errorf("%w: --size: %v", errUsage, err)
	}
	unit, err := tiers.ParseSize(*unitFlag)
	if err != nil {
		return fmt.Errorf("%w: --unit: %v", errUsage, err)
	}
	if *conc < 1 {
		return fmt.Errorf("%w: --concurrency must be at least 1", errUsage)
	}
	if len(scenarios) == 0 {
		scenarios = listFlag{"spray", "kill", "qos", "shm", "tcp"}
	}
	b := &engineBench{size: int(size), conc: *conc, dur: *duration, unit: float64(unit), out: func(r engineRow) {
		if *asJSON {
			line, _ := json.Marshal(r)
			fmt.Fprintln(e.stdout, string(line))
			return
		}
		fmt.Fprintf(e.stdout, "%-6s %-22s %9.3f %9.3f %9.3f %7d %6d  %s\n", r.Scenario, r.Mode, r.GBps, r.P50ms, r.P99ms, r.Ops, r.Errors, r.Note)
	}}
	if !*asJSON {
		b.rails = func(r []engine.RailInfo) {
			fmt.Fprintln(e.stdout, "\nthe sprayer's rails after its run:")
			_ = printRails(e, r)
			fmt.Fprintln(e.stdout)
		}
		fmt.Fprintf(e.stdout, "%-6s %-22s %9s %9s %9s %7s %6s  %s\n", "SCEN", "MODE", "GB/s", "P50 ms", "P99 ms", "OPS", "ERRS", "NOTE")
	}
	for _, s := range scenarios {
		var err error
		switch s {
		case "spray":
			err = b.spray(ctx)
		case "kill":
			err = b.kill(ctx)
		case "qos":
			err = b.qos(ctx)
		case "shm":
			err = b.shm(ctx)
		case "tcp":
			err = b.tcp(ctx)
		default:
			return fmt.Errorf("%w: --scenario %q: want spray, kill, qos, shm or tcp", errUsage, s)
		}
		if err != nil {
			return fmt.Errorf("scenario %s: %w", s, err)
		}
	}
	return nil
}

// engineRow is one line of `tidepool bench engine`.
type engineRow struct {
	Scenario string  `json:"scenario"`
	Mode     string  `json:"mode"`
	Ops      int     `json:"ops"`
	Errors   int     `json:"errors"`
	GBps     float64 `json:"gbps"`
	P50ms    float64 `json:"p50_ms"`
	P99ms    float64 `json:"p99_ms"`
	Ratio    float64 `json:"ratio,omitempty"` // against the scenario's baseline row
	Note     string  `json:"note,omitempty"`
}

type engineBench struct {
	size, conc int
	dur        time.Duration
	unit       float64
	out        func(engineRow)
	rails      func([]engine.RailInfo) // nil: do not print
}

const benchSegment = "bench/dram0@1"

// server is an engine serving one DRAM segment on several rails; each
// rail can be killed: its listener and every connection it accepted closed.
type server struct {
	eng   *engine.Engine
	tier  *tiers.DRAMTier
	rails []*killableListener
}

func newServer(rails int) (*server, error) {
	tier, err := tiers.NewDRAM("dram0", 256<<20)
	if err != nil {
		return nil, err
	}
	s := &server{eng: engine.New(engine.Config{}), tier: tier}
	if err := s.eng.Register(engine.Rename(tier, benchSegment)); err != nil {
		return nil, err
	}
	for range rails {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			s.close()
			return nil, err
		}
		kl := &killableListener{Listener: ln}
		s.rails = append(s.rails, kl)
		go s.eng.Serve(kl)
	}
	return s, nil
}

func (s *server) endpoint() string {
	var addrs []string
	for _, r := range s.rails {
		addrs = append(addrs, r.Addr().String())
	}
	return strings.Join(addrs, ",")
}

func (s *server) close() {
	s.eng.Close()
	s.tier.Close()
}

type killableListener struct {
	net.Listener
	mu     sync.Mutex
	conns  []net.Conn
	killed bool
}

func (k *killableListener) Accept() (net.Conn, error) {
	c, err := k.Listener.Accept()
	if err != nil {
		return nil, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.killed {
		c.Close()
		return nil, net.ErrClosed
	}
	k.conns = append(k.conns, c)
	return c, nil
}

func (k *killableListener) kill() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.killed = true
	k.Listener.Close()
	for _, c := range k.conns {
		c.Close()
	}
}

// client is an engine whose TCP traffic goes through a shaper.
func newClient(cfg engine.Config) (*engine.Engine, *enginetest.Shaper) {
	sh := enginetest.NewShaper(engine.NewTCPTransport(cfg.ConnsPerPeer, 5*time.Second), 1)
	cfg.Transport = sh
	return engine.New(cfg), sh
}

// sample is one finished request.
type sample struct {
	end  time.Time
	lat  time.Duration
	prio engine.Priority
	err  error
}

// load runs conc loops of reads of size bytes at prio until ctx ends.
func load(ctx context.Context, eng *engine.Engine, target engine.Target, size, conc int, prio engine.Priority, record func(sample)) *sync.WaitGroup {
	var wg sync.WaitGroup
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, size)
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			span := (256<<20 - size) / 4096
			for ctx.Err() == nil {
				off := int64(rng.IntN(max(span, 1))) * 4096
				start := time.Now()
				b := eng.NewBatch()
				t := b.Read(buf, target, off, engine.Options{Priority: prio})
				err := b.Submit(context.Background())
				if err == nil {
					_ = b.Wait(context.Background())
					err = t.Err()
				}
				record(sample{end: time.Now(), lat: time.Since(start), prio: prio, err: err})
			}
		}()
	}
	return &wg
}

// collector gathers samples from concurrent loops.
type collector struct {
	mu      sync.Mutex
	samples []sample
}

func (c *collector) add(s sample) {
	c.mu.Lock()
	c.samples = append(c.samples, s)
	c.mu.Unlock()
}

func (c *collector) row(scenario, mode string, size int, elapsed time.Duration, prio engine.Priority) engineRow {
	c.mu.Lock()
	defer c.mu.Unlock()
	var lats []time.Duration
	errs := 0
	for _, s := range c.samples {
		if s.prio != prio {
			continue
		}
		if s.err != nil {
			errs++
			continue
		}
		lats = append(lats, s.lat)
	}
	slices.Sort(lats)
	return engineRow{
		Scenario: scenario, Mode: mode, Ops: len(lats), Errors: errs,
		GBps:  float64(len(lats)*size) / 1e9 / elapsed.Seconds(),
		P50ms: ms(percentile(lats, 0.50)), P99ms: ms(percentile(lats, 0.99)),
	}
}

// run measures one client configuration for the bench duration.
func (b *engineBench) run(ctx context.Context, scenario, mode string, eng *engine.Engine, target engine.Target, size, conc int, prio engine.Priority) engineRow {
	var c collector
	// A short warm-up dials the connections and seeds the estimates.
	warm, cancel := context.WithTimeout(ctx, b.dur/10)
	load(warm, eng, target, size, conc, prio, func(sample) {}).Wait()
	cancel()
	run, cancel := context.WithTimeout(ctx, b.dur)
	defer cancel()
	start := time.Now()
	load(run, eng, target, size, conc, prio, c.add).Wait()
	return c.row(scenario, mode, size, time.Since(start), prio)
}

// shapes are the spray scenario's rails: 4:2:1:1 of the unit, the last
// one noisy (latency jitter up to 2 ms per op).
func (b *engineBench) shape(sh *enginetest.Shaper, srv *server) {
	for i, r := range srv.rails {
		mult := []float64{4, 2, 1, 1}[i]
		s := enginetest.RailShape{Bandwidth: mult * b.unit}
		if i == 3 {
			s.Jitter = 2 * time.Millisecond
		}
		sh.SetRail(r.Addr().String(), s)
	}
}

func (b *engineBench) spray(ctx context.Context) error {
	srv, err := newServer(4)
	if err != nil {
		return err
	}
	defer srv.close()
	target := engine.Target{Endpoint: srv.endpoint(), Segment: benchSegment}
	var base engineRow
	for _, rr := range []bool{true, false} {
		eng, sh := newClient(engine.Config{RoundRobin: rr, NoShm: true, RailBandwidth: b.unit})
		b.shape(sh, srv)
		mode := "sprayer"
		if rr {
			mode = "round-robin"
		}
		row := b.run(ctx, "spray", mode, eng, target, b.size, b.conc, engine.Medium)
		rails := eng.Rails()
		eng.Close()
		if rr {
			base = row
			row.Note = fmt.Sprintf("rails %s/s x 4:2:1:1, last noisy", human(uint64(b.unit)))
		} else {
			row.Ratio = row.GBps / base.GBps
			row.Note = fmt.Sprintf("%.2fx round-robin throughput, p99 %.2fx", row.GBps/base.GBps, row.P99ms/base.P99ms)
		}
		b.out(row)
		if b.rails != nil && !rr {
			b.rails(rails)
		}
	}
	return nil
}

func (b *engineBench) kill(ctx context.Context) error {
	srv, err := newServer(4)
	if err != nil {
		return err
	}
	defer srv.close()
	target := engine.Target{Endpoint: srv.endpoint(), Segment: benchSegment}
	eng, _ := newClient(engine.Config{NoShm: true})
	defer eng.Close()
	var c collector
	warm, cancel := context.WithTimeout(ctx, b.dur/10)
	load(warm, eng, target, b.size, b.conc, engine.Medium, func(sample) {}).Wait()
	cancel()
	run, cancel := context.WithTimeout(ctx, b.dur)
	defer cancel()
	start := time.Now()
	wg := load(run, eng, target, b.size, b.conc, engine.Medium, c.add)
	killAt := start.Add(b.dur / 3)
	select {
	case <-time.After(time.Until(killAt)):
	case <-run.Done():
	}
	killAt = time.Now()
	srv.rails[1].kill()
	wg.Wait()
	row := c.row("kill", "sprayer, 1 of 4 killed", b.size, time.Since(start), engine.Medium)

	// Throughput in 10 ms windows: the dip after the kill.
	const win = 10 * time.Millisecond
	// Rerouting is done when the last request that was in flight at the
	// kill (some of its slices on the dead rail) has finished.
	c.mu.Lock()
	buckets := map[int]int{}
	var reroute time.Duration
	for _, s := range c.samples {
		if s.err == nil {
			buckets[int(s.end.Sub(start)/win)] += b.size
		}
		if began := s.end.Add(-s.lat); began.Before(killAt) && s.end.After(killAt) {
			reroute = max(reroute, s.end.Sub(killAt))
		}
	}
	c.mu.Unlock()
	killB := int(killAt.Sub(start) / win)
	pre := 0
	for i := range killB {
		pre += buckets[i]
	}
	preRate := float64(pre) / float64(max(killB, 1))
	minRate := preRate
	// Requests finish in bursts, so smooth over 5 windows.
	for i := killB; i < int(b.dur/win); i++ {
		sum := 0
		for j := i; j < i+5; j++ {
			sum += buckets[j]
		}
		rate := float64(sum) / 5
		minRate = min(minRate, rate)
	}
	row.Note = fmt.Sprintf("lost %d requests; the ones in flight at the kill done %v after it; worst 50 ms after it at %.0f%% of the rate before",
		row.Errors, reroute.Round(100*time.Microsecond), 100*minRate/max(preRate, 1))
	b.out(row)
	return nil
}

func (b *engineBench) qos(ctx context.Context) error {
	srv, err := newServer(4)
	if err != nil {
		return err
	}
	defer srv.close()
	target := engine.Target{Endpoint: srv.endpoint(), Segment: benchSegment}
	eng, sh := newClient(engine.Config{NoShm: true, RailBandwidth: b.unit})
	defer eng.Close()
	for _, r := range srv.rails {
		sh.SetRail(r.Addr().String(), enginetest.RailShape{Bandwidth: 2 * b.unit})
	}
	const small = 64 << 10
	alone := b.run(ctx, "qos", "HIGH 64KiB alone", eng, target, small, 1, engine.High)
	b.out(alone)

	var c collector
	run, cancel := context.WithTimeout(ctx, b.dur)
	defer cancel()
	start := time.Now()
	bulk := load(run, eng, target, b.size, b.conc, engine.Low, c.add)
	high := load(run, eng, target, small, 1, engine.High, c.add)
	bulk.Wait()
	high.Wait()
	elapsed := time.Since(start)
	loaded := c.row("qos", "HIGH 64KiB + LOW bulk", small, elapsed, engine.High)
	loaded.Ratio = loaded.P99ms / alone.P99ms
	loaded.Note = fmt.Sprintf("p99 %.2fx unloaded", loaded.Ratio)
	b.out(loaded)
	low := c.row("qos", "LOW bulk beside HIGH", b.size, elapsed, engine.Low)
	low.Note = "aging keeps LOW moving"
	b.out(low)
	return nil
}

func (b *engineBench) shm(ctx context.Context) error {
	srv, err := newServer(1)
	if err != nil {
		return err
	}
	defer srv.close()
	target := engine.Target{Endpoint: srv.endpoint(), Segment: benchSegment}
	base := memcpyRow(b.size, b.dur)
	b.out(base)
	eng := engine.New(engine.Config{})
	defer eng.Close()
	row := b.run(ctx, "shm", "shm get", eng, target, b.size, 1, engine.High)
	row.Ratio = row.GBps / base.GBps
	row.Note = fmt.Sprintf("%.0f%% of memcpy", 100*row.Ratio)
	b.out(row)
	return nil
}

func (b *engineBench) tcp(ctx context.Context) error {
	srv, err := newServer(1)
	if err != nil {
		return err
	}
	defer srv.close()
	target := engine.Target{Endpoint: srv.endpoint(), Segment: benchSegment}
	eng := engine.New(engine.Config{NoShm: true})
	defer eng.Close()
	for _, n := range []int{1, 4} {
		row := b.run(ctx, "tcp", fmt.Sprintf("one rail, concurrency %d", n), eng, target, b.size, n, engine.High)
		b.out(row)
	}
	return nil
}

// memcpyRow measures copy() of size-byte buffers: the shm baseline.
func memcpyRow(size int, dur time.Duration) engineRow {
	src, dst := make([]byte, size), make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	var lats []time.Duration
	start := time.Now()
	var n atomic.Int64
	for time.Since(start) < dur {
		t0 := time.Now()
		copy(dst, src)
		lats = append(lats, time.Since(t0))
		n.Add(1)
	}
	elapsed := time.Since(start)
	slices.Sort(lats)
	return engineRow{Scenario: "shm", Mode: "memcpy baseline", Ops: int(n.Load()),
		GBps:  float64(n.Load()) * float64(size) / 1e9 / elapsed.Seconds(),
		P50ms: ms(percentile(lats, 0.5)), P99ms: ms(percentile(lats, 0.99))}
}
