package master

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// Limits on requests; anything larger is InvalidArgument.
const (
	MaxKeyLen    = 4096
	MaxBatchKeys = 16384
	// MaxSegmentsPerNode bounds a Register: each segment is FSM state and
	// a line of every status answer.
	MaxSegmentsPerNode = 64
	// maxSegmentID is the longest segment id (node/name@epoch) the
	// transfer engine's frames carry (engine.MaxSegmentName).
	maxSegmentID = 255
	// maxEndpoint bounds a store's endpoint: its rails' addresses joined
	// by commas.
	maxEndpoint = 4096
	defaultList = 1000
	// defaultListPage is a List page when the caller names no limit: each
	// page is a pass over the table (see FSM.list), so pages are large.
	defaultListPage = 10000
	// LeaderTrailer names the trailer that carries the leader's address when
	// a follower refuses a request.
	LeaderTrailer = leaderconn.Trailer
)

func errorf(sentinel error, key string) error { return fmt.Errorf("%w: %q", sentinel, key) }

// code maps the master's errors to gRPC status codes.
func code(err error) codes.Code {
	switch {
	case err == nil:
		return codes.OK
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrUnknownNode):
		return codes.NotFound
	case errors.Is(err, ErrInvalidRequest):
		return codes.InvalidArgument
	case errors.Is(err, ErrNoSpace), errors.Is(err, ErrNoSegments), errors.Is(err, ErrLogDisk), errors.Is(err, ErrOverQuota):
		return codes.ResourceExhausted
	case errors.Is(err, ErrTooLarge):
		return codes.OutOfRange
	case errors.Is(err, ErrPutInProgress), errors.Is(err, ErrNotInProgress), errors.Is(err, ErrPinned),
		errors.Is(err, ErrCopyInProgress), errors.Is(err, ErrDraining), errors.Is(err, ErrDrained), errors.Is(err, ErrQuorum):
		return codes.FailedPrecondition
	case errors.Is(err, ErrNotLeader), errors.Is(err, ErrStoreGone):
		return codes.Unavailable
	case errors.Is(err, ErrOutcomeUnknown):
		return codes.Aborted
	case errors.Is(err, auth.ErrPermissionDenied):
		return codes.PermissionDenied
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, ErrPutExpired):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

func itemStatus(err error) *pb.ItemStatus {
	if err == nil {
		return &pb.ItemStatus{}
	}
	return &pb.ItemStatus{Code: int32(code(err)), Message: err.Error()}
}

// toStatus turns an error into a gRPC status; a follower's refusal carries
// the leader's address in a trailer so clients can follow it.
func (s *Server) toStatus(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrNotLeader) {
		// The trailer, empty while no leader is known, also tells the
		// client that a master refused the call: it did not take effect.
		id, addr := s.Leader()
		_ = grpc.SetTrailer(ctx, metadata.Pairs(LeaderTrailer, addr))
		return status.Errorf(codes.Unavailable, "master %s is not the leader (leader: %s at %q)", s.cfg.ID, id, addr)
	}
	return status.Error(code(err), err.Error())
}

func validKey(k string) error {
	switch {
	case k == "":
		return fmt.Errorf("%w: empty key", ErrInvalidRequest)
	case len(k) > MaxKeyLen:
		return fmt.Errorf("%w: key of %d bytes exceeds the %d-byte limit", ErrInvalidRequest, len(k), MaxKeyLen)
	}
	return nil
}

// validTier refuses a tier this master does not know (the zero tier is
// the caller's default).
func validTier(t pb.Tier) error {
	if _, ok := pb.Tier_name[int32(t)]; !ok {
		return fmt.Errorf("%w: unknown tier %d", ErrInvalidRequest, t)
	}
	return nil
}

// validName checks a node id or segment name: printable ASCII without the
// separators of a segment id ("/" and "@"), so that no two (node, name)
// pairs make the same id.
func validName(what, name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty %s", ErrInvalidRequest, what)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' || c == '/' || c == '@' {
			return fmt.Errorf("%w: %s %q: byte %#02x at %d (want printable ASCII without space, '/' or '@')", ErrInvalidRequest, what, name, c, i)
		}
	}
	return nil
}

// validRegister checks a Register request: names that make unambiguous
// segment ids the engine can carry, known tiers, and bounded counts.
func validRegister(req *pb.RegisterRequest) error {
	if req.Endpoint == "" || len(req.Segments) == 0 {
		return fmt.Errorf("%w: register needs a node id, an endpoint and at least one segment", ErrInvalidRequest)
	}
	if err := validName("node id", req.Node); err != nil {
		return err
	}
	if len(req.Segments) > MaxSegmentsPerNode {
		return fmt.Errorf("%w: %d segments (at most %d per node)", ErrInvalidRequest, len(req.Segments), MaxSegmentsPerNode)
	}
	if n := len(req.TicketKey); n != 0 && n != ticket.NodeKeySize {
		return fmt.Errorf("%w: ticket key of %d bytes (want %d, or none)", ErrInvalidRequest, n, ticket.NodeKeySize)
	}
	if len(req.Endpoint) > maxEndpoint {
		return fmt.Errorf("%w: endpoint of %d bytes (at most %d)", ErrInvalidRequest, len(req.Endpoint), maxEndpoint)
	}
	names := map[string]bool{}
	for _, sp := range req.Segments {
		if err := validName("segment name", sp.Name); err != nil {
			return err
		}
		// The epoch can take 20 digits.
		if n := len(SegmentID(req.Node, sp.Name, 0)) - 1 + 20; n > maxSegmentID {
			return fmt.Errorf("%w: segment %q of node %q makes an id of up to %d bytes (at most %d)", ErrInvalidRequest, sp.Name, req.Node, n, maxSegmentID)
		}
		if sp.Tier == pb.Tier_TIER_UNSPECIFIED || validTier(sp.Tier) != nil {
			return fmt.Errorf("%w: segment %q has tier %d (want HBM, DRAM or SSD)", ErrInvalidRequest, sp.Name, sp.Tier)
		}
		if sp.Capacity < alignment(sp.Tier) || names[sp.Name] {
			return fmt.Errorf("%w: segment %q needs a unique name and a capacity of at least %d bytes", ErrInvalidRequest, sp.Name, alignment(sp.Tier))
		}
		names[sp.Name] = true
	}
	return nil
}

