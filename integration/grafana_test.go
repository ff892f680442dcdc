package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// dashboardMetrics is every metric name a query of the Grafana dashboard
// reads, a histogram's _bucket, _sum and _count named by its family.
func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy/grafana/tidepool.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("deploy/grafana/tidepool.json: %v", err)
	}
	name := regexp.MustCompile(`\btidepool_[a-z0-9_]+`)
	var names []string
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			for _, n := range name.FindAllString(tg.Expr, -1) {
				names = append(names, strings.TrimSuffix(n, "_bucket"))
			}
		}
	}
	slices.Sort(names)
	if names = slices.Compact(names); len(names) < 20 {
		t.Fatalf("the dashboard queries %d metrics: %q", len(names), names)
	}
	return names
}

func scrape(addr string) (string, error) {
	resp, err := httpClient.Get("http://" + addr + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// exported reports whether text, a /metrics answer, has a sample of name.
func exported(text, name string) bool {
	for line := range strings.Lines(text) {
		if rest, ok := strings.CutPrefix(line, name); ok && len(rest) > 0 && (rest[0] == '{' || rest[0] == ' ' || strings.HasPrefix(rest, "_bucket")) {
			return true
		}
	}
	return false
}

// TestGrafanaDashboard: every metric deploy/grafana/tidepool.json queries
// is one a live pool exports (a master and a store in `tidepool up`, and a
// node agent moving bytes over TCP) once it has served what the panels
// show: puts past DRAM into SSD and out of it (demotions, evictions),
// gets, lookups, refusals, the agent's lookups, puts and gets, a tenant's
// calls and quota (the pool is --secure, so its client is a tenant's).
// And Debian's promtool finds nothing to fault in each daemon's /metrics.
func TestGrafanaDashboard(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: apt-get install prometheus (.ci/run installs it)")
	}
	want := dashboardMetrics(t)
	ctx := t.Context()
	dir := t.TempDir()
	u := startUp(t, ctx, dir, "--dram", "32MiB", "--ssd", "96MiB", "--lease-ttl", "1s", "--secure")
	p := &securePool{upProc: u, certs: filepath.Join(dir, "certs")}
	if p.ca, err = (auth.Files{CA: filepath.Join(p.certs, "ca.crt")}).ClientConfig(auth.Master); err != nil {
		t.Fatal(err)
	}
	admin := leaderconn.Credentials{TLS: p.ca, Token: p.token(t, "admin")}
	tenant := leaderconn.Credentials{TLS: p.ca, Token: p.token(t, "client")}
	u.creds = admin
	sock := filepath.Join(t.TempDir(), "agent.sock")
	agentHTTP := freeAddr(t)
	startDaemon(t, ctx, "agent", func() ([]string, string) {
		return []string{"agent", "--socket", sock, "--masters", u.grpc, "--http", agentHTTP, "--no-shm",
			"--tls-ca", filepath.Join(p.certs, "ca.crt"), "--token-file", filepath.Join(p.certs, "client.token")}, agentHTTP
	})
	// A quota well above what the tenant puts in DRAM, so the gauges are
	// there and no put waits on it.
	mustCLI(t, ctx, nil, "admin", "quota", "set", "default", "--tier", "dram", "--bytes", "1GiB", "--masters", u.grpc,
		"--tls-ca", filepath.Join(p.certs, "ca.crt"), "--token-file", filepath.Join(p.certs, "admin.token"))

	c := p.client(t, tenant)
	value := bytes.Repeat([]byte{7}, 1<<20)
	var chain []string
	for i := range 160 { // 160 MiB into 128: demotions to SSD, evictions from it
		k := fmt.Sprintf("dash/%03d", i)
		if err := c.Put(ctx, k, value); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
		chain = append(chain, k)
	}
	last := chain[len(chain)-8:]
	for _, k := range last {
		if _, err := c.Get(ctx, k); err != nil {
			t.Fatalf("get %s: %v", k, err)
		}
	}
	if _, err := c.Get(ctx, "dash/none"); err == nil {
		t.Fatal("get of a missing key succeeded")
	}
	if _, err := c.Lookup(ctx, append(slices.Clone(last), "dash/none")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.BatchExists(ctx, last); err != nil {
		t.Fatal(err)
	}
	// A put the master refuses at placement.
	if err := p.conn(t, tenant).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
		_, err := pb.NewMasterClient(cc).BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "dash/huge", Size: 1 << 40}}}, o...)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	// The agent: a session, puts from its region, gets into it, lookups.
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	ag := pb.NewAgentClient(cc)
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+p.token(t, "client"))
	open, err := ag.Open(ctx, &pb.OpenRequest{Client: "dashboard", ShmBytes: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"dash/agent/0", "dash/agent/1"}
	spans := []*pb.Span{{Offset: 0, Length: 1 << 20}, {Offset: 1 << 20, Length: 1 << 20}}
	if _, err := ag.BatchPut(ctx, &pb.AgentPutRequest{Session: open.Session, Keys: keys, Spans: spans}); err != nil {
		t.Fatal(err)
	}
	if _, err := ag.Lookup(ctx, &pb.LookupRequest{Keys: keys}); err != nil {
		t.Fatal(err)
	}
	if _, err := ag.BatchGet(ctx, &pb.AgentGetRequest{Session: open.Session, Keys: keys, Spans: spans}); err != nil {
		t.Fatal(err)
	}

	var texts map[string]string
	waitFor(t, 60*time.Second, func() error {
		texts = map[string]string{}
		for _, addr := range []string{u.http, agentHTTP} {
			txt, err := scrape(addr)
			if err != nil {
				return err
			}
			texts[addr] = txt
		}
		var missing []string
		for _, name := range want {
			if !exported(texts[u.http], name) && !exported(texts[agentHTTP], name) {
				missing = append(missing, name)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("the dashboard queries metrics the pool does not export: %q", missing)
		}
		return nil
	})
	t.Logf("the dashboard's %d metrics are all exported", len(want))
	for addr, txt := range texts {
		cmd := exec.Command(promtool, "check", "metrics")
		cmd.Stdin = strings.NewReader(txt)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool check metrics on http://%s/metrics: %v\n%s", addr, err, out)
		}
	}
}
