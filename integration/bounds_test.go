//go:build linux

package integration

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
)

// holdConnsEnv names, in a child of the test binary, the engine address it
// opens connections to: HOLD_N of them, each idle, or each a stalled write
// if HOLD_SEGMENT names a segment. It says "held" on stdout and keeps them
// until its stdin closes.
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
			// A write header for the whole segment, a megabyte but one of
			// payload, then silence (the engine's frame, see engine/frame.go).
			size, _ := strconv.ParseUint(os.Getenv("HOLD_SIZE"), 10, 64)
			b := binary.BigEndian.AppendUint16(nil, 0x5450)
			b = append(b, 1, 2)
			b = binary.BigEndian.AppendUint16(b, uint16(len(seg)))
			b = append(b, seg...)
			b = binary.BigEndian.AppendUint64(b, 0)
			b = binary.BigEndian.AppendUint64(b, size)
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

// startHolders starts procs children that hold n connections each to addr
// (stalled writes to seg if not empty) and waits until they have them.
func startHolders(t *testing.T, procs, n int, addr, seg string, segSize uint64) {
	t.Helper()
	for range procs {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), holdConnsEnv+"="+addr, "HOLD_N="+strconv.Itoa(n), "HOLD_SEGMENT="+seg, "HOLD_SIZE="+strconv.FormatUint(segSize, 10))
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
		t.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || strings.TrimSpace(line) != "held" {
			t.Fatalf("connection holder: %q, %v", line, err)
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
	startHolders(t, 2, 500, u.engine, ssd, ssdSize)
	check("stalled")
	startHolders(t, 2, 10000, u.engine, "", 0)
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
