package statuspage

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func status(context.Context) (*pb.StatusResponse, error) {
	return &pb.StatusResponse{
		LeaderId: "m1", LeaderAddress: "10.0.0.1:50051", RaftTerm: 3, RaftCommitIndex: 42, Objects: 7, CompleteBytes: 3 << 20,
		Members: []*pb.MemberInfo{{Id: "m1", Address: "10.0.0.1:50051", Leader: true}, {Id: "m2", RaftAddress: "10.0.0.2:50052"}},
		Segments: []*pb.SegmentInfo{
			{Name: "s1/dram0@1", Node: "s1", Tier: pb.Tier_TIER_DRAM, Capacity: 4 << 20, Used: 1 << 20, Objects: 2, Alive: true},
			{Name: "s1/ssd0@1", Node: "s1", Tier: pb.Tier_TIER_SSD, Capacity: 8 << 20, Used: 2 << 20, Objects: 5, Alive: true},
			{Name: "s2/dram0@4", Node: "s2", Tier: pb.Tier_TIER_DRAM, Capacity: 4 << 20, Draining: true, Alive: true},
			{Name: "s3/hbm0-emulated@1", Node: "s3", Tier: pb.Tier_TIER_HBM, Capacity: 1 << 20},
		},
	}, nil
}

func render(t *testing.T, p *Page) string {
	t.Helper()
	rec := httptest.NewRecorder()
	p.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "text/html; charset=utf-8" {
		t.Fatalf("status page: %d %q\n%s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
	}
	body := rec.Body.String()
	// It loads nothing from elsewhere: no scripts, stylesheets, images.
	for _, bad := range []string{"<script", "<link", "src=", "@import", "url("} {
		if strings.Contains(body, bad) {
			t.Fatalf("the page has %q", bad)
		}
	}
	return body
}

func wantAll(t *testing.T, body string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(body, w) {
			t.Errorf("page lacks %q", w)
		}
	}
}

// TestMasterPage: members, usage by tier and segment, hit ratios and
// events, each number with its exact value in a data- attribute.
func TestMasterPage(t *testing.T) {
	hits := func() (uint64, map[string]uint64) {
		return 200, map[string]uint64{"dram": 150, "ssd": 10, "unlocated": 4}
	}
	at := time.Now().Add(-90 * time.Second)
	body := render(t, &Page{Title: "master m1", Status: status, Hits: hits, Refresh: 7 * time.Second,
		Events: func() []Event { return []Event{{At: at, Kind: "drain", Text: "draining store s2: 0 replicas"}} }})
	wantAll(t, body,
		`<meta http-equiv="refresh" content="7">`,
		`id="leader" data-value="m1"`, `id="objects" data-value="7"`, `id="bytes" data-value="3145728">3.0 MiB`,
		`class="member" data-id="m1" data-leader="true"`, `class="member" data-id="m2" data-leader="false"`, "not known yet",
		`class="tier" data-tier="dram" data-used="1048576" data-reserved="0" data-capacity="8388608"`,
		`class="tier" data-tier="ssd" data-used="2097152"`, `data-tier="hbm-emulated"`,
		`data-segment="s1/dram0@1" data-node="s1" data-tier="dram" data-state="alive" data-used="1048576"`,
		`data-segment="s2/dram0@4" data-node="s2" data-tier="dram" data-state="draining"`,
		`data-segment="s3/hbm0-emulated@1" data-node="s3" data-tier="hbm-emulated" data-state="dead"`,
		`style="width: 25.00%"`, // s1's DRAM: 1 of 4 MiB
		`class="hits" data-tier="dram" data-matched="150" data-probed="200"`, "75.0%",
		`class="hits" data-tier="count-only lookups (no location)" data-matched="4"`,
		`class="event" data-kind="drain"`, "1m30s ago", "draining store s2",
	)
	// The tiers come fastest first.
	if h, d, s := strings.Index(body, `data-tier="hbm-emulated" data-used`), strings.Index(body, `data-tier="dram" data-used`), strings.Index(body, `data-tier="ssd" data-used`); !(h < d && d < s) {
		t.Errorf("tiers out of order: hbm %d, dram %d, ssd %d", h, d, s)
	}
	if strings.Contains(body, "Rails of store") {
		t.Error("a master's page shows rails")
	}
}

// TestStorePage: the store's own segments first and marked, and its rails.
func TestStorePage(t *testing.T) {
	body := render(t, &Page{Title: "store s2", Status: status, Node: "s2", Rails: func() []engine.RailInfo {
		return []engine.RailInfo{{Peer: "10.0.0.9:50061", Addr: "10.0.0.2:50061", State: "paused", Errors: 3, InflightBytes: 1 << 20, Bandwidth: 2.5e9}}
	}})
	wantAll(t, body, `class="segment mine" data-segment="s2/dram0@4"`, "Rails of store s2",
		`class="rail" data-peer="10.0.0.9:50061" data-rail="10.0.0.2:50061" data-state="paused" data-errors="3"`, "1.0 MiB", "2.3 GiB/s")
	if strings.Index(body, `data-segment="s2/dram0@4"`) > strings.Index(body, `data-segment="s1/dram0@1"`) {
		t.Error("the store's own segment is not first")
	}
	empty := render(t, &Page{Title: "store s2", Status: status, Node: "s2", Rails: func() []engine.RailInfo { return nil }})
	wantAll(t, empty, "No rails yet")
}

// TestPageWithoutMaster: a failed Status is shown, not a broken page.
func TestPageWithoutMaster(t *testing.T) {
	body := render(t, &Page{Title: "store s1", Node: "s1", Status: func(context.Context) (*pb.StatusResponse, error) {
		return nil, errors.New("no master leader reachable at [10.0.0.1:50051]")
	}})
	wantAll(t, body, `id="error"`, "Cannot reach a master: no master leader reachable at [10.0.0.1:50051]")
}
