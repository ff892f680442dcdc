package deploy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
)

// review18Binary builds tidepool (through checkFlags, which builds it once)
// and returns its path.
func review18Binary(t *testing.T, objs []any) string {
	t.Helper()
	checkFlags(t, objs)
	return filepath.Join(helpDir, "tidepool")
}

func review18Port(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// review18MasterArgs renders the chart with master.replicas = replicas and
// returns master i's container args with $(POD_NAME) substituted. If local
// is not nil, every master's DNS name (and the 0.0.0.0 binds) is replaced
// by 127.0.0.1 and the ports local gives, and --dir by dir: the chart's
// flags, on loopback.
func review18MasterArgs(t *testing.T, replicas, i int, local func(j int) (grpc, raft, http int), dir string) ([]string, []any) {
	t.Helper()
	objs := renderWith(t, map[string]any{"master": map[string]any{"replicas": replicas}})
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	pod := fmt.Sprintf("tp-tidepool-master-%d", i)
	var out []string
	for _, a := range sts.Spec.Template.Spec.Containers[0].Args {
		a = strings.ReplaceAll(a, "$(POD_NAME)", pod)
		if local != nil {
			for j := range 9 {
				g, r, _ := local(j)
				host := fmt.Sprintf("tp-tidepool-master-%d.tp-tidepool-master-peers.kv.svc", j)
				a = strings.ReplaceAll(a, host+":50051", fmt.Sprintf("127.0.0.1:%d", g))
				a = strings.ReplaceAll(a, host+":50052", fmt.Sprintf("127.0.0.1:%d", r))
			}
			g, r, h := local(i)
			switch {
			case strings.HasPrefix(a, "--listen="):
				a = fmt.Sprintf("--listen=127.0.0.1:%d", g)
			case strings.HasPrefix(a, "--raft="):
				a = fmt.Sprintf("--raft=127.0.0.1:%d", r)
			case strings.HasPrefix(a, "--http="):
				a = fmt.Sprintf("--http=127.0.0.1:%d", h)
			case strings.HasPrefix(a, "--dir="):
				a = "--dir=" + dir
			}
		}
		out = append(out, a)
	}
	return out, objs
}

// renderWith renders the chart with the given values (as `helm template tp
// helm/tidepool -n kv --set ...`).
func renderWith(t *testing.T, vals map[string]any) []any {
	t.Helper()
	objs, err := renderValues(vals)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// TestReview18MasterStartsBeforeItsDNSRecord shows that a master started
// exactly as the chart starts it exits at once when its own name under the
// headless service does not resolve yet: master/raftnet.go listenRaft
// resolves --raft-advertise ($(POD_NAME).tp-tidepool-master-peers.kv.svc)
// with net.ResolveTCPAddr at start and startRaft returns that error. In a
// cluster a new pod's container starts before the kubelet has reported its
// IP, so before the EndpointSlice and CoreDNS have its record: every new
// master pod (first install, rescheduling, a deleted pod) fails its first
// start and goes through CrashLoopBackOff. Here the name never resolves,
// which is the state of cluster DNS during that window. The test wants the
// master to keep running (wait for its name) rather than exit.
func TestReview18MasterStartsBeforeItsDNSRecord(t *testing.T) {
	g, r, h := review18Port(t), review18Port(t), review18Port(t)
	args, objs := review18MasterArgs(t, 1, 0, nil, "")
	bin := review18Binary(t, objs)
	for i, a := range args {
		switch {
		case strings.HasPrefix(a, "--listen="):
			args[i] = fmt.Sprintf("--listen=127.0.0.1:%d", g)
		case strings.HasPrefix(a, "--raft="):
			args[i] = fmt.Sprintf("--raft=127.0.0.1:%d", r)
		case strings.HasPrefix(a, "--http="):
			args[i] = fmt.Sprintf("--http=127.0.0.1:%d", h)
		case strings.HasPrefix(a, "--dir="):
			args[i] = "--dir=" + t.TempDir()
		}
	}
	cmd := exec.Command(bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		t.Fatalf("the master exited (%v) before its DNS record existed:\n%s\nargs: %q", err, out.String(), args)
	case <-time.After(5 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

func review18Leader(addr string) (bool, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return false, err
	}
	return strings.Contains(string(b), "\ntidepool_master_is_leader 1\n"), nil
}

// TestReview18GrowOneToThreeMasters shows what deploy/README.md's "Growing
// the masters" does to a release installed with the default one master:
// raising master.replicas to 3 starts tp-tidepool-master-1 and -2 with the
// chart's new --peers (all three) and no raft state, so startRaft
// (master/server.go) bootstraps them as a new three-voter cluster. Two of
// three is a quorum: they elect a leader of their own, with an empty table,
// beside master-0's cluster (and raft at equal terms makes master-0 step
// down to it, while both logs start with a different entry at index 1 term
// 1). The chart gives the new masters no --join. Here master-0 runs with the
// args of the one-master release, master-1 and -2 with those of the
// three-master one, on loopback. The test wants no master other than
// master-0 to become a leader before an operator adds them.
func TestReview18GrowOneToThreeMasters(t *testing.T) {
	type ports struct{ g, r, h int }
	ps := make([]ports, 3)
	for i := range ps {
		ps[i] = ports{review18Port(t), review18Port(t), review18Port(t)}
	}
	local := func(j int) (int, int, int) {
		if j >= len(ps) {
			return 1, 1, 1
		}
		return ps[j].g, ps[j].r, ps[j].h
	}
	start := func(bin string, args []string) { startProcess(t, bin, args) }
	args0, objs := review18MasterArgs(t, 1, 0, local, t.TempDir())
	bin := review18Binary(t, objs)
	start(bin, args0)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if ok, _ := review18Leader(fmt.Sprintf("127.0.0.1:%d", ps[0].h)); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("master-0 alone did not become leader")
		}
		time.Sleep(200 * time.Millisecond)
	}
	for i := 1; i < 3; i++ {
		args, _ := review18MasterArgs(t, 3, i, local, t.TempDir())
		start(bin, args)
	}
	deadline = time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		for i := 1; i < 3; i++ {
			if ok, _ := review18Leader(fmt.Sprintf("127.0.0.1:%d", ps[i].h)); ok {
				l0, _ := review18Leader(fmt.Sprintf("127.0.0.1:%d", ps[0].h))
				t.Fatalf("tp-tidepool-master-%d, started by the chart at replicas=3, became a raft leader of a new cluster (master-0 leader now: %v)", i, l0)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// startProcess runs bin with args until the test ends, and logs the end
// of its output if the test failed.
func startProcess(t *testing.T, bin string, args []string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("tidepool %q:\n%s", args, tail(out.String(), 2000))
		}
	})
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
