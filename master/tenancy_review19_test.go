package master

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Tokens of the review's pools: an admin, a store and two client tenants.
const (
	r19Admin   = "r19-admin-token-0123456789"
	r19Store   = "r19-store-token-0123456789"
	r19Master  = "r19-master-token-0123456789"
	r19TenantA = "r19-tenant-a-token-0123456789"
	r19TenantB = "r19-tenant-b-token-0123456789"
)

func r19Tokens(t testing.TB) *auth.Tokens {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokens.json")
	body := fmt.Sprintf(`{"tokens": [
	  {"name": "admin", "role": "admin", "token": %q},
	  {"name": "store", "role": "store", "token": %q},
	  {"name": "masters", "role": "master", "token": %q},
	  {"name": "a", "role": "client", "tenant": "a", "token": %q},
	  {"name": "b", "role": "client", "tenant": "b", "token": %q}
	]}`, r19Admin, r19Store, r19Master, r19TenantA, r19TenantB)
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// r19Ctx is a call context carrying token.
func r19Ctx(t testing.TB, token string) context.Context {
	return metadata.AppendToOutgoingContext(rpcCtx(t), "authorization", "Bearer "+token)
}

// r19Start is start for a master whose callers need a token: it waits for
// the admin's Status.
func r19Start(t testing.TB, cfg Config) *member {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := serve(t, cfg, ln)
	waitFor(t, 10*time.Second, "gRPC server of "+cfg.ID, func() error {
		_, err := m.master().Status(r19Ctx(t, r19Admin), &pb.StatusRequest{})
		return err
	})
	return m
}

// r19Pool is one secure master (tokens, no TLS) with one registered store
// node of one DRAM segment.
func r19Pool(t *testing.T) *member {
	t.Helper()
	c := newClusterOf(t, 1, func(cfg *Config) { cfg.Security = Security{Tokens: r19Tokens(t)} }, r19Start)
	m := c.leader()
	_, err := m.registry().Register(r19Ctx(t, r19Store), &pb.RegisterRequest{Node: "s0", Endpoint: "127.0.0.1:9",
		Segments: []*pb.SegmentSpec{{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 64 << 20}}})
	if err != nil {
		t.Fatalf("register: %v", err)
	}
	return m
}

// r19PutStart starts a put of key as token's caller.
func r19PutStart(t *testing.T, m *member, token, key string, size uint64) *pb.PutStartResult {
	t.Helper()
	r, err := m.master().PutStart(r19Ctx(t, token), &pb.PutStartRequest{Key: key, Size: size, Checksum: 1})
	if err != nil || len(r.Replicas) != 1 {
		t.Fatalf("put start %q: %v, %v", key, r, err)
	}
	return r
}

// r19Grant has tenant token end a put of key and ask for one grant of
// size bytes, as an ask or (asks false) as clients before asks did, and
// returns the grant's put id.
func r19Grant(t *testing.T, m *member, token, key string, size uint64, asks bool) uint64 {
	t.Helper()
	r := r19PutStart(t, m, token, key, size)
	req := &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{Key: key, PutId: r.PutId, Size: size, Checksum: 1}}}
	if asks {
		req.GrantAsks = []*pb.GrantAsk{{Size: size, Count: 1}}
	} else {
		req.Grants = []*pb.PutStartRequest{{Size: size}}
	}
	resp, err := m.master().BatchPutEnd(r19Ctx(t, token), req)
	if err != nil {
		t.Fatalf("batch put end %q with a grant: %v", key, err)
	}
	if c := resp.Results[0].Code; c != 0 {
		t.Fatalf("batch put end %q: %v %s", key, codes.Code(c), resp.Results[0].Message)
	}
	if len(resp.Grants) != 1 || resp.Grants[0].Count != 1 {
		t.Fatalf("asked one grant, got %v", resp.Grants)
	}
	return resp.Grants[0].FirstPutId
}