func parentLoopError(key, parent string) error {
	if key == parent {
		return fmt.Errorf("%w: %q names itself as its parent", ErrInvalidRequest, key)
	}
	return fmt.Errorf("%w: parent %q of %q descends from it: the chain would loop", ErrInvalidRequest, parent, key)
}

func validKeys(keys []string) error {
	if len(keys) == 0 {
		return fmt.Errorf("%w: no keys", ErrInvalidRequest)
	}
	if len(keys) > MaxBatchKeys {
		return fmt.Errorf("%w: %d keys exceed the batch limit of %d", ErrInvalidRequest, len(keys), MaxBatchKeys)
	}
	for _, k := range keys {
		if err := validKey(k); err != nil {
			return err
		}
	}
	return nil
}

// leaderOnly refuses reads on followers: leases and read-your-writes live
// on the leader.
func (s *Server) leaderOnly() error {
	if !s.IsLeader() {
		return ErrNotLeader
	}
	return nil
}

// intercept counts requests by method and code and turns errors into statuses.
func (s *Server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	start := time.Now()
	ctx, err := s.authorize(ctx, info.FullMethod)
	var ns namespace
	if err == nil {
		if t := callerTenant(ctx); t != "" {
			ns = newNamespace(t)
			err = ns.request(req)
		}
	}
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = s.toStatus(ctx, err)
		}
		s.metrics.request(info.FullMethod, status.Code(err), time.Since(start))
		return nil, err
	}
	resp, err := h(ctx, req)
	if ns.prefix != "" {
		s.metrics.tenantRequest(ns.tenant, info.FullMethod)
		if err == nil {
			ns.reply(resp)
		}
	}
	if err != nil {
		if _, ok := status.FromError(err); !ok || errors.Is(err, ErrNotLeader) {
			err = s.toStatus(ctx, err)
		}
		if ns.prefix != "" {
			err = ns.status(err)
		}
	}
	s.metrics.request(info.FullMethod, status.Code(err), time.Since(start))
	return resp, err
}

type masterService struct {
	pb.UnimplementedMasterServer
	s *Server
}

func (m *masterService) PutStart(ctx context.Context, req *pb.PutStartRequest) (*pb.PutStartResult, error) {
	resp, err := m.BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{req}})
	if err != nil {
		return nil, err
	}
	r := resp.Results[0]
	if r.Status.Code != 0 {
		return nil, status.Error(codes.Code(r.Status.Code), r.Status.Message)
	}
	return r, nil
}

