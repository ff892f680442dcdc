//go:build linux

package integration

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// holdConnsEnv names, in a child of the test binary, the engine address it
// opens connections to: HOLD_N of them, each idle, or each a stalled write
// if HOLD_SEGMENT names a segment (of HOLD_SIZE bytes at HOLD_OFF, with the
// ticket HOLD_TICKET in hex). It says "held" on stdout and keeps them until
// its stdin closes.
const holdConnsEnv = "TIDEPOOL_TEST_HOLD_CONNS"

func holdConns(addr string) int {
	n, _ := strconv.Atoi(os.Getenv("HOLD_N"))
	seg := os.Getenv("HOLD_SEGMENT")
	var conns []net.Conn
	for range n {
		nc, err := net.Dial("tcp", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return 1
		}
		if seg != "" {
			// A write header, a megabyte but one of payload, then silence.
			size, _ := strconv.ParseUint(os.Getenv("HOLD_SIZE"), 10, 64)
			off, _ := strconv.ParseUint(os.Getenv("HOLD_OFF"), 10, 64)
			tk, _ := hex.DecodeString(os.Getenv("HOLD_TICKET"))
			b := engineRequest(frameOpWrite, seg, off, size, tk)
			b = append(b, make([]byte, 1<<20-1)...)
			if _, err := nc.Write(b); err != nil {
				fmt.Fprintln(os.Stderr, "write:", err)
				return 1
			}
		}
		conns = append(conns, nc)
	}
	fmt.Println("held")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	return 0
}

// startChild starts this test binary as a child with env added (TestMain
// turns it into the helper env names), and returns it with the first line
// it prints. Cleanup closes its stdin (the helpers exit then), kills it
// and waits.
func startChild(t *testing.T, env ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("child %v: %v", env, err)
	}
	return cmd, strings.TrimSpace(line)
}

// startHolders starts procs children that hold n connections each to addr
// (stalled writes of size bytes at off of seg with tk if seg is not empty)
// and waits until they have them.
func startHolders(t *testing.T, procs, n int, addr, seg string, off, size uint64, tk []byte) {
	t.Helper()
	for range procs {
		_, line := startChild(t, holdConnsEnv+"="+addr, "HOLD_N="+strconv.Itoa(n), "HOLD_SEGMENT="+seg,
			"HOLD_OFF="+strconv.FormatUint(off, 10), "HOLD_SIZE="+strconv.FormatUint(size, 10), "HOLD_TICKET="+hex.EncodeToString(tk))
		if line != "held" {
			t.Fatalf("connection holder: %q", line)
		}
	}
}

