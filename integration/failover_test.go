package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// haMasters is a cluster of masters, each a real process with its own
// directory and ports.
type haMasters struct {
	procs            []*proc
	argv             [][]string
	grpc, http, raft []string
	check            extentCheck
}

// startMasters starts n masters of one new cluster and waits until each
// knows the leader (none can be ready before a quorum runs).
func startMasters(t *testing.T, ctx context.Context, n int, extra ...string) *haMasters {
	t.Helper()
	dirs := make([]string, n)
	for i := range dirs {
		dirs[i] = t.TempDir()
	}
	return startMastersIn(t, ctx, dirs, extra...)
}

// startMastersIn is startMasters with master i's data in dirs[i].
func startMastersIn(t *testing.T, ctx context.Context, dirs []string, extra ...string) *haMasters {
	t.Helper()
	n := len(dirs)
	h := &haMasters{}
	var peers []string
	for i := range n {
		h.grpc = append(h.grpc, freeAddr(t))
		h.http = append(h.http, freeAddr(t))
		h.raft = append(h.raft, freeAddr(t))
		peers = append(peers, fmt.Sprintf("m%d=%s", i+1, h.raft[i]))
	}
	for i := range n {
		argv := append([]string{"master", "--id", fmt.Sprintf("m%d", i+1), "--dir", dirs[i],
			"--listen", h.grpc[i], "--raft", h.raft[i], "--http", h.http[i], "--peers", strings.Join(peers, ",")}, extra...)
		h.argv = append(h.argv, argv)
		h.procs = append(h.procs, startProc(t, fmt.Sprintf("master m%d", i+1), argv...))
	}
	for i, p := range h.procs {
		if err := waitReady(ctx, p, h.http[i], readyTimeout); err != nil {
			t.Fatalf("master m%d not ready: %v", i+1, err)
		}
	}
	h.check.register(t, h.live)
	return h
}

// live is the addresses of the masters that still run.
func (h *haMasters) live() []string { return liveOf(h.procs, h.grpc) }

// restart starts master i again on its directory and ports.
func (h *haMasters) restart(t *testing.T, ctx context.Context, i int) {
	t.Helper()
	h.procs[i] = startProc(t, fmt.Sprintf("master m%d (restarted)", i+1), h.argv[i]...)
	if err := waitReady(ctx, h.procs[i], h.http[i], readyTimeout); err != nil {
		t.Fatalf("restarted master m%d not ready: %v", i+1, err)
	}
	h.check.register(t, h.live)
}

// faultValue is the value of key: its bytes name it, so a get that returns
// another object's bytes is caught even if that object's checksum holds.
func faultValue(key string, size int) []byte {
	v := make([]byte, 0, size+sha256.Size)
	seed := sha256.Sum256([]byte(key))
	for ctr := uint64(0); len(v) < size; ctr++ {
		var b [40]byte
		copy(b[:], seed[:])
		binary.LittleEndian.PutUint64(b[32:], ctr)
		h := sha256.Sum256(b[:])
		v = append(v, h[:]...)
	}
	return v[:size]
}

// TestPutsThroughLeaderKills: puts at concurrency 8 while the leader of
// three masters is killed (SIGKILL) five times. Every acknowledged put reads
// back byte for byte; a put that failed either reads back whole or is not
// there; and once no write can land, no space is held for a failed put.
func TestPutsThroughLeaderKills(t *testing.T) {
	if testing.Short() {
		t.Skip("kills masters for a minute")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const putTimeout = 3 * time.Second
	h := startMasters(t, ctx, 3, "--put-timeout", putTimeout.String(), "--lease-ttl", "1s")
	masters := strings.Join(h.grpc, ",")
	startStore(t, ctx, "s1", masters, "dram:1GiB")
	c := newClient(t, h.grpc...)

	// A few fixed sizes, so puts of one shape come in streams and use
	// grants placed by a leader that may be gone by the time they end.
	sizes := []int{4 << 10, 16<<10 + 5, 64 << 10, 100<<10 + 1}
	const budget = 400 << 20 // stays below the eviction watermark
	type put struct {
		key  string
		size int
		err  error
	}
	var (
		mu    sync.Mutex
		puts  []put
		acked atomic.Int64
		total atomic.Int64
		stop  = make(chan struct{})
		wg    sync.WaitGroup
	)
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if total.Load() > budget {
					return
				}
				p := put{key: fmt.Sprintf("w%d/%06d", w, i), size: sizes[(w+i/16)%len(sizes)]}
				pctx, pcancel := context.WithTimeout(ctx, 30*time.Second)
				p.err = c.Put(pctx, p.key, faultValue(p.key, p.size))
				pcancel()
				if p.err == nil {
					acked.Add(1)
					total.Add(int64(p.size))
				}
				mu.Lock()
				puts = append(puts, p)
				mu.Unlock()
			}
		})
	}
	leader := func() int {
		var id string
		waitFor(t, 30*time.Second, func() error {
			st, err := c.Status(ctx)
			if err != nil {
				return err
			}
			if id = st.LeaderId; id == "" {
				return errors.New("no leader")
			}
			return nil
		})
		var i int
		if _, err := fmt.Sscanf(id, "m%d", &i); err != nil || i < 1 || i > 3 {
			t.Fatalf("leader id %q", id)
		}
		return i - 1
	}
	for kill := range 5 {
		// Kill while puts succeed, not before the cluster got going again.
		from := acked.Load()
		waitFor(t, 60*time.Second, func() error {
			if n := acked.Load(); n < from+50 {
				return fmt.Errorf("%d puts acknowledged since the last kill, want 50", n-from)
			}
			return nil
		})
		i := leader()
		t.Logf("kill %d: SIGKILL leader m%d after %d acknowledged puts", kill+1, i+1, acked.Load())
		h.procs[i].kill(t)
		h.restart(t, ctx, i)
	}
	close(stop)
	wg.Wait()

	var failed int
	for _, p := range puts {
		got, err := c.Get(ctx, p.key)
		switch {
		case p.err == nil && err != nil:
			t.Errorf("acknowledged put %s (%d bytes): get: %v", p.key, p.size, err)
		case err == nil && !bytes.Equal(got, faultValue(p.key, p.size)):
			t.Errorf("get %s: %d bytes that are not its value (put error: %v)", p.key, len(got), p.err)
		case err != nil && !errors.Is(err, client.ErrNotFound):
			t.Errorf("failed put %s (%v): get: %v, want its value or not found", p.key, p.err, err)
		}
		if p.err != nil {
			failed++
		}
	}
	t.Logf("%d puts, %d acknowledged, %d failed; all read back", len(puts), acked.Load(), failed)

	// Once no write placed by any leader can land (a reservation's window,
	// the put timeout and the late-write grace), every byte in use belongs
	// to an object.
	waitFor(t, 60*time.Second, func() error {
		st, err := c.Status(ctx)
		if err != nil {
			return err
		}
		objs, err := c.List(ctx, "")
		if err != nil {
			return err
		}
		var want uint64
		for _, o := range objs {
			want += (o.Size + 63) / 64 * 64
		}
		for _, s := range st.Segments {
			if s.Alive && (s.Reserved != 0 || s.Used != want) {
				return fmt.Errorf("segment %s: used %d, reserved %d; want %d used by %d objects, nothing reserved",
					s.Name, s.Used, s.Reserved, want, len(objs))
			}
		}
		return nil
	})
}
