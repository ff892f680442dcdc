package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// raftProxy stands in front of one master's raft address. Masters dial
// raft from the host of their --raft address, each its own loopback
// address here, so the proxy tells them apart by source and can cut one
// master off: block drops its connections and refuses new ones.
type raftProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	block  map[string]bool     // source IPs cut off
	all    bool                // every source cut off
	conns  map[net.Conn]string // open client-side connections, by source IP
	wg     sync.WaitGroup
}

func newRaftProxy(t *testing.T, listen, target string) *raftProxy {
	t.Helper()
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		t.Fatal(err)
	}
	p := &raftProxy{ln: ln, target: target, block: map[string]bool{}, conns: map[net.Conn]string{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(func() {
		ln.Close()
		p.cut(func(string) bool { return true })
		p.wg.Wait()
	})
	return p
}

func (p *raftProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		src, _, _ := net.SplitHostPort(c.RemoteAddr().String())
		p.mu.Lock()
		if p.all || p.block[src] {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c] = src
		p.mu.Unlock()
		p.wg.Add(1)
		go p.pipe(c)
	}
}

func (p *raftProxy) pipe(c net.Conn) {
	defer p.wg.Done()
	defer func() {
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.Close()
	}()
	up, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); up.Close(); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); c.Close(); done <- struct{}{} }()
	<-done
	<-done
}

// cut blocks the sources match accepts, and closes their connections.
func (p *raftProxy) cut(match func(src string) bool) {
	p.mu.Lock()
	var open []net.Conn
	for c, src := range p.conns {
		if match(src) {
			p.block[src] = true
			open = append(open, c)
		}
	}
	p.mu.Unlock()
	for _, c := range open {
		c.Close()
	}
}

func (p *raftProxy) blockSources(srcs ...string) {
	p.mu.Lock()
	for _, s := range srcs {
		p.block[s] = true
	}
	p.mu.Unlock()
	p.cut(func(src string) bool {
		for _, s := range srcs {
			if s == src {
				return true
			}
		}
		return false
	})
}

func (p *raftProxy) heal() {
	p.mu.Lock()
	clear(p.block)
	p.all = false
	p.mu.Unlock()
}

// partitioned is three masters whose raft traffic runs through proxies:
// master i listens for raft on 127.0.0.(i+2) and dials from there.
type partitioned struct {
	*haMasters
	ips     []string
	proxies []*raftProxy
}

