package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/tiers"
)

// Config configures a store node.
type Config struct {
	// ID names the node; it must be stable across restarts of the same node.
	ID      string
	Masters []string
	// Credentials are what the node shows the masters: a store's
	// certificate or token where the pool has security.
	Credentials leaderconn.Credentials
	// Listen is the transfer engine's listen address, e.g. "127.0.0.1:0",
	// or several separated by commas: one rail each.
	Listen string
	// Advertise is the engine address peers dial, or several separated by
	// commas; default the listeners' addresses.
	Advertise string
	// Tiers are mounted by the caller and closed by Node.Close.
	Tiers             []tiers.Tier
	HeartbeatInterval time.Duration // default 1 s
	// IndexSyncInterval is how often the index of a persistent tier (SSD)
	// is brought in line with the master's view of its objects; default
	// 5 s. Objects put since the last sync are not re-adopted after a crash.
	IndexSyncInterval time.Duration
	Engine            engine.Config // Registerer and Logger are filled in
	Registerer        prometheus.Registerer
	Logger            *slog.Logger

	// CopyConcurrency caps the copies the master's heartbeats hand this
	// node that run at once; default 4.
	CopyConcurrency int
	// Prefault commits the memory tiers' pages in the background at start,
	// so puts do not take first-touch page faults.
	Prefault bool
}

// prefaulter is a tier that can commit its memory ahead of need.
type prefaulter interface {
	Prefault(ctx context.Context) error
}

// Node is a running store node.
type Node struct {
	cfg      Config
	log      *slog.Logger
	eng      *engine.Engine
	lns      []net.Listener
	masters  *leaderconn.Conn
	endpoint string
	guard    *guard

	mu struct {
		sync.Mutex
		epoch uint64
		names []string // engine names of the registered segments
		// watched are the persistent tiers' segments, by engine name, whose
		// I/O errors are reported (see ioWatch).
		watched  map[string]*ioWatch
		reported map[string]bool     // failed segments logged
		watches  map[string]*ioWatch // by tier name, across registrations
		// gen counts registrations: a copy's result is reported only
		// within the one it was handed out in.
		gen     uint64
		copying map[uint64]struct{} // ids of the copies running
		done    []*pb.CopyResult    // finished copies, not yet reported
	}
	// Metrics; nil without a Registerer.
	indexedObjs *prometheus.GaugeVec // tier: objects in a persistent tier's index
	copies      *prometheus.CounterVec
	copiedBytes prometheus.Counter

	registered chan struct{}
	wake       chan struct{} // a copy finished: heartbeat now to report it
	stop       chan struct{}
	runDone    chan struct{} // closed when run has returned
	closeOnce  sync.Once
	closeErr   error
	wg         sync.WaitGroup
}

