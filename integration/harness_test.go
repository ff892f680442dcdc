//go:build linux

package integration

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// binPath is the tidepool binary TestMain builds; read-only once tests run.
var binPath string

func TestMain(m *testing.M) {
	if addr := os.Getenv(holdConnsEnv); addr != "" {
		os.Exit(holdConns(addr)) // a child a test started to hold connections
	}
	if sock := os.Getenv(openSessionsEnv); sock != "" {
		os.Exit(openSessions(sock)) // a child a test started to hold agent sessions
	}
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	root, err := moduleRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "tidepool-integration-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "tidepool")
	build := exec.Command("go", "build", "-o", bin, "./cmd/tidepool")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "integration: go build ./cmd/tidepool: %v\n%s", err, out)
		return 1
	}
	binPath = bin
	return m.Run()
}

// moduleRoot is the directory above this package that holds go.mod.
func moduleRoot() (string, error) {
	dir, err := filepath.Abs("..")
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("module root not found above the package: %w", err)
	}
	return dir, nil
}

// usedPorts keeps one test binary from handing out a port twice.
var usedPorts struct {
	sync.Mutex
	m map[int]bool
}

// freeAddr returns a loopback address whose port was free a moment ago.
// Another process may take it before ours binds; daemons started with
// startDaemon retry with fresh ports when that happens.
func freeAddr(t *testing.T) string {
	t.Helper()
	usedPorts.Lock()
	defer usedPorts.Unlock()
	if usedPorts.m == nil {
		usedPorts.m = map[int]bool{}
	}
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("probe for a free port: %v", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if !usedPorts.m[port] {
			usedPorts.m[port] = true
			return "127.0.0.1:" + strconv.Itoa(port)
		}
	}
	t.Fatal("no unused free port after 100 probes")
	return ""
}

// logBuffer collects a process's output; safe for concurrent use.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// proc is one daemon process of the binary.
type proc struct {
	name string
	args []string
	cmd  *exec.Cmd
	out  *logBuffer
	done chan struct{} // closed once the process has exited
	err  error         // what cmd.Wait returned; read only after done
}

// startProc starts the binary with args. Its stdout and stderr go to a
// buffer that is logged if the test fails; cleanup kills it.
func startProc(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, args: args, out: &logBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(binPath, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	// Should the test binary die, take the daemons with it.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("--- %s (pid %d): tidepool %s; exit: %v ---\n%s", p.name, p.cmd.Process.Pid, strings.Join(args, " "), p.err, p.out.String())
		}
	})
	return p
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill stops the process with SIGKILL, as a crash would, and waits for it.
func (p *proc) kill(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil && !p.exited() {
		t.Fatalf("kill %s: %v", p.name, err)
	}
	<-p.done
}

// term stops the process with SIGTERM and returns its exit code; the
// process must exit within timeout.
func (p *proc) term(t *testing.T, timeout time.Duration) int {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !p.exited() {
		t.Fatalf("SIGTERM %s: %v", p.name, err)
	}
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v of SIGTERM", p.name, timeout)
	}
	return p.cmd.ProcessState.ExitCode()
}

// poll calls cond until it returns nil, ctx ends or timeout passes, backing
// off from 10 ms to 200 ms between calls. It returns cond's last error.
func poll(ctx context.Context, timeout time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	delay := 10 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not met after %v: %w", timeout, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; last: %w", ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 200*time.Millisecond)
	}
}

// waitFor polls cond until it returns nil and fails the test if that takes
// longer than timeout.
func waitFor(t *testing.T, timeout time.Duration, cond func() error) {
	t.Helper()
	if err := poll(context.Background(), timeout, cond); err != nil {
		t.Fatalf("waitFor: %v", err)
	}
}

var httpClient = &http.Client{Timeout: time.Second}

// waitReady polls the daemon's /readyz until it answers 200 OK. It returns
// early if the process exits.
func waitReady(ctx context.Context, p *proc, httpAddr string, timeout time.Duration) error {
	return poll(ctx, timeout, func() error {
		if p.exited() {
			return fmt.Errorf("%s exited: %v", p.name, p.err)
		}
		resp, err := httpClient.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %s: %s", resp.Status, strings.TrimSpace(string(body)))
		}
		return nil
	})
}

const readyTimeout = 20 * time.Second

// startDaemon starts a daemon and waits until it is ready. args picks fresh
// addresses on every call and returns the command line and the HTTP
// address; if a port was taken between probing and binding, startDaemon
// tries again with new ones.
func startDaemon(t *testing.T, ctx context.Context, name string, args func() ([]string, string)) *proc {
	t.Helper()
	for attempt := 1; ; attempt++ {
		argv, httpAddr := args()
		p := startProc(t, name, argv...)
		err := waitReady(ctx, p, httpAddr, readyTimeout)
		if err == nil {
			return p
		}
		if out := p.out.String(); p.exited() && (strings.Contains(out, "address already in use") || strings.Contains(out, "ports clash")) && attempt < 3 {
			t.Logf("%s: a port was taken, retrying with new ports", name)
			continue
		}
		t.Fatalf("%s not ready: %v", name, err)
	}
}