// TestReview19TenantUsesOwnGrant: a tenant's client asks for a grant and
// then publishes a put through it, as client.BatchPut does for a stream of
// puts of one shape. The grant is its own tenant's, so the put must end.
func TestReview19TenantUsesOwnGrant(t *testing.T) {
	m := r19Pool(t)
	const size = 4096
	for _, asks := range []bool{true, false} {
		id := r19Grant(t, m, r19TenantA, fmt.Sprint("first", asks), size, asks)
		resp, err := m.master().BatchPutEnd(r19Ctx(t, r19TenantA), &pb.BatchPutEndRequest{
			Items: []*pb.PutEndItem{{Key: fmt.Sprint("second", asks), PutId: id, Size: size, Checksum: 1}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if c := resp.Results[0].Code; c != 0 {
			t.Fatalf("tenant a's put through its own grant %d (asks %v): %v %q, want OK", id, asks, codes.Code(c), resp.Results[0].Message)
		}
	}
	// An ask naming another tenant is refused whole.
	r := r19PutStart(t, m, r19TenantA, "third", size)
	_, err := m.master().BatchPutEnd(r19Ctx(t, r19TenantA), &pb.BatchPutEndRequest{
		Items:     []*pb.PutEndItem{{Key: "third", PutId: r.PutId, Size: size, Checksum: 1}},
		GrantAsks: []*pb.GrantAsk{{Size: size, Count: 1, Tenant: "b"}},
	})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("an ask for another tenant's grants: %v, want PermissionDenied", err)
	}
}

// TestReview19RevokeAnotherTenantsGrant: put ids are global and
// sequential, so tenant b can name tenant a's grant; PutRevoke with an
// empty key must not give it back for b ("grants of another tenant cannot
// be ended or revoked").
func TestReview19RevokeAnotherTenantsGrant(t *testing.T) {
	m := r19Pool(t)
	const size = 4096
	id := r19Grant(t, m, r19TenantA, "first", size, true)
	resp, err := m.master().PutRevoke(r19Ctx(t, r19TenantB), &pb.KeysRequest{Keys: []string{""}, PutIds: []uint64{id}})
	if err != nil {
		t.Fatal(err)
	}
	m.srv.puts.mu.Lock()
	_, pending := m.srv.puts.pending[id]
	m.srv.puts.mu.Unlock()
	if c := resp.Results[0].Code; c == 0 || !pending {
		t.Fatalf("tenant b revoked tenant a's grant %d: item code %v %q, grant still pending: %v", id, codes.Code(c), resp.Results[0].Message, pending)
	}
}

// TestReview19PublishOverAnotherTenantsPut: a BatchPutEnd item with its
// replicas ("placed by another leader") names the segment, offset and
// reservation to publish. Tenant b learns them from its own put (the next
// put in the reservation lies one stride further), then publishes its key
// over tenant a's put while a writes it: b gets a read lease on a's bytes,
// and a's put can no longer end.
func TestReview19PublishOverAnotherTenantsPut(t *testing.T) {
	m := r19Pool(t)
	const size = 4096
	own := r19PutStart(t, m, r19TenantB, "probe", size) // b's own put: its place tells b where the next one goes
	secret := r19PutStart(t, m, r19TenantA, "secret", size)

	guess := &pb.Replica{Segment: own.Replicas[0].Segment, Offset: own.Replicas[0].Offset + size}
	resp, err := m.master().BatchPutEnd(r19Ctx(t, r19TenantB), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: "stolen", Size: size, Checksum: 1, Replicas: []*pb.Replica{guess}, Reservations: own.Reservations,
	}}})
	if err != nil {
		t.Fatal(err)
	}
	published := resp.Results[0].Code == 0
	got, err := m.master().GetReplicas(r19Ctx(t, r19TenantB), &pb.KeysRequest{Keys: []string{"stolen"}})
	if err != nil {
		t.Fatal(err)
	}
	var leased []*pb.Replica
	if got.Results[0].Status.Code == 0 {
		leased = got.Results[0].Replicas
	}
	end, err := m.master().PutEnd(r19Ctx(t, r19TenantA), &pb.KeysRequest{Keys: []string{"secret"}, PutIds: []uint64{secret.PutId}})
	if err != nil {
		t.Fatal(err)
	}
	a := secret.Replicas[0]
	for _, r := range leased {
		if r.Segment == a.Segment && r.Offset == a.Offset {
			t.Errorf("tenant b published %q over tenant a's put in flight (%s@%d) and got a read lease on it", "stolen", a.Segment, a.Offset)
		}
	}
	if published || end.Results[0].Code != 0 {
		t.Errorf("tenant b's publish with its own replicas: ok %v; tenant a's PutEnd of its put afterwards: %v %q",
			published, codes.Code(end.Results[0].Code), end.Results[0].Message)
	}
}

// TestReview19TokensOnlyClusterMembers: with --tokens and no TLS (which
// the README allows: "With --tokens or TLS on a master, every call needs a
// token or a client certificate"), the masters' own calls to each other
// (announce's AddMember, the probes of Members and AddMember) carry no
// credential, so followers never get their gRPC address recorded.
func TestReview19TokensOnlyClusterMembers(t *testing.T) {
	tokens := r19Tokens(t)
	c := newClusterOf(t, 3, func(cfg *Config) { cfg.Security = Security{Tokens: tokens, PeerToken: r19Master} }, r19Start)
	leader := c.leader()
	// What a master shows another (probes, announcements) is accepted:
	// the in-memory raft transport's addresses are no host:port, so the
	// announcements themselves cannot be checked here.
	for _, m := range c.members {
		conn, err := leaderconn.Dial([]string{m.addr}, leader.srv.peerCreds())
		if err != nil {
			t.Fatal(err)
		}
		err = conn.Do(rpcCtx(t), func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
			_, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, o...)
			return err
		})
		conn.Close()
		if err != nil {
			t.Errorf("a master's probe of %s: %v", m.srv.cfg.ID, err)
		}
	}
	// Without the master token, a cluster of masters with tokens and no
	// TLS is refused at start.
	_, err := New(Config{ID: "x", Dir: t.TempDir(), Peers: []raft.Server{{ID: "x", Address: "a:1"}, {ID: "y", Address: "b:1"}},
		Security: Security{Tokens: tokens}})
	if err == nil || !strings.Contains(err.Error(), "token") {
		t.Errorf("masters with tokens, no TLS and no master token: %v", err)
	}
}

// TestReview19AnswersNameKeysWithoutTheNamespace: "a client of tenant a
// that puts k makes a/k, sees k in every answer". The messages of item
// statuses and errors are answers too.
func TestReview19AnswersNameKeysWithoutTheNamespace(t *testing.T) {
	m := r19Pool(t)
	got, err := m.master().GetReplicas(r19Ctx(t, r19TenantA), &pb.KeysRequest{Keys: []string{"missing"}})
	if err != nil {
		t.Fatal(err)
	}
	r19PutStart(t, m, r19TenantA, "busy", 4096)
	_, again := m.master().PutStart(r19Ctx(t, r19TenantA), &pb.PutStartRequest{Key: "busy", Size: 4096})
	for what, msg := range map[string]string{
		"GetReplicas of a missing key": got.Results[0].Status.GetMessage(),
		"PutStart of a key in flight":  fmt.Sprint(again),
	} {
		if strings.Contains(msg, `"a/`) {
			t.Errorf("%s answers tenant a with its namespace's prefix: %s", what, msg)
		}
	}
}
