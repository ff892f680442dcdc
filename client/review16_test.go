package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// TestReview16RetryKeepsReplicaCount: with one of three stores unreachable
// by the client, puts asking for two replicas (a chain, in one batch) all
// succeed with two replicas on the two stores it can reach, and the chain
// links survive the retry of the blocks placed on the unreachable store.
func TestReview16RetryKeepsReplicaCount(t *testing.T) {
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "a", proxied: true}, {id: "b"}, {id: "c"}}})
	cl := c.newClient()
	ctx := testCtx(t)
	c.stores[0].proxy.SetDown(true)
	var keys []string
	var vals [][]byte
	for i := range 12 {
		keys, vals = append(keys, fmt.Sprintf("chain/%02d", i)), append(vals, value(uint64(i), 8<<10))
	}
	for i, err := range cl.BatchPutWith(ctx, keys, vals, client.PutOptions{Chain: true, Replicas: 2}) {
		if err != nil {
			t.Fatalf("put %s: %v", keys[i], err)
		}
	}
	infos, err := cl.List(ctx, "chain/")
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != len(keys) {
		t.Fatalf("%d objects listed, want %d", len(infos), len(keys))
	}
	for _, o := range infos {
		var nodes []string
		for _, r := range o.Replicas {
			nodes = append(nodes, r.Node)
		}
		slices.Sort(nodes)
		if !slices.Equal(nodes, []string{"b", "c"}) {
			t.Fatalf("%s on %v, want b and c", o.Key, nodes)
		}
		if got, err := cl.Get(ctx, o.Key); err != nil || !bytes.Equal(got, vals[slices.Index(keys, o.Key)]) {
			t.Fatalf("get %s: %d bytes, %v", o.Key, len(got), err)
		}
	}
}

// TestReview16EveryStoreUnreachable: a client that reaches no store fails
// its puts after one retry, promptly, rather than retrying on and on; the
// master, told every node is unreachable, still places on all of them
// (both puts are placed twice, and fail on the write, not for want of a
// segment).
func TestReview16EveryStoreUnreachable(t *testing.T) {
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "a", proxied: true}, {id: "b", proxied: true}}})
	cl := c.newClient()
	ctx := testCtx(t)
	c.stores[0].proxy.SetDown(true)
	c.stores[1].proxy.SetDown(true)
	start := time.Now()
	errs := cl.BatchPut(ctx, []string{"x", "y"}, [][]byte{value(1, 4<<10), value(2, 4<<10)})
	for i, err := range errs {
		if !errors.Is(err, client.ErrUnavailable) {
			t.Fatalf("put %d with no store reachable: %v, want ErrUnavailable", i, err)
		}
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("failing the puts took %v", d)
	}
}
