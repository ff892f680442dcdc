package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// joiner is a master started with --join: it serves, but is in no cluster
// until the leader adds it.
type joiner struct {
	*proc
	id, grpc, raft, http string
}

func startJoiner(t *testing.T, ctx context.Context, id string) *joiner {
	t.Helper()
	j := &joiner{id: id, grpc: freeAddr(t), raft: freeAddr(t), http: freeAddr(t)}
	j.proc = startProc(t, "master "+id, "master", "--id", id, "--dir", t.TempDir(), "--join",
		"--listen", j.grpc, "--raft", j.raft, "--http", j.http)
	// Not ready (no leader) before it is added: wait for it to serve.
	if err := poll(ctx, readyTimeout, func() error {
		if j.exited() {
			return fmt.Errorf("%s exited: %v", id, j.err)
		}
		resp, err := httpClient.Get("http://" + j.http + "/healthz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/healthz: %s", resp.Status)
		}
		return nil
	}); err != nil {
		t.Fatalf("joining master %s: %v", id, err)
	}
	return j
}

// TestGrowAndReplaceMasters: a one-master cluster under put load grows to
// three with `admin members add`, then one master is replaced (a fourth
// added, the first removed and stopped). The store and the client were
// given the first master's address alone; nothing acknowledged is lost,
// and a change that would lose quorum is refused.
func TestGrowAndReplaceMasters(t *testing.T) {
	if testing.Short() {
		t.Skip("changes raft membership under load")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	m1 := startMaster(t, ctx, t.TempDir())
	startStore(t, ctx, "s1", m1.grpc, "dram:2GiB") // far more than the puts write: nothing is evicted
	c := newClient(t, m1.grpc)

	var (
		mu    sync.Mutex
		acked []string
		fails []string
		stop  = make(chan struct{})
		wg    sync.WaitGroup
	)
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := fmt.Sprintf("w%d/%06d", w, i)
				pctx, pcancel := context.WithTimeout(ctx, 30*time.Second)
				err := c.Put(pctx, k, faultValue(k, 4<<10))
				pcancel()
				mu.Lock()
				if err == nil {
					acked = append(acked, k)
				} else {
					fails = append(fails, err.Error())
				}
				mu.Unlock()
			}
		})
	}
	progress := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(acked)
	}
	// Puts go on through each step.
	advancing := func(step string) {
		t.Helper()
		from := progress()
		waitFor(t, 30*time.Second, func() error {
			if n := progress(); n < from+50 {
				return fmt.Errorf("%s: %d puts acknowledged since, want 50", step, n-from)
			}
			return nil
		})
	}
	advancing("one master")

	members := func(masters string) string {
		t.Helper()
		return string(mustCLI(t, ctx, nil, "admin", "members", "--masters", masters).stdout)
	}
	var joined []*joiner
	for _, id := range []string{"m2", "m3"} {
		j := startJoiner(t, ctx, id)
		joined = append(joined, j)
		mustCLI(t, ctx, nil, "admin", "members", "add", id, j.raft, j.grpc, "--masters", m1.grpc)
		advancing("after adding " + id)
	}
	waitFor(t, 30*time.Second, func() error {
		out := members(m1.grpc)
		for _, a := range []string{m1.grpc, joined[0].grpc, joined[1].grpc} {
			if !strings.Contains(out, a) {
				return fmt.Errorf("members do not list %s yet:\n%s", a, out)
			}
		}
		if strings.Contains(out, " no\n") {
			return fmt.Errorf("a master does not answer:\n%s", out)
		}
		return nil
	})
	// Every master's address is known to every master, a follower once it
	// has applied the entry that the leader already answers from.
	for _, j := range joined {
		waitFor(t, 10*time.Second, func() error {
			out := string(mustCLI(t, ctx, nil, "status", "--masters", j.grpc).stdout)
			for _, a := range []string{m1.grpc, joined[0].grpc, joined[1].grpc} {
				if !strings.Contains(out, a) {
					return fmt.Errorf("status through %s does not show %s:\n%s", j.id, a, out)
				}
			}
			return nil
		})
	}

	// Removing two of three would leave one voter of a cluster whose other
	// master is stopped: refused.
	joined[1].kill(t)
	r := cli(t, ctx, nil, "admin", "members", "remove", "m2", "--masters", m1.grpc)
	if r.code == 0 || !strings.Contains(r.stderr, "quorum") {
		t.Fatalf("removing m2 with m3 stopped: %v, want a refusal for quorum", r)
	}
	mustCLI(t, ctx, nil, "admin", "members", "remove", "m3", "--masters", m1.grpc)
	advancing("after removing the stopped m3")

	// Replace m1: add m4, remove m1, stop it. The store and the client
	// learn the masters from the members the leader reports every 10 s
	// (leaderconn's refresh); give them that period.
	m4 := startJoiner(t, ctx, "m4")
	mustCLI(t, ctx, nil, "admin", "members", "add", "m4", m4.raft, m4.grpc, "--masters", m1.grpc)
	learned := time.Now().Add(12 * time.Second)
	waitFor(t, 30*time.Second, func() error {
		if time.Now().Before(learned) {
			return fmt.Errorf("the refresh period has not passed")
		}
		return nil
	})
	advancing("with m1, m2 and m4")
	mustCLI(t, ctx, nil, "admin", "members", "remove", "m1", "--masters", joined[0].grpc+","+m4.grpc)
	m1.term(t, 10*time.Second)
	advancing("after m1 was replaced")
	out := members(joined[0].grpc + "," + m4.grpc)
	if strings.Contains(out, "m1") || !strings.Contains(out, "m4") {
		t.Fatalf("members after replacing m1:\n%s", out)
	}

	close(stop)
	wg.Wait()
	mu.Lock()
	keys := append([]string(nil), acked...)
	t.Logf("%d puts acknowledged, %d failed: %q", len(keys), len(fails), fails)
	mu.Unlock()
	for chunk := range slices.Chunk(keys, 4096) {
		got, errs := c.BatchGet(ctx, chunk)
		for i, k := range chunk {
			if errs[i] != nil || !bytes.Equal(got[i], faultValue(k, 4<<10)) {
				t.Fatalf("acknowledged %s: %d bytes, %v", k, len(got[i]), errs[i])
			}
		}
	}
	checkNoSharedExtents(t, joined[0].grpc, m4.grpc)
}

