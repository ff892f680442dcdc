package client_test

import (
	"bytes"
	"fmt"
	"testing"
)

// TestPutRetriedElsewhere: a store the client cannot reach, though it
// heartbeats, costs no put: each put placed there is placed again on
// another store at once, and after the client's report the master places
// nothing more there.
func TestPutRetriedElsewhere(t *testing.T) {
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "a", proxied: true}, {id: "b"}}})
	cl := c.newClient()
	ctx := testCtx(t)
	c.stores[0].proxy.SetDown(true)

	vals := map[string][]byte{}
	for i := range 16 {
		k := fmt.Sprintf("k/%d", i)
		vals[k] = value(uint64(i), 8<<10)
		if err := cl.Put(ctx, k, vals[k]); err != nil {
			t.Fatalf("put %s with store a unreachable: %v", k, err)
		}
	}
	keys := make([]string, 0, len(vals))
	batch := make([][]byte, 0, len(vals))
	for i := range 16 {
		k := fmt.Sprintf("b/%d", i)
		vals[k] = value(uint64(100+i), 8<<10)
		keys, batch = append(keys, k), append(batch, vals[k])
	}
	for i, err := range cl.BatchPut(ctx, keys, batch) {
		if err != nil {
			t.Fatalf("batch put %s: %v", keys[i], err)
		}
	}
	infos, err := cl.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != len(vals) {
		t.Fatalf("%d objects listed, want %d", len(infos), len(vals))
	}
	for _, o := range infos {
		for _, r := range o.Replicas {
			if r.Node != "b" {
				t.Fatalf("%s has a replica on %s, which the client cannot reach", o.Key, r.Node)
			}
		}
		if got, err := cl.Get(ctx, o.Key); err != nil || !bytes.Equal(got, vals[o.Key]) {
			t.Fatalf("get %s: %d bytes, %v", o.Key, len(got), err)
		}
	}
}