// rssBytes is a process's resident set size.
func rssBytes(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestStalledWritesAndIdleConnectionsBounded: 1,000 connections that sent
// a write header for a whole SSD segment and 1 MiB - 1 byte, then nothing,
// took a daemon from 29 MB to 1.07 GB RSS, not released after; 19,990 idle
// engine connections reached the fd limit and made the master fail too.
// Now the daemon stays under 200 MB and serves another client throughout.
func TestStalledWritesAndIdleConnectionsBounded(t *testing.T) {
	ctx := t.Context()
	u := startUp(t, ctx, t.TempDir(), "--dram", "32MiB", "--ssd", "512MiB")
	c, err := client.New(client.Config{Masters: []string{u.grpc}, Tier: "ssd", EngineConfig: engine.Config{NoShm: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ssd string
	var ssdSize uint64
	for _, s := range st.Segments {
		if strings.Contains(s.Name, "/ssd") {
			ssd, ssdSize = s.Name, s.Capacity
		}
	}
	if ssd == "" {
		t.Fatalf("no SSD segment in %v", st.Segments)
	}
	pid := u.cmd.Process.Pid
	before := rssBytes(t, pid)
	value := make([]byte, 256<<10)
	check := func(what string) {
		t.Helper()
		for i := range 3 {
			k := fmt.Sprintf("ok/%s/%d", what, i)
			ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			err := c.Put(ctx, k, value)
			if err == nil {
				_, err = c.Get(ctx, k)
			}
			cancel()
			if err != nil {
				t.Fatalf("%s: put and get of %s: %v", what, k, err)
			}
		}
	}
	check("before")
	// 1,000 stalled writes, as many as one host may hold (the engine's cap
	// per peer host is 1,024 connections): 500 without a ticket, refused
	// before their bytes reach the segment (the server discards the
	// payload they announced as it comes, and gets none), and 500 with the
	// ticket of a put of 1 MiB, stalled inside it.
	startHolders(t, 1, 500, u.engine, ssd, 0, ssdSize, nil)
	start, err := pb.NewMasterClient(dialMaster(t, u.grpc)).BatchPutStart(ctx, &pb.BatchPutStartRequest{
		Items: []*pb.PutStartRequest{{Key: "stalled", Size: 1 << 20, Tier: pb.Tier_TIER_SSD}}})
	if err != nil || len(start.Results[0].GetReplicas()) != 1 {
		t.Fatalf("PutStart of the stalled put: %v %v", start, err)
	}
	r := start.Results[0].Replicas[0]
	startHolders(t, 1, 500, u.engine, r.Segment, r.Offset, 1<<20, r.Ticket)
	check("stalled")
	startHolders(t, 2, 10000, u.engine, "", 0, 0, nil)
	check("idle")
	peak := rssBytes(t, pid)
	t.Logf("daemon RSS %d MiB before, %d MiB with 1,000 stalled writes and 20,000 idle connections", before>>20, peak>>20)
	if peak > 200<<20 {
		t.Fatalf("daemon RSS %d MiB, want under 200", peak>>20)
	}
	// The master answers as ever.
	if _, err := c.Status(ctx); err != nil {
		t.Fatalf("status: %v", err)
	}
	if err := errors.Join(c.BatchRemove(ctx, []string{"ok/before/0"})...); err != nil {
		t.Fatal(err)
	}
}

// openSessionsEnv names, in a child of the test binary, the agent socket
// it opens sessions on, as many as the agent lets it (at most
// OPEN_MAX); it prints how many, and the code of the refusal, then waits
// until killed or its stdin closes.
const openSessionsEnv = "TIDEPOOL_TEST_OPEN_SESSIONS"

func openSessions(sock string) int {
	most, _ := strconv.Atoi(os.Getenv("OPEN_MAX"))
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ag := pb.NewAgentClient(cc)
	n, refused := 0, codes.OK
	for ; n < most; n++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := ag.Open(ctx, &pb.OpenRequest{Client: "hog", ShmBytes: 1 << 20})
		cancel()
		if err != nil {
			refused = status.Code(err)
			break
		}
	}
	fmt.Println(n, refused)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	return 0
}

// sessionHog is a child process holding agent sessions.
type sessionHog struct {
	cmd     *exec.Cmd
	opened  int
	refused string
}

func startSessionHog(t *testing.T, sock string, most int) *sessionHog {
	t.Helper()
	cmd, line := startChild(t, openSessionsEnv+"="+sock, "OPEN_MAX="+strconv.Itoa(most))
	h := &sessionHog{cmd: cmd}
	if _, err := fmt.Sscan(line, &h.opened, &h.refused); err != nil {
		t.Fatalf("session hog: %q, %v", line, err)
	}
	return h
}

// TestSessionsEndWithTheirProcess: sessions were not tied to the process
// that opened them; one that opened 256 and exited locked every other
// process out for --session-idle (10 minutes). Now one process holds at
// most --max-sessions-per-process, and its sessions end within a second
// of its death.
func TestSessionsEndWithTheirProcess(t *testing.T) {
	ctx := t.Context()
	u := startUp(t, ctx, t.TempDir(), "--dram", "64MiB", "--ssd", "0")
	sock := t.TempDir() + "/agent.sock"
	agentHTTP := freeAddr(t)
	startDaemon(t, ctx, "agent", func() ([]string, string) {
		return []string{"agent", "--socket", sock, "--masters", u.grpc, "--http", agentHTTP, "--max-sessions", "40",
			"--max-sessions-per-process", "32", "--max-session-bytes", "1MiB"}, agentHTTP
	})
	hog := startSessionHog(t, sock, 100)
	if hog.opened != 32 || hog.refused != "ResourceExhausted" {
		t.Fatalf("one process opened %d sessions (refused: %s), want 32 and then ResourceExhausted", hog.opened, hog.refused)
	}
	other := startSessionHog(t, sock, 100)
	if other.opened != 8 || other.refused != "ResourceExhausted" {
		t.Fatalf("a second process opened %d of the 8 left (refused: %s)", other.opened, other.refused)
	}
	if err := hog.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = hog.cmd.Wait()
	killed := time.Now()
	waitFor(t, 5*time.Second, func() error {
		n, err := counter(agentHTTP, "tidepool_agent_sessions_orphaned_total")
		if err == nil && n < 32 {
			err = fmt.Errorf("%v of 32 sessions ended", n)
		}
		return err
	})
	if took := time.Since(killed); took > time.Second {
		t.Errorf("the dead process's sessions ended %v after it, want within a second", took)
	}
	if third := startSessionHog(t, sock, 10); third.opened != 10 {
		t.Fatalf("after the hog died another process opened %d of 10 sessions (refused: %s)", third.opened, third.refused)
	}
}
