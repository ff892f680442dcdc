package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// service is the Agent gRPC service of a Server.
type service struct {
	pb.UnimplementedAgentServer
	s *Server
}

// fail counts a failed request and turns err into its gRPC status.
func (s *Server) fail(err error) error {
	s.stats.errors.Add(1)
	return toStatus(err)
}

// items turns per-key errors into statuses, counting the failures.
func (s *Server) items(errs []error) []*pb.ItemStatus {
	out := make([]*pb.ItemStatus, len(errs))
	for i, err := range errs {
		if err != nil && !miss(err) {
			s.stats.errors.Add(1)
		}
		out[i] = itemStatus(err)
	}
	return out
}

func checkKeys(keys []string) error {
	switch {
	case len(keys) == 0:
		return fmt.Errorf("%w: no keys", client.ErrInvalidArgument)
	case len(keys) > MaxBatchKeys:
		return fmt.Errorf("%w: %d keys exceed the batch limit of %d", client.ErrInvalidArgument, len(keys), MaxBatchKeys)
	}
	return nil
}

func validKey(k string) error {
	switch {
	case k == "":
		return fmt.Errorf("%w: empty key", client.ErrInvalidArgument)
	case len(k) > client.MaxKeyLen:
		return fmt.Errorf("%w: key of %d bytes exceeds the %d-byte limit", client.ErrInvalidArgument, len(k), client.MaxKeyLen)
	}
	return nil
}

func (a *service) Open(ctx context.Context, req *pb.OpenRequest) (*pb.OpenResponse, error) {
	s := a.s
	name := req.Client
	if len(name) > 256 {
		name = name[:256]
	}
	ss, err := s.open(name, req.ShmBytes, ownerOf(ctx))
	if err != nil {
		return nil, s.fail(err)
	}
	s.stats.opened.Add(1)
	s.log.Info("session opened", "session", ss.id, "client", name, "bytes", ss.size, "path", ss.path)
	return &pb.OpenResponse{
		Session: ss.id, ShmPath: ss.path, ShmBytes: ss.size,
		IdleTimeoutMs: uint64(s.cfg.SessionIdle.Milliseconds()), Masters: s.cfg.Masters,
	}, nil
}

func (a *service) Close(ctx context.Context, req *pb.SessionRef) (*pb.SessionRef, error) {
	if err := a.s.closeSession(req.Session); err != nil {
		return nil, a.s.fail(err)
	}
	a.s.log.Info("session closed", "session", req.Session)
	return &pb.SessionRef{Session: req.Session}, nil
}

func (a *service) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	s := a.s
	keys, err := req.ChainKeys(MaxBatchKeys)
	if err != nil {
		return nil, s.fail(fmt.Errorf("%w: %w", client.ErrInvalidArgument, err))
	}
	if len(req.PackedKeys) > 0 {
		// The lease table keeps the matched keys: not as views that would
		// keep the whole request.
		for i, k := range keys {
			keys[i] = strings.Clone(k)
		}
	}
	if err := checkKeys(keys); err != nil {
		return nil, s.fail(err)
	}
	if req.CountOnly {
		n, err := s.batchExists(ctx, keys)
		if err != nil {
			return nil, s.fail(err)
		}
		return &pb.LookupResponse{Matched: uint32(n)}, nil
	}
	m, err := s.c.Lookup(ctx, keys)
	if err != nil {
		return nil, s.fail(err)
	}
	s.stats.lookups.Add(1)
	s.stats.probed.Add(uint64(len(keys)))
	s.stats.matched.Add(uint64(m.Len()))
	now := time.Now()
	s.leases.keep(m, now)
	return lookupResponse(m, now), nil
}

// lookupResponse describes m in the master's columnar shape; the lease
// runs for lease_ttl_ms from now.
func lookupResponse(m client.Match, now time.Time) *pb.LookupResponse {
	n := m.Len()
	resp := &pb.LookupResponse{
		Matched:         uint32(n),
		Sizes:           make([]uint64, 0, n),
		Checksums:       make([]uint32, 0, n),
		ReplicaCounts:   make([]uint32, 0, n),
		ReplicaSegments: make([]uint32, 0, n),
		ReplicaOffsets:  make([]uint64, 0, n),
	}
	index := map[string]uint32{}
	for _, b := range m.Blocks {
		resp.Sizes = append(resp.Sizes, b.Size)
		resp.Checksums = append(resp.Checksums, b.Checksum)
		reps := b.Replicas()
		resp.ReplicaCounts = append(resp.ReplicaCounts, uint32(len(reps)))
		for _, r := range reps {
			i, ok := index[r.Segment]
			if !ok {
				i = uint32(len(resp.Segments))
				index[r.Segment] = i
				resp.Segments = append(resp.Segments, &pb.Replica{Segment: r.Segment, Node: r.Node, Endpoint: r.Endpoint, Tier: r.Tier})
			}
			resp.ReplicaSegments = append(resp.ReplicaSegments, i)
			resp.ReplicaOffsets = append(resp.ReplicaOffsets, r.Offset)
		}
	}
	if ttl := m.LeaseEnd.Sub(now); n > 0 && ttl > 0 {
		resp.LeaseTtlMs = uint64(ttl.Milliseconds())
	}
	return resp
}

