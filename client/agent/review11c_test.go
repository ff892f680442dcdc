package agent_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// review11cAgent is an agent on a unix socket whose path the test knows
// (for child processes), with a client of it. Its client's master is
// never asked: these tests only open sessions and ask for stats.
type review11cAgent struct {
	sock string
	ac   pb.AgentClient
}

func startReview11cAgent(t *testing.T) *review11cAgent {
	t.Helper()
	cl, err := client.New(client.Config{Masters: []string{"127.0.0.1:1"}, Logger: mastertest.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	srv, err := agent.New(agent.Config{Client: cl, Logger: mastertest.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "tpa")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	a := &review11cAgent{sock: filepath.Join(dir, "agent.sock")}
	ln, err := net.Listen("unix", a.sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("close agent: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	conn, err := grpc.NewClient("unix://"+a.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	a.ac = pb.NewAgentClient(conn)
	return a
}

// sessionOpen reports whether the agent still knows session id.
func (a *review11cAgent) sessionOpen(t *testing.T, id uint64) bool {
	t.Helper()
	_, err := a.ac.Stats(testCtx(t), &pb.SessionRef{Session: id})
	if status.Code(err) == codes.NotFound {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

const review11cChildEnv = "TIDEPOOL_REVIEW11C_AGENT_SOCK"

// review11cChild, in a child process (the test binary run again), opens a
// session on the agent at sock, prints its id and exits.
func review11cChild(sock string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err == nil {
		var resp *pb.OpenResponse
		if resp, err = pb.NewAgentClient(conn).Open(ctx, &pb.OpenRequest{Client: "child", ShmBytes: 4096}); err == nil {
			fmt.Println(resp.Session)
			os.Exit(0)
		}
	}
	fmt.Println("error:", err)
	os.Exit(1)
}

// startChild runs a child process that opens a session and exits; it
// returns the child, not yet waited for, and the session's id.
func startChild(t *testing.T, sock, test string) (*exec.Cmd, uint64) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), review11cChildEnv+"="+sock)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	var id uint64
	if _, serr := fmt.Sscan(line, &id); err != nil || serr != nil {
		t.Fatalf("child: %q, %v %v", line, err, serr)
	}
	return cmd, id
}

// processState is field 3 of /proc/PID/stat: R, S, Z...
func processState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "gone"
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && len(s) > i+2 {
		return s[i+2 : i+3]
	}
	return "?"
}

// TestReview11cSessionsOfAnExitedUnreapedProcess: a process that has
// exited but whose parent has not waited for it yet is a zombie, and
// /proc/PID/stat still shows its pid and start time, so peer.go's alive
// holds and its sessions never end by reapOrphans: not while its parent
// neglects to wait (a multiprocessing pool, a supervisor), and never in
// a container whose PID 1 does not reap the orphans it inherits. The
// session ends on exit once the child is reaped (first part), not when it
// exits (second part): alive should read the state field (Z, X) too.
func TestReview11cSessionsOfAnExitedUnreapedProcess(t *testing.T) {
	if sock := os.Getenv(review11cChildEnv); sock != "" {
		review11cChild(sock)
	}
	a := startReview11cAgent(t)

	reaped, id := startChild(t, a.sock, t.Name())
	if err := reaped.Wait(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Second, "the session of the exited and reaped child to end", func() bool { return !a.sessionOpen(t, id) })

	zombie, id := startChild(t, a.sock, t.Name())
	waitFor(t, 5*time.Second, "the second child to exit", func() bool { return processState(zombie.Process.Pid) == "Z" })
	exited := time.Now()
	deadline := exited.Add(2 * time.Second)
	for a.sessionOpen(t, id) {
		if time.Now().After(deadline) {
			t.Fatalf("the session of a child that exited %v ago (pid %d, state %s, not yet waited for by its parent) is still open",
				time.Since(exited).Round(time.Millisecond), zombie.Process.Pid, processState(zombie.Process.Pid))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReview11cSessionsSurviveAnUnreadableProc: alive takes any failure
// to read /proc/PID/stat for the process's death. An agent out of file
// descriptors for a moment (EMFILE: each session holds a memfd, each
// attached region another, and gRPC a socket per connection) reads no
// /proc file, and reapOrphans ends the sessions of every live process.
func TestReview11cSessionsSurviveAnUnreadableProc(t *testing.T) {
	a := startReview11cAgent(t)
	resp, err := a.ac.Open(testCtx(t), &pb.OpenRequest{Client: "live", ShmBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	// Use up the descriptors for a second (four owner checks), then give
	// them back. Lower the soft limit for it, so that is few.
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = 4096
	if low.Cur > lim.Cur {
		low.Cur = lim.Cur
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var fds []int
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			if !errors.Is(err, unix.EMFILE) {
				t.Errorf("open: %v", err)
			}
			break
		}
		fds = append(fds, fd)
	}
	time.Sleep(time.Second)
	for _, fd := range fds {
		unix.Close(fd)
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if !a.sessionOpen(t, resp.Session) {
		t.Fatalf("the session of this live process (pid %d) ended while the agent had no file descriptor free for a second", os.Getpid())
	}
}
