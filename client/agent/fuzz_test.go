package agent

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// fuzzRPC is one RPC FuzzAgentRequests may call: a fresh request to
// decode the input into, and the call.
type fuzzRPC struct {
	name string
	req  func() proto.Message
	call func(context.Context, proto.Message) (proto.Message, error)
}

func unary[Req any, PReq interface {
	*Req
	proto.Message
}, Resp proto.Message](name string, call func(context.Context, PReq, ...grpc.CallOption) (Resp, error)) fuzzRPC {
	return fuzzRPC{
		name: name,
		req:  func() proto.Message { return PReq(new(Req)) },
		call: func(ctx context.Context, req proto.Message) (proto.Message, error) { return call(ctx, req.(PReq)) },
	}
}

func agentRPCs(ac pb.AgentClient) []fuzzRPC {
	return []fuzzRPC{
		unary("Open", ac.Open),
		unary("Close", ac.Close),
		unary("Lookup", ac.Lookup),
		unary("BatchExists", ac.BatchExists),
		unary("BatchGet", ac.BatchGet),
		unary("BatchPut", ac.BatchPut),
		unary("Remove", ac.Remove),
		unary("Clear", ac.Clear),
		unary("Stats", ac.Stats),
		unary("Attach", ac.Attach),
		unary("Detach", ac.Detach),
		unary("Exists", ac.Exists),
		unary("Describe", ac.Describe),
	}
}

// fuzzAgent is FuzzAgentRequests' agent, serving on a unix socket with a
// real cluster behind it, and the session its inputs name as session 1:
// a region of fuzzRegion bytes, with a memfd of fuzzAttached bytes
// attached as region 1.
type fuzzAgent struct {
	s       *Server
	ac      pb.AgentClient
	dir     string
	memfd   string // the memfd's /proc/PID/fd/N
	session uint64
}

const (
	fuzzRegion   = 1 << 20
	fuzzAttached = 64 << 10
)

func newFuzzAgent(f *testing.F) *fuzzAgent {
	// A put of a key removed under a lookup's lease waits out the lease:
	// a short one keeps such inputs cheap.
	m := mastertest.Start(f, func(cfg *master.Config) { cfg.LeaseTTL = 200 * time.Millisecond })
	mastertest.StartStore(f, []string{m.Addr()}, "s0", 16<<20, nil)
	cl, err := client.New(client.Config{Masters: []string{m.Addr()}, SharedBuffers: true, Logger: mastertest.Logger()})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { cl.Close() })
	s, err := New(Config{Client: cl, MaxSessionBytes: fuzzRegion, SessionIdle: time.Hour, Logger: mastertest.Logger()})
	if err != nil {
		f.Fatal(err)
	}
	// A short directory: a socket path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "tpa")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { os.RemoveAll(dir) })
	ln, err := net.Listen("unix", filepath.Join(dir, "agent.sock"))
	if err != nil {
		f.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	f.Cleanup(func() {
		if err := s.Close(); err != nil {
			f.Errorf("close agent: %v", err)
		}
		if err := <-served; err != nil {
			f.Errorf("Serve: %v", err)
		}
	})
	conn, err := grpc.NewClient("unix://"+ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { conn.Close() })
	fd, err := unix.MemfdCreate("tp-fuzz", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, fuzzAttached); err != nil {
		f.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "file"), make([]byte, fuzzAttached), 0o600); err != nil {
		f.Fatal(err)
	}
	a := &fuzzAgent{s: s, ac: pb.NewAgentClient(conn), dir: dir, memfd: fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)}
	a.heal(f)
	return a
}