func (a *service) BatchExists(ctx context.Context, req *pb.KeysRequest) (*pb.BatchExistsResponse, error) {
	if err := checkKeys(req.Keys); err != nil {
		return nil, a.s.fail(err)
	}
	n, err := a.s.batchExists(ctx, req.Keys)
	if err != nil {
		return nil, a.s.fail(err)
	}
	return &pb.BatchExistsResponse{Count: uint32(n)}, nil
}

func (s *Server) batchExists(ctx context.Context, keys []string) (int, error) {
	n, err := s.c.BatchExists(ctx, keys)
	if err != nil {
		return 0, err
	}
	s.stats.lookups.Add(1)
	s.stats.probed.Add(uint64(len(keys)))
	s.stats.matched.Add(uint64(n))
	return n, nil
}

func (a *service) BatchGet(ctx context.Context, req *pb.AgentGetRequest) (*pb.AgentGetResponse, error) {
	s := a.s
	if err := checkKeys(req.Keys); err != nil {
		return nil, s.fail(err)
	}
	if len(req.Spans) != len(req.Keys) {
		return nil, s.fail(fmt.Errorf("%w: %d keys but %d spans", client.ErrInvalidArgument, len(req.Keys), len(req.Spans)))
	}
	ss, err := s.acquire(req.Session)
	if err != nil {
		return nil, s.fail(err)
	}
	defer ss.release()

	n := len(req.Keys)
	errs := make([]error, n)
	bufs := make([][]byte, n)
	sizes := make([]uint64, n)
	for i, k := range req.Keys {
		if errs[i] = validKey(k); errs[i] == nil {
			bufs[i], errs[i] = ss.span(req.Spans[i])
		}
	}
	refuseOverlaps(req.Spans, errs)
	done := s.getLeased(ctx, req.Keys, bufs, errs, sizes)

	// The rest ask the master. The agent has checked every key and span, so
	// what the client still refuses is a short buffer.
	var keys []string
	var idx []int
	var rest [][]byte
	for i := range n {
		if errs[i] == nil && !done[i] {
			keys, idx, rest = append(keys, req.Keys[i]), append(idx, i), append(rest, bufs[i])
		}
	}
	if len(keys) > 0 {
		ns, es := s.c.BatchGetInto(ctx, keys, rest)
		for j, i := range idx {
			switch e := es[j]; {
			case e == nil:
				sizes[i] = uint64(ns[j])
			case errors.Is(e, client.ErrShortBuffer):
				errs[i] = valueTooLong(keys[j], len(rest[j]), e)
			default:
				errs[i] = e
			}
		}
	}
	for i, err := range errs {
		if err == nil {
			s.stats.gets.Add(1)
			s.stats.getBytes.Add(sizes[i])
		}
	}
	return &pb.AgentGetResponse{Results: s.items(errs), Sizes: sizes}, nil
}

// getLeased reads the keys that a recent lookup leased under that lease, and
// reports which it read or failed for good; the others (not leased, or the
// read failed) are for the master.
func (s *Server) getLeased(ctx context.Context, keys []string, bufs [][]byte, errs []error, sizes []uint64) []bool {
	done := make([]bool, len(keys))
	if s.leases == nil {
		return done
	}
	now := time.Now()
	var m client.Match
	var idx []int
	var mbufs [][]byte
	for i, k := range keys {
		if errs[i] != nil {
			continue
		}
		b, end, ok := s.leases.get(k, now)
		if !ok {
			continue
		}
		if b.Size > uint64(len(bufs[i])) {
			errs[i] = fmt.Errorf("%w: %q is %d bytes, its span %d", ErrValueTooLong, k, b.Size, len(bufs[i]))
			done[i] = true
			continue
		}
		if len(m.Blocks) == 0 || end.Before(m.LeaseEnd) {
			m.LeaseEnd = end
		}
		m.Blocks = append(m.Blocks, b)
		idx, mbufs = append(idx, i), append(mbufs, bufs[i])
	}
	if len(idx) == 0 {
		return done
	}
	ns, es := s.c.GetMatched(ctx, m, mbufs)
	for j, i := range idx {
		if es[j] != nil {
			// Evicted after its lease, moved, or the lease ran out: forget it
			// and ask the master.
			s.leases.drop(keys[i])
			continue
		}
		sizes[i], done[i] = uint64(ns[j]), true
		s.stats.leasedGets.Add(1)
	}
	return done
}

