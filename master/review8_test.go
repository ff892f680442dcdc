package master

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"
	"unsafe"
	"weak"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review8Keeper is a master that keeps the keys of every lookup as
// ChainKeys returned them (views of the request), as the real master's
// slowReads and promote maps do.
type review8Keeper struct {
	pb.UnimplementedMasterServer
	mu   sync.Mutex
	kept [][]string
}

func (k *review8Keeper) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	keys, err := req.ChainKeys(MaxBatchKeys)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	k.mu.Lock()
	k.kept = append(k.kept, keys)
	k.mu.Unlock()
	return &pb.LookupResponse{Matched: uint32(len(keys))}, nil
}

// TestReview8CodecKeysOutliveBuffers: master RPCs use leaderconn's codec,
// which pools its buffers and hands them back after Unmarshal. Keys that
// ChainKeys returns as views must not point into those buffers: keys kept
// past the handler stay what they were while later, different requests
// reuse the pool (one-frame and many-frame messages both).
func TestReview8CodecKeysOutliveBuffers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	k := &review8Keeper{}
	srv := grpc.NewServer(append(leaderconn.ServerOptions(), grpc.MaxRecvMsgSize(64<<20))...)
	pb.RegisterMasterServer(srv, k)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), append(leaderconn.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	mc := pb.NewMasterClient(conn)

	var sent [][]string
	for round := range 24 {
		n := []int{8, 200, 3000}[round%3] // below pooling, one frame, many frames
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("r%02d/%05d/%s", round, i, strings.Repeat(string(rune('a'+round)), 64))
		}
		req := &pb.LookupRequest{}
		req.PackKeys(keys)
		if _, err := mc.Lookup(rpcCtx(t), req); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, keys)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for i, keys := range k.kept {
		if !slices.Equal(keys, sent[i]) {
			t.Fatalf("request %d: kept keys changed after the handler returned: %.40q", i, keys[0])
		}
	}
}

// review8Pinned runs a packed lookup of one SSD-only block followed by
// misses of big keys (about 4 MiB in all) straight into the service, and
// returns a weak pointer to the request's packed bytes.
func review8Pinned(t *testing.T, m *member, hit string) (weak.Pointer[byte], []string) {
	keys := []string{hit}
	for i := range 1000 {
		keys = append(keys, fmt.Sprintf("miss/%04d/%s", i, strings.Repeat("m", 4000)))
	}
	req := &pb.LookupRequest{}
	req.PackKeys(keys)
	resp, err := (&masterService{s: m.srv}).Lookup(rpcCtx(t), req)
	if err != nil || resp.Matched != 1 {
		t.Fatalf("lookup: %v, %v; want 1 matched", resp, err)
	}
	m.srv.mu.Lock()
	var views []string
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(req.PackedKeys)))
	hi := lo + uintptr(len(req.PackedKeys))
	for k := range m.srv.mu.slowReads {
		if p := uintptr(unsafe.Pointer(unsafe.StringData(k))); p >= lo && p < hi {
			views = append(views, k)
		}
	}
	m.srv.mu.Unlock()
	return weak.Make(&req.PackedKeys[0]), views
}

// TestReview8SlowReadsPinPackedRequest: the master keeps the keys of
// blocks served from SSD alone in slowReads (and then promote), up to
// 1<<17 of them. A kept key must be a copy, not a view of its packed
// request, or one 12-byte key would keep a 4 MiB request alive.
func TestReview8SlowReadsPinPackedRequest(t *testing.T) {
	t.Parallel()
	for _, promoteAfter := range []int{-1, 1000} { // -1: no promotion, the control
		e := newTierEnv(t, func(cfg *Config) { cfg.PromoteAfter = promoteAfter })
		m := e.m
		startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
		chainPut(t, m, 4*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD}, "slow0")

		wp, views := review8Pinned(t, m, "slow0")
		runtime.GC()
		runtime.GC()
		switch {
		case promoteAfter < 0 && wp.Value() != nil:
			t.Fatal("control: the request is alive with promotion off; the test cannot tell")
		case wp.Value() != nil:
			t.Errorf("a 4 MiB lookup request is still alive after it was answered; slowReads keys that are views of it: %q", views)
		}
	}
}

// TestReview8PackedEdgeCases: packed requests the ChainKeys tests do not
// cover, over gRPC: lengths without bytes, a count past the limit with no
// bytes at all, a key past MaxKeyLen, and non-UTF-8 keys (which match
// nothing, not fail).
func TestReview8PackedEdgeCases(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap))
	chainPut(t, m, 4*kib, nil, "e0", "e1")

	for _, tc := range []struct {
		name string
		req  *pb.LookupRequest
	}{
		{"a zero length and no bytes", &pb.LookupRequest{KeyLengths: []uint32{0}}},
		{"zero lengths past the limit", &pb.LookupRequest{KeyLengths: make([]uint32, MaxBatchKeys+1)}},
		{"a packed key past MaxKeyLen", func() *pb.LookupRequest {
			r := &pb.LookupRequest{}
			r.PackKeys([]string{strings.Repeat("k", MaxKeyLen+1)})
			return r
		}()},
		{"count only, a length past the bytes", &pb.LookupRequest{CountOnly: true, PackedKeys: []byte("e0"), KeyLengths: []uint32{3}}},
	} {
		if _, err := m.master().Lookup(rpcCtx(t), tc.req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", tc.name, err)
		}
	}

	bad := "e\xff"
	if utf8.ValidString(bad) {
		t.Fatal("test key is UTF-8")
	}
	for _, count := range []bool{false, true} {
		r := &pb.LookupRequest{CountOnly: count}
		r.PackKeys([]string{"e0", bad, "e1"})
		if resp, err := m.master().Lookup(rpcCtx(t), r); err != nil || resp.Matched != 1 {
			t.Errorf("count only %v: a non-UTF-8 key after a hit: %v, %v; want 1 matched", count, resp, err)
		}
		r.PackKeys([]string{"e0", "e1"})
		if resp, err := m.master().Lookup(rpcCtx(t), r); err != nil || resp.Matched != 2 {
			t.Errorf("count only %v: %v, %v; want 2 matched", count, resp, err)
		}
	}
}