func (m *masterService) BatchPutStart(ctx context.Context, req *pb.BatchPutStartRequest) (*pb.BatchPutStartResponse, error) {
	if len(req.Items) == 0 || len(req.Items) > MaxBatchKeys {
		return nil, fmt.Errorf("%w: batch of %d items (want 1 to %d)", ErrInvalidRequest, len(req.Items), MaxBatchKeys)
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	host := clientHost(ctx)
	// A batch of KV blocks is mostly one size: order the segments once per
	// size and tier (but sample anew per put for RandomOfTwo).
	placed := map[sizeTier][]string{}
	place := func(size uint64, tier pb.Tier) []string {
		if m.s.cfg.Placement == RandomOfTwo {
			return m.s.candidates(size, tier, host)
		}
		k := sizeTier{size, tier}
		if _, ok := placed[k]; !ok {
			placed[k] = m.s.candidates(size, tier, host)
		}
		return placed[k]
	}
	views := map[string]segmentView{}
	var largest uint64
	for _, v := range m.s.fsm.segmentViews() {
		views[v.id] = v
		largest = max(largest, v.capacity)
	}
	results := make([]*pb.PutStartResult, len(req.Items))
	recs := make([]putRecord, len(req.Items))
	loops := m.s.fsm.loopingParents(len(req.Items), func(i int) (string, string) { return req.Items[i].Key, req.Items[i].Parent })
	over, err := m.s.admitBatch(ctx, len(req.Items), func(i int) (quotaCharge, bool) {
		return m.quotaCharge(req.Items[i], loops[i], place, views, largest)
	})
	if err != nil {
		return nil, err
	}
	if len(req.Items) > 1 {
		m.s.fsm.warm(len(req.Items), func(i int) string {
			if k := req.Items[i].Key; len(k) <= MaxKeyLen {
				return k
			}
			return "" // refused below: not worth hashing under the lock
		})
	}
	for i, it := range req.Items {
		if loops[i] {
			results[i] = &pb.PutStartResult{Status: itemStatus(parentLoopError(it.Key, it.Parent))}
			m.s.metrics.putFailed(codes.InvalidArgument)
			continue
		}
		if err := over[i]; err != nil {
			results[i] = &pb.PutStartResult{Status: itemStatus(err)}
			m.s.metrics.putFailed(codes.ResourceExhausted)
			continue
		}
		r, err := m.start(ctx, it, &recs[i], place, views, largest, host)
		if err != nil {
			return nil, err // the context ended
		}
		results[i] = r
		if r.Status.Code != 0 {
			m.s.metrics.putFailed(codes.Code(r.Status.Code))
		}
	}
	return &pb.BatchPutStartResponse{Results: results}, nil
}

// quotaCharge is what it asks of its tenant's quota, where it has one: in
// the tier placement puts it (the one asked for, or where it spills), its
// size once per replica that tier's nodes can hold. A put that fails
// anyway (invalid, too large, a parent loop) or takes no room (its key is
// complete) asks nothing, so makes no one evict.
func (m *masterService) quotaCharge(it *pb.PutStartRequest, loop bool, place func(uint64, pb.Tier) []string,
	views map[string]segmentView, largest uint64) (quotaCharge, bool) {
	if it.Tenant == "" || !m.s.fsm.hasQuotas(it.Tenant) || loop || it.Size == 0 || it.Size > largest ||
		validKey(it.Key) != nil || validTier(it.Tier) != nil {
		return quotaCharge{}, false
	}
	cands := place(it.Size, it.Tier)
	if len(cands) == 0 {
		return quotaCharge{}, false
	}
	tier := views[cands[0]].tier
	if !m.s.fsm.hasQuota(it.Tenant, tier) || m.s.fsm.putState(it.Key, m.s.cfg.Now().UnixNano()) != pb.ObjectState_OBJECT_STATE_UNSPECIFIED {
		return quotaCharge{}, false
	}
	nodes := map[string]bool{}
	for _, v := range views {
		if v.tier == tier {
			nodes[v.node] = true
		}
	}
	replicas := min(uint64(max(it.Replicas, 1)), uint64(len(nodes)))
	return quotaCharge{key: quotaKey{it.Tenant, tier}, bytes: satMul(it.Size, replicas)}, true
}

// putRecord is what the leader keeps and answers for one put of a
// BatchPutStart: its entry in the put table, the item its PutEnd
// publishes, its answer and room for one replica's extent and
// descriptor. A batch's records are one allocation rather than about a
// dozen a put; they live until the batch's last put has ended.
type putRecord struct {
	pending pendingPut
	item    pb.PublishItem
	result  pb.PutStartResult
	status  pb.ItemStatus
	ext     pb.Extent
	exts    [1]*pb.Extent
	used    [1]*openResv
	replica pb.Replica
	reps    [1]*pb.Replica
}

// start places one put, keeping what it holds in rec. It is not committed
// until its PutEnd, so a start costs no raft round unless its segment
// needs a new reservation.
func (m *masterService) start(ctx context.Context, it *pb.PutStartRequest, rec *putRecord, place func(uint64, pb.Tier) []string,
	views map[string]segmentView, largest uint64, host string) (*pb.PutStartResult, error) {
	fail := func(err error) (*pb.PutStartResult, error) { return &pb.PutStartResult{Status: itemStatus(err)}, nil }
	err := validKey(it.Key)
	if err == nil {
		err = validTier(it.Tier)
	}
	if err == nil && (len(it.Parent) > MaxKeyLen || len(it.Tenant) > MaxKeyLen) {
		err = fmt.Errorf("%w: parent key or tenant of %q longer than %d bytes", ErrInvalidRequest, it.Key, MaxKeyLen)
	}
	if err == nil && it.Size == 0 {
		err = fmt.Errorf("%w: zero-length value for %q", ErrInvalidRequest, it.Key)
	}
	if err != nil {
		return fail(err)
	}
	now := m.s.cfg.Now()
	// Gets already answer a key being removed as gone (see lease): a put
	// must not find it still there and succeed without writing, nor place
	// a new incarnation under the old one.
	if m.s.beingRemoved(it.Key) {
		return fail(fmt.Errorf("%w: a removal of %q is in flight; put it again once it has ended", ErrPutInProgress, it.Key))
	}
	switch m.s.fsm.putState(it.Key, now.UnixNano()) {
	case pb.ObjectState_OBJECT_STATE_COMPLETE:
		// It may be a held put's (see holds): this one is held with it.
		r := &pb.PutStartResult{Status: itemStatus(nil), Exists: true}
		r.HoldMs = m.s.holdMs(m.s.fsm.tombUntil([]string{it.Key}), now.UnixNano())
		return r, nil
	case pb.ObjectState_OBJECT_STATE_PROCESSING:
		return fail(errorf(ErrPutInProgress, it.Key))
	}
	switch {
	case len(views) == 0:
		return fail(ErrNoSegments)
	case it.Size > largest:
		return fail(fmt.Errorf("%w: %d bytes, largest segment holds %d", ErrTooLarge, it.Size, largest))
	}
	t, item, p := m.s.puts, &rec.item, &rec.pending
	item.Key, item.Size, item.Checksum, item.Parent, item.Tenant, item.ReplicasWanted = it.Key, it.Size, it.Checksum, it.Parent, it.Tenant, it.Replicas
	p.item, p.deadline = item, now.Add(m.s.cfg.PutTimeout)
	t.mu.Lock()
	if t.inProgress(it.Key, now) {
		t.mu.Unlock()
		return fail(errorf(ErrPutInProgress, it.Key))
	}
	t.add(p) // claims the key while it is placed
	t.mu.Unlock()
	return m.placePut(ctx, rec, it, place, views, host)
}

// placePut places a put claimed in the put table (rec.pending), and
// answers it.
func (m *masterService) placePut(ctx context.Context, rec *putRecord, it *pb.PutStartRequest, place func(uint64, pb.Tier) []string,
	views map[string]segmentView, host string) (*pb.PutStartResult, error) {
	t, p, item := m.s.puts, &rec.pending, &rec.item
	fail := func(err error) (*pb.PutStartResult, error) { return &pb.PutStartResult{Status: itemStatus(err)}, nil }
	want := max(int(it.Replicas), 1)
	exts, used, err := m.s.place(ctx, item, want, it.Tier, place(it.Size, it.Tier), views, rec)
	for attempt := 0; attempt < maxRoomAttempts && errors.Is(err, ErrNoSpace); attempt++ {
		// A put under memory pressure evicts instead of failing.
		// In its first lease TTL a leader evicts only what it made itself;
		// the put then waits for the rest rather than fail.
		if !m.s.makeRoom(ctx, it.Size, it.Tier, host) && !m.s.awaitEvictable(ctx, p.deadline) {
			break
		}
		exts, used, err = m.s.place(ctx, item, want, it.Tier, m.s.candidates(it.Size, it.Tier, host), views, rec)
	}
	var reps []*pb.Replica
	if err == nil {
		m.s.fsm.mu.RLock()
		reps = m.s.fsm.describePlaced(exts, access{op: ticket.Write, id: p.id, expiry: p.deadline.UnixNano()}, rec)
		m.s.fsm.mu.RUnlock()
		if len(reps) < len(exts) {
			// A segment went away since it was placed in; its space goes
			// with it.
			err = fmt.Errorf("%w while placing a put of %d bytes; retry", ErrStoreGone, it.Size)
		}
	}
	t.mu.Lock()
	if t.pending[p.id] == p {
		p.resv = used
		item.Replicas, item.Reservations = exts, resvIDs(used)
		if err != nil {
			t.done(p.id)
		}
	} else {
		// The leader changed, or the sweep expired the put, while it was
		// placed: what it took is not handed out.
		t.unclaim(used)
		switch {
		case err != nil:
		case t.gen != p.gen:
			err = fmt.Errorf("%w: the leader changed while placing a put; retry", ErrNotLeader)
		case m.s.cfg.Now().Before(p.deadline):
			err = fmt.Errorf("%w: %q was revoked while it was placed", ErrNotInProgress, it.Key)
		default:
			err = fmt.Errorf("%w (%v, the master is overloaded); retry", ErrPutExpired, m.s.cfg.PutTimeout)
		}
	}
	t.mu.Unlock()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if err != nil {
		return fail(err)
	}
	if want := orDRAM(it.Tier); reps[0].Tier != want {
		m.s.spill()
	}
	r := &rec.result
	r.Status, r.Replicas, r.PutId, r.Reservations = &rec.status, reps, p.id, item.Reservations
	r.WriteTimeoutMs = uint64(m.s.cfg.PutTimeout.Milliseconds())
	return r, nil
}

type sizeTier struct {
	size uint64
	tier pb.Tier
}

// maxPutReplicas bounds the replicas a PutEnd item may name.
const maxPutReplicas = 16

// maxRoomAttempts bounds how often one put makes room and retries: the
// room made for one put may be taken by another before it looks again.
const maxRoomAttempts = 8

func itemsResponse(errs []error) *pb.ItemsResponse {
	resp := &pb.ItemsResponse{Results: make([]*pb.ItemStatus, len(errs))}
	ok := make([]pb.ItemStatus, len(errs)) // one allocation for a batch that succeeded
	for i, err := range errs {
		if err == nil {
			resp.Results[i] = &ok[i]
		} else {
			resp.Results[i] = itemStatus(err)
		}
	}
	return resp
}

// PutEnd publishes puts by key and put id. Puts an earlier leader placed
// are published only by BatchPutEnd, which carries where they were placed.
func (m *masterService) PutEnd(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	if len(req.PutIds) != 0 && len(req.PutIds) != len(req.Keys) {
		return nil, fmt.Errorf("%w: %d put ids for %d keys", ErrInvalidRequest, len(req.PutIds), len(req.Keys))
	}
	items := make([]*pb.PutEndItem, len(req.Keys))
	for i, k := range req.Keys {
		items[i] = &pb.PutEndItem{Key: k}
		if len(req.PutIds) > 0 {
			items[i].PutId = req.PutIds[i]
		}
	}
	resp, err := m.BatchPutEnd(ctx, &pb.BatchPutEndRequest{Items: items})
	if err != nil {
		return nil, err
	}
	// This answer has no holds to carry: it is the hold.
	if hold := time.Duration(slices.Max(append(resp.HoldMs, 0))) * time.Millisecond; hold > 0 {
		if err := m.s.sleep(ctx, hold); err != nil {
			return nil, err
		}
	}
	return &pb.ItemsResponse{Results: resp.Results}, nil
}

func (m *masterService) BatchPutEnd(ctx context.Context, req *pb.BatchPutEndRequest) (*pb.BatchPutEndResponse, error) {
	if len(req.Items) == 0 || len(req.Items) > MaxBatchKeys || len(req.Grants)+len(req.GrantAsks) > MaxBatchKeys {
		return nil, fmt.Errorf("%w: batch of %d items and %d grant asks (want 1 to %d)", ErrInvalidRequest, len(req.Items), len(req.Grants)+len(req.GrantAsks), MaxBatchKeys)
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	errs := make([]error, len(req.Items))
	cmd := &pb.PublishCmd{}
	var idx []int     // errs index of each command item
	var mine []uint64 // per command item: the put id if this leader placed it, else 0
	var legacy []int  // puts started by a PutStartCmd (the log of an older master)
	var unplaced []uint32
	now := m.s.cfg.Now().UnixNano()
	t := m.s.puts
	t.mu.Lock()
	for i, it := range req.Items {
		if err := validKey(it.Key); err != nil {
			errs[i] = err
			continue
		}
		id := it.PutId
		if id == 0 {
			id = t.byKey[it.Key]
		}
		if p := t.pending[id]; p != nil && p.grant && !ownedBy(ctx, p.item.Tenant) {
			errs[i] = fmt.Errorf("%w: grant %d is another tenant's", ErrNotInProgress, id)
			continue
		}
		if p := t.pending[id]; p != nil && p.grant && len(p.item.Replicas) > 0 {
			if it.Size != p.item.Size || len(it.Parent) > MaxKeyLen || len(it.Tenant) > MaxKeyLen {
				errs[i] = fmt.Errorf("%w: PutEnd of %q: %d bytes in a grant of %d, or parent or tenant too long", ErrInvalidRequest, it.Key, it.Size, p.item.Size)
				continue
			}
			p.item.Key, p.item.Checksum, p.item.Parent, p.item.Tenant = it.Key, it.Checksum, it.Parent, it.Tenant
			p.grant = false
		}
		if p := t.pending[id]; p != nil && p.item.Key == it.Key && len(p.item.Replicas) > 0 {
			cmd.Items = append(cmd.Items, p.item)
			mine = append(mine, p.id)
			idx = append(idx, i)
			continue
		}
		if len(it.Replicas) == 0 {
			if m.s.fsm.putState(it.Key, now) == pb.ObjectState_OBJECT_STATE_PROCESSING {
				legacy = append(legacy, i)
			} else {
				errs[i] = fmt.Errorf("%w: %q was not placed by this leader; send its replicas", ErrNotInProgress, it.Key)
				unplaced = append(unplaced, uint32(i))
			}
			continue
		}
		if len(it.Parent) > MaxKeyLen || len(it.Tenant) > MaxKeyLen || len(it.Replicas) > maxPutReplicas {
			errs[i] = fmt.Errorf("%w: PutEnd item of %q", ErrInvalidRequest, it.Key)
			continue
		}
		if len(it.Reservations) != len(it.Replicas) {
			// The FSM refuses these too; columns (columnsOf) cannot say it.
			errs[i] = fmt.Errorf("%w: %d replicas and %d reservations for %q", ErrInvalidRequest, len(it.Replicas), len(it.Reservations), it.Key)
			continue
		}
		if callerTenant(ctx) != "" {
			// Where another leader placed a put, this one takes the
			// client's word for its replicas: space free in their
			// reservation, which may be another tenant's put still being
			// written. A tenant's put in flight across a failover fails
			// instead (the client puts it again).
			errs[i] = fmt.Errorf("%w: %q was placed by an earlier leader; put it again", ErrNotInProgress, it.Key)
			continue
		}
		// Another leader placed it: the client says what it asked for (an
		// older one does not: then what was placed).
		pi := &pb.PublishItem{
			Key: it.Key, Size: it.Size, Checksum: it.Checksum, PutId: it.PutId, Parent: it.Parent, Tenant: it.Tenant,
			Reservations: it.Reservations, ReplicasWanted: max(it.ReplicasWanted, uint32(len(it.Replicas))),
		}
		for _, r := range it.Replicas {
			pi.Replicas = append(pi.Replicas, &pb.Extent{Segment: r.Segment, Offset: r.Offset, Length: it.Size})
		}
		cmd.Items = append(cmd.Items, pi)
		mine = append(mine, 0)
		idx = append(idx, i)
	}
	t.mu.Unlock()
	// The parents as they will be published (a placed put's are its
	// start's): those that would close a loop are refused, and their puts
	// end here.
	loops := m.s.fsm.loopingParents(len(cmd.Items), func(j int) (string, string) { return cmd.Items[j].Key, cmd.Items[j].Parent })
	if slices.Contains(loops, true) {
		var keep []*pb.PublishItem
		var keepIdx []int
		var keepMine []uint64
		t.mu.Lock()
		for j, it := range cmd.Items {
			if !loops[j] {
				keep, keepIdx, keepMine = append(keep, it), append(keepIdx, idx[j]), append(keepMine, mine[j])
				continue
			}
			errs[idx[j]] = parentLoopError(it.Key, it.Parent)
			if mine[j] != 0 {
				t.done(mine[j])
			}
		}
		t.mu.Unlock()
		cmd.Items, idx, mine = keep, keepIdx, keepMine
	}
	if len(cmd.Items) > 0 {
		out, err := m.s.apply(ctx, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: columnsOf(cmd.Items)}})
		if err != nil {
			return nil, err
		}
		for j, e := range out.([]error) {
			errs[idx[j]] = e
		}
		t.mu.Lock()
		for _, id := range mine {
			if id != 0 {
				t.done(id)
			}
		}
		t.mu.Unlock()
	}
	if len(legacy) > 0 {
		kc := &pb.KeysCmd{}
		for _, i := range legacy {
			kc.Keys = append(kc.Keys, req.Items[i].Key)
			kc.PutIds = append(kc.PutIds, req.Items[i].PutId)
		}
		out, err := m.s.apply(ctx, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: kc}})
		if err != nil {
			return nil, err
		}
		for j, e := range out.([]error) {
			errs[legacy[j]] = e
		}
	}
	var ended []string
	for i, e := range errs {
		if e == nil {
			ended = append(ended, req.Items[i].Key)
		}
	}
	m.s.touch(ended, m.s.cfg.Now())
	resp := &pb.BatchPutEndResponse{Grants: m.grant(ctx, grantAsks(req)), Unplaced: unplaced, HoldMs: m.s.holds(req.Items, errs)}
	if !req.SparseResults {
		resp.Results = itemsResponse(errs).Results
		return resp, nil
	}
	for i, err := range errs {
		if err != nil {
			resp.Results, resp.Failed = append(resp.Results, itemStatus(err)), append(resp.Failed, uint32(i))
		}
	}
	return resp, nil
}