func (a *service) BatchPut(ctx context.Context, req *pb.AgentPutRequest) (*pb.ItemsResponse, error) {
	s := a.s
	if err := checkKeys(req.Keys); err != nil {
		return nil, s.fail(err)
	}
	if len(req.Spans) != len(req.Keys) {
		return nil, s.fail(fmt.Errorf("%w: %d keys but %d spans", client.ErrInvalidArgument, len(req.Keys), len(req.Spans)))
	}
	if req.Parent != "" {
		if !req.Chain {
			return nil, s.fail(fmt.Errorf("%w: a parent without chain", client.ErrInvalidArgument))
		}
		if err := validKey(req.Parent); err != nil {
			return nil, s.fail(fmt.Errorf("parent: %w", err))
		}
	}
	ss, err := s.acquire(req.Session)
	if err != nil {
		return nil, s.fail(err)
	}
	defer ss.release()

	// A bad span leaves its value empty, which the client refuses for that
	// key alone: the batch keeps its order, so a chain keeps its links.
	n := len(req.Keys)
	spanErrs := make([]error, n)
	values := make([][]byte, n)
	for i := range n {
		values[i], spanErrs[i] = ss.span(req.Spans[i])
	}
	errs := s.c.BatchPutWith(ctx, req.Keys, values, client.PutOptions{Chain: req.Chain, Parent: req.Parent, Replicas: int(req.Replicas)})
	for i := range n {
		if spanErrs[i] != nil && validKey(req.Keys[i]) == nil {
			errs[i] = spanErrs[i]
		}
		if errs[i] == nil {
			s.stats.puts.Add(1)
			s.stats.putBytes.Add(uint64(len(values[i])))
		}
	}
	return &pb.ItemsResponse{Results: s.items(errs)}, nil
}

// refuseOverlaps fails every get whose span overlaps another of the
// request in the same region: two values written into the same bytes would
// fail their checksums, and one would be lost.
func refuseOverlaps(spans []*pb.Span, errs []error) {
	var idx []int
	for i, err := range errs {
		if err == nil && spans[i].GetLength() > 0 {
			idx = append(idx, i)
		}
	}
	slices.SortFunc(idx, func(a, b int) int {
		return cmp.Or(cmp.Compare(spans[a].GetRegion(), spans[b].GetRegion()), cmp.Compare(spans[a].GetOffset(), spans[b].GetOffset()))
	})
	end, last := uint64(0), -1 // the furthest end so far in the region, and whose
	for _, i := range idx {
		sp := spans[i]
		if last >= 0 && sp.GetRegion() != spans[last].GetRegion() {
			end, last = 0, -1
		}
		if last >= 0 && sp.GetOffset() < end {
			errs[i] = overlap(sp)
			errs[last] = overlap(spans[last])
		}
		if e := sp.GetOffset() + sp.GetLength(); e > end {
			end, last = e, i
		}
	}
}

func overlap(sp *pb.Span) error {
	return fmt.Errorf("%w: [%d, %d) of region %d", ErrOverlap, sp.GetOffset(), sp.GetOffset()+sp.GetLength(), sp.GetRegion())
}

func (a *service) Remove(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	s := a.s
	if err := checkKeys(req.Keys); err != nil {
		return nil, s.fail(err)
	}
	return &pb.ItemsResponse{Results: s.items(s.remove(ctx, req.Keys))}, nil
}

// remove removes keys in one batch and returns one error per key.
func (s *Server) remove(ctx context.Context, keys []string) []error {
	errs := s.c.BatchRemove(ctx, keys)
	s.leases.drop(keys...)
	for _, err := range errs {
		if err == nil {
			s.stats.removed.Add(1)
		}
	}
	return errs
}

