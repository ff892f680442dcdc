package tidepoolpb

import "strings"

// Name is the tier as flags and metrics spell it: "hbm", "dram", "ssd".
func (t Tier) Name() string { return strings.ToLower(strings.TrimPrefix(t.String(), "TIER_")) }

// TierName is the segment's tier as flags spell it, "hbm-emulated" for an
// HBM tier in host memory: a store names those "hbmN-emulated", and the
// segment id is "node/name@epoch".
func (s *SegmentInfo) TierName() string {
	name, _, _ := strings.Cut(s.Name[strings.LastIndex(s.Name, "/")+1:], "@")
	if s.Tier == Tier_TIER_HBM && strings.HasSuffix(name, "-emulated") {
		return "hbm-emulated"
	}
	return s.Tier.Name()
}

// ParseTier reads a tier as Name spells it; "unspecified" is none.
func ParseTier(name string) (Tier, bool) {
	t, ok := Tier_value["TIER_"+strings.ToUpper(name)]
	return Tier(t), ok && t != int32(Tier_TIER_UNSPECIFIED)
}