// holds says, per item, how long the writer of each put that ended well
// waits before it reports the put done: until no client may answer its
// key from a lookup cache with an incarnation removed before (see tombs),
// at most a lease TTL. Nil if no item waits (the rule: only a key removed
// while a lookup leased it). The writer waits, not this answer: a batch
// carries the ends of other puts, which need not wait.
func (s *Server) holds(items []*pb.PutEndItem, errs []error) []uint32 {
	var out []uint32
	held := 0
	now := s.cfg.Now().UnixNano()
	for i, until := range s.fsm.tombsOf(len(items), func(i int) string { return items[i].Key }) {
		ms := s.holdMs(until, now)
		if errs[i] != nil || ms == 0 {
			continue
		}
		if out == nil {
			out = make([]uint32, len(items))
		}
		out[i] = ms
		held++
	}
	s.metrics.putsHeld(held)
	return out
}

// holdMs is a hold until the given time, at now (unix nanos): at most a
// lease TTL, in milliseconds rounded up; 0 if it has passed.
func (s *Server) holdMs(until, now int64) uint32 {
	if until <= now {
		return 0
	}
	wait := min(time.Duration(until-now), s.cfg.LeaseTTL+stepDownLag) // an earlier leader's lease, too
	return uint32((wait + time.Millisecond - 1) / time.Millisecond)
}

