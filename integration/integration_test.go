//go:build linux

package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

const maxObject = 8 << 20

type object struct {
	key   string
	value []byte
}

// newRand returns a seeded generator and logs the seed, so a failure can
// be replayed with the same data.
func newRand(t *testing.T) *rand.ChaCha8 {
	t.Helper()
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], uint64(time.Now().UnixNano()))
	t.Logf("data seed %x", seed[:8])
	return rand.NewChaCha8(seed)
}

func randomBytes(src *rand.ChaCha8, n int) []byte {
	b := make([]byte, n)
	_, _ = src.Read(b)
	return b
}

// randomObjects returns n objects under prefix with sizes spread
// log-uniformly over [1 B, 8 MiB]; the first is 1 B and the second 8 MiB.
func randomObjects(src *rand.ChaCha8, prefix string, n int) []object {
	r := rand.New(src)
	objs := make([]object, n)
	for i := range objs {
		size := int(math.Exp(r.Float64() * math.Log(maxObject)))
		switch i {
		case 0:
			size = 1
		case 1:
			size = maxObject
		}
		size = min(max(size, 1), maxObject)
		objs[i] = object{key: fmt.Sprintf("%s%03d", prefix, i), value: randomBytes(src, size)}
	}
	return objs
}

// forEach runs fn on every object with a few workers and returns the
// errors by key.
func forEach(objs []object, workers int, fn func(o object) error) map[string]error {
	var mu sync.Mutex
	errs := map[string]error{}
	next := make(chan object)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for o := range next {
				if err := fn(o); err != nil {
					mu.Lock()
					errs[o.key] = err
					mu.Unlock()
				}
			}
		})
	}
	for _, o := range objs {
		next <- o
	}
	close(next)
	wg.Wait()
	return errs
}

func putAll(t *testing.T, ctx context.Context, c *client.Client, objs []object) {
	t.Helper()
	errs := forEach(objs, 4, func(o object) error { return c.Put(ctx, o.key, o.value) })
	for k, err := range errs {
		t.Errorf("put %s: %v", k, err)
	}
	if len(errs) > 0 {
		t.FailNow()
	}
}

// getAll reads every object back with Get and compares it byte for byte.
func getAll(t *testing.T, ctx context.Context, c *client.Client, objs []object, when string) {
	t.Helper()
	errs := forEach(objs, 4, func(o object) error {
		got, err := c.Get(ctx, o.key)
		if err != nil {
			return err
		}
		if !bytes.Equal(got, o.value) {
			return fmt.Errorf("got %d bytes that differ from the %d put", len(got), len(o.value))
		}
		return nil
	})
	for k, err := range errs {
		t.Errorf("%s: get %s: %v", when, k, err)
	}
	if len(errs) > 0 {
		t.FailNow()
	}
}

// getIntoSome reads a few objects with GetInto into buffers longer than
// the values and checks the bytes past the value are left alone.
func getIntoSome(t *testing.T, ctx context.Context, c *client.Client, objs []object, idx ...int) {
	t.Helper()
	for _, i := range idx {
		o := objs[i]
		buf := bytes.Repeat([]byte{0xA5}, len(o.value)+17)
		n, err := c.GetInto(ctx, o.key, buf)
		if err != nil {
			t.Fatalf("GetInto %s: %v", o.key, err)
		}
		if n != len(o.value) || !bytes.Equal(buf[:n], o.value) {
			t.Fatalf("GetInto %s: got %d bytes, want the %d put", o.key, n, len(o.value))
		}
		if tail := buf[n:]; !bytes.Equal(tail, bytes.Repeat([]byte{0xA5}, len(tail))) {
			t.Fatalf("GetInto %s wrote past the value", o.key)
		}
	}
	big := objs[1]
	if _, err := c.GetInto(ctx, big.key, make([]byte, len(big.value)-1)); !errors.Is(err, client.ErrInvalidArgument) {
		t.Fatalf("GetInto %s with a buffer one byte short: got %v, want ErrInvalidArgument", big.key, err)
	}
}

func keysOf(objs []object) []string {
	keys := make([]string, len(objs))
	for i, o := range objs {
		keys[i] = o.key
	}
	slices.Sort(keys)
	return keys
}

// segmentsOf returns the status of the node's segments.
func segmentsOf(st *pb.StatusResponse, node string) []*pb.SegmentInfo {
	var out []*pb.SegmentInfo
	for _, s := range st.Segments {
		if s.Node == node {
			out = append(out, s)
		}
	}
	return out
}

