//go:build linux

package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestDrainStore drains one of two store processes with `tidepool admin
// drain`: its objects move to the other store and read back byte for byte,
// progress shows while it runs, the drained process stays out of the pool
// while it keeps running, and a restart brings it back.
func TestDrainStore(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir())
	s1 := startStore(t, ctx, "s1", m.grpc, "dram:512MiB")
	startStore(t, ctx, "s2", m.grpc, "dram:512MiB")
	c := newClient(t, m.grpc)
	src := newRand(t)

	objs := make([]object, 60)
	for i := range objs {
		objs[i] = object{key: fmt.Sprintf("drain/%02d", i), value: randomBytes(src, 1+int(src.Uint64()%(4<<20)))}
	}
	putAll(t, ctx, c, objs)
	onS1 := 0
	for _, n := range replicaNodes(t, ctx, c) {
		if n == "s1" {
			onS1++
		}
	}
	if onS1 == 0 {
		t.Fatal("placement put nothing on s1; the drain would have nothing to move")
	}

	r := cli(t, ctx, nil, "admin", "drain", "s1", "--masters", m.grpc)
	if r.code != 0 || !strings.Contains(r.stderr, "draining s1: ") {
		t.Fatalf("admin drain s1: %s; want exit 0 and progress on stderr", r)
	}
	want := fmt.Sprintf("drained s1: %d objects moved, 0 dropped", onS1)
	if !strings.HasPrefix(string(r.stdout), want) {
		t.Fatalf("admin drain s1 printed %q, want %q...", r.stdout, want)
	}
	t.Logf("%s", strings.TrimSpace(string(r.stdout)))

	for k, n := range replicaNodes(t, ctx, c) {
		if n != "s2" {
			t.Fatalf("%s is on %q after the drain, want s2", k, n)
		}
	}
	getAll(t, ctx, c, objs, "after the drain")

	// The process runs on but stays out: the master answers its heartbeat
	// FAILED_PRECONDITION and it does not register again.
	waitFor(t, 10*time.Second, func() error {
		if !strings.Contains(s1.out.String(), "drained by an operator") {
			return fmt.Errorf("s1 has not noticed the drain")
		}
		return nil
	})
	if s1.exited() {
		t.Fatal("s1 exited after the drain; it should idle until stopped")
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if segs := segmentsOf(st, "s1"); len(segs) != 0 {
		t.Fatalf("s1 still has segments after the drain: %v", segs)
	}
	// A second drain of a drained node reports it done at once.
	mustCLI(t, ctx, nil, "admin", "drain", "s1", "-q", "--masters", m.grpc)
	wantErrorLine(t, cli(t, ctx, nil, "admin", "drain", "nosuch", "--masters", m.grpc), "admin", "nosuch")

	// Restarted, the store rejoins the pool.
	s1.kill(t)
	startStore(t, ctx, "s1", m.grpc, "dram:512MiB")
	st, err = c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if segs := segmentsOf(st, "s1"); len(segs) != 1 || segs[0].Used != 0 {
		t.Fatalf("s1 after its restart: %v, want one empty segment", segs)
	}
	getAll(t, ctx, c, objs, "after s1 rejoined")
}