// New starts serving the tiers and registering with the masters in the
// background; Registered tells when the node is part of the pool.
func New(cfg Config) (*Node, error) {
	if cfg.ID == "" || len(cfg.Tiers) == 0 {
		return nil, errors.New("store: config needs an ID and at least one tier")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = time.Second
	}
	if cfg.IndexSyncInterval <= 0 {
		cfg.IndexSyncInterval = 5 * time.Second
	}
	if cfg.CopyConcurrency <= 0 {
		cfg.CopyConcurrency = 4
	}
	masters, err := leaderconn.Dial(cfg.Masters, cfg.Credentials)
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	var lns []net.Listener
	var addrs []string
	for _, addr := range strings.Split(cfg.Listen, ",") {
		ln, err := net.Listen("tcp", strings.TrimSpace(addr))
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			masters.Close()
			return nil, fmt.Errorf("store: listen for transfers on %q: %w", addr, err)
		}
		lns = append(lns, ln)
		addrs = append(addrs, ln.Addr().String())
	}
	g, err := newGuard()
	if err != nil {
		for _, l := range lns {
			l.Close()
		}
		masters.Close()
		return nil, fmt.Errorf("store: %w", err)
	}
	ecfg := cfg.Engine
	ecfg.Registerer, ecfg.Logger, ecfg.Guard = cfg.Registerer, cfg.Logger, g
	n := &Node{
		cfg: cfg, log: cfg.Logger, eng: engine.New(ecfg), lns: lns, masters: masters, guard: g,
		endpoint:   cfg.Advertise,
		registered: make(chan struct{}),
		stop:       make(chan struct{}),
		runDone:    make(chan struct{}),
		wake:       make(chan struct{}, 1),
	}
	n.mu.copying = map[uint64]struct{}{}
	if n.endpoint == "" {
		n.endpoint = strings.Join(addrs, ",")
	}
	if cfg.Registerer != nil {
		n.indexedObjs = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tidepool_store_indexed_objects",
			Help: "Objects in the index of a persistent tier (SSD), as of the last sync with the master.",
		}, []string{"tier"})
		n.copies = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tidepool_store_copies_total",
			Help: "Copies the master asked this node to make, by result (ok, failed).",
		}, []string{"result"})
		n.copiedBytes = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tidepool_store_copied_bytes_total",
			Help: "Bytes of the copies this node made.",
		})
		for _, c := range []prometheus.Collector{n.indexedObjs, n.copies, n.copiedBytes} {
			if err := cfg.Registerer.Register(c); err != nil {
				n.log.Warn("store metric not registered", "err", err)
			}
		}
	}
	for _, ln := range lns {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			if err := n.eng.Serve(ln); err != nil {
				n.log.Error("transfer engine stopped", "err", err)
			}
		}()
	}
	if cfg.Prefault {
		n.prefault()
	}
	n.wg.Add(1)
	go n.run()
	return n, nil
}

// ID is the node's id.
func (n *Node) ID() string { return n.cfg.ID }

// Endpoint is the address peers reach this node's transfer engine at:
// one per rail, separated by commas.
func (n *Node) Endpoint() string { return n.endpoint }

// Rails describes the rails this node's engine uses towards its peers.
func (n *Node) Rails() []engine.RailInfo { return n.eng.Rails() }

// Status asks the masters for the cluster's status (for the status page).
func (n *Node) Status(ctx context.Context) (*pb.StatusResponse, error) {
	var st *pb.StatusResponse
	err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) (err error) {
		st, err = pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, opts...)
		return err
	})
	return st, err
}

// Registered is closed once the node has registered with the master.
func (n *Node) Registered() <-chan struct{} { return n.registered }

// Epoch is the node's current registration epoch, 0 before the first.
func (n *Node) Epoch() uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mu.epoch
}

