package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/client/agent"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestAgent runs the Python side's flows on one agent: put a chain from
// the region, look it up, count it, read it back into other spans, remove
// and clear.
func TestAgent(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("test", 4<<20)

	const blocks, size = 8, 16 << 10
	keys := make([]string, blocks)
	puts := make([]*pb.Span, blocks)
	gets := make([]*pb.Span, blocks)
	for i := range keys {
		keys[i] = fmt.Sprintf("chain/%02d", i)
		puts[i] = &pb.Span{Offset: uint64(i * size), Length: size}
		gets[i] = &pb.Span{Offset: uint64((blocks + 2*i) * size), Length: size + 100} // room to spare
		copy(r.mem[i*size:], value(uint64(i), size))
	}

	t.Run("PutChain", func(t *testing.T) {
		resp, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: keys, Spans: puts, Chain: true})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK)
		// Putting them again succeeds: objects are immutable.
		resp, err = f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: keys[:2], Spans: puts[:2], Chain: true})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK)
		// The master recorded the links.
		objs, err := f.cl.List(ctx, keys[3])
		if err != nil || len(objs) != 1 {
			t.Fatalf("List(%s) = %v, %v", keys[3], objs, err)
		}
	})

	t.Run("Lookup", func(t *testing.T) {
		missing := append(append([]string{}, keys...), "chain/missing-a", "chain/missing-b")
		holed := append(append([]string{}, keys[:5]...), "chain/hole")
		holed = append(holed, keys[6:]...)
		for _, tc := range []struct {
			name  string
			chain []string
			want  int
		}{
			{"whole", keys, blocks},
			{"tail missing", missing, blocks},
			{"hole", holed, 5},
			{"head missing", []string{"chain/none", keys[0]}, 0},
		} {
			resp, err := f.ac.Lookup(ctx, &pb.LookupRequest{Keys: tc.chain})
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			if int(resp.Matched) != tc.want {
				t.Fatalf("%s: matched %d, want %d", tc.name, resp.Matched, tc.want)
			}
			checkColumns(t, resp, size)
			if tc.want > 0 && resp.LeaseTtlMs == 0 {
				t.Fatalf("%s: no lease", tc.name)
			}
			packed := &pb.LookupRequest{}
			packed.PackKeys(tc.chain)
			if p, err := f.ac.Lookup(ctx, packed); err != nil || p.Matched != resp.Matched {
				t.Fatalf("%s: packed lookup = %v, %v; want %d matched", tc.name, p, err, resp.Matched)
			}
			count, err := f.ac.Lookup(ctx, &pb.LookupRequest{Keys: tc.chain, CountOnly: true})
			if err != nil || int(count.Matched) != tc.want || len(count.Sizes) != 0 {
				t.Fatalf("%s: count-only lookup = %v, %v; want %d and no columns", tc.name, count, err, tc.want)
			}
			ex, err := f.ac.BatchExists(ctx, &pb.KeysRequest{Keys: tc.chain})
			if err != nil || int(ex.Count) != tc.want {
				t.Fatalf("%s: BatchExists = %v, %v; want %d", tc.name, ex, err, tc.want)
			}
		}
	})

	t.Run("Get", func(t *testing.T) {
		// The lookups above leased the chain: these reads use the lease.
		leased := f.metric("tidepool_agent_leased_gets_total")
		clear(r.mem[blocks*size:])
		resp, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: keys, Spans: gets})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK)
		for i := range keys {
			at := (blocks + 2*i) * size
			if resp.Sizes[i] != size || !bytes.Equal(r.mem[at:at+size], value(uint64(i), size)) {
				t.Fatalf("block %d: %d bytes that differ from the value put", i, resp.Sizes[i])
			}
			if r.mem[at+size] != 0 {
				t.Fatalf("block %d: written past the value", i)
			}
		}
		if got := f.metric("tidepool_agent_leased_gets_total"); got != leased+blocks {
			t.Fatalf("leased gets went from %v to %v, want +%d", leased, got, blocks)
		}
	})

	t.Run("GetUnleased", func(t *testing.T) {
		// Plain puts, never looked up: the reads ask the master.
		k := []string{"plain/a", "plain/b"}
		sp := []*pb.Span{{Offset: 0, Length: 1000}, {Offset: 1000, Length: 3000}}
		copy(r.mem, value(50, 4000))
		resp, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: k, Spans: sp})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK)
		leased := f.metric("tidepool_agent_leased_gets_total")
		dst := []*pb.Span{{Offset: 1 << 20, Length: 3000}, {Offset: 2 << 20, Length: 3000}}
		got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: k, Spans: dst})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, got.Results, codes.OK)
		want := value(50, 4000)
		if got.Sizes[0] != 1000 || got.Sizes[1] != 3000 ||
			!bytes.Equal(r.mem[1<<20:1<<20+1000], want[:1000]) || !bytes.Equal(r.mem[2<<20:2<<20+3000], want[1000:]) {
			t.Fatalf("sizes %v, or the bytes differ", got.Sizes)
		}
		if f.metric("tidepool_agent_leased_gets_total") != leased {
			t.Fatal("a get of keys never looked up used a lease")
		}
	})

	t.Run("GetErrors", func(t *testing.T) {
		short := &pb.Span{Offset: 0, Length: size - 1}
		resp, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id,
			Keys: []string{keys[0], "plain/b", "nope", "", keys[1], keys[2], keys[3]},
			Spans: []*pb.Span{
				short,                                 // leased, too short
				{Offset: size, Length: 10},            // from the master, too short
				{Offset: size + 16, Length: 10},       // missing
				{Offset: size + 32, Length: 10},       // empty key
				{Offset: r.size - 10, Length: 11},     // past the end
				{Offset: math.MaxUint64, Length: 2},   // offset overflows
				{Offset: r.size - size, Length: size}, // fine: the last bytes
			}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OutOfRange, codes.OutOfRange, codes.NotFound, codes.InvalidArgument,
			codes.InvalidArgument, codes.InvalidArgument, codes.OK)
		if resp.Sizes[0] != 0 || resp.Sizes[6] != size {
			t.Fatalf("sizes %v", resp.Sizes)
		}
	})

	t.Run("PutErrors", func(t *testing.T) {
		resp, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id,
			Keys:  []string{"bad/a", "bad/b", "", "bad/d", "bad/e"},
			Spans: []*pb.Span{{Offset: r.size, Length: 1}, {Offset: 0, Length: 0}, {Offset: 0, Length: 1}, {Offset: 1, Length: math.MaxUint64}, {Offset: 0, Length: 5}},
			Chain: true, Parent: keys[blocks-1]})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.InvalidArgument, codes.InvalidArgument, codes.InvalidArgument, codes.InvalidArgument, codes.OK)
		// The good one is stored; the refused ones are not.
		objs, err := f.cl.List(ctx, "bad/")
		if err != nil || len(objs) != 1 || objs[0].Key != "bad/e" {
			t.Fatalf("List(bad/) = %v, %v", objs, err)
		}
	})

	t.Run("Remove", func(t *testing.T) {
		resp, err := f.ac.Remove(ctx, &pb.KeysRequest{Keys: []string{keys[blocks-1], "nope", ""}})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, resp.Results, codes.OK, codes.NotFound, codes.InvalidArgument)
		ex, err := f.ac.BatchExists(ctx, &pb.KeysRequest{Keys: keys})
		if err != nil || ex.Count != blocks-1 {
			t.Fatalf("BatchExists after removing the last block = %v, %v", ex, err)
		}
		// The removed block was leased, but a get must not return it.
		got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: keys[blocks-1:], Spans: gets[blocks-1:]})
		if err != nil {
			t.Fatal(err)
		}
		checkItems(t, got.Results, codes.NotFound)
	})

	t.Run("Clear", func(t *testing.T) {
		resp, err := f.ac.Clear(ctx, &pb.ClearRequest{Prefix: "chain/"})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Removed != blocks-1 {
			t.Fatalf("Clear removed %d, want %d", resp.Removed, blocks-1)
		}
		if ex, err := f.ac.BatchExists(ctx, &pb.KeysRequest{Keys: keys}); err != nil || ex.Count != 0 {
			t.Fatalf("BatchExists after Clear = %v, %v", ex, err)
		}
		if objs, err := f.cl.List(ctx, "plain/"); err != nil || len(objs) != 2 {
			t.Fatalf("Clear(chain/) touched plain/: %v, %v", objs, err)
		}
		if resp, err := f.ac.Clear(ctx, &pb.ClearRequest{Prefix: "chain/"}); err != nil || resp.Removed != 0 {
			t.Fatalf("second Clear = %v, %v", resp, err)
		}
	})

	t.Run("Stats", func(t *testing.T) {
		st, err := f.ac.Stats(ctx, &pb.SessionRef{Session: r.id})
		if err != nil {
			t.Fatal(err)
		}
		if st.Sessions != 1 || st.Lookups == 0 || st.BlocksProbed < st.BlocksMatched || st.BlocksMatched == 0 ||
			st.Gets < blocks+2 || st.GetBytes < blocks*size || st.Puts < blocks || st.PutBytes < blocks*size || st.Errors == 0 {
			t.Fatalf("stats %v", st)
		}
		for name, want := range map[string]uint64{
			"tidepool_agent_lookups_total": st.Lookups, "tidepool_agent_blocks_probed_total": st.BlocksProbed,
			"tidepool_agent_blocks_matched_total": st.BlocksMatched, "tidepool_agent_gets_total": st.Gets,
			"tidepool_agent_get_bytes_total": st.GetBytes, "tidepool_agent_puts_total": st.Puts,
			"tidepool_agent_put_bytes_total": st.PutBytes, "tidepool_agent_errors_total": st.Errors,
			"tidepool_agent_sessions": 1, "tidepool_agent_session_bytes": r.size,
		} {
			if got := f.metric(name); got != float64(want) {
				t.Errorf("%s = %v, want %d", name, got, want)
			}
		}
	})
}