// sleep waits d, or until ctx ends or the server closes.
func (s *Server) sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-s.stop:
		return fmt.Errorf("%w: master closing", ErrNotLeader)
	}
}

// PutRevoke abandons puts whose writes have ended. A put this leader
// placed costs no raft round: its space goes back with its reservation.
//
// A grant is revoked by its put id, with an empty key.
func (m *masterService) PutRevoke(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	if len(req.PutIds) != 0 && len(req.PutIds) != len(req.Keys) {
		return nil, fmt.Errorf("%w: %d put ids for %d keys", ErrInvalidRequest, len(req.PutIds), len(req.Keys))
	}
	if len(req.Keys) == 0 || len(req.Keys) > MaxBatchKeys {
		return nil, fmt.Errorf("%w: %d keys (want 1 to %d)", ErrInvalidRequest, len(req.Keys), MaxBatchKeys)
	}
	for i, k := range req.Keys {
		if k == "" && len(req.PutIds) > 0 && req.PutIds[i] != 0 {
			continue
		}
		if err := validKey(k); err != nil {
			return nil, err
		}
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	errs := make([]error, len(req.Keys))
	legacy := &pb.KeysCmd{}
	var idx []int
	t := m.s.puts
	t.mu.Lock()
	for i, k := range req.Keys {
		var id uint64
		if len(req.PutIds) > 0 {
			id = req.PutIds[i]
		}
		if id == 0 {
			id = t.byKey[k]
		}
		// A grant has no key until it ends: it is its tenant's to revoke.
		if p := t.pending[id]; p != nil && (p.grant && ownedBy(ctx, p.item.Tenant) || !p.grant && p.item.Key == k) {
			t.done(id)
			continue
		}
		if k == "" {
			errs[i] = fmt.Errorf("%w: grant %d (expired, or used)", ErrNotInProgress, id)
			continue
		}
		legacy.Keys = append(legacy.Keys, k)
		legacy.PutIds = append(legacy.PutIds, id)
		idx = append(idx, i)
	}
	t.mu.Unlock()
	if len(legacy.Keys) > 0 {
		out, err := m.s.apply(ctx, &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: legacy}})
		if err != nil {
			return nil, err
		}
		for j, e := range out.([]error) {
			errs[idx[j]] = e
		}
	}
	return itemsResponse(errs), nil
}

