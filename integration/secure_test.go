package integration

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// securePool is `tidepool up --secure` with a second client tenant, "b",
// beside the development certificates' "default".
type securePool struct {
	*upProc
	certs string
	ca    *tls.Config // a client's TLS: the CA, no certificate
}

// tenantBToken is tenant b's client token, added to the tokens file.
const tenantBToken = "tenant-b-token-0123456789"

func startSecurePool(t *testing.T, ctx context.Context) *securePool {
	t.Helper()
	dir := t.TempDir()
	certs := filepath.Join(dir, "certs")
	if r := cli(t, ctx, nil, "certs", "init", certs); r.code != 0 {
		t.Fatalf("certs init: %s", r)
	}
	addTokenEntry(t, filepath.Join(certs, "tokens.json"), map[string]string{"name": "tenant-b", "role": "client", "tenant": "b", "token": tenantBToken})
	p := &securePool{certs: certs}
	p.upProc = startUp(t, ctx, dir, "--secure", "--ssd", "0", "--dram", "64MiB")
	var err error
	if p.ca, err = (auth.Files{CA: filepath.Join(certs, "ca.crt")}).ClientConfig(auth.Master); err != nil {
		t.Fatal(err)
	}
	return p
}

func addTokenEntry(t *testing.T, path string, entry map[string]string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Tokens []map[string]string `json:"tokens"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	f.Tokens = append(f.Tokens, entry)
	if b, err = json.Marshal(f); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func (p *securePool) token(t *testing.T, role string) string {
	t.Helper()
	tok, err := auth.ReadToken(filepath.Join(p.certs, role+".token"))
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// conn dials the pool's masters showing creds.
func (p *securePool) conn(t *testing.T, creds leaderconn.Credentials) *leaderconn.Conn {
	t.Helper()
	c, err := leaderconn.Dial([]string{p.grpc}, creds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// client is an SDK client showing creds to the masters and trusting the
// pool's CA at the stores.
func (p *securePool) client(t *testing.T, creds leaderconn.Credentials) *client.Client {
	t.Helper()
	storeTLS, err := (auth.Files{CA: filepath.Join(p.certs, "ca.crt")}).ClientConfig(auth.Store)
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(client.Config{Masters: []string{p.grpc}, Credentials: creds, EngineConfig: engine.Config{NoShm: true, PeerTLS: storeTLS}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestSecurePool is the acceptance line for `--secure`: no
// credential, a foreign one or one of the wrong role is refused at the
// master, the store's rails and the agent, and changes nothing; tenants
// cannot reach each other's keys.
func TestSecurePool(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := startSecurePool(t, ctx)
	admin := leaderconn.Credentials{TLS: p.ca, Token: p.token(t, "admin")}
	tenantA := leaderconn.Credentials{TLS: p.ca, Token: p.token(t, "client")}
	tenantB := leaderconn.Credentials{TLS: p.ca, Token: tenantBToken}
	p.creds = admin // for the extents check at the end

	a, b := p.client(t, tenantA), p.client(t, tenantB)
	value := []byte("tenant a's value")
	if err := a.Put(ctx, "k", value); err != nil {
		t.Fatalf("tenant a's put: %v", err)
	}
	if errs := a.BatchPutChain(ctx, "", []string{"c0", "c1"}, [][]byte{[]byte("b0"), []byte("b1")}); errors.Join(errs...) != nil {
		t.Fatalf("tenant a's chain: %v", errs)
	}
	status := func(creds leaderconn.Credentials) (*pb.StatusResponse, error) {
		var st *pb.StatusResponse
		err := p.conn(t, creds).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) (err error) {
			st, err = pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, o...)
			return err
		})
		return st, err
	}
	before, err := status(admin)
	if err != nil {
		t.Fatal(err)
	}
	seg := before.Segments[0]

	t.Run("master refuses calls without a credential", func(t *testing.T) {
		plain := p.conn(t, leaderconn.Credentials{})
		err := plain.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
			_, err := pb.NewMasterClient(cc).Exists(ctx, &pb.KeysRequest{Keys: []string{"k"}}, o...)
			return err
		})
		wantCode(t, "plaintext Exists", err, codes.Unauthenticated)
		_, err = status(leaderconn.Credentials{TLS: p.ca})
		wantCode(t, "TLS without a token", err, codes.Unauthenticated)
		_, err = status(leaderconn.Credentials{TLS: p.ca, Token: "not-a-token-of-this-pool"})
		wantCode(t, "unknown token", err, codes.Unauthenticated)
		// gRPC in plaintext to the TLS port: the connection fails.
		cc, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
		defer scancel()
		_, err = pb.NewRegistryClient(cc).Leave(sctx, &pb.HeartbeatRequest{Node: seg.Node, Epoch: seg.Epoch})
		if err == nil {
			t.Fatal("a plaintext gRPC Leave was answered")
		}
	})

	t.Run("registry and admin calls need their roles", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			creds leaderconn.Credentials
			want  codes.Code
		}{
			{"TLS without a token", leaderconn.Credentials{TLS: p.ca}, codes.Unauthenticated},
			{"client token", tenantA, codes.PermissionDenied},
			{"admin token", admin, codes.PermissionDenied}, // stores alone speak for stores
		} {
			c := p.conn(t, tc.creds)
			calls := map[string]func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error{
				"Leave": func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					_, err := pb.NewRegistryClient(cc).Leave(ctx, &pb.HeartbeatRequest{Node: seg.Node, Epoch: seg.Epoch}, o...)
					return err
				},
				"Heartbeat": func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					_, err := pb.NewRegistryClient(cc).Heartbeat(ctx, &pb.HeartbeatRequest{Node: seg.Node, Epoch: seg.Epoch}, o...)
					return err
				},
				"Register": func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					_, err := pb.NewRegistryClient(cc).Register(ctx, &pb.RegisterRequest{Node: "rogue", Endpoint: "127.0.0.1:9",
						Segments: []*pb.SegmentSpec{{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 40}}}, o...)
					return err
				},
			}
			if tc.creds != admin {
				calls["Evict"] = func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					_, err := pb.NewAdminClient(cc).Evict(ctx, &pb.EvictRequest{Prefix: ""}, o...)
					return err
				}
				calls["Pin"] = func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					_, err := pb.NewAdminClient(cc).Pin(ctx, &pb.PinRequest{Key: "k"}, o...)
					return err
				}
				calls["Drain"] = func(cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					s, err := pb.NewAdminClient(cc).Drain(ctx, &pb.DrainRequest{Node: seg.Node}, o...)
					if err == nil {
						_, err = s.Recv()
					}
					return err
				}
			}
			for name, call := range calls {
				err := c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
					return call(cc, o...)
				})
				wantCode(t, tc.name+" "+name, err, tc.want)
			}
		}
		after, err := status(admin)
		if err != nil {
			t.Fatal(err)
		}
		if len(after.Segments) != len(before.Segments) || !after.Segments[0].Alive || after.Segments[0].Epoch != seg.Epoch ||
			after.Segments[0].Draining || after.Objects != before.Objects {
			t.Errorf("refused calls changed the pool: segments %v, %d objects, before %v, %d", after.Segments, after.Objects, before.Segments, before.Objects)
		}
		got, err := a.Get(ctx, "k")
		if err != nil || string(got) != string(value) {
			t.Errorf("tenant a's value after the refused calls: %q, %v", got, err)
		}
	})

	t.Run("PutRevoke of another tenant's put is refused", func(t *testing.T) {
		var started *pb.BatchPutStartResponse
		err := p.conn(t, tenantA).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) (err error) {
			started, err = pb.NewMasterClient(cc).BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "in-flight", Size: 4096}}}, o...)
			return err
		})
		if err != nil || started.Results[0].Status.Code != 0 {
			t.Fatalf("tenant a's put start: %v %v", started, err)
		}
		id := started.Results[0].PutId
		revoke := func(creds leaderconn.Credentials, key string) (*pb.ItemsResponse, error) {
			var resp *pb.ItemsResponse
			err := p.conn(t, creds).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) (err error) {
				resp, err = pb.NewMasterClient(cc).PutRevoke(ctx, &pb.KeysRequest{Keys: []string{key}, PutIds: []uint64{id}}, o...)
				return err
			})
			return resp, err
		}
		_, err = revoke(leaderconn.Credentials{TLS: p.ca}, "in-flight")
		wantCode(t, "PutRevoke without a token", err, codes.Unauthenticated)
		for _, key := range []string{"in-flight", ""} {
			resp, err := revoke(tenantB, key)
			if err == nil && resp.Results[0].Code == 0 {
				t.Errorf("tenant b revoked tenant a's put %d naming %q", id, key)
			}
		}
		// Still tenant a's to revoke: the refused calls changed nothing.
		resp, err := revoke(tenantA, "in-flight")
		if err != nil || resp.Results[0].Code != 0 {
			t.Errorf("tenant a's own revoke after b's: %v %v", resp, err)
		}
	})

	t.Run("a client token cannot run admin commands", func(t *testing.T) {
		r := cli(t, ctx, nil, "admin", "evict", "--masters", p.grpc, "--tls-ca", filepath.Join(p.certs, "ca.crt"),
			"--token-file", filepath.Join(p.certs, "client.token"), "--prefix", "")
		if r.code == 0 || !strings.Contains(r.stderr, "may not call") {
			t.Errorf("admin evict with a client token: %s", r)
		}
		mustCLI(t, ctx, nil, "status", "--masters", p.grpc, "--tls-ca", filepath.Join(p.certs, "ca.crt"),
			"--token-file", filepath.Join(p.certs, "admin.token"))
	})

	t.Run("tenants do not see each other's keys", func(t *testing.T) {
		if _, err := b.Get(ctx, "k"); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("tenant b's get of a's key: %v, want NotFound", err)
		}
		if ok, err := b.Exists(ctx, "k"); err != nil || ok {
			t.Errorf("tenant b's exists of a's key: %v, %v", ok, err)
		}
		if objs, err := b.List(ctx, ""); err != nil || len(objs) != 0 {
			t.Errorf("tenant b lists %d objects (%v), want none", len(objs), err)
		}
		if m, err := b.Lookup(ctx, []string{"c0", "c1"}); err != nil || m.Len() != 0 {
			t.Errorf("tenant b's lookup of a's chain matched %d (%v)", m.Len(), err)
		}
		if err := b.Remove(ctx, "k"); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("tenant b's remove of a's key: %v, want NotFound", err)
		}
		if err := b.Put(ctx, "k", []byte("tenant b's own")); err != nil {
			t.Fatalf("tenant b's put of its own k: %v", err)
		}
		for _, tc := range []struct {
			c    *client.Client
			want string
		}{{a, string(value)}, {b, "tenant b's own"}} {
			if got, err := tc.c.Get(ctx, "k"); err != nil || string(got) != tc.want {
				t.Errorf("get k: %q, %v, want %q", got, err, tc.want)
			}
		}
		objs, err := a.List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, o := range objs {
			keys = append(keys, o.Key)
			if o.Tenant != "default" {
				t.Errorf("tenant a's object %q records tenant %q", o.Key, o.Tenant)
			}
		}
		if strings.Join(keys, ",") != "c0,c1,k" {
			t.Errorf("tenant a lists %v, want its own keys without a prefix", keys)
		}
		if m, err := a.Lookup(ctx, []string{"c0", "c1"}); err != nil || m.Len() != 2 {
			t.Errorf("tenant a's lookup of its chain matched %d (%v)", m.Len(), err)
		}
		// A request naming another tenant is refused.
		err = p.conn(t, tenantB).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
			_, err := pb.NewMasterClient(cc).BatchPutStart(ctx, &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "x", Size: 10, Tenant: "default"}}}, o...)
			return err
		})
		wantCode(t, "put naming another tenant", err, codes.PermissionDenied)
		// The admin sees both, each under its tenant's name.
		all, err := p.client(t, admin).List(ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		keys = keys[:0]
		for _, o := range all {
			keys = append(keys, o.Key)
		}
		if strings.Join(keys, ",") != "b/k,default/c0,default/c1,default/k" {
			t.Errorf("the admin lists %v", keys)
		}
	})

	t.Run("store rails refuse what the master did not grant", func(t *testing.T) {
		// Plaintext: the TLS handshake fails, the connection closes.
		nc, err := net.DialTimeout("tcp", p.engine, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_ = nc.SetDeadline(time.Now().Add(15 * time.Second))
		_, _ = nc.Write([]byte("plaintext request, not a TLS handshake......"))
		if _, err := nc.Read(make([]byte, 1)); err == nil {
			t.Error("the store's rail answered a plaintext request")
		}
		nc.Close()
		// TLS with the pool's CA but no ticket: the read is refused.
		storeTLS, err := (auth.Files{CA: filepath.Join(p.certs, "ca.crt")}).ClientConfig(auth.Store)
		if err != nil {
			t.Fatal(err)
		}
		e := engine.New(engine.Config{NoShm: true, PeerTLS: storeTLS})
		defer e.Close()
		bt := e.NewBatch()
		task := bt.Read(make([]byte, 16), engine.Target{Endpoint: seg.Endpoint, Segment: seg.Name}, 0, engine.Options{})
		_ = bt.Submit(ctx)
		_ = bt.Wait(ctx)
		if task.State() != engine.Failed || !errors.Is(task.Err(), engine.ErrForbidden) {
			t.Errorf("a read without a ticket: %v, %v; want refused", task.State(), task.Err())
		}
	})

	t.Run("a store without a store credential cannot register", func(t *testing.T) {
		for _, tc := range []struct{ name, want string }{
			{"client certificate", "PermissionDenied"},
			{"plaintext", "Unauthenticated"},
		} {
			http := freeAddr(t)
			args := []string{"store", "--id", "rogue", "--masters", p.grpc, "--listen", freeAddr(t), "--http", http,
				"--tier", "dram:8MiB", "--prefault=false"}
			if tc.name != "plaintext" {
				args = append(args, "--tls-ca", filepath.Join(p.certs, "ca.crt"),
					"--tls-cert", filepath.Join(p.certs, "client.crt"), "--tls-key", filepath.Join(p.certs, "client.key"))
			}
			s := startProc(t, "rogue store", args...)
			waitFor(t, 20*time.Second, func() error {
				if !strings.Contains(s.out.String(), tc.want) {
					return errors.New("no refusal logged yet")
				}
				return nil
			})
			s.term(t, 10*time.Second)
		}
		st, err := status(admin)
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Segments) != len(before.Segments) {
			t.Errorf("segments %v after the rogue stores, want %d", st.Segments, len(before.Segments))
		}
	})

	t.Run("the agent asks for its token", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "agent.sock")
		agentHTTP := freeAddr(t)
		startDaemon(t, ctx, "agent", func() ([]string, string) {
			return []string{"agent", "--socket", sock, "--masters", p.grpc, "--http", agentHTTP, "--no-shm",
				"--tls-ca", filepath.Join(p.certs, "ca.crt"), "--token-file", filepath.Join(p.certs, "client.token")}, agentHTTP
		})
		cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		ag := pb.NewAgentClient(cc)
		_, err = ag.Exists(ctx, &pb.KeysRequest{Keys: []string{"k"}})
		wantCode(t, "agent call without a token", err, codes.Unauthenticated)
		bctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tenantBToken)
		_, err = ag.Exists(bctx, &pb.KeysRequest{Keys: []string{"k"}})
		wantCode(t, "agent call with another tenant's token", err, codes.Unauthenticated)
		actx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+p.token(t, "client"))
		resp, err := ag.Exists(actx, &pb.KeysRequest{Keys: []string{"k", "c0"}})
		if err != nil || len(resp.Exists) != 2 || !resp.Exists[0] || !resp.Exists[1] {
			t.Errorf("agent exists with its token: %v, %v", resp, err)
		}
	})

	t.Run("a tenant over its quota evicts its own objects", func(t *testing.T) {
		const block = 64 << 10
		ca, tokens := filepath.Join(p.certs, "ca.crt"), filepath.Join(p.certs, "admin.token")
		mustCLI(t, ctx, nil, "admin", "quota", "set", "default", "--tier", "dram", "--bytes", "512KiB",
			"--masters", p.grpc, "--tls-ca", ca, "--token-file", tokens)
		var bKeys []string
		for i := range 4 {
			k := fmt.Sprintf("b-block-%d", i)
			if err := b.Put(ctx, k, bytes.Repeat([]byte{byte(i)}, block)); err != nil {
				t.Fatal(err)
			}
			bKeys = append(bKeys, k)
		}
		for i := range 24 {
			if err := a.Put(ctx, fmt.Sprintf("a-block-%d", i), bytes.Repeat([]byte{byte(i)}, block)); err != nil {
				t.Fatalf("tenant a's put %d under its quota: %v", i, err)
			}
		}
		objs, err := a.List(ctx, "a-block-")
		if err != nil {
			t.Fatal(err)
		}
		if len(objs) > 8 || len(objs) == 0 {
			t.Errorf("tenant a holds %d blocks of 64 KiB under a 512 KiB quota", len(objs))
		}
		if _, err := a.Get(ctx, "a-block-23"); err != nil {
			t.Errorf("tenant a's newest block: %v", err)
		}
		for _, k := range bKeys {
			if got, err := b.Get(ctx, k); err != nil || len(got) != block {
				t.Errorf("tenant b's %s after a's evictions: %d bytes, %v", k, len(got), err)
			}
		}
		r := mustCLI(t, ctx, nil, "admin", "quota", "--masters", p.grpc, "--tls-ca", ca, "--token-file", tokens)
		if !strings.Contains(string(r.stdout), "default") || !strings.Contains(string(r.stdout), "524288") {
			t.Errorf("admin quota lists:\n%s", r.stdout)
		}
		if n, err := counter(p.http, "tidepool_tenant_evictions_total", `tenant="default"`, `reason="quota"`); err != nil || n == 0 {
			t.Errorf("tidepool_tenant_evictions_total of tenant default for its quota: %v (%v)", n, err)
		}
		if n, err := counter(p.http, "tidepool_tenant_evictions_total", `tenant="b"`); err == nil && n > 0 {
			t.Errorf("tenant b lost %v objects to evictions", n)
		}
	})

	t.Run("the status page shows each tenant", func(t *testing.T) {
		dom := chromium(t, ctx, "--dump-dom", "http://"+p.http+"/")
		tenants := map[string]map[string]string{}
		for _, a := range attrs(dom, "tenant") {
			tenants[a["tenant"]] = a
		}
		if tenants["default"] == nil || tenants["b"] == nil {
			t.Fatalf("the page's tenants: %v\n%s", tenants, dom)
		}
		if tenants["default"]["probed"] == "0" {
			t.Errorf("tenant default's lookups not counted: %v", tenants["default"])
		}
		var usage *pb.QuotasResponse
		err := p.conn(t, admin).Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) (err error) {
			usage, err = pb.NewAdminClient(cc).Quotas(ctx, &pb.QuotasRequest{}, o...)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		shown := map[string]map[string]string{}
		for _, a := range attrs(dom, "tenant-use") {
			shown[a["tier"]+"/"+a["objects"]+"/"+a["bytes"]+"/"+a["quota-bytes"]] = a
		}
		for _, u := range usage.Tenants {
			k := fmt.Sprintf("%s/%d/%d/%d", u.Tier.Name(), u.Objects, u.Bytes, u.QuotaBytes)
			if shown[k] == nil {
				t.Errorf("tenant %s's use %s is not on the page (%v)", u.Tenant, k, shown)
			}
		}
		if dir := os.Getenv("TIDEPOOL_SCREENSHOTS"); dir != "" {
			path, err := filepath.Abs(filepath.Join(dir, "status-page-tenants.png"))
			if err != nil {
				t.Fatal(err)
			}
			chromium(t, ctx, "--screenshot="+path, "--window-size=1280,1300", "http://"+p.http+"/")
		}
	})

	t.Run("the tokens file is read again on SIGHUP", func(t *testing.T) {
		const tenantC = "tenant-c-token-0123456789"
		c := leaderconn.Credentials{TLS: p.ca, Token: tenantC}
		if _, err := status(c); err == nil {
			t.Fatal("tenant c's token works before it is in the file")
		}
		addTokenEntry(t, filepath.Join(p.certs, "tokens.json"), map[string]string{"name": "tenant-c", "role": "client", "tenant": "c", "token": tenantC})
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, func() error { _, err := status(c); return err })
		if !strings.Contains(p.out.String(), "tokens file reloaded") {
			t.Error("the reload is not logged")
		}
	})

	// Refusals are logged, never with the token that was refused.
	for _, secret := range []string{"not-a-token-of-this-pool", tenantBToken} {
		if strings.Contains(p.out.String(), secret) {
			t.Errorf("the master's log holds a token: %q", secret)
		}
	}
	if !strings.Contains(p.out.String(), "refused a call") {
		t.Error("no refusal was logged")
	}
	if n, err := counter(p.http, "tidepool_auth_refused_total", `reason="tls"`); err != nil || n == 0 {
		t.Errorf("tidepool_auth_refused_total{reason=\"tls\"} %v (%v), want the plaintext connections counted", n, err)
	}
	if n, err := counter(p.http, "tidepool_auth_refused_total"); err != nil || n == 0 {
		t.Errorf("tidepool_auth_refused_total %v (%v), want refusals counted", n, err)
	}
}