// TestPutGetRestartMaster is the acceptance test: objects put through one
// master process survive its clean restart, while the store process keeps
// running and keeps its registration.
func TestPutGetRestartMaster(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir())
	s := startStore(t, ctx, "s1", m.grpc, "dram:2GiB")
	c := newClient(t, m.grpc)

	objs := randomObjects(newRand(t), "obj/", 200)
	var total int
	for _, o := range objs {
		total += len(o.value)
	}
	start := time.Now()
	putAll(t, ctx, c, objs)
	t.Logf("put 200 objects, %.1f MiB, in %v", float64(total)/(1<<20), time.Since(start).Round(time.Millisecond))
	start = time.Now()
	getAll(t, ctx, c, objs, "before the restart")
	t.Logf("read them back in %v", time.Since(start).Round(time.Millisecond))
	getIntoSome(t, ctx, c, objs, 0, 1, 2, 3)

	ls := mustCLI(t, ctx, nil, "ls", "--masters", m.grpc)
	if got, want := strings.Fields(string(ls.stdout)), keysOf(objs); !slices.Equal(got, want) {
		t.Fatalf("tidepool ls lists %d keys, want the %d put:\n%s", len(got), len(want), ls.stdout)
	}

	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := segmentsOf(st, "s1")
	if len(before) != 1 || !before[0].Alive {
		t.Fatalf("before the restart: want one live segment of s1, got %v", before)
	}

	if code := m.term(t, 20*time.Second); code != 0 {
		t.Fatalf("master exited with %d after SIGTERM, want 0", code)
	}
	m.restart(t, ctx)

	// The store's heartbeats reach the new process with its old epoch.
	waitFor(t, 15*time.Second, func() error {
		n, err := counter(m.http, "tidepool_master_requests_total", `method="/tidepool.v1.Registry/Heartbeat"`, `code="OK"`)
		if err == nil && n < 2 {
			err = fmt.Errorf("%v heartbeats answered OK", n)
		}
		return err
	})
	if s.exited() {
		t.Fatalf("store exited: %v", s.err)
	}
	st, err = c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	after := segmentsOf(st, "s1")
	if len(after) != 1 || after[0].Name != before[0].Name || after[0].Epoch != before[0].Epoch || !after[0].Alive {
		t.Fatalf("after the restart: want s1's segment %s alive at epoch %d, got %v", before[0].Name, before[0].Epoch, after)
	}
	if st.Objects != 200 {
		t.Fatalf("after the restart the master counts %d objects, want 200", st.Objects)
	}
	getAll(t, ctx, c, objs, "after the restart")
	getIntoSome(t, ctx, c, objs, 0, 1)
	late := object{"late", []byte("put after the restart")}
	if err := c.Put(ctx, late.key, late.value); err != nil {
		t.Fatalf("put after the restart: %v", err)
	}
	getAll(t, ctx, c, []object{late}, "after the restart")
	if strings.Contains(s.out.String(), "registering again") {
		t.Fatal("the store registered again after the master restart")
	}
}

// TestPutRightAfterMasterRestart puts as soon as a restarted master reports
// ready, before the store's next heartbeat.
// Raft announces leadership before a restarted master has replayed its
// log; the master must not serve (nor report ready) until it has.
func TestPutRightAfterMasterRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir())
	startStore(t, ctx, "s1", m.grpc, "dram:64MiB")
	c := newClient(t, m.grpc)
	if err := c.Put(ctx, "before", []byte("v")); err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		if code := m.term(t, 20*time.Second); code != 0 {
			t.Fatalf("master exited with %d after SIGTERM, want 0", code)
		}
		m.restart(t, ctx)
		if err := c.Put(ctx, fmt.Sprintf("after-%d", round), []byte("v")); err != nil {
			t.Fatalf("restart %d: put as soon as the master is ready: %v", round+1, err)
		}
	}
}