func (m *masterService) Remove(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	// A key whose put is in flight is taken, as a PROCESSING object was.
	errs := make([]error, len(req.Keys))
	var keys []string
	var idx []int
	now := m.s.cfg.Now()
	m.s.puts.mu.Lock()
	for i, k := range req.Keys {
		if m.s.puts.inProgress(k, now) {
			errs[i] = errorf(ErrPutInProgress, k)
			continue
		}
		keys = append(keys, k)
		idx = append(idx, i)
	}
	m.s.puts.mu.Unlock()
	if len(keys) == 0 {
		return itemsResponse(errs), nil
	}
	freeAfter, done := m.s.startRemove(keys)
	defer done()
	cmd := &pb.RemoveCmd{Keys: keys, FreeAfterUnixNano: freeAfter.UnixNano(), CachedUntilUnixNano: m.s.cachedEnds(keys)}
	out, err := m.s.apply(ctx, &pb.Command{Op: &pb.Command_Remove{Remove: cmd}})
	if err != nil {
		return nil, err
	}
	for j, e := range out.([]error) {
		errs[idx[j]] = e
	}
	return itemsResponse(errs), nil
}

func (m *masterService) GetReplicas(ctx context.Context, req *pb.KeysRequest) (*pb.GetReplicasResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	// A key whose removal is in flight cannot be leased (its space may be
	// reused once the removal commits), nor answered not found: should
	// its leader die before the removal commits, a later get would find
	// it again. So the get waits for the removal to end, then reads again
	// (on this leader still, or fails for the client to ask the next).
	var res []*pb.ObjectReplicas
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		objs := m.s.fsm.complete(req.Keys)
		now := m.s.cfg.Now()
		exp := now.Add(m.s.cfg.LeaseTTL).UnixNano()
		refused := m.s.lease(req.Keys, objs, now.UnixNano(), exp, false)
		res = m.s.fsm.replicas(req.Keys, objs, now.UnixNano(), access{op: ticket.Read, expiry: exp})
		if len(refused) == 0 {
			break
		}
		if err := m.s.sleep(ctx, wait); err != nil {
			return nil, err
		}
		if err := m.s.leaderOnly(); err != nil {
			return nil, err
		}
	}
	m.s.noteReads(req.Keys, res)
	return &pb.GetReplicasResponse{Results: res, LeaseTtlMs: uint64(m.s.cfg.LeaseTTL.Milliseconds())}, nil
}