// masterProc is a master daemon and its addresses.
type masterProc struct {
	*proc
	dir, grpc, raft, http string
	extra                 []string
	check                 extentCheck
}

func (m *masterProc) argv() []string {
	return append([]string{"master", "--id", "m1", "--dir", m.dir, "--listen", m.grpc, "--raft", m.raft, "--http", m.http}, m.extra...)
}

// startMaster starts a single-node master cluster in dir.
func startMaster(t *testing.T, ctx context.Context, dir string, extra ...string) *masterProc {
	t.Helper()
	m := &masterProc{dir: dir, extra: extra}
	m.proc = startDaemon(t, ctx, "master", func() ([]string, string) {
		m.grpc, m.raft, m.http = freeAddr(t), freeAddr(t), freeAddr(t)
		return m.argv(), m.http
	})
	m.check.register(t, m.live)
	return m
}

// live is the master's address while it runs.
func (m *masterProc) live() []string { return liveOf([]*proc{m.proc}, []string{m.grpc}) }

// liveOf is the addresses of the processes that still run.
func liveOf(procs []*proc, addrs []string) []string {
	var live []string
	for i, p := range procs {
		if !p.exited() {
			live = append(live, addrs[i])
		}
	}
	return live
}

// restart starts the master again on the same directory and ports, after
// the previous process has exited.
func (m *masterProc) restart(t *testing.T, ctx context.Context) {
	t.Helper()
	if !m.exited() {
		t.Fatal("restart of a master that is still running")
	}
	m.proc = startProc(t, "master (restarted)", m.argv()...)
	if err := waitReady(ctx, m.proc, m.http, readyTimeout); err != nil {
		t.Fatalf("restarted master not ready: %v", err)
	}
	m.check.register(t, m.live)
}

// storeProc is a store daemon and its addresses.
type storeProc struct {
	*proc
	id, engine, http string
}

// startStore starts a store node with one tier and waits until it has
// registered with the master.
func startStore(t *testing.T, ctx context.Context, id, masters, tier string) *storeProc {
	t.Helper()
	s := &storeProc{id: id}
	s.proc = startDaemon(t, ctx, "store "+id, func() ([]string, string) {
		s.engine, s.http = freeAddr(t), freeAddr(t)
		return []string{"store", "--id", id, "--masters", masters, "--listen", s.engine, "--http", s.http, "--tier", tier}, s.http
	})
	return s
}

// upProc is an all-in-one `tidepool up` cluster.
type upProc struct {
	*proc
	grpc, raft, engine, http string
	creds                    leaderconn.Credentials // what the extents check shows the master
}

// startUp runs `tidepool up` in dir on free non-default ports.
func startUp(t *testing.T, ctx context.Context, dir string, extra ...string) *upProc {
	t.Helper()
	u := &upProc{}
	entries, _ := os.ReadDir(dir)
	fresh, attempt := len(entries) == 0, 0
	u.proc = startDaemon(t, ctx, "up", func() ([]string, string) {
		if attempt++; attempt > 1 && fresh {
			// The masters of the attempt that failed stored a raft
			// configuration naming its ports.
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
		}
		u.grpc, u.raft, u.engine, u.http = freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
		return append([]string{"up", "--dir", dir, "--listen", u.grpc, "--raft", u.raft, "--engine", u.engine, "--http", u.http}, extra...), u.http
	})
	t.Cleanup(func() { checkNoSharedExtentsAs(t, u.creds, liveOf([]*proc{u.proc}, []string{u.grpc})...) })
	return u
}

// extentCheck runs checkNoSharedExtents once, at the first of the cleanups
// registered for it. Cleanups run last first, so registering again after
// each process of the cluster starts runs the check before any of them is
// stopped.
type extentCheck struct{ once sync.Once }

func (c *extentCheck) register(t *testing.T, live func() []string) {
	t.Cleanup(func() { c.once.Do(func() { checkNoSharedExtents(t, live()...) }) })
}

// checkNoSharedExtents is the invariant every test ends with, asked of
// whichever of the cluster's masters still run: no two replicas of live
// objects overlap in a segment. A test that stopped its whole cluster is
// not checked here; one that ends it on purpose checks before (logged).
func checkNoSharedExtents(t *testing.T, masters ...string) {
	t.Helper()
	checkNoSharedExtentsAs(t, leaderconn.Credentials{}, masters...)
}