// TestUpPutGet64MiB moves a 64 MiB file through `tidepool up` with the
// CLI, from a file and from stdin.
func TestUpPutGet64MiB(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	u := startUp(t, ctx, filepath.Join(dir, "data"))
	src := newRand(t)

	in, out := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	value := randomBytes(src, 64<<20)
	if err := os.WriteFile(in, value, 0o644); err != nil {
		t.Fatal(err)
	}
	r := mustCLI(t, ctx, nil, "put", "--masters", u.grpc, "k", in)
	t.Logf("put 64 MiB: %v", r.took.Round(time.Millisecond))
	r = mustCLI(t, ctx, nil, "get", "--masters", u.grpc, "k", "-o", out)
	t.Logf("get 64 MiB: %v", r.took.Round(time.Millisecond))
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, value) {
		t.Fatalf("get -o wrote %d bytes that differ from the %d put", len(got), len(value))
	}
	if _, err := os.Stat(out + ".tidepool-tmp"); !os.IsNotExist(err) {
		t.Errorf("get -o left its temporary file behind: %v", err)
	}

	value2 := randomBytes(src, 3<<20+7)
	mustCLI(t, ctx, bytes.NewReader(value2), "put", "--masters", u.grpc, "k2", "-")
	r = mustCLI(t, ctx, nil, "get", "--masters", u.grpc, "k2")
	if !bytes.Equal(r.stdout, value2) {
		t.Fatalf("get k2 printed %d bytes that differ from the %d put from stdin", len(r.stdout), len(value2))
	}
}

// TestCLIErrors checks the CLI's error contract: one line on stderr,
// "tidepool CMD: ...", and exit 1.
func TestCLIErrors(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()

	closed := freeAddr(t)

	u := startUp(t, ctx, filepath.Join(dir, "data"), "--dram", "64MiB", "--ssd", "0")
	ms := []string{"--masters", u.grpc}
	file := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	src := newRand(t)
	small := file("small", randomBytes(src, 1000))
	empty := file("empty", nil)
	huge := filepath.Join(dir, "huge")
	if err := os.WriteFile(huge, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(huge, 65<<20); err != nil { // sparse: the size is what counts
		t.Fatal(err)
	}
	missingOut := filepath.Join(dir, "never-written")

	for _, tc := range []struct {
		name, want string
		args       []string
	}{
		{"put empty key", "empty key", []string{"put", "", small}},
		{"put 4097-byte key", "4097", []string{"put", strings.Repeat("k", 4097), small}},
		{"put zero-length file", "zero-length", []string{"put", "k", empty}},
		{"put 65 MiB into 64 MiB segments", "larger than any segment", []string{"put", "k", huge}},
		{"put missing file", "no such file", []string{"put", "k", filepath.Join(dir, "missing")}},
		{"get unknown key", "not found", []string{"get", "unknown"}},
		{"get -o unknown key", "not found", []string{"get", "unknown", "-o", missingOut}},
		{"get empty key", "empty key", []string{"get", ""}},
		{"rm unknown key", "not found", []string{"rm", "unknown"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(append([]string{tc.args[0]}, ms...), tc.args[1:]...)
			r := cli(t, ctx, nil, args...)
			wantErrorLine(t, r, tc.args[0], tc.want)
			if r.took > 10*time.Second {
				t.Errorf("took %v", r.took)
			}
		})
	}
	if _, err := os.Stat(missingOut); !os.IsNotExist(err) {
		t.Errorf("a failed get -o created %s: %v", missingOut, err)
	}

	t.Run("exists unknown key", func(t *testing.T) {
		r := cli(t, ctx, nil, append([]string{"exists"}, append(ms, "unknown")...)...)
		if r.code != 1 || r.stderr != "" || string(r.stdout) != "absent\n" {
			t.Errorf("want exit 1, no stderr and \"absent\" on stdout, got %s, stdout %q", r, r.stdout)
		}
	})

	t.Run("4096-byte key", func(t *testing.T) {
		key := strings.Repeat("k", 4096)
		mustCLI(t, ctx, nil, append([]string{"put"}, append(ms, key, small)...)...)
		r := mustCLI(t, ctx, nil, append([]string{"exists"}, append(ms, key)...)...)
		if string(r.stdout) != "present\n" {
			t.Errorf("exists printed %q, want \"present\"", r.stdout)
		}
	})

	t.Run("put existing key keeps the original", func(t *testing.T) {
		first := file("first", randomBytes(src, 4096))
		second := file("second", randomBytes(src, 5000))
		mustCLI(t, ctx, nil, append([]string{"put"}, append(ms, "dup", first)...)...)
		mustCLI(t, ctx, nil, append([]string{"put"}, append(ms, "dup", second)...)...)
		r := mustCLI(t, ctx, nil, append([]string{"get"}, append(ms, "dup")...)...)
		want, _ := os.ReadFile(first)
		if !bytes.Equal(r.stdout, want) {
			t.Errorf("get dup: got %d bytes, want the %d of the first put", len(r.stdout), len(want))
		}
	})

	t.Run("SIGTERM while the master refuses connections", func(t *testing.T) {
		// A listener that hangs up on every connection: a master that is
		// down, but one that shows when the command has started.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var dials atomic.Int64
		go func() {
			for {
				conn, err := ln.Accept()
				if err != nil {
					return
				}
				dials.Add(1)
				conn.Close()
			}
		}()
		cmd, stderr := startCLI(t, "get", "--masters", ln.Addr().String(), "k")
		waitFor(t, 10*time.Second, func() error {
			if dials.Load() < 2 {
				return errors.New("the command has not retried yet")
			}
			return nil
		})
		start := time.Now()
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Fatal("the command did not exit within 10 s of SIGTERM")
		}
		r := cliResult{stderr: stderr.String(), code: cmd.ProcessState.ExitCode(), took: time.Since(start)}
		wantErrorLine(t, r, "get", "unavailable")
	})

	t.Run("unreachable master", func(t *testing.T) {
		r, err := runCLI(ctx, nil, "get", "--masters", closed, "--timeout", "2s", "k")
		if err != nil {
			t.Fatal(err)
		}
		wantErrorLine(t, r, "get", "unavailable")
		if r.took > 20*time.Second {
			t.Errorf("failed after %v, want about the 2 s --timeout", r.took)
		}
	})
}

