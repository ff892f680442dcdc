package tiers

import (
	"fmt"
	"strings"

	"github.com/tidepool-kv/tidepool/engine"
)

// Kind is the storage medium of a tier.
type Kind int

const (
	HBM Kind = iota + 1
	DRAM
	SSD
)

func (k Kind) String() string {
	switch k {
	case HBM:
		return "hbm"
	case DRAM:
		return "dram"
	case SSD:
		return "ssd"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// Tier is one storage medium of a store node.
//
// Implementations must be safe for concurrent use: the engine serves many
// reads and writes of disjoint ranges at once.
type Tier interface {
	Kind() Kind
	// Name is unique on the node, for example "dram0".
	Name() string
	Capacity() int64
	// Segment exposes the tier's bytes to the transfer engine.
	Segment() engine.Segment
	Close() error
}

// ParseSize parses a byte size such as "512MiB", "8GiB", "1G" or "4096".
func ParseSize(s string) (int64, error) {
	units := []struct {
		suffix string
		mult   int64
	}{
		{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
		{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1},
	}
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSuffix(t, u.suffix), u.mult
			break
		}
	}
	var n int64
	if _, err := fmt.Sscanf(t, "%d", &n); err != nil || n <= 0 || fmt.Sprint(n) != t {
		return 0, fmt.Errorf("invalid size %q: want a positive number with an optional unit (KiB, MiB, GiB, TiB)", s)
	}
	if n > (1<<62)/mult {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	return n * mult, nil
}
