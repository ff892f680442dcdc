package statuspage

import (
	"bytes"
	"cmp"
	"context"
	_ "embed"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Event is one line of a master's recent events.
type Event struct {
	At   time.Time
	Kind string
	Text string
}

// Page serves the status page of one daemon. The fields it has decide the
// sections it shows; Status is required.
type Page struct {
	// Title names the daemon: "master m1", "store s1", "tidepool up".
	Title string
	// Status is the cluster as a master answers the Status call (on a
	// store, asked of its masters).
	Status func(context.Context) (*pb.StatusResponse, error)
	// Events, on a master, is its recent events, newest first.
	Events func() []Event
	// Hits, on a master, is its lookup counters since it started: the
	// block keys asked about and the blocks matched, by tier.
	Hits func() (probed uint64, matched map[string]uint64)
	// Tenants, on a master, is each tenant's lookup counters and use of
	// each tier, by name.
	Tenants func() []Tenant
	// Node, on a store, is its id: its segments come first and are marked.
	Node string
	// Rails, on a store, describes its engine's rails.
	Rails func() []engine.RailInfo
	// Refresh is how often the page reloads itself; 0 means 5 s.
	Refresh time.Duration
	Log     *slog.Logger
}

//go:embed page.html
var pageHTML string

var tmpl = template.Must(template.New("page").Funcs(template.FuncMap{
	"bytes":   formatBytes,
	"percent": func(f float64) string { return strconv.FormatFloat(100*f, 'f', 1, 64) + "%" },
	"width":   func(f float64) string { return strconv.FormatFloat(100*min(max(f, 0), 1), 'f', 2, 64) + "%" },
	"ago":     func(t time.Time) string { return time.Since(t).Round(time.Second).String() },
	"rfc3339": func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
}).Parse(pageHTML))

// Tenant is one tenant's lookup counters and use, as a master counts them.
type Tenant struct {
	Name    string
	Probed  uint64
	Matched map[string]uint64 // by tier
	Tiers   []TenantTier
}

// TenantTier is a tenant's use of one tier and its limits there (0: none).
type TenantTier struct {
	Tier                     string
	Bytes, Objects           uint64
	QuotaBytes, QuotaObjects uint64
}

// Fill is the fraction of the bytes quota used (0 without one).
func (t TenantTier) Fill() float64 { return ratio(t.Bytes, t.QuotaBytes) }

type tenantView struct {
	Tenant
	Hits *hits
}

// view is what the template renders.
type view struct {
	Title    string
	Refresh  int
	Now      time.Time
	Err      string
	Status   *pb.StatusResponse
	Tiers    []tierUsage
	Segments []segment
	Hits     *hits
	Tenants  []tenantView
	Events   []Event
	Node     string
	Rails    []engine.RailInfo
}

type tierUsage struct {
	Tier                     string
	Used, Reserved, Capacity uint64
	Segments                 int
}

// Fill and ReservedFill are the used and reserved fractions of capacity.
func (u tierUsage) Fill() float64         { return ratio(u.Used, u.Capacity) }
func (u tierUsage) ReservedFill() float64 { return ratio(u.Reserved, u.Capacity) }

type segment struct {
	*pb.SegmentInfo
	Tier  string
	Mine  bool
	State string
}

func (s segment) Fill() float64         { return ratio(s.Used, s.Capacity) }
func (s segment) ReservedFill() float64 { return ratio(s.Reserved, s.Capacity) }

// hits is the lookup counters of a master since it started.
type hits struct {
	Probed uint64
	Tiers  []tierHits
}

type tierHits struct {
	Tier    string
	Matched uint64
	Ratio   float64
}

func ratio(a, b uint64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func (p *Page) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	v := view{Title: p.Title, Refresh: max(1, int(cmp.Or(p.Refresh, 5*time.Second).Seconds())), Now: time.Now(), Node: p.Node}
	ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
	defer cancel()
	st, err := p.Status(ctx)
	if err != nil {
		v.Err = err.Error()
	} else {
		v.Status = st
		v.Tiers, v.Segments = usage(st, p.Node)
	}
	if p.Hits != nil {
		v.Hits = lookupHits(p.Hits())
	}
	if p.Tenants != nil {
		for _, t := range p.Tenants() {
			v.Tenants = append(v.Tenants, tenantView{Tenant: t, Hits: lookupHits(t.Probed, t.Matched)})
		}
	}
	if p.Events != nil {
		v.Events = p.Events()
	}
	if p.Rails != nil {
		v.Rails = p.Rails()
		slices.SortFunc(v.Rails, func(a, b engine.RailInfo) int {
			return cmp.Or(cmp.Compare(a.Peer, b.Peer), cmp.Compare(a.Addr, b.Addr))
		})
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, v); err != nil {
		if p.Log != nil {
			p.Log.Error("status page", "err", err)
		}
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(buf.Bytes())
}

// usage sums the segments by tier, fastest tier first, and orders the
// segments node's first, then by tier and name.
func usage(st *pb.StatusResponse, node string) ([]tierUsage, []segment) {
	byTier := map[string]*tierUsage{}
	rank := map[string]pb.Tier{}
	var segs []segment
	for _, s := range st.Segments {
		name := s.TierName()
		u := byTier[name]
		if u == nil {
			u = &tierUsage{Tier: name}
			byTier[name], rank[name] = u, s.Tier
		}
		u.Used += s.Used
		u.Reserved += s.Reserved
		u.Capacity += s.Capacity
		u.Segments++
		state := "alive"
		switch {
		case s.Draining:
			state = "draining"
		case !s.Alive:
			state = "dead"
		}
		segs = append(segs, segment{SegmentInfo: s, Tier: name, Mine: node != "" && s.Node == node, State: state})
	}
	var tiers []tierUsage
	for _, u := range byTier {
		tiers = append(tiers, *u)
	}
	slices.SortFunc(tiers, func(a, b tierUsage) int {
		return cmp.Or(cmp.Compare(rank[a.Tier], rank[b.Tier]), cmp.Compare(a.Tier, b.Tier))
	})
	slices.SortFunc(segs, func(a, b segment) int {
		if a.Mine != b.Mine {
			if a.Mine {
				return -1
			}
			return 1
		}
		return cmp.Or(cmp.Compare(a.SegmentInfo.Tier, b.SegmentInfo.Tier), cmp.Compare(a.Name, b.Name))
	})
	return tiers, segs
}

// lookupHits is the hit ratio of each tier's matched blocks.
func lookupHits(probed uint64, matched map[string]uint64) *hits {
	h := &hits{Probed: probed}
	for t, n := range matched {
		if t == "unlocated" {
			t = "count-only lookups (no location)"
		}
		h.Tiers = append(h.Tiers, tierHits{Tier: t, Matched: n, Ratio: ratio(n, probed)})
	}
	slices.SortFunc(h.Tiers, func(a, b tierHits) int { return cmp.Compare(a.Tier, b.Tier) })
	return h
}

// formatBytes is a count of bytes (any integer or float type) in binary
// units, one decimal: "1.5 GiB".
func formatBytes(n any) (string, error) {
	var f float64
	switch v := n.(type) {
	case uint64:
		f = float64(v)
	case int64:
		f = float64(v)
	case float64:
		f = v
	default:
		return "", fmt.Errorf("bytes of a %T", n)
	}
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	i := 0
	for ; f >= 1024 && i < len(units)-1; i++ {
		f /= 1024
	}
	if i == 0 {
		return strconv.FormatFloat(f, 'f', 0, 64) + " B", nil
	}
	return strconv.FormatFloat(f, 'f', 1, 64) + " " + units[i], nil
}