func (m *masterService) Exists(ctx context.Context, req *pb.KeysRequest) (*pb.ExistsResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	return &pb.ExistsResponse{Exists: m.s.fsm.exists(req.Keys)}, nil
}

func (m *masterService) List(ctx context.Context, req *pb.ListRequest) (*pb.ListResponse, error) {
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	limit := int(req.Limit)
	if limit <= 0 || limit > MaxBatchKeys {
		limit = defaultListPage
	}
	objs, truncated := m.s.list(req.Prefix, req.StartAfter, limit, m.s.cfg.Now())
	return &pb.ListResponse{Objects: objs, Truncated: truncated}, nil
}

// Status answers on any master, so operators can inspect a follower.
func (m *masterService) Status(ctx context.Context, _ *pb.StatusRequest) (*pb.StatusResponse, error) {
	s := m.s
	id, addr := s.Leader()
	resp := &pb.StatusResponse{
		LeaderId: id, LeaderAddress: addr, RaftCommitIndex: s.raft.CommitIndex(), RaftTerm: s.raft.CurrentTerm(),
		SelfId: s.cfg.ID, SelfRaftAddress: string(s.trans.LocalAddr()),
	}
	if cf := s.raft.GetConfiguration(); cf.Error() == nil {
		for _, srv := range cf.Configuration().Servers {
			resp.Members = append(resp.Members, &pb.MemberInfo{
				Id: string(srv.ID), Address: s.fsm.member(string(srv.ID)), RaftAddress: string(srv.Address), Leader: string(srv.ID) == id,
			})
		}
	}
	leader := s.IsLeader()
	live := s.fsm.liveNodes()
	for _, v := range s.fsm.segmentViews() {
		_, registered := live[v.node]
		resp.Segments = append(resp.Segments, &pb.SegmentInfo{
			Name: v.id, Node: v.node, Tier: v.tier, Capacity: v.capacity, Used: v.used, Reserved: v.reserved,
			Endpoint: v.endpoint, Epoch: v.epoch, Alive: registered && (!leader || s.alive(v.node)), Objects: uint64(v.objects), Draining: v.draining,
		})
	}
	_, complete, bytes := s.fsm.objectStats()
	resp.Objects, resp.CompleteBytes = uint64(complete), bytes
	rs := s.fsm.repairs()
	resp.UnderReplicated, resp.Repairing = uint64(rs.under), uint64(rs.repairing)
	if leader {
		s.mu.Lock()
		resp.LeaderSinceUnixNano = s.mu.leaderSince.UnixNano()
		s.mu.Unlock()
	}
	if err := s.diskError(); err != nil {
		resp.RaftLogError = err.Error()
	}
	return resp, nil
}

type registryService struct {
	pb.UnimplementedRegistryServer
	s *Server
}

func (r *registryService) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	if err := validRegister(req); err != nil {
		return nil, err
	}
	out, err := r.s.apply(ctx, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{
		Node: req.Node, Endpoint: req.Endpoint, Segments: req.Segments, Adopt: req.Adopt, AdoptMore: req.AdoptMore,
		TicketKey: req.TicketKey,
	}}})
	if err != nil {
		return nil, err
	}
	res := out.(RegisterResult)
	if err := r.s.heartbeat(req.Node, res.Epoch); err != nil {
		return nil, err
	}
	r.s.log.Info("store node registered", "node", req.Node, "epoch", res.Epoch, "endpoint", req.Endpoint,
		"segments", res.SegmentIDs, "adopted", res.Adopted, "offered", len(req.Adopt))
	return &pb.RegisterResponse{Epoch: res.Epoch, SegmentIds: res.SegmentIDs, Adopted: uint32(res.Adopted)}, nil
}

func (r *registryService) Heartbeat(ctx context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	if err := r.s.leaderOnly(); err != nil {
		return nil, err
	}
	if err := r.s.heartbeat(req.Node, req.Epoch); err != nil {
		return nil, err
	}
	if err := r.s.failSegments(ctx, req.Node, req.Epoch, req.FailedSegments); err != nil {
		return nil, status.Errorf(codes.Unavailable, "take failed segments out: %v", err) // reported again
	}
	if err := r.s.endCopies(ctx, req.CopiesDone); err != nil {
		// The store reports them again. Never FAILED_PRECONDITION: to a
		// store that means it was drained.
		return nil, status.Errorf(codes.Unavailable, "end copies: %v", err)
	}
	return &pb.HeartbeatResponse{Copies: r.s.takeCopies(req.Node, int(req.CopySlots))}, nil
}

