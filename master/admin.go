package master

import (
	"context"
	"fmt"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// adminService is the operators' service: pins and eviction on demand.
type adminService struct {
	pb.UnimplementedAdminServer
	s *Server
}

func (a *adminService) Pin(ctx context.Context, req *pb.PinRequest) (*pb.ItemsResponse, error) {
	if err := validKey(req.Key); err != nil {
		return nil, err
	}
	cmd := &pb.PinCmd{Key: req.Key, Hard: req.Hard}
	if !req.Hard {
		ttl := time.Duration(req.TtlMs) * time.Millisecond
		switch {
		case req.TtlMs == 0:
			ttl = DefaultSoftPinTTL
		case req.TtlMs > uint64(MaxSoftPinTTL/time.Millisecond):
			return nil, fmt.Errorf("%w: soft pin of %v exceeds the %v limit (pin hard instead)", ErrInvalidRequest, ttl, MaxSoftPinTTL)
		}
		cmd.SoftUntilUnixNano = a.s.cfg.Now().Add(ttl).UnixNano()
	}
	return a.pin(ctx, cmd)
}

func (a *adminService) Unpin(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	resp := &pb.ItemsResponse{}
	for _, k := range req.Keys {
		r, err := a.pin(ctx, &pb.PinCmd{Key: k, Unpin: true})
		if err != nil {
			return nil, err
		}
		resp.Results = append(resp.Results, r.Results...)
	}
	return resp, nil
}

func (a *adminService) pin(ctx context.Context, cmd *pb.PinCmd) (*pb.ItemsResponse, error) {
	out, err := a.s.apply(ctx, &pb.Command{Op: &pb.Command_Pin{Pin: cmd}})
	if err != nil {
		return nil, err
	}
	return itemsResponse(out.([]error)), nil
}

// Evict removes what the filters select; a dry run selects the same and
// changes nothing.
func (a *adminService) Evict(ctx context.Context, req *pb.EvictRequest) (*pb.EvictResponse, error) {
	if err := a.s.leaderOnly(); err != nil {
		return nil, err
	}
	if err := validTier(req.Tier); err != nil {
		return nil, err
	}
	now := a.s.cfg.Now()
	victims, allowSoft, skipped, err := a.s.adminVictims(req, now)
	if err != nil {
		return nil, err
	}
	keys := make([]string, len(victims))
	for i, v := range victims {
		keys[i] = v.key
	}
	resp := &pb.EvictResponse{Objects: a.s.fsm.infos(keys), Skipped: uint64(skipped)}
	if req.DryRun {
		for _, o := range resp.Objects {
			resp.Bytes += o.Size
		}
		return resp, nil
	}
	n, bytes, err := a.s.evictObjects(ctx, victims, allowSoft, "admin", "any")
	if err != nil {
		return nil, err
	}
	if n < len(resp.Objects) {
		// Some became protected or went away between selection and apply.
		resp.Skipped += uint64(len(resp.Objects) - n)
		gone := map[string]bool{}
		for _, o := range a.s.fsm.infos(keys) {
			gone[o.Key] = false
		}
		kept := resp.Objects[:0]
		for _, o := range resp.Objects {
			if _, still := gone[o.Key]; !still {
				kept = append(kept, o)
			}
		}
		resp.Objects = kept
	}
	resp.Bytes = bytes
	return resp, nil
}