// checkNoSharedExtentsAs is checkNoSharedExtents showing the masters creds.
func checkNoSharedExtentsAs(t *testing.T, creds leaderconn.Credentials, masters ...string) {
	t.Helper()
	if len(masters) == 0 {
		t.Logf("extents not checked: no master runs")
		return
	}
	c, err := client.New(client.Config{Masters: masters, Credentials: creds})
	if err != nil {
		t.Logf("extents not checked: %v", err)
		return
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	objs, err := c.List(ctx, "")
	if err != nil {
		t.Logf("extents not checked: list: %v", err)
		return
	}
	if err := sharedExtents(objs); err != nil {
		t.Errorf("invariant: %v", err)
	}
}

// sharedExtents returns an error naming the first two objects whose
// replicas overlap in one segment.
func sharedExtents(objs []*pb.ObjectInfo) error {
	type ext struct {
		key      string
		off, end uint64
	}
	bySeg := map[string][]ext{}
	for _, o := range objs {
		for _, r := range o.Replicas {
			bySeg[r.Segment] = append(bySeg[r.Segment], ext{o.Key, r.Offset, r.Offset + max(r.Length, o.Size)})
		}
	}
	for seg, exts := range bySeg {
		slices.SortFunc(exts, func(a, b ext) int { return cmp.Compare(a.off, b.off) })
		for i := 1; i < len(exts); i++ {
			if a, b := exts[i-1], exts[i]; b.off < a.end {
				return fmt.Errorf("objects %q [%d, %d) and %q [%d, %d) share space in segment %s", a.key, a.off, a.end, b.key, b.off, b.end, seg)
			}
		}
	}
	return nil
}

// cliResult is the outcome of one client command.
type cliResult struct {
	stdout []byte
	stderr string
	code   int
	took   time.Duration
}

func (r cliResult) String() string {
	return fmt.Sprintf("exit %d after %v, stderr %q, %d bytes of stdout", r.code, r.took.Round(time.Millisecond), r.stderr, len(r.stdout))
}

// runCLI runs a client command to completion; ctx bounds it. It does not
// touch a testing.T, so it may run on any goroutine.
func runCLI(ctx context.Context, stdin io.Reader, args ...string) (cliResult, error) {
	cmd := exec.CommandContext(ctx, binPath, args...)
	cmd.Stdin = stdin
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	start := time.Now()
	err := cmd.Run()
	r := cliResult{stdout: stdout.Bytes(), stderr: stderr.String(), took: time.Since(start), code: -1}
	if cmd.ProcessState != nil {
		r.code = cmd.ProcessState.ExitCode()
	}
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		return r, fmt.Errorf("tidepool %s: %w (%s)", shortArgs(args), err, r)
	}
	return r, nil
}

// cli runs a client command to completion; ctx bounds it.
func cli(t *testing.T, ctx context.Context, stdin io.Reader, args ...string) cliResult {
	t.Helper()
	r, err := runCLI(ctx, stdin, args...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// mustCLI runs a client command that must succeed and stay silent on stderr.
func mustCLI(t *testing.T, ctx context.Context, stdin io.Reader, args ...string) cliResult {
	t.Helper()
	r := cli(t, ctx, stdin, args...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("tidepool %s: want exit 0 and no stderr, got %s", shortArgs(args), r)
	}
	return r
}

// wantErrorLine checks the CLI's error contract: exit 1 and exactly one
// line on stderr, "tidepool CMD: ...", that contains want.
func wantErrorLine(t *testing.T, r cliResult, cmd, want string) {
	t.Helper()
	if r.code != 1 {
		t.Errorf("tidepool %s: want exit 1, got %s", cmd, r)
	}
	// Notices of a wait for a master may come first (see waitNotice).
	stderr := r.stderr
	for strings.HasPrefix(stderr, "tidepool: still waiting ") || strings.HasPrefix(stderr, "tidepool: no master listens ") {
		_, stderr, _ = strings.Cut(stderr, "\n")
	}
	line, rest, ok := strings.Cut(stderr, "\n")
	if !ok || rest != "" {
		t.Errorf("tidepool %s: want exactly one error line on stderr, after any notices of a wait, got %q", cmd, r.stderr)
	}
	if prefix := "tidepool " + cmd + ": "; !strings.HasPrefix(line, prefix) {
		t.Errorf("tidepool %s: stderr %q does not start with %q", cmd, line, prefix)
	}
	if !strings.Contains(line, want) {
		t.Errorf("tidepool %s: stderr %q does not mention %q", cmd, line, want)
	}
	t.Logf("exit %d, stderr: %s", r.code, line)
}

// shortArgs prints a command line with long arguments cut.
func shortArgs(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		if len(a) > 40 {
			a = fmt.Sprintf("%s...(%d bytes)", a[:20], len(a))
		}
		out[i] = strconv.Quote(a)
	}
	return strings.Join(out, " ")
}

// newClient returns a Go SDK client of the masters; cleanup closes it.
func newClient(t *testing.T, masters ...string) *client.Client {
	t.Helper()
	c, err := client.New(client.Config{Masters: masters})
	if err != nil {
		t.Fatalf("client.New: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// counter sums the samples of a Prometheus counter, served as text on
// httpAddr's /metrics, whose label set contains every one of labels
// (each written as name="value").
func counter(httpAddr, name string, labels ...string) (float64, error) {
	resp, err := httpClient.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("/metrics: %s", resp.Status)
	}
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
next:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(line, l) {
				continue next
			}
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return 0, fmt.Errorf("metric line %q: %w", line, err)
		}
		sum += v
	}
	return sum, sc.Err()
}