// heal opens session 1 and attaches its region 1 again if an input closed
// or detached them.
func (a *fuzzAgent) heal(t testing.TB) {
	ss := a.fixture()
	if ss != nil {
		ss.mu.RLock()
		ok := ss.attached[1] != nil
		ss.mu.RUnlock()
		if ok {
			return
		}
		a.s.closeSession(a.session)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	o, err := a.ac.Open(ctx, &pb.OpenRequest{Client: "fuzz", ShmBytes: fuzzRegion})
	if err != nil {
		t.Fatal(err)
	}
	a.session = o.Session
	if r, err := a.ac.Attach(ctx, &pb.AttachRequest{Session: a.session, Path: a.memfd, Size: fuzzAttached}); err != nil || r.Region != 1 {
		t.Fatalf("attach = %v, %v", r, err)
	}
}

// held names a session some request still holds, if any.
func (a *fuzzAgent) held() string {
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	for id, ss := range a.s.mu.sessions {
		if n := ss.active.Load(); n != 0 {
			return fmt.Sprintf("session %d held by %d requests", id, n)
		}
	}
	return ""
}

func (a *fuzzAgent) fixture() *session {
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	return a.s.mu.sessions[a.session]
}

// aim points what req names at the fixture: session 1 is the fixture's;
// an Attach path of "memfd", "own" or "file" is the fixture's memfd, its
// own region or a plain file, and any other a path that does not exist
// (the agent opens what it is given read-write).
func (a *fuzzAgent) aim(req proto.Message) {
	sess := func(id *uint64) {
		if *id == 1 {
			*id = a.session
		}
	}
	switch r := req.(type) {
	case *pb.SessionRef:
		sess(&r.Session)
	case *pb.AgentGetRequest:
		sess(&r.Session)
	case *pb.AgentPutRequest:
		sess(&r.Session)
	case *pb.DetachRequest:
		sess(&r.Session)
	case *pb.AttachRequest:
		sess(&r.Session)
		switch r.Path {
		case "memfd":
			r.Path = a.memfd
		case "own":
			if ss := a.fixture(); ss != nil {
				r.Path = ss.path
			}
		case "file":
			r.Path = filepath.Join(a.dir, "file")
		default:
			r.Path = filepath.Join(a.dir, "missing")
		}
	}
}

// FuzzAgentRequests sends arbitrary requests, as a process's SDK would, to
// an agent with a real cluster behind it: the first byte picks the RPC,
// the rest is its request, encoded. Every refusal is a status with a code
// that says what was wrong (never UNKNOWN or INTERNAL); no request leaves
// a session held; a get writes nothing outside the spans it names; and
// the agent keeps answering.
func FuzzAgentRequests(f *testing.F) {
	a := newFuzzAgent(f)
	rpcs := agentRPCs(a.ac)
	seed := func(name string, req proto.Message) {
		for i, r := range rpcs {
			if r.name == name {
				b, err := proto.Marshal(req)
				if err != nil {
					f.Fatal(err)
				}
				f.Add(append([]byte{byte(i)}, b...))
				return
			}
		}
		f.Fatalf("no RPC %s", name)
	}
	spans := []*pb.Span{{Offset: 0, Length: 100}, {Offset: 100, Length: 4096}, {Offset: 8, Length: 64, Region: 1}}
	seed("Open", &pb.OpenRequest{Client: "p", ShmBytes: 4096})
	seed("Close", &pb.SessionRef{Session: 2})
	seed("BatchPut", &pb.AgentPutRequest{Session: 1, Keys: []string{"a", "b", "c"}, Spans: spans, Chain: true, Parent: "root", Replicas: 1})
	seed("BatchPut", &pb.AgentPutRequest{Session: 1, Keys: []string{"x"}, Spans: spans[2:]})
	seed("BatchGet", &pb.AgentGetRequest{Session: 1, Keys: []string{"a", "b", "c"}, Spans: []*pb.Span{{Offset: 200, Length: 200}, {Offset: 4096, Length: 8192}, {Offset: 0, Length: 64, Region: 1}}})
	seed("BatchGet", &pb.AgentGetRequest{Session: 1, Keys: []string{"a", "b"}, Spans: []*pb.Span{{Offset: 0, Length: 200}, {Offset: 100, Length: 200}}})
	seed("Lookup", &pb.LookupRequest{Keys: []string{"a", "b", "c", "d"}})
	packed := &pb.LookupRequest{CountOnly: true}
	packed.PackKeys([]string{"a", "b"})
	seed("Lookup", packed)
	seed("BatchExists", &pb.KeysRequest{Keys: []string{"a", "b"}})
	seed("Exists", &pb.KeysRequest{Keys: []string{"a", "z"}})
	seed("Describe", &pb.KeysRequest{Keys: []string{"a", ""}})
	seed("Remove", &pb.KeysRequest{Keys: []string{"x"}})
	seed("Clear", &pb.ClearRequest{Prefix: "a", Regex: "^a$"})
	seed("Stats", &pb.SessionRef{Session: 1})
	seed("Attach", &pb.AttachRequest{Session: 1, Path: "memfd", Size: fuzzAttached})
	seed("Attach", &pb.AttachRequest{Session: 1, Path: "own", Size: fuzzRegion})
	seed("Attach", &pb.AttachRequest{Session: 1, Path: "file", Size: fuzzAttached})
	seed("Detach", &pb.DetachRequest{Session: 1, Region: 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		r := rpcs[int(in[0])%len(rpcs)]
		req := r.req()
		if proto.Unmarshal(in[1:], req) != nil {
			return
		}
		a.aim(req)
		var before [][]byte // the fixture's regions, 0 and 1, for a get into them
		get, _ := req.(*pb.AgentGetRequest)
		if get != nil && get.Session == a.session {
			ss := a.fixture()
			before = [][]byte{bytes.Clone(ss.mem), bytes.Clone(ss.attached[1].mem)}
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := r.call(ctx, req)
		cancel()
		if err != nil {
			st, ok := status.FromError(err)
			if !ok {
				t.Fatalf("%s(%v): error %v is not a status", r.name, req, err)
			}
			if c := st.Code(); c == codes.Unknown || c == codes.Internal {
				t.Fatalf("%s(%v): %v", r.name, req, err)
			}
		}
		if o, ok := resp.(*pb.OpenResponse); ok && err == nil {
			if o.ShmBytes > fuzzRegion {
				t.Fatalf("opened a region of %d bytes, at most %d may be", o.ShmBytes, fuzzRegion)
			}
			if err := a.s.closeSession(o.Session); err != nil {
				t.Fatal(err)
			}
		}
		// A call that ran out of time may still be ending on the agent.
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			held := a.held()
			if held == "" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("5s after %s(%v) returned %v: %s", r.name, req, err, held)
			}
		}
		if before != nil {
			ss := a.fixture()
			checkSpans(t, get, resp, err, before, [][]byte{ss.mem, ss.attached[1].mem})
		}
		ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := a.ac.Stats(ctx, &pb.SessionRef{}); err != nil {
			t.Fatalf("stats after %s(%v): %v", r.name, req, err)
		}
		a.heal(t)
	})
}