// TestAgentRefusals checks that bad requests fail cleanly, with the right
// code, and change nothing.
func TestAgentRefusals(t *testing.T) {
	f := newFixture(t, agent.Config{MaxSessionBytes: 1 << 20})
	ctx := testCtx(t)
	r := f.open("test", 1<<20)
	unknown := r.id + 1
	span := []*pb.Span{{Offset: 0, Length: 10}}

	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
		msg  string
	}{
		{"open empty", func() error { _, err := f.ac.Open(ctx, &pb.OpenRequest{}); return err }, codes.InvalidArgument, "shm_bytes 0"},
		{"open too large", func() error { _, err := f.ac.Open(ctx, &pb.OpenRequest{ShmBytes: 1<<20 + 1}); return err }, codes.InvalidArgument, "want 1 to 1048576"},
		{"get unknown session", func() error {
			_, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: unknown, Keys: []string{"k"}, Spans: span})
			return err
		}, codes.NotFound, fmt.Sprintf("unknown session %d (closed or idle too long)", unknown)},
		{"put unknown session", func() error {
			_, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: unknown, Keys: []string{"k"}, Spans: span})
			return err
		}, codes.NotFound, "unknown session"},
		{"close unknown session", func() error { _, err := f.ac.Close(ctx, &pb.SessionRef{Session: unknown}); return err }, codes.NotFound, "unknown session"},
		{"stats unknown session", func() error { _, err := f.ac.Stats(ctx, &pb.SessionRef{Session: unknown}); return err }, codes.NotFound, "unknown session"},
		{"get no keys", func() error { _, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id}); return err }, codes.InvalidArgument, "no keys"},
		{"put no keys", func() error { _, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id}); return err }, codes.InvalidArgument, "no keys"},
		{"get spans mismatch", func() error {
			_, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{"a", "b"}, Spans: span})
			return err
		}, codes.InvalidArgument, "2 keys but 1 spans"},
		{"put spans mismatch", func() error {
			_, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: []string{"a"}})
			return err
		}, codes.InvalidArgument, "1 keys but 0 spans"},
		{"put parent without chain", func() error {
			_, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: []string{"a"}, Spans: span, Parent: "p"})
			return err
		}, codes.InvalidArgument, "parent without chain"},
		{"put long parent", func() error {
			_, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: []string{"a"}, Spans: span, Chain: true, Parent: strings.Repeat("p", client.MaxKeyLen+1)})
			return err
		}, codes.InvalidArgument, "parent"},
		{"too many keys", func() error {
			_, err := f.ac.BatchExists(ctx, &pb.KeysRequest{Keys: make([]string, agent.MaxBatchKeys+1)})
			return err
		}, codes.InvalidArgument, "batch limit"},
		{"lookup no keys", func() error { _, err := f.ac.Lookup(ctx, &pb.LookupRequest{}); return err }, codes.InvalidArgument, "no keys"},
		{"lookup empty key", func() error { _, err := f.ac.Lookup(ctx, &pb.LookupRequest{Keys: []string{"a", ""}}); return err }, codes.InvalidArgument, "empty key"},
		{"lookup bad packed keys", func() error {
			_, err := f.ac.Lookup(ctx, &pb.LookupRequest{PackedKeys: []byte("ab"), KeyLengths: []uint32{3}})
			return err
		}, codes.InvalidArgument, "past the"},
		{"exists no keys", func() error { _, err := f.ac.BatchExists(ctx, &pb.KeysRequest{}); return err }, codes.InvalidArgument, "no keys"},
		{"remove no keys", func() error { _, err := f.ac.Remove(ctx, &pb.KeysRequest{}); return err }, codes.InvalidArgument, "no keys"},
		{"clear everything", func() error { _, err := f.ac.Clear(ctx, &pb.ClearRequest{}); return err }, codes.InvalidArgument, "prefix"},
	} {
		err := tc.call()
		if st := status.Convert(err); st.Code() != tc.code || !strings.Contains(st.Message(), tc.msg) {
			t.Errorf("%s: %v, want %v containing %q", tc.name, err, tc.code, tc.msg)
		}
	}
	if st, err := f.ac.Stats(ctx, &pb.SessionRef{}); err != nil || st.Sessions != 1 || st.Puts != 0 {
		t.Fatalf("stats after refusals: %v, %v", st, err)
	}
}