// run registers, then heartbeats; it registers again when the master has
// forgotten this node's epoch, and goes idle when the node was drained.
func (n *Node) run() {
	defer n.wg.Done()
	defer close(n.runDone)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n.wg.Add(1)
	go func() { // cancels in-flight master calls on Close
		defer n.wg.Done()
		select {
		case <-n.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	// Copies stop on Close, and when the node is drained.
	copyCtx, stopCopies := context.WithCancel(ctx)
	defer stopCopies()
	// Index syncs run beside heartbeats, so a long one (many objects, many
	// pages) never holds a heartbeat past the node TTL; run returns only
	// once the sync loop has, so no sync races Close's final one.
	syncDone := make(chan struct{})
	go func() {
		defer close(syncDone)
		n.syncLoop(ctx)
	}()
	defer func() { cancel(); <-syncDone }()
	tick := time.NewTicker(n.cfg.HeartbeatInterval)
	defer tick.Stop()
	for {
		if n.Epoch() == 0 {
			if err := n.register(ctx); err != nil {
				if ctx.Err() != nil {
					return
				}
				n.log.Warn("register with master", "err", err)
			}
		} else {
			switch err := n.heartbeat(ctx, copyCtx); {
			case status.Code(err) == codes.NotFound:
				n.log.Warn("master forgot this node; registering again", "err", err)
				n.unregister()
				continue
			case status.Code(err) == codes.FailedPrecondition:
				n.log.Warn("drained by an operator; staying out of the pool until restarted", "node", n.cfg.ID, "err", err)
				stopCopies()
				n.unregister()
				<-n.stop
				return
			case err != nil && ctx.Err() == nil:
				n.log.Warn("heartbeat", "err", err)
			}
		}
		select {
		case <-n.stop:
			return
		case <-tick.C:
		case <-n.wake:
		}
	}
}

// syncLoop syncs the indexes of persistent tiers every IndexSyncInterval
// while the node is registered, until ctx ends.
func (n *Node) syncLoop(ctx context.Context) {
	tick := time.NewTicker(n.cfg.IndexSyncInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if n.Epoch() == 0 {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		if err := n.syncIndexes(sctx); err != nil && ctx.Err() == nil {
			n.log.Warn("sync the index of a persistent tier", "err", err)
		}
		cancel()
	}
}

// indexed is a tier that keeps its objects across a restart and indexes
// them, so they can be re-adopted (the SSD tier).
type indexed interface {
	tiers.Tier
	Index() *tiers.SSDIndex
}

// A page of kept objects, offered by one Register or Adopt call, is a raft
// entry and a gRPC message, both size-limited: at most adoptPage objects
// and adoptPageBytes encoded (keys, parents and tenants may be long).
const (
	adoptPage      = 10000
	adoptPageBytes = 8 << 20
)

// adoptPages cuts kept into pages.
func adoptPages(kept []*pb.AdoptedObject) [][]*pb.AdoptedObject {
	var pages [][]*pb.AdoptedObject
	start, bytes := 0, 0
	for i, o := range kept {
		size := proto.Size(o) + 8
		if i > start && (i-start == adoptPage || bytes+size > adoptPageBytes) {
			pages = append(pages, kept[start:i])
			start, bytes = i, 0
		}
		bytes += size
	}
	if start < len(kept) {
		pages = append(pages, kept[start:])
	}
	return pages
}

func (n *Node) register(ctx context.Context) error {
	req := &pb.RegisterRequest{Node: n.cfg.ID, Endpoint: n.endpoint, TicketKey: n.guard.nodeKey}
	var kept []*pb.AdoptedObject
	for _, t := range n.cfg.Tiers {
		req.Segments = append(req.Segments, &pb.SegmentSpec{Name: t.Name(), Tier: tierProto(t.Kind()), Capacity: uint64(t.Capacity())})
		it, ok := t.(indexed)
		if !ok {
			continue
		}
		objs, err := it.Index().All()
		if err != nil {
			// Rejoining matters more than what the index held: the tier
			// starts empty in the pool and the next sync rewrites the index.
			n.log.Error("unreadable index; the tier's objects are not re-adopted", "tier", t.Name(), "err", err)
			continue
		}
		for _, o := range objs {
			kept = append(kept, &pb.AdoptedObject{
				Key: o.Key, Segment: t.Name(), Offset: o.Offset, Size: o.Size, Checksum: o.Checksum,
				HardPinned: o.HardPinned, SoftPinUntilUnixNano: o.SoftPinUntil, Parent: o.Parent, Tenant: o.Tenant,
			})
		}
	}
	pages := adoptPages(kept)
	if len(pages) > 0 {
		req.Adopt, req.AdoptMore = pages[0], len(pages) > 1
	}
	var resp *pb.RegisterResponse
	err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) (err error) {
		resp, err = pb.NewRegistryClient(cc).Register(ctx, req, opts...)
		return err
	})
	if err != nil {
		return err
	}
	if len(resp.SegmentIds) != len(n.cfg.Tiers) {
		return fmt.Errorf("master returned %d segment ids for %d tiers", len(resp.SegmentIds), len(n.cfg.Tiers))
	}
	// Serve the segments before the remaining pages: objects adopted so far
	// are readable already.
	n.mu.Lock()
	if err := n.guard.serve(resp.SegmentIds); err != nil {
		n.mu.Unlock()
		return err
	}
	// A tier's watch outlives registrations: a disk that failed is
	// reported again under the new epoch's name, not trusted afresh.
	if n.mu.watches == nil {
		n.mu.watches = map[string]*ioWatch{}
	}
	n.mu.watched, n.mu.reported = map[string]*ioWatch{}, map[string]bool{}
	for i, t := range n.cfg.Tiers {
		seg := t.Segment()
		if t.Kind() == tiers.SSD {
			w := n.mu.watches[t.Name()]
			if w == nil {
				w = &ioWatch{Segment: seg}
				n.mu.watches[t.Name()] = w
			}
			n.mu.watched[resp.SegmentIds[i]], seg = w, w
		}
		if err := n.eng.Register(engine.Rename(seg, resp.SegmentIds[i])); err != nil {
			n.unregisterLocked()
			n.mu.Unlock()
			return err
		}
		n.mu.names = append(n.mu.names, resp.SegmentIds[i])
	}
	n.mu.Unlock()
	adopted := int(resp.Adopted)
	// Further pages: the master places nothing on this node until the last,
	// so no put lands on a kept object meanwhile. A failure registers anew.
	for i := 1; i < len(pages); i++ {
		page := &pb.AdoptRequest{Node: n.cfg.ID, Epoch: resp.Epoch, Objects: pages[i], Done: i == len(pages)-1}
		var ar *pb.AdoptResponse
		err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) (err error) {
			ar, err = pb.NewRegistryClient(cc).Adopt(ctx, page, opts...)
			return err
		})
		if err != nil {
			n.unregister()
			return fmt.Errorf("re-adopt page %d of %d of kept objects: %w", i+1, len(pages), err)
		}
		adopted += int(ar.Adopted)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.mu.epoch = resp.Epoch
	n.mu.gen++
	n.mu.done = nil // the master forgot the copies of the previous epoch
	n.log.Info("registered with master", "node", n.cfg.ID, "epoch", resp.Epoch, "segments", resp.SegmentIds,
		"kept", len(kept), "adopted", adopted)
	select {
	case <-n.registered:
	default:
		close(n.registered)
	}
	return nil
}

