package integration

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"
)

// chromium runs headless Chromium (Debian's chromium) with args and
// returns its stdout.
func chromium(t *testing.T, ctx context.Context, args ...string) []byte {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium not found: apt-get install chromium (.ci/run installs it)")
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	// --no-sandbox: tests run as root here; a throwaway profile per run.
	argv := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
		"--user-data-dir=" + t.TempDir(), "--hide-scrollbars"}, args...)
	cmd := exec.CommandContext(ctx, bin, argv...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	return out
}

// attrs returns, for each element of class class in dom, its data-
// attributes.
func attrs(dom []byte, class string) []map[string]string {
	el := regexp.MustCompile(`<[a-z]+ class="` + regexp.QuoteMeta(class) + `[^"]*"([^>]*)>`)
	attr := regexp.MustCompile(`data-([a-z-]+)="([^"]*)"`)
	var out []map[string]string
	for _, m := range el.FindAllSubmatch(dom, -1) {
		a := map[string]string{}
		for _, kv := range attr.FindAllSubmatch(m[1], -1) {
			a[string(kv[1])] = string(kv[2])
		}
		out = append(out, a)
	}
	return out
}

func idValue(t *testing.T, dom []byte, id string) string {
	t.Helper()
	m := regexp.MustCompile(`id="` + id + `" data-value="([^"]*)"`).FindSubmatch(dom)
	if m == nil {
		t.Fatalf("the page has no #%s", id)
	}
	return string(m[1])
}

// TestStatusPageInChromium: the status page of a live pool, loaded by
// headless Chromium, shows what the Status call answers: the leader and
// members, the objects, every segment's usage; the lookup hit ratio and the
// leader's events; and a store's page marks its segments and shows its
// rails. A screenshot of each is saved (to $TIDEPOOL_SCREENSHOTS if set:
// docs/operations.md shows the ones in docs/).
func TestStatusPageInChromium(t *testing.T) {
	ctx := t.Context()
	u := startUp(t, ctx, t.TempDir(), "--dram", "64MiB", "--ssd", "128MiB")
	s2 := startStore(t, ctx, "s2", u.grpc, "dram:32MiB")
	c := newClient(t, u.grpc)
	var keys []string
	for i := range 12 {
		k := fmt.Sprintf("page/%02d", i)
		if err := c.Put(ctx, k, bytes.Repeat([]byte{byte(i)}, (i+1)<<18)); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
	}
	if _, err := c.Lookup(ctx, append(keys[:4:4], "page/none")); err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}

	dom := chromium(t, ctx, "--dump-dom", "http://"+u.http+"/")
	if got := idValue(t, dom, "leader"); got != st.LeaderId {
		t.Errorf("page shows leader %q, Status %q", got, st.LeaderId)
	}
	if got := idValue(t, dom, "objects"); got != strconv.FormatUint(st.Objects, 10) {
		t.Errorf("page shows %s objects, Status %d", got, st.Objects)
	}
	if got := idValue(t, dom, "bytes"); got != strconv.FormatUint(st.CompleteBytes, 10) {
		t.Errorf("page shows %s bytes, Status %d", got, st.CompleteBytes)
	}
	members := attrs(dom, "member")
	if len(members) != len(st.Members) || members[0]["id"] != st.Members[0].Id || members[0]["leader"] != "true" {
		t.Errorf("page shows members %v, Status %v", members, st.Members)
	}
	segs := map[string]map[string]string{}
	for _, a := range attrs(dom, "segment") {
		segs[a["segment"]] = a
	}
	if len(segs) != len(st.Segments) || len(segs) != 3 {
		t.Errorf("page shows %d segments, Status %d", len(segs), len(st.Segments))
	}
	for _, s := range st.Segments {
		a := segs[s.Name]
		if a == nil || a["used"] != strconv.FormatUint(s.Used, 10) || a["capacity"] != strconv.FormatUint(s.Capacity, 10) ||
			a["objects"] != strconv.FormatUint(s.Objects, 10) || a["tier"] != s.TierName() || a["node"] != s.Node {
			t.Errorf("segment %s: page %v, Status %v", s.Name, a, s)
		}
	}
	tiers := map[string]uint64{}
	for _, s := range st.Segments {
		tiers[s.TierName()] += s.Capacity
	}
	for _, a := range attrs(dom, "tier") {
		if a["capacity"] != strconv.FormatUint(tiers[a["tier"]], 10) {
			t.Errorf("tier %s: page capacity %s, Status %d", a["tier"], a["capacity"], tiers[a["tier"]])
		}
	}
	hits := attrs(dom, "hits")
	if len(hits) != 1 || hits[0]["tier"] != "dram" || hits[0]["matched"] != "4" || hits[0]["probed"] != "5" {
		t.Errorf("page shows lookup hits %v, want 4 of 5 in dram", hits)
	}
	if ev := attrs(dom, "event"); len(ev) == 0 || ev[len(ev)-1]["kind"] != "leader" {
		t.Errorf("page shows events %v, want the election last", ev)
	}

	// The second store's own page: its segment marked, its rails.
	sdom := chromium(t, ctx, "--dump-dom", "http://"+s2.http+"/")
	mine := attrs(sdom, "segment mine")
	if len(mine) != 1 || mine[0]["node"] != "s2" {
		t.Errorf("store page marks %v, want s2's segment", mine)
	}
	if !bytes.Contains(sdom, []byte("Rails of store s2")) {
		t.Error("store page has no rails section")
	}

	dir := os.Getenv("TIDEPOOL_SCREENSHOTS")
	if dir == "" {
		dir = t.TempDir()
	}
	for name, addr := range map[string]string{"status-page-master.png": u.http, "status-page-store.png": s2.http} {
		path, err := filepath.Abs(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		chromium(t, ctx, "--screenshot="+path, "--window-size=1280,1100", "http://"+addr+"/")
		png, err := os.ReadFile(path)
		if err != nil || len(png) < 10000 || !bytes.HasPrefix(png, []byte("\x89PNG")) {
			t.Fatalf("screenshot %s: %d bytes, %v", path, len(png), err)
		}
		t.Logf("screenshot of %s: %s (%d bytes)", addr, path, len(png))
	}
}