// TestUpLocalCluster: `tidepool up --masters 3 --stores 2` runs a local HA
// cluster of five processes that serves puts and gets, survives the
// leader's SIGKILL, and stops whole on one SIGTERM.
func TestUpLocalCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	u := startUp(t, ctx, t.TempDir(), "--masters", "3", "--stores", "2", "--dram", "64MiB", "--ssd", "0")
	var st string
	waitFor(t, 30*time.Second, func() error { // followers send the leader their addresses
		st = string(mustCLI(t, ctx, nil, "status", "--masters", u.grpc).stdout)
		if n := strings.Count(st, "127.0.0.1:"); n < 1+3+2 {
			return fmt.Errorf("status of the local cluster:\n%s", st)
		}
		return nil
	})
	for _, seg := range []string{"store-0/", "store-1/"} {
		if !strings.Contains(st, seg) {
			t.Fatalf("status shows no %s segment:\n%s", seg, st)
		}
	}
	// up's own status page shows the cluster as its masters answer.
	resp, err := httpClient.Get("http://" + u.http + "/")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if n := strings.Count(string(page), `class="member"`); resp.StatusCode != http.StatusOK || n != 3 || !strings.Contains(string(page), "tidepool up (3 masters, 2 stores)") {
		t.Fatalf("up's status page: %s, %d members:\n%s", resp.Status, n, page)
	}
	put := func(key string) {
		t.Helper()
		mustCLI(t, ctx, strings.NewReader(key), "put", key, "-", "--masters", u.grpc)
		if got := mustCLI(t, ctx, nil, "get", key, "--masters", u.grpc).stdout; string(got) != key {
			t.Fatalf("get %s: %q", key, got)
		}
	}
	put("before")
	// Until up says it is up, a process that exits fails the start and up
	// stops the rest; after, the cluster outlives its processes.
	waitFor(t, 10*time.Second, func() error {
		if !strings.Contains(u.out.String(), "tidepool is up") {
			return errors.New("up has not said it is up")
		}
		return nil
	})
	// The leader's pid is in up's log: kill it. The clients after are
	// given every master's address (the killed leader may be the first).
	leader, all := "", []string{}
	waitFor(t, 20*time.Second, func() error {
		all = all[:0]
		for _, line := range strings.Split(string(mustCLI(t, ctx, nil, "admin", "members", "--masters", u.grpc).stdout), "\n") {
			if f := strings.Fields(line); len(f) == 5 && f[0] != "MASTER" {
				all = append(all, f[1])
				if f[3] == "leader" {
					leader = f[0]
				}
			}
		}
		if leader == "" || len(all) != 3 {
			return fmt.Errorf("no leader yet, or not every master's address (%q)", all)
		}
		return nil
	})
	masters := strings.Join(all, ",")
	pid := 0
	for _, line := range strings.Split(u.out.String(), "\n") {
		if strings.Contains(line, "msg=started process="+leader+" ") {
			fmt.Sscanf(line[strings.Index(line, "pid="):], "pid=%d", &pid)
		}
	}
	if pid == 0 {
		t.Fatalf("no pid of %s in up's output:\n%s", leader, u.out.String())
	}
	t.Logf("SIGKILL leader %s (pid %d) of masters %s", leader, pid, masters)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, func() error {
		r := cli(t, ctx, strings.NewReader("after"), "put", "after", "-", "--masters", masters, "--timeout", "10s")
		if r.code != 0 {
			return fmt.Errorf("put after the leader's kill: %v", r)
		}
		return nil
	})
	if got := mustCLI(t, ctx, nil, "get", "before", "--masters", masters).stdout; string(got) != "before" {
		t.Fatalf("get before after the failover: %q", got)
	}
	checkNoSharedExtents(t, all...) // before the cluster stops
	if code := u.term(t, 30*time.Second); code != 0 {
		t.Fatalf("up exited %d on SIGTERM", code)
	}
	if !strings.Contains(u.out.String(), "exited; the rest of the cluster keeps running") {
		t.Fatalf("up did not report the killed master:\n%s", u.out.String())
	}
	for _, line := range strings.Split(u.out.String(), "\n") {
		var p int
		if i := strings.Index(line, "msg=started process="); i >= 0 {
			fmt.Sscanf(line[strings.Index(line, "pid="):], "pid=%d", &p)
			if p > 0 && syscall.Kill(p, 0) == nil {
				t.Fatalf("process %d still runs after up exited", p)
			}
		}
	}
}