// TestAgentLeasesOff: with LeasedBlocks negative every get asks the master,
// and a value longer than its span is still OUT_OF_RANGE.
func TestAgentLeasesOff(t *testing.T) {
	f := newFixture(t, agent.Config{LeasedBlocks: -1})
	ctx := testCtx(t)
	r := f.open("test", 1<<20)
	copy(r.mem, value(7, 5000))
	put, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: []string{"k0"}, Spans: []*pb.Span{{Length: 5000}}, Chain: true})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, put.Results, codes.OK)
	if resp, err := f.ac.Lookup(ctx, &pb.LookupRequest{Keys: []string{"k0"}}); err != nil || resp.Matched != 1 {
		t.Fatalf("Lookup = %v, %v", resp, err)
	}
	got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{"k0", "k0"},
		Spans: []*pb.Span{{Offset: 8192, Length: 5000}, {Offset: 16384, Length: 4999}}})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, got.Results, codes.OK, codes.OutOfRange)
	if !bytes.Equal(r.mem[8192:8192+5000], value(7, 5000)) {
		t.Fatal("bytes differ")
	}
	if f.metric("tidepool_agent_leased_gets_total") != 0 {
		t.Fatal("a lease was used with leases off")
	}
}

// TestAgentSessionEnds: Close ends a session and removes its region; the
// reaper ends idle sessions, and requests keep a session alive.
func TestAgentSessionEnds(t *testing.T) {
	f := newFixture(t, agent.Config{SessionIdle: 200 * time.Millisecond})
	ctx := testCtx(t)

	closed := f.open("closed", 4096)
	if _, err := f.ac.Close(ctx, &pb.SessionRef{Session: closed.id}); err != nil {
		t.Fatal(err)
	}
	if !regionGone(closed.path) {
		t.Fatalf("the region of a closed session is still at %s", closed.path)
	}
	if _, err := f.ac.Close(ctx, &pb.SessionRef{Session: closed.id}); status.Code(err) != codes.NotFound {
		t.Fatalf("second Close: %v", err)
	}
	closed.mem[0] = 1 // the caller's mapping outlives the session

	idle := f.open("idle", 4096)
	alive := f.open("alive", 4096)
	if idle.timeout != 200*time.Millisecond {
		t.Fatalf("idle timeout %v", idle.timeout)
	}
	// Keep "alive" busy until "idle" has been reaped (asking about the
	// agent, not the session, which would keep it alive), then let it go.
	waitFor(t, 10*time.Second, "the idle session to end", func() bool {
		if _, err := f.ac.Stats(ctx, &pb.SessionRef{Session: alive.id}); err != nil {
			t.Fatalf("a session in use ended: %v", err)
		}
		st, err := f.ac.Stats(ctx, &pb.SessionRef{})
		return err == nil && st.Sessions == 1
	})
	_, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: idle.id, Keys: []string{"k"}, Spans: []*pb.Span{{Length: 1}}})
	if st := status.Convert(err); st.Code() != codes.NotFound || !strings.Contains(st.Message(), "closed or idle too long") {
		t.Fatalf("get on an idle session: %v", err)
	}
	waitFor(t, 10*time.Second, "the second session to end", func() bool {
		st, err := f.ac.Stats(ctx, &pb.SessionRef{})
		return err == nil && st.Sessions == 0
	})
	if got := f.metric("tidepool_agent_sessions_expired_total"); got != 2 {
		t.Fatalf("%v sessions expired, want 2", got)
	}
}

