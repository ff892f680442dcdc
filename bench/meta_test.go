package bench_test

import (
	"context"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/bench"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/mastertest"
)

// TestMeta runs every kind of row briefly against an in-process master and
// store: no errors, keys counted, and nothing left behind.
func TestMeta(t *testing.T) {
	m := mastertest.Start(t, nil)
	mastertest.StartStore(t, []string{m.Addr()}, "s0", 64<<20, nil)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var seen int
	rows, err := bench.Meta(ctx, bench.MetaConfig{
		Masters: []string{m.Addr()}, Batches: []int{1, 16}, Clients: []int{1, 2},
		Duration: 100 * time.Millisecond, Prefix: "meta-test/",
	}, func(bench.MetaRow) { seen++ })
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3*2*2 || seen != len(rows) {
		t.Fatalf("%d rows (%d seen), want 12", len(rows), seen)
	}
	for _, r := range rows {
		if r.Errors != 0 || r.Calls == 0 || r.KeysPerS <= 0 || r.P99Ms < r.MeanMs/100 {
			t.Errorf("row %+v", r)
		}
	}
	c, err := client.New(client.Config{Masters: []string{m.Addr()}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	left, err := c.List(ctx, "meta-test/")
	if err != nil || len(left) != 0 {
		t.Fatalf("left behind: %d objects, %v", len(left), err)
	}
	if _, err := bench.Meta(ctx, bench.MetaConfig{Masters: []string{m.Addr()}, Ops: []string{"delete"}}, nil); err == nil {
		t.Fatal("an unknown op was accepted")
	}
}
