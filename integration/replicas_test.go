package integration

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// TestReplicasSurviveStoreKills: three masters and three stores, objects
// put with two replicas. SIGKILL a store: every object stays readable byte
// for byte and is back on two live nodes within 30 s; SIGKILL a second:
// still nothing is lost.
func TestReplicasSurviveStoreKills(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out the node TTL twice")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	h := startMasters(t, ctx, 3)
	masters := strings.Join(h.grpc, ",")
	stores := map[string]*storeProc{}
	for _, id := range []string{"s1", "s2", "s3"} {
		stores[id] = startStore(t, ctx, id, masters, "dram:256MiB")
	}
	c := newClient(t, h.grpc...)

	vals := map[string][]byte{}
	var keys []string
	var batch [][]byte
	for i := range 300 {
		k := fmt.Sprintf("r/%04d", i)
		size := 64 << 10
		if i%50 == 0 {
			size = 1<<20 + i
		}
		vals[k] = faultValue(k, size)
		keys, batch = append(keys, k), append(batch, vals[k])
	}
	for chunk := range slices.Chunk(keys, 32) {
		vs := make([][]byte, len(chunk))
		for i, k := range chunk {
			vs[i] = vals[k]
		}
		for i, err := range c.BatchPutWith(ctx, chunk, vs, client.PutOptions{Replicas: 2}) {
			if err != nil {
				t.Fatalf("put %s: %v", chunk[i], err)
			}
		}
	}
	nodesOf := func() map[string][]string {
		t.Helper()
		infos, err := c.List(ctx, "r/")
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for _, o := range infos {
			for _, r := range o.Replicas {
				if !slices.Contains(out[o.Key], r.Node) {
					out[o.Key] = append(out[o.Key], r.Node)
				}
			}
		}
		return out
	}
	for k, nodes := range nodesOf() {
		if len(nodes) != 2 {
			t.Fatalf("%s on %v, want two nodes", k, nodes)
		}
	}
	readAll := func(when string) {
		t.Helper()
		got, errs := c.BatchGet(ctx, keys)
		for i, k := range keys {
			if errs[i] != nil || !bytes.Equal(got[i], vals[k]) {
				t.Fatalf("%s: get %s: %d bytes, %v", when, k, len(got[i]), errs[i])
			}
		}
	}
	backOnTwo := func(dead ...string) {
		t.Helper()
		waitFor(t, 30*time.Second, func() error {
			placed := nodesOf()
			if len(placed) != len(keys) {
				return fmt.Errorf("%d objects listed, want %d", len(placed), len(keys))
			}
			for k, nodes := range placed {
				if len(nodes) != 2 || slices.ContainsFunc(nodes, func(n string) bool { return slices.Contains(dead, n) }) {
					return fmt.Errorf("%s on %v", k, nodes)
				}
			}
			st, err := c.Status(ctx)
			if err != nil {
				return err
			}
			if st.UnderReplicated != 0 || st.Repairing != 0 {
				return fmt.Errorf("%d under-replicated, %d repairs running", st.UnderReplicated, st.Repairing)
			}
			return nil
		})
	}

	stores["s1"].kill(t)
	killed := time.Now()
	readAll("right after s1 was killed")
	backOnTwo("s1")
	t.Logf("back on two replicas %v after s1 was killed", time.Since(killed).Round(100*time.Millisecond))
	readAll("after re-replication")

	stores["s2"].kill(t)
	readAll("right after s2 was killed")
	waitFor(t, 30*time.Second, func() error {
		for k, nodes := range nodesOf() {
			if !slices.Equal(nodes, []string{"s3"}) {
				return fmt.Errorf("%s on %v, want s3 alone once s2 is declared dead", k, nodes)
			}
		}
		return nil
	})
	readAll("with s3 alone")
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.UnderReplicated != uint64(len(keys)) {
		t.Fatalf("%d under-replicated with one store left, want all %d", st.UnderReplicated, len(keys))
	}
	// The CLI may ask a follower, which learns that s2 is dead up to a raft
	// commit timeout after the leader.
	waitFor(t, 10*time.Second, func() error {
		out, err := runCLI(ctx, nil, "status", "--masters", masters)
		if err != nil || out.code != 0 {
			return fmt.Errorf("tidepool status: %v %s", err, out)
		}
		if !bytes.Contains(out.stdout, fmt.Appendf(nil, "re-replicating: %d objects", len(keys))) {
			return fmt.Errorf("status does not say what is under-replicated:\n%s", out.stdout)
		}
		return nil
	})
}