// TestAgentCloseDuringUse closes sessions and then the agent under a load
// of puts and gets: no crash, no leak, every request ends.
func TestAgentCloseDuringUse(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	const workers, size = 4, 64 << 10
	regions := make([]region, workers)
	for i := range regions {
		regions[i] = f.open(fmt.Sprint("worker", i), 2*size)
		copy(regions[i].mem, value(uint64(i), size))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var codesSeen []codes.Code
	started := make(chan struct{}, workers)
	for w := range workers {
		wg.Go(func() {
			r := regions[w]
			for n := 0; ; n++ {
				k := []string{fmt.Sprintf("busy/%d/%d", w, n%8)}
				if _, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: k, Spans: []*pb.Span{{Length: size}}}); err != nil {
					mu.Lock()
					codesSeen = append(codesSeen, status.Code(err))
					mu.Unlock()
					return
				}
				_, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: k, Spans: []*pb.Span{{Offset: size, Length: size}}})
				if err != nil {
					mu.Lock()
					codesSeen = append(codesSeen, status.Code(err))
					mu.Unlock()
					return
				}
				if n == 2 {
					started <- struct{}{}
				}
			}
		})
	}
	for range workers {
		<-started
	}
	// One session ends under its worker, then the whole agent.
	if _, err := f.ac.Close(ctx, &pb.SessionRef{Session: regions[0].id}); err != nil {
		t.Fatal(err)
	}
	if err := f.agent.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for _, c := range codesSeen {
		if c != codes.NotFound && c != codes.Unavailable && c != codes.Canceled {
			t.Errorf("a request ended with %v", c)
		}
	}
	for _, r := range regions {
		if !regionGone(r.path) {
			t.Errorf("region %s still there after Close", r.path)
		}
	}
	if _, err := f.ac.Open(ctx, &pb.OpenRequest{ShmBytes: 1}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Open after Close: %v", err)
	}
}

