package master

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// defaultWeights weigh a block by its fastest tier when a Score request
// sets none: llm-d's defaults for gpu (HBM) and cpu (DRAM), and less for
// SSD, which a router would otherwise rank like memory.
var defaultWeights = map[pb.Tier]float64{pb.Tier_TIER_HBM: 1.0, pb.Tier_TIER_DRAM: 0.8, pb.Tier_TIER_SSD: 0.5}

// scoreTiers are the tiers a Score answers for, fastest first.
var scoreTiers = []pb.Tier{pb.Tier_TIER_HBM, pb.Tier_TIER_DRAM, pb.Tier_TIER_SSD}

// Score answers a router: how many leading blocks of a chain the pool
// holds, per tier, and their weighted score. It reads the FSM as Lookup
// does, but leases nothing and touches nothing, so a router's questions
// change neither what is evicted nor what may be.
func (m *masterService) Score(ctx context.Context, req *pb.ScoreRequest) (*pb.ScoreResponse, error) {
	if req.Chain == nil {
		return nil, fmt.Errorf("%w: a score needs a chain", ErrInvalidRequest)
	}
	keys, err := req.Chain.ChainKeys(MaxBatchKeys)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	if err := validKeys(keys); err != nil {
		return nil, err
	}
	weights := defaultWeights
	if len(req.Weights) > 0 {
		weights = maps.Clone(defaultWeights)
		for _, w := range req.Weights {
			if !slices.Contains(scoreTiers, w.Tier) || w.Weight < 0 || math.IsInf(w.Weight, 0) || math.IsNaN(w.Weight) {
				return nil, fmt.Errorf("%w: weight %v for tier %s: want a finite weight of 0 or more for hbm, dram or ssd", ErrInvalidRequest, w.Weight, w.Tier)
			}
			weights[w.Tier] = w.Weight
		}
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	// A lookup refuses a key whose removal is in flight: so does a score.
	if n := slices.IndexFunc(keys, m.s.beingRemoved); n >= 0 {
		keys = keys[:n]
	}
	return m.s.fsm.score(keys, weights), nil
}

// score counts the leading complete blocks of keys, in all and per tier
// of the pool, and sums each matched block's best weight.
func (f *FSM) score(keys []string, weights map[pb.Tier]float64) *pb.ScoreResponse {
	f.mu.RLock()
	defer f.mu.RUnlock()
	resp := &pb.ScoreResponse{}
	var present uint8
	for _, s := range f.segments {
		present |= 1 << s.tier
	}
	var runs [8]uint32
	open := present // the tiers every block so far was in
	for _, k := range keys {
		o := f.objects.get(k)
		tiers := f.tiersOf(o)
		if tiers == 0 {
			break
		}
		resp.Matched++
		best := 0.0
		for _, t := range scoreTiers {
			if tiers&(1<<t) != 0 {
				best = max(best, weights[t])
			}
		}
		resp.Score += best
		if open &= tiers; open == 0 {
			continue
		}
		for t := range runs {
			if open&(1<<t) != 0 {
				runs[t]++
			}
		}
	}
	for _, t := range scoreTiers {
		if present&(1<<t) != 0 {
			resp.Tiers = append(resp.Tiers, &pb.TierBlocks{Tier: t, Blocks: runs[t]})
		}
	}
	return resp
}