func freeOn(t *testing.T, ip string) string {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Skipf("cannot listen on %s (a loopback address of its own per master): %v", ip, err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func startPartitioned(t *testing.T, ctx context.Context, extra ...string) *partitioned {
	t.Helper()
	p := &partitioned{haMasters: &haMasters{}}
	var binds, advs, peers []string
	for i := range 3 {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		p.ips = append(p.ips, ip)
		binds, advs = append(binds, freeOn(t, ip)), append(advs, freeOn(t, ip))
		peers = append(peers, fmt.Sprintf("m%d=%s", i+1, advs[i]))
		p.proxies = append(p.proxies, newRaftProxy(t, advs[i], binds[i]))
		p.grpc, p.http, p.raft = append(p.grpc, freeAddr(t)), append(p.http, freeAddr(t)), append(p.raft, advs[i])
	}
	for i := range 3 {
		argv := append([]string{"master", "--id", fmt.Sprintf("m%d", i+1), "--dir", t.TempDir(), "--listen", p.grpc[i],
			"--raft", binds[i], "--raft-advertise", advs[i], "--http", p.http[i], "--peers", strings.Join(peers, ",")}, extra...)
		p.argv = append(p.argv, argv)
		p.procs = append(p.procs, startProc(t, fmt.Sprintf("master m%d", i+1), argv...))
	}
	for i, proc := range p.procs {
		if err := waitReady(ctx, proc, p.http[i], readyTimeout); err != nil {
			t.Fatalf("master m%d not ready: %v", i+1, err)
		}
	}
	p.check.register(t, p.live)
	return p
}

// isolate cuts master i off from the others, both ways.
func (p *partitioned) isolate(i int) {
	for j, px := range p.proxies {
		if j == i {
			px.mu.Lock()
			px.all = true
			px.mu.Unlock()
			px.cut(func(string) bool { return true })
		} else {
			px.blockSources(p.ips[i])
		}
	}
}

func (p *partitioned) heal() {
	for _, px := range p.proxies {
		px.heal()
	}
}

// TestPartitionedLeader: the leader of three masters is cut off from the
// other two while clients go on using it. It acknowledges no put made
// after the cut, and every read lease it grants after the cut ends before
// the new leader may break it (the new leader waits out its first lease
// TTL, counted from when it took over, plus raft's step-down lag). The
// other two elect a leader and serve puts; once healed, the old leader
// follows, one leader serves, and every acknowledged put reads back.
func TestPartitionedLeader(t *testing.T) {
	if testing.Short() {
		t.Skip("partitions a raft group")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const leaseTTL = 2 * time.Second
	p := startPartitioned(t, ctx, "--lease-ttl", leaseTTL.String(), "--put-timeout", "3s")
	startStore(t, ctx, "s1", strings.Join(p.grpc, ","), "dram:256MiB")
	c := newClient(t, p.grpc...)

	val := func(k string) []byte { return faultValue(k, 8<<10) }
	var acked []string
	for i := range 20 {
		k := fmt.Sprintf("before/%d", i)
		if err := c.Put(ctx, k, val(k)); err != nil {
			t.Fatal(err)
		}
		acked = append(acked, k)
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var old int
	if _, err := fmt.Sscanf(st.LeaderId, "m%d", &old); err != nil {
		t.Fatalf("leader %q", st.LeaderId)
	}
	old--
	// A client that knows the old leader alone, made now: it learns no
	// other master for 10 s, longer than the partition.
	pinned := newClient(t, p.grpc[old])
	if _, err := pinned.Get(ctx, "before/0"); err != nil {
		t.Fatal(err)
	}

	p.isolate(old)
	cutAt := time.Now()
	type read struct{ ret time.Time }
	var (
		oldReads  []read
		oldPuts   []string
		stopOld   = make(chan struct{})
		oldWorker sync.WaitGroup
		tried     int
	)
	oldWorker.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stopOld:
				return
			default:
			}
			rctx, rcancel := context.WithTimeout(ctx, 200*time.Millisecond)
			if _, err := pinned.Get(rctx, fmt.Sprintf("before/%d", i%20)); err == nil {
				oldReads = append(oldReads, read{time.Now()})
			}
			rcancel()
		}
	})
	oldWorker.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stopOld:
				return
			default:
			}
			pctx, pcancel := context.WithTimeout(ctx, 300*time.Millisecond)
			k := fmt.Sprintf("old/%d", i)
			tried = i + 1
			if err := pinned.Put(pctx, k, val(k)); err == nil {
				oldPuts = append(oldPuts, k)
			}
			pcancel()
		}
	})

	// The majority side elects a leader and serves puts.
	views := make([]*client.Client, 3) // each asks its own master for its status
	for i := range views {
		views[i] = newClient(t, p.grpc[i])
	}
	var newLeader int
	var since time.Time
	waitFor(t, 30*time.Second, func() error {
		for i := range 3 {
			if i == old {
				continue
			}
			s, err := views[i].Status(ctx)
			if err != nil || s.LeaderSinceUnixNano == 0 {
				continue
			}
			if _, err := fmt.Sscanf(s.LeaderId, "m%d", &newLeader); err == nil && newLeader-1 != old {
				since = time.Unix(0, s.LeaderSinceUnixNano)
				return nil
			}
		}
		return errors.New("no new leader yet")
	})
	t.Logf("m%d cut off; m%d leads %v after the cut", old+1, newLeader, since.Sub(cutAt).Round(time.Millisecond))
	for i := range 20 {
		k := fmt.Sprintf("during/%d", i)
		pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
		err := c.Put(pctx, k, val(k))
		pcancel()
		if err != nil {
			t.Fatalf("put on the majority side: %v", err)
		}
		acked = append(acked, k)
	}
	close(stopOld)
	oldWorker.Wait()
	if len(oldPuts) > 0 {
		t.Fatalf("the cut-off leader acknowledged %d puts made after the cut: %v", len(oldPuts), oldPuts)
	}
	for _, r := range oldReads {
		// A lease granted before ret ends before ret+TTL; the new leader
		// breaks none before since+TTL+step-down lag (500 ms).
		if r.ret.After(since.Add(500 * time.Millisecond)) {
			t.Fatalf("the cut-off leader granted a read at %v, after the new leader took over at %v",
				r.ret.Sub(cutAt), since.Sub(cutAt))
		}
	}
	t.Logf("the cut-off leader served %d reads after the cut, the last %v after it", len(oldReads),
		func() time.Duration {
			if len(oldReads) == 0 {
				return 0
			}
			return oldReads[len(oldReads)-1].ret.Sub(cutAt).Round(time.Millisecond)
		}())

	p.heal()
	waitFor(t, 30*time.Second, func() error {
		leaders := map[string]bool{}
		for i := range 3 {
			s, err := views[i].Status(ctx)
			if err != nil {
				return err
			}
			leaders[s.LeaderId] = true
		}
		if len(leaders) != 1 || leaders[""] {
			return fmt.Errorf("masters disagree on the leader: %v", leaders)
		}
		return nil
	})
	// The pinned client reaches the leader through the old one again.
	waitFor(t, 30*time.Second, func() error {
		return pinned.Put(ctx, "after", val("after"))
	})
	acked = append(acked, "after")
	got, errs := c.BatchGet(ctx, acked)
	for i, k := range acked {
		if errs[i] != nil || !bytes.Equal(got[i], val(k)) {
			t.Fatalf("acknowledged %s: %d bytes, %v", k, len(got[i]), errs[i])
		}
	}
	for i := range tried {
		k := fmt.Sprintf("old/%d", i)
		if ok, err := c.Exists(ctx, k); err != nil || ok {
			t.Fatalf("%s, put through the cut-off leader and not acknowledged, exists after healing: %v, %v", k, ok, err)
		}
	}
}