// fixture is an agent of a one-store in-process cluster, served on a unix
// socket, and a gRPC client of it.
type fixture struct {
	t     *testing.T
	agent *agent.Server
	reg   *prometheus.Registry
	cl    *client.Client
	ac    pb.AgentClient
}

func newFixture(t *testing.T, cfg agent.Config) *fixture {
	t.Helper()
	return fixtureAt(t, startCluster(t), cfg)
}

// fixtureAt is newFixture's agent, reaching the cluster at addr (an
// in-process master, or a proxy in front of one).
func fixtureAt(t *testing.T, addr string, cfg agent.Config) *fixture {
	t.Helper()
	cl, err := client.New(client.Config{Masters: []string{addr}, Logger: mastertest.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	f := &fixture{t: t, cl: cl, reg: prometheus.NewRegistry()}
	cfg.Client, cfg.Registerer, cfg.Logger = cl, f.reg, mastertest.Logger()
	if f.agent, err = agent.New(cfg); err != nil {
		t.Fatal(err)
	}
	// A short directory: a socket path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "tpa")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- f.agent.Serve(ln) }()
	t.Cleanup(func() {
		if err := f.agent.Close(); err != nil {
			t.Errorf("close agent: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	f.ac = pb.NewAgentClient(conn)
	return f
}

// region is a session as its process sees it: the region mapped from the
// path Open answered.
type region struct {
	id      uint64
	path    string
	size    uint64
	timeout time.Duration
	mem     []byte
}

func (f *fixture) open(name string, size uint64) region {
	f.t.Helper()
	resp, err := f.ac.Open(testCtx(f.t), &pb.OpenRequest{Client: name, ShmBytes: size})
	if err != nil {
		f.t.Fatal(err)
	}
	if resp.ShmBytes != size || !strings.HasPrefix(resp.ShmPath, fmt.Sprintf("/proc/%d/fd/", os.Getpid())) {
		f.t.Fatalf("Open = %v", resp)
	}
	file, err := os.OpenFile(resp.ShmPath, os.O_RDWR, 0)
	if err != nil {
		f.t.Fatal(err)
	}
	defer file.Close()
	mem, err := unix.Mmap(int(file.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { unix.Munmap(mem) })
	return region{id: resp.Session, path: resp.ShmPath, size: size, timeout: time.Duration(resp.IdleTimeoutMs) * time.Millisecond, mem: mem}
}

// regionGone reports whether a session's path no longer names its memfd
// (the fd may have been reused for something else since).
func regionGone(path string) bool {
	target, err := os.Readlink(path)
	return err != nil || !strings.Contains(target, "memfd:tidepool-agent")
}

// metric is the value of an unlabeled metric of the agent's registry.
func (f *fixture) metric(name string) float64 {
	f.t.Helper()
	families, err := f.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	f.t.Fatalf("no metric %s", name)
	return 0
}

func checkItems(t *testing.T, items []*pb.ItemStatus, want ...codes.Code) {
	t.Helper()
	if len(want) == 1 && len(items) > 1 {
		for range items[1:] {
			want = append(want, want[0])
		}
	}
	if len(items) != len(want) {
		t.Fatalf("%d results, want %d", len(items), len(want))
	}
	for i, it := range items {
		if codes.Code(it.Code) != want[i] {
			t.Errorf("item %d: %v %q, want %v", i, codes.Code(it.Code), it.Message, want[i])
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

// checkColumns checks a LookupResponse's shape: every index in range, one
// DRAM replica on store s0 per block of size bytes.
func checkColumns(t *testing.T, r *pb.LookupResponse, size uint64) {
	t.Helper()
	n := int(r.Matched)
	if len(r.Sizes) != n || len(r.Checksums) != n || len(r.ReplicaCounts) != n || len(r.ReplicaSegments) != n || len(r.ReplicaOffsets) != n {
		t.Fatalf("matched %d with columns %d %d %d %d %d", n, len(r.Sizes), len(r.Checksums), len(r.ReplicaCounts), len(r.ReplicaSegments), len(r.ReplicaOffsets))
	}
	for i := range n {
		seg := r.ReplicaSegments[i]
		if r.Sizes[i] != size || r.ReplicaCounts[i] != 1 || int(seg) >= len(r.Segments) {
			t.Fatalf("block %d: size %d, %d replicas, segment %d of %d", i, r.Sizes[i], r.ReplicaCounts[i], seg, len(r.Segments))
		}
		if s := r.Segments[seg]; s.Tier != pb.Tier_TIER_DRAM || s.Node != "s0" || s.Endpoint == "" {
			t.Fatalf("block %d on %v", i, s)
		}
		if r.Checksums[i] != client.Checksum(value(uint64(i), int(size))) {
			t.Fatalf("block %d: checksum %08x", i, r.Checksums[i])
		}
	}
}

// startCluster starts a master and one store "s0" with a 64 MiB DRAM tier
// in this process, closed when the test ends, and returns the master's
// address.
func startCluster(t *testing.T) string {
	t.Helper()
	m := mastertest.Start(t, nil)
	mastertest.StartStore(t, []string{m.Addr()}, "s0", 64<<20, nil)
	return m.Addr()
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 45*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// value returns n deterministic pseudo-random bytes.
func value(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}
