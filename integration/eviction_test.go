//go:build linux

package integration

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestEvictPoolFill is the memory policy's acceptance test with real
// processes: 1 GiB of puts into a 256 MiB DRAM segment all succeed, the
// sweep brings the segment under its watermark afterwards, a hard-pinned
// object survives it all byte for byte, and `admin evict --prefix P
// --dry-run` lists exactly what `admin evict --prefix P` then removes.
func TestEvictPoolFill(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	const (
		capacity = 256 << 20
		total    = 1 << 30
		leaseTTL = time.Second
		prefix   = "fill/"
	)
	m := startMaster(t, ctx, t.TempDir(), "--lease-ttl", leaseTTL.String())
	leaderSince := time.Now() // ready means leader: it took over before this
	startStore(t, ctx, "s1", m.grpc, fmt.Sprintf("dram:%dMiB", capacity>>20))
	c := newClient(t, m.grpc)
	src := newRand(t)

	// The hard-pinned object is the least recently used of all.
	pinned := object{key: prefix + "pinned", value: randomBytes(src, 5<<20+3)}
	if err := c.Put(ctx, pinned.key, pinned.value); err != nil {
		t.Fatalf("put %s: %v", pinned.key, err)
	}
	mustCLI(t, ctx, nil, "admin", "pin", pinned.key, "--hard", "--masters", m.grpc)

	// A new leader evicts nothing for one lease TTL; the puts below need
	// eviction from about a quarter of the way on, so give it that.
	time.Sleep(time.Until(leaderSince.Add(leaseTTL + 200*time.Millisecond)))

	// Values are slices of one random pool at random offsets.
	pool := randomBytes(src, 16<<20)
	rng := rand.New(src)
	type put struct {
		key       string
		off, size int
	}
	var puts []put
	for n, i := 0, 0; n < total; i++ {
		size := 1<<20 + rng.IntN(7<<20+1)
		puts = append(puts, put{key: fmt.Sprintf("%sobj%04d", prefix, i), off: rng.IntN(len(pool) - size + 1), size: size})
		n += size
	}
	start := time.Now()
	var failed atomic.Int32
	var mu sync.Mutex
	var errs []string
	next := make(chan put)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for p := range next {
				if err := c.Put(ctx, p.key, pool[p.off:p.off+p.size]); err != nil {
					failed.Add(1)
					mu.Lock()
					errs = append(errs, fmt.Sprintf("put %s (%d bytes): %v", p.key, p.size, err))
					mu.Unlock()
				}
			}
		})
	}
	for _, p := range puts {
		next <- p
	}
	close(next)
	wg.Wait()
	took := time.Since(start)
	for _, e := range errs {
		t.Error(e)
	}
	if failed.Load() > 0 {
		t.Fatalf("%d of %d puts failed", failed.Load(), len(puts))
	}
	t.Logf("put %d objects, 1 GiB, into a 256 MiB segment in %v (%.0f MiB/s)", len(puts), took.Round(time.Millisecond), float64(total>>20)/took.Seconds())

	n, err := counter(m.http, "tidepool_master_evictions_total", `reason="allocation"`)
	if err != nil || n == 0 {
		t.Fatalf("allocation evictions: %v, %v; want some", n, err)
	}
	t.Logf("%v objects evicted to make room", n)

	// The sweep brings the segment to at most high - ratio (0.85) of its
	// capacity: well within 0.90 a few sweeps later.
	var used uint64
	waitFor(t, 10*time.Second, func() error {
		st, err := c.Status(ctx)
		if err != nil {
			return err
		}
		segs := segmentsOf(st, "s1")
		if len(segs) != 1 || segs[0].Capacity != capacity {
			return fmt.Errorf("segments of s1: %v", segs)
		}
		used = segs[0].Used
		if float64(used) > 0.90*capacity {
			return fmt.Errorf("used %d of %d", used, capacity)
		}
		return nil
	})
	t.Logf("used %.1f MiB of 256 MiB after the sweeps", float64(used)/(1<<20))

	// The hard-pinned object is still there, byte for byte.
	got, err := c.Get(ctx, pinned.key)
	if err != nil {
		t.Fatalf("get %s: %v", pinned.key, err)
	}
	if !bytes.Equal(got, pinned.value) {
		t.Fatalf("get %s: %d bytes that differ from the %d put", pinned.key, len(got), len(pinned.value))
	}

	// The most recent puts survived; what is left are objects that were put.
	objs, err := c.List(ctx, prefix)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, o := range objs {
		listed = append(listed, o.Key)
	}
	if !slices.Contains(listed, pinned.key) || len(listed) >= len(puts) || len(listed) < 10 {
		t.Fatalf("after the fill %d of %d objects are left, pinned one included: %v", len(listed), len(puts)+1, slices.Contains(listed, pinned.key))
	}
	// A sample of the survivors reads back right.
	for _, p := range puts[len(puts)-3:] {
		if !slices.Contains(listed, p.key) {
			continue
		}
		got, err := c.Get(ctx, p.key)
		if err != nil || !bytes.Equal(got, pool[p.off:p.off+p.size]) {
			t.Fatalf("get %s: %d bytes, %v", p.key, len(got), err)
		}
	}

	// Dry run, then the real thing: the same keys in the same order.
	evictCLI := func(dry bool) (keys []string, summary string) {
		t.Helper()
		args := []string{"admin", "evict", "--prefix", prefix, "--masters", m.grpc}
		if dry {
			args = append(args, "--dry-run")
		}
		r := mustCLI(t, ctx, nil, args...)
		for line := range strings.Lines(string(r.stdout)) {
			line = strings.TrimSuffix(line, "\n")
			if k, _, ok := strings.Cut(line, "\t"); ok {
				keys = append(keys, k)
			} else {
				summary = line
			}
		}
		return keys, summary
	}
	dryKeys, drySummary := evictCLI(true)
	if again, _ := evictCLI(true); !slices.Equal(again, dryKeys) {
		t.Fatalf("two dry runs differ:\n%v\n%v", dryKeys, again)
	}
	realKeys, realSummary := evictCLI(false)
	t.Logf("dry run: %s; evict: %s", drySummary, realSummary)
	if !slices.Equal(dryKeys, realKeys) {
		t.Fatalf("evict --prefix %s removed\n%v\nbut the dry run listed\n%v", prefix, realKeys, dryKeys)
	}
	wantKeys := slices.DeleteFunc(slices.Clone(listed), func(k string) bool { return k == pinned.key })
	if sorted := slices.Sorted(slices.Values(realKeys)); !slices.Equal(sorted, wantKeys) {
		t.Fatalf("evict --prefix %s removed %d keys, want every unpinned one of the %d listed", prefix, len(realKeys), len(wantKeys))
	}
	wantSummary := fmt.Sprintf("would evict %d objects", len(dryKeys))
	if !strings.HasPrefix(drySummary, wantSummary) || !strings.HasPrefix(realSummary, "evicted "+strings.TrimPrefix(wantSummary, "would evict ")) ||
		!strings.Contains(drySummary, "kept 1") || !strings.Contains(realSummary, "kept 1") {
		t.Fatalf("summaries %q and %q: want %d objects and the pinned one kept", drySummary, realSummary, len(dryKeys))
	}
	ls := mustCLI(t, ctx, nil, "ls", prefix, "--masters", m.grpc)
	if got := strings.Fields(string(ls.stdout)); !slices.Equal(got, []string{pinned.key}) {
		t.Fatalf("ls %s after the eviction: %v, want only the pinned key", prefix, got)
	}
	for _, k := range []string{realKeys[0], realKeys[len(realKeys)-1]} {
		if r := cli(t, ctx, nil, "exists", k, "--masters", m.grpc); r.code != 1 || strings.TrimSpace(string(r.stdout)) != "absent" {
			t.Fatalf("exists %s after its eviction: %s, stdout %q", k, r, r.stdout)
		}
	}
	mustCLI(t, ctx, nil, "exists", pinned.key, "--masters", m.grpc)
	if r, _ := evictCLI(true); len(r) != 0 {
		t.Fatalf("a dry run after the eviction still lists %v", r)
	}
	if n, err := counter(m.http, "tidepool_master_evictions_total", `reason="admin"`); err != nil || n != float64(len(realKeys)) {
		t.Fatalf("admin evictions %v, %v; want %d", n, err, len(realKeys))
	}
	// The evicted space is free again (once no lease holds it): only the
	// pinned object's is used.
	waitFor(t, 10*time.Second, func() error {
		_ = c.Remove(ctx, "no-such-key") // any command moves the master's clock past the leases
		st, err := c.Status(ctx)
		if err != nil {
			return err
		}
		if u := segmentsOf(st, "s1")[0].Used; u != uint64(len(pinned.value)+63)/64*64 {
			return fmt.Errorf("used %d", u)
		}
		return nil
	})
	got, err = c.Get(ctx, pinned.key)
	if err != nil || !bytes.Equal(got, pinned.value) {
		t.Fatalf("get %s at the end: %d bytes, %v", pinned.key, len(got), err)
	}
}