// clearPage is how many objects Clear lists and removes at a time, so its
// memory does not grow with the pool.
const clearPage = 1000

// Clear removes the complete objects whose key has the prefix (and matches
// the regex); objects still being put are left alone. It walks the table a
// page at a time.
func (a *service) Clear(ctx context.Context, req *pb.ClearRequest) (*pb.ClearResponse, error) {
	s := a.s
	if req.Prefix == "" && !req.All {
		return nil, s.fail(fmt.Errorf("%w: clear needs a prefix (or all)", client.ErrInvalidArgument))
	}
	var re *regexp.Regexp
	if req.Regex != "" {
		var err error
		if re, err = regexp.Compile(req.Regex); err != nil {
			return nil, s.fail(fmt.Errorf("%w: regex: %v", client.ErrInvalidArgument, err))
		}
	}
	var removed, failed uint64
	var first error
	after := ""
	for {
		page, more, err := s.c.ListPage(ctx, req.Prefix, after, clearPage)
		if err != nil {
			first = cmp.Or(first, fmt.Errorf("list %q: %w", req.Prefix, err))
			failed++
			break
		}
		var keys []string
		for _, o := range page {
			if o.State == pb.ObjectState_OBJECT_STATE_COMPLETE && (re == nil || re.MatchString(o.Key)) {
				keys = append(keys, o.Key)
			}
		}
		if len(keys) > 0 {
			for _, err := range s.remove(ctx, keys) {
				switch {
				case err == nil:
					removed++
				case miss(err): // removed meanwhile
				default:
					failed++
					first = cmp.Or(first, err)
				}
			}
		}
		if !more {
			break
		}
		after = page[len(page)-1].Key
	}
	if first != nil {
		s.stats.errors.Add(failed - 1)
		return nil, s.fail(fmt.Errorf("removed %d objects matching prefix %q; %d failed, the first: %w", removed, req.Prefix, failed, first))
	}
	return &pb.ClearResponse{Removed: removed}, nil
}

// Stats answers the agent's counters. Session 0 asks without a session;
// another must exist, and the call keeps it alive.
func (a *service) Stats(ctx context.Context, req *pb.SessionRef) (*pb.AgentStatsResponse, error) {
	if req.Session != 0 {
		ss, err := a.s.acquire(req.Session)
		if err != nil {
			return nil, a.s.fail(err)
		}
		ss.release()
	}
	return a.s.statsResponse(), nil
}

func (a *service) Attach(ctx context.Context, req *pb.AttachRequest) (*pb.AttachResponse, error) {
	id, err := a.s.attach(req.Session, req.Path, req.Size)
	if err != nil {
		return nil, a.s.fail(err)
	}
	a.s.log.Info("region attached", "session", req.Session, "region", id, "path", req.Path, "bytes", req.Size)
	return &pb.AttachResponse{Region: id}, nil
}

func (a *service) Detach(ctx context.Context, req *pb.DetachRequest) (*pb.SessionRef, error) {
	if err := a.s.detach(req.Session, req.Region); err != nil {
		return nil, a.s.fail(err)
	}
	return &pb.SessionRef{Session: req.Session}, nil
}

// Exists answers per key; a key the pool would refuse is absent.
func (a *service) Exists(ctx context.Context, req *pb.KeysRequest) (*pb.ExistsResponse, error) {
	s := a.s
	if err := checkKeys(req.Keys); err != nil {
		return nil, s.fail(err)
	}
	ok, err := s.c.Present(ctx, req.Keys)
	if err != nil {
		return nil, s.fail(err)
	}
	n := 0
	for _, b := range ok {
		if b {
			n++
		}
	}
	s.stats.lookups.Add(1)
	s.stats.probed.Add(uint64(len(req.Keys)))
	s.stats.matched.Add(uint64(n))
	return &pb.ExistsResponse{Exists: ok}, nil
}

func (a *service) Describe(ctx context.Context, req *pb.KeysRequest) (*pb.GetReplicasResponse, error) {
	s := a.s
	if err := checkKeys(req.Keys); err != nil {
		return nil, s.fail(err)
	}
	blocks, errs := s.c.Describe(ctx, req.Keys)
	resp := &pb.GetReplicasResponse{Results: make([]*pb.ObjectReplicas, len(blocks))}
	for i, b := range blocks {
		resp.Results[i] = &pb.ObjectReplicas{Status: itemStatus(errs[i]), Size: b.Size, Checksum: b.Checksum, Replicas: b.Replicas()}
	}
	return resp, nil
}