// startCLI starts a client command in the background; cleanup kills it.
func startCLI(t *testing.T, args ...string) (*exec.Cmd, *logBuffer) {
	t.Helper()
	cmd := exec.Command(binPath, args...)
	stderr := &logBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, stderr
}

// bigValue is the value of the i-th large put: base, stamped with i every
// 64 KiB so that no two keys share their bytes.
func bigValue(base []byte, i int) []byte {
	v := slices.Clone(base)
	for off := 0; off+8 <= len(v); off += 64 << 10 {
		binary.LittleEndian.PutUint64(v[off:], uint64(i))
	}
	return v
}

type putOutcome struct {
	key  string
	i    int
	err  error
	took time.Duration
	node string // of the replica, for a put that succeeded
}

// placement returns the node that holds key's replica: "s2" if the key is
// no longer listed (only the killed s2's objects go), "" if the master could
// not be asked.
func placement(ctx context.Context, c *client.Client, key string) string {
	objs, err := c.List(ctx, key)
	switch {
	case err != nil:
		return ""
	case len(objs) == 0 || objs[0].Key != key || len(objs[0].Replicas) == 0:
		return "s2"
	}
	return objs[0].Replicas[0].Node
}

// TestStoreKilledMidPut kills one of two stores during a stream of puts:
// puts that found it unreachable are placed again on the other store at
// once, failed puts leave nothing visible, the other store's objects stay
// readable, and once the master declares the dead store gone its objects
// are reported missing instead of hanging readers.
func TestStoreKilledMidPut(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir(), "--node-ttl", "2s")
	startStore(t, ctx, "s1", m.grpc, "dram:1GiB")
	s2 := startStore(t, ctx, "s2", m.grpc, "dram:1GiB")
	c := newClient(t, m.grpc)
	src := newRand(t)

	small := make([]object, 20)
	for i := range small {
		small[i] = object{key: fmt.Sprintf("small/%02d", i), value: randomBytes(src, 1+rand.New(src).IntN(64<<10))}
	}
	putAll(t, ctx, c, small)
	getAll(t, ctx, c, small, "before the kill")
	values := map[string][]byte{}
	for _, o := range small {
		values[o.key] = o.value
	}
	nodes := replicaNodes(t, ctx, c)
	for _, o := range small {
		if n := nodes[o.key]; n != "s1" && n != "s2" {
			t.Fatalf("%s placed on %q", o.key, n)
		}
	}

	base := randomBytes(src, maxObject)
	var (
		mu       sync.Mutex
		outcomes []putOutcome
		ok       atomic.Int64
		limit    atomic.Int64 // puts to make: few enough that s1 evicts none
	)
	limit.Store(80)
	more := make(chan struct{})
	// Three writers, so that the kill is likely to cut a transfer short.
	stop := make(chan struct{})
	loopDone := make(chan struct{})
	var next atomic.Int64
	var writers sync.WaitGroup
	for range 3 {
		writers.Go(func() {
			for {
				if ok.Load() >= limit.Load() { // wait for the limit to rise once s2 is dropped
					select {
					case <-stop:
						return
					case <-more:
						if ok.Load() >= limit.Load() {
							return
						}
					}
				}
				i := int(next.Add(1)) - 1
				if i >= 5000 {
					return
				}
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("big/%04d", i)
				pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
				start := time.Now()
				err := c.Put(pctx, key, bigValue(base, i))
				pcancel()
				took := time.Since(start)
				node := ""
				if err == nil {
					node = placement(ctx, c, key)
				}
				mu.Lock()
				outcomes = append(outcomes, putOutcome{key, i, err, took, node})
				mu.Unlock()
				if err == nil {
					ok.Add(1)
				}
			}
		})
	}
	go func() {
		writers.Wait()
		close(loopDone)
	}()
	defer func() { close(stop); <-loopDone }()

	waitFor(t, 20*time.Second, func() error {
		if n := ok.Load(); n < 6 {
			return fmt.Errorf("%d large puts done", n)
		}
		return nil
	})
	s2.kill(t)
	killed := time.Now()
	okAtKill := ok.Load()

	// Before the master notices, a read of an object on s2 fails fast.
	var onS2 string
	for _, o := range small {
		if nodes[o.key] == "s2" {
			onS2 = o.key
			break
		}
	}
	if onS2 != "" {
		gctx, gcancel := context.WithTimeout(ctx, 10*time.Second)
		start := time.Now()
		_, err := c.Get(gctx, onS2)
		gcancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("get %s from the killed store: got %v after %v, want a prompt error", onS2, err, time.Since(start))
		} else {
			t.Logf("get %s from the killed store, %v after the kill: %v", onS2, time.Since(killed).Round(time.Millisecond), err)
		}
	}

	// After the node TTL the master drops s2, and new puts land on s1.
	waitFor(t, 15*time.Second, func() error {
		st, err := c.Status(ctx)
		if err != nil {
			return err
		}
		if segs := segmentsOf(st, "s2"); len(segs) > 0 {
			return fmt.Errorf("s2 still has %d segments", len(segs))
		}
		return nil
	})
	t.Logf("s2 dropped %v after the kill", time.Since(killed).Round(time.Millisecond))
	okAtDrop := ok.Load()
	limit.Store(okAtDrop + 5)
	close(more)
	// Before the master dropped it, a put that could not reach s2 was
	// placed again elsewhere at once (the client reported s2).
	if okAtDrop == okAtKill {
		t.Errorf("no put succeeded between s2's kill and its drop: puts that found it unreachable were not placed elsewhere")
	}
	waitFor(t, 30*time.Second, func() error {
		if n := ok.Load() - okAtDrop; n < 3 {
			return fmt.Errorf("%d large puts done since s2 was dropped", n)
		}
		return nil
	})
	close(stop)
	<-loopDone
	stop = make(chan struct{}) // for the deferred close

	mu.Lock()
	results := slices.Clone(outcomes)
	mu.Unlock()
	var failed []putOutcome
	var slowest time.Duration
	for _, r := range results {
		slowest = max(slowest, r.took)
		if r.err != nil {
			failed = append(failed, r)
			if !errors.Is(r.err, client.ErrUnavailable) {
				t.Errorf("put %s failed with %v, want ErrUnavailable", r.key, r.err)
			}
		} else {
			values[r.key] = bigValue(base, r.i)
			if r.node == "" {
				t.Errorf("could not list %s after its put", r.key)
			}
			nodes[r.key] = r.node
		}
	}
	t.Logf("%d large puts: %d before the kill, %d succeeded, %d failed; slowest %v", len(results), okAtKill, len(results)-len(failed), len(failed), slowest.Round(time.Millisecond))
	var cut int
	for _, r := range failed {
		// A put whose transfer the kill cut short fails on the open
		// connection; later ones fail to dial.
		if !strings.Contains(r.err.Error(), "dial") {
			cut++
			t.Logf("put %s cut short after %v: %v", r.key, r.took.Round(time.Millisecond), r.err)
		}
	}
	if len(failed) > 0 {
		t.Logf("e.g. put %s failed after %v: %v", failed[len(failed)-1].key, failed[len(failed)-1].took.Round(time.Millisecond), failed[len(failed)-1].err)
	}
	t.Logf("%d puts cut short by the kill, %d refused", cut, len(failed)-cut)

	// No failed put is visible.
	for _, r := range failed {
		if ok, err := c.Exists(ctx, r.key); err != nil || ok {
			t.Errorf("exists %s after its put failed: %v, %v", r.key, ok, err)
		}
		if _, err := c.Get(ctx, r.key); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("get %s after its put failed: %v, want ErrNotFound", r.key, err)
		}
	}

	// Every object placed on s1 reads back; every one placed on s2 is gone.
	var onS1, gone int
	for key, want := range values {
		gctx, gcancel := context.WithTimeout(ctx, 10*time.Second)
		got, err := c.Get(gctx, key)
		gcancel()
		switch node := nodes[key]; {
		case node == "s2":
			gone++
			if !errors.Is(err, client.ErrNotFound) {
				t.Errorf("get %s, placed on the killed s2: %v, want ErrNotFound", key, err)
			}
		case err != nil:
			t.Errorf("get %s, placed on %q: %v", key, node, err)
		case !bytes.Equal(got, want):
			t.Errorf("get %s: %d bytes that differ from the %d put", key, len(got), len(want))
		default:
			onS1++
		}
	}
	t.Logf("%d objects read back from s1, %d on s2 reported missing", onS1, gone)
	if gone == 0 {
		t.Error("no object had been placed on s2")
	}

	// The master holds only complete objects, all on s1.
	objs, err := c.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o.State != pb.ObjectState_OBJECT_STATE_COMPLETE {
			t.Errorf("%s left in state %v", o.Key, o.State)
		}
		for _, r := range o.Replicas {
			if r.Node != "s1" {
				t.Errorf("%s has a replica on %s", o.Key, r.Node)
			}
		}
	}
	if len(objs) != onS1 {
		t.Errorf("the master lists %d objects, want the %d on s1", len(objs), onS1)
	}
}