// syncPage is how many objects one SegmentObjects page asks for: the
// master scans its table once per page.
const syncPage = 50000

// syncIndexes makes each persistent tier's index what the master says the
// tier holds: objects put since the last sync are added, removed ones go,
// and pins, parent keys and tenants that changed are rewritten.
func (n *Node) syncIndexes(ctx context.Context) error {
	epoch := n.Epoch()
	for _, t := range n.cfg.Tiers {
		it, ok := t.(indexed)
		if !ok {
			continue
		}
		var all []*pb.AdoptedObject
		for req := (&pb.SegmentObjectsRequest{Node: n.cfg.ID, Epoch: epoch, Segment: t.Name(), Limit: syncPage}); ; {
			var resp *pb.SegmentObjectsResponse
			err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) (err error) {
				resp, err = pb.NewRegistryClient(cc).SegmentObjects(ctx, req, opts...)
				return err
			})
			if err != nil {
				return err
			}
			all = append(all, resp.Objects...)
			if !resp.Truncated || len(resp.Objects) == 0 {
				break
			}
			req.StartAfter = resp.Objects[len(resp.Objects)-1].Key
		}
		// The index must never name bytes the disk could still lose.
		if s, ok := t.(interface{ Sync() error }); ok {
			if err := s.Sync(); err != nil {
				// After a failed fdatasync the kernel may have dropped the
				// dirty pages: the segment's bytes can no longer be trusted.
				n.syncFailed(t.Name(), err)
				return fmt.Errorf("tier %s: sync data before indexing it: %w", t.Name(), err)
			}
		}
		objs := make([]tiers.SSDObject, len(all))
		for i, o := range all {
			objs[i] = tiers.SSDObject{
				Key: o.Key, Offset: o.Offset, Size: o.Size, Checksum: o.Checksum,
				HardPinned: o.HardPinned, SoftPinUntil: o.SoftPinUntilUnixNano, Parent: o.Parent, Tenant: o.Tenant,
			}
		}
		if err := it.Index().Replace(objs); err != nil {
			return fmt.Errorf("tier %s: %w", t.Name(), err)
		}
		if n.indexedObjs != nil {
			n.indexedObjs.WithLabelValues(t.Name()).Set(float64(len(objs)))
		}
	}
	return nil
}

func (n *Node) unregister() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.unregisterLocked()
}

// unregisterLocked stops serving the segments; n.mu must be held.
func (n *Node) unregisterLocked() {
	for _, name := range n.mu.names {
		n.eng.Unregister(name)
	}
	n.mu.names, n.mu.epoch = nil, 0
	_ = n.guard.serve(nil)
}