// failSegments takes out of the pool the segments a store reports failing
// (an SSD tier returning I/O errors); one reported again, or not the
// node's, is skipped.
func (s *Server) failSegments(ctx context.Context, node string, epoch uint64, ids []string) error {
	if len(ids) > MaxSegmentsPerNode {
		return fmt.Errorf("%w: %d failed segments", ErrInvalidRequest, len(ids))
	}
	for _, id := range ids {
		n, e, name, ok := s.fsm.segmentName(id)
		if !ok || n != node || e != epoch {
			continue
		}
		_, err := s.apply(ctx, &pb.Command{Op: &pb.Command_SegmentFail{SegmentFail: &pb.SegmentFailCmd{Node: node, Epoch: epoch, Name: name}}})
		if err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		s.log.Error("segment I/O failing: taken out of the pool; its objects are re-replicated from other replicas, or lost",
			"segment", id, "node", node)
	}
	return nil
}

// clientHost is the IP address the request came from, for LocalFirst.
func clientHost(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	host, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		return ""
	}
	return host
}

func (r *registryService) SegmentObjects(ctx context.Context, req *pb.SegmentObjectsRequest) (*pb.SegmentObjectsResponse, error) {
	if err := r.s.leaderOnly(); err != nil {
		return nil, err
	}
	if e, ok := r.s.fsm.liveNodes()[req.Node]; !ok || e != req.Epoch {
		return nil, fmt.Errorf("%w: %s@%d", ErrUnknownNode, req.Node, req.Epoch)
	}
	limit := int(req.Limit)
	if limit <= 0 || limit > maxObjectPage {
		limit = defaultObjectPage
	}
	id := SegmentID(req.Node, req.Segment, req.Epoch)
	objs, truncated := r.s.fsm.segmentObjects(id, req.Segment, req.StartAfter, limit)
	return &pb.SegmentObjectsResponse{Objects: objs, Truncated: truncated}, nil
}

// Pages of a segment's objects: a page of kept objects is a raft entry and
// a gRPC message, both of which must stay well under their size limits.
const (
	defaultObjectPage = 10000
	maxObjectPage     = 50000
)

// Adopt re-adopts a further page of a registering node's kept objects.
func (r *registryService) Adopt(ctx context.Context, req *pb.AdoptRequest) (*pb.AdoptResponse, error) {
	if len(req.Objects) > maxObjectPage {
		return nil, fmt.Errorf("%w: a page of %d objects (at most %d)", ErrInvalidRequest, len(req.Objects), maxObjectPage)
	}
	out, err := r.s.apply(ctx, &pb.Command{Op: &pb.Command_Adopt{Adopt: &pb.AdoptCmd{
		Node: req.Node, Epoch: req.Epoch, Objects: req.Objects, Done: req.Done,
	}}})
	if err != nil {
		return nil, err
	}
	// Adoption stands in for heartbeats while it lasts.
	if err := r.s.heartbeat(req.Node, req.Epoch); err != nil {
		return nil, err
	}
	if req.Done {
		r.s.log.Info("store node re-adopted its kept objects", "node", req.Node, "epoch", req.Epoch)
	}
	return &pb.AdoptResponse{Adopted: uint32(out.(int))}, nil
}

func (r *registryService) Leave(ctx context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	if _, err := r.s.apply(ctx, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: req.Node, Epoch: req.Epoch}}}); err != nil {
		return nil, err
	}
	r.s.mu.Lock()
	delete(r.s.mu.lastSeen, req.Node)
	r.s.mu.Unlock()
	r.s.log.Info("store node left the pool", "node", req.Node, "epoch", req.Epoch)
	return &pb.HeartbeatResponse{}, nil
}

// ReportCorrupt drops the replica a reader found corrupt. Its space is
// reused only after the leases on the key end, like a removal's.
func (m *masterService) ReportCorrupt(ctx context.Context, req *pb.CorruptReplica) (*pb.CorruptReplicaResponse, error) {
	if err := validKey(req.Key); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	freeAfter, done := m.s.startRemove([]string{req.Key})
	defer done()
	out, err := m.s.apply(ctx, &pb.Command{Op: &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{
		Key: req.Key, Segment: req.Segment, Checksum: req.Checksum, FreeAfterUnixNano: freeAfter.UnixNano(),
		CachedUntilUnixNano: at(m.s.cachedEnds([]string{req.Key}), 0),
	}}})
	if err != nil {
		return nil, err
	}
	dropped := out.(bool)
	if dropped {
		m.s.log.Warn("dropped a corrupt replica", "key", req.Key, "segment", req.Segment)
		m.s.metrics.corrupt()
	}
	return &pb.CorruptReplicaResponse{Dropped: dropped}, nil
}

// maxUnreachable bounds the segments of one UnreachableReport: those of a
// batch's failed writes.
const maxUnreachable = 256

func (m *masterService) ReportUnreachable(ctx context.Context, req *pb.UnreachableReport) (*pb.UnreachableResponse, error) {
	if len(req.Segments) > maxUnreachable {
		return nil, fmt.Errorf("%w: %d segments in one report (at most %d)", ErrInvalidRequest, len(req.Segments), maxUnreachable)
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	nodes := m.s.fsm.nodesOf(req.Segments)
	if len(nodes) > 0 {
		m.s.log.Warn("a client could not reach store nodes; placement avoids them until their heartbeats decide", "nodes", nodes)
		m.s.avoid(nodes)
	}
	return &pb.UnreachableResponse{Nodes: nodes}, nil
}