// replicaNodes maps every listed key to the node of its first replica.
func replicaNodes(t *testing.T, ctx context.Context, c *client.Client) map[string]string {
	t.Helper()
	objs, err := c.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	nodes := map[string]string{}
	for _, o := range objs {
		if len(o.Replicas) > 0 {
			nodes[o.Key] = o.Replicas[0].Node
		}
	}
	return nodes
}

// TestMalformedFrame sends garbage to a store's transfer engine: the store
// drops those connections and keeps serving everyone else.
func TestMalformedFrame(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir())
	s := startStore(t, ctx, "s1", m.grpc, "dram:256MiB")
	c := newClient(t, m.grpc)
	src := newRand(t)

	header := func(version, op byte, nameLen uint16, name string, length uint64) []byte {
		b := []byte{'T', 'P', version, op}
		b = binary.BigEndian.AppendUint16(b, nameLen)
		b = append(b, name...)
		b = binary.BigEndian.AppendUint64(b, 0)
		return binary.BigEndian.AppendUint64(b, length)
	}
	frames := []struct {
		name string
		b    []byte
	}{
		{"random bytes", append([]byte("GARBAGE!"), randomBytes(src, 4096)...)},
		{"bad version", header(9, 1, 1, "x", 1)},
		{"bad op", header(1, 7, 1, "x", 1)},
		{"name over 255 bytes", header(1, 1, 300, strings.Repeat("x", 300), 1)},
		{"length over 1 GiB", header(1, 2, 1, "x", 1<<31)},
	}

	// A connection stuck inside a frame must not block the others.
	stuck, err := net.Dial("tcp", s.engine)
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	if _, err := stuck.Write([]byte{'T', 'P', 1}); err != nil {
		t.Fatal(err)
	}

	for _, f := range frames {
		t.Run(f.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", s.engine)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Write(f.b); err != nil {
				t.Fatalf("write: %v", err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := conn.Read(make([]byte, 64))
			var ne net.Error
			switch {
			case errors.As(err, &ne) && ne.Timeout():
				t.Fatal("the store kept the connection open after a malformed frame")
			case n > 0:
				t.Fatalf("the store answered %d bytes to a malformed frame", n)
			case err != io.EOF && !errors.Is(err, syscall.ECONNRESET):
				t.Fatalf("read: %v, want EOF or a reset", err)
			}
		})
	}

	v := randomBytes(src, 1<<20+3)
	if err := c.Put(ctx, "after-garbage", v); err != nil {
		t.Fatalf("put after the garbage: %v", err)
	}
	got, err := c.Get(ctx, "after-garbage")
	if err != nil || !bytes.Equal(got, v) {
		t.Fatalf("get after the garbage: %d bytes, %v", len(got), err)
	}
	n, err := counter(s.http, "tidepool_engine_malformed_frames_total")
	if err != nil {
		t.Fatal(err)
	}
	if int(n) != len(frames) {
		t.Errorf("the store counted %v malformed frames, want %d", n, len(frames))
	}
	if s.exited() {
		t.Fatalf("store exited: %v", s.err)
	}
}