// heartbeat reports finished copies and starts, under copyCtx, the copies
// the master hands out in return.
func (n *Node) heartbeat(ctx, copyCtx context.Context) error {
	done, gen := n.takeResults()
	req := &pb.HeartbeatRequest{Node: n.cfg.ID, Epoch: n.Epoch(), CopiesDone: done, CopySlots: n.copySlots(), FailedSegments: n.failedSegments()}
	ctx, cancel := context.WithTimeout(ctx, 5*n.cfg.HeartbeatInterval)
	defer cancel()
	var resp *pb.HeartbeatResponse
	err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) (err error) {
		resp, err = pb.NewRegistryClient(cc).Heartbeat(ctx, req, opts...)
		return err
	})
	if err != nil {
		n.putBack(done, gen) // sent again next time; the master ignores copies it has ended
		return err
	}
	for _, t := range resp.Copies {
		n.startCopy(copyCtx, t)
	}
	return nil
}

// syncFailed records a failed sync of tier name's data as an I/O error of
// its segment, reported on the next heartbeat as a failed read would be.
func (n *Node) syncFailed(name string, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if w := n.mu.watches[name]; w != nil {
		w.check(err)
	}
}

// failedSegments lists the segments whose I/O failed, logging each the
// first time; the master takes them out of the pool.
func (n *Node) failedSegments() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for _, name := range n.mu.names {
		w := n.mu.watched[name]
		if w == nil || w.err() == nil {
			continue
		}
		out = append(out, name)
	}
	for _, name := range out {
		if !n.mu.reported[name] {
			n.log.Error("segment I/O failed; reporting it to the master, which takes it out of the pool", "segment", name, "err", n.mu.watched[name].err())
			n.mu.reported[name] = true
		}
	}
	return out
}

// leave brings the indexes of persistent tiers up to date and takes the
// node out of the pool, best effort: if the master cannot be reached, it
// declares the node dead after its TTL instead.
func (n *Node) leave() {
	epoch := n.Epoch()
	if epoch == 0 {
		return
	}
	// Long enough to page through a large index, short enough for a stop.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := n.syncIndexes(ctx); err != nil {
		n.log.Warn("sync indexes before leaving", "err", err)
	}
	err := n.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		_, err := pb.NewRegistryClient(cc).Leave(ctx, &pb.HeartbeatRequest{Node: n.cfg.ID, Epoch: epoch}, opts...)
		return err
	})
	if err != nil {
		n.log.Warn("leave the pool; the master will notice after its node TTL", "err", err)
		return
	}
	n.log.Info("left the pool", "node", n.cfg.ID, "epoch", epoch)
}

// prefault commits the memory tiers' pages in the background, one tier at
// a time; Close stops it.
func (n *Node) prefault() {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-n.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		for _, t := range n.cfg.Tiers {
			p, ok := t.(prefaulter)
			if !ok {
				continue
			}
			start := time.Now()
			if err := p.Prefault(ctx); err != nil {
				if ctx.Err() == nil {
					n.log.Warn("prefault memory; its first puts take page faults", "tier", t.Name(), "err", err)
				}
				continue
			}
			n.log.Info("prefaulted memory", "tier", t.Name(), "bytes", t.Capacity(), "took", time.Since(start).Round(time.Millisecond))
		}
	}()
}

// Close stops heartbeats and transfers, then closes the tiers.
// It is safe to call more than once.
func (n *Node) Close() error {
	n.closeOnce.Do(func() {
		close(n.stop)
		<-n.runDone // no sync of its own races the final one
		n.leave()
		errs := []error{n.eng.Close()}
		n.wg.Wait()
		errs = append(errs, n.masters.Close())
		for _, t := range n.cfg.Tiers {
			errs = append(errs, t.Close())
		}
		n.closeErr = errors.Join(errs...)
	})
	return n.closeErr
}

func tierProto(k tiers.Kind) pb.Tier {
	switch k {
	case tiers.HBM:
		return pb.Tier_TIER_HBM
	case tiers.SSD:
		return pb.Tier_TIER_SSD
	}
	return pb.Tier_TIER_DRAM
}