// checkSpans checks a get's effects on the regions of its session: bytes
// outside every span it names are as they were, and no value is longer
// than its span.
func checkSpans(t *testing.T, req *pb.AgentGetRequest, resp proto.Message, err error, before, after [][]byte) {
	t.Helper()
	for r := range before {
		size := uint64(len(before[r]))
		spans := make([]int, size+1) // spans starting at i, less those ending there
		for _, sp := range req.Spans {
			if uint64(sp.Region) == uint64(r) && sp.Offset < size {
				spans[sp.Offset]++
				spans[sp.Offset+min(sp.Length, size-sp.Offset)]--
			}
		}
		in := 0
		for i := range size {
			if in += spans[i]; in == 0 && before[r][i] != after[r][i] {
				t.Fatalf("BatchGet(%v) wrote byte %d of region %d, outside its spans", req, i, r)
			}
		}
	}
	if err != nil {
		return
	}
	g := resp.(*pb.AgentGetResponse)
	if len(g.Results) != len(req.Keys) || len(g.Sizes) != len(req.Keys) {
		t.Fatalf("BatchGet(%v) = %v: not one result and size per key", req, g)
	}
	for i, st := range g.Results {
		if st.Code == 0 && g.Sizes[i] > req.Spans[i].Length {
			t.Fatalf("BatchGet(%v): value %d of %d bytes, its span %d", req, i, g.Sizes[i], req.Spans[i].Length)
		}
	}
}
