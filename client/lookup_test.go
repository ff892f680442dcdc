package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/tidepool-kv/tidepool/client"
)

func chainOf(prefix string, n int) ([]string, [][]byte) {
	keys := make([]string, n)
	vals := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s/%04d", prefix, i)
		vals[i] = value(uint64(i), 1000+i)
	}
	return keys, vals
}

func putChain(t testing.TB, cl *client.Client, keys []string, vals [][]byte) {
	t.Helper()
	for i, err := range cl.BatchPutChain(testCtx(t), "", keys, vals) {
		if err != nil {
			t.Fatalf("put %s: %v", keys[i], err)
		}
	}
}

// TestLookup: a lookup matches the cached prefix, GetMatched reads it under
// the lookup's lease without the master, and repeated lookups of a hot
// prefix are answered from the descriptor cache.
func TestLookup(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	cl := c.newClient()
	ctx := testCtx(t)
	keys, vals := chainOf("chain", 32)
	putChain(t, cl, keys[:24], vals[:24])

	m, err := cl.Lookup(ctx, keys)
	if err != nil || m.Len() != 24 {
		t.Fatalf("lookup: %d blocks, %v; want 24", m.Len(), err)
	}
	if n, err := cl.BatchExists(ctx, keys); err != nil || n != 24 {
		t.Fatalf("batch exists: %d, %v", n, err)
	}
	bufs := make([][]byte, m.Len())
	for i := range bufs {
		bufs[i] = make([]byte, 2048)
	}
	ns, errs := cl.GetMatched(ctx, m, bufs)
	for i := range ns {
		if errs[i] != nil || !bytes.Equal(bufs[i][:ns[i]], vals[i]) {
			t.Fatalf("block %d: %d bytes, %v", i, ns[i], errs[i])
		}
	}

	// The rest is put; the cached prefix is answered locally, the tail by
	// the master, and the answer is the whole chain.
	putChain(t, cl, keys[24:], vals[24:])
	if m, err := cl.Lookup(ctx, keys); err != nil || m.Len() != 32 {
		t.Fatalf("lookup after the rest was put: %d, %v", m.Len(), err)
	}

	// The client that removes blocks stops answering them from its cache.
	if errs := cl.BatchRemove(ctx, keys[8:]); errors.Join(errs...) != nil {
		t.Fatal(errs)
	}
	if m, err := cl.Lookup(ctx, keys); err != nil || m.Len() != 8 {
		t.Fatalf("lookup after removing blocks 8 on: %d, %v; want 8", m.Len(), err)
	}

	for _, tc := range []struct {
		name  string
		chain []string
	}{
		{"an empty chain", nil},
		{"an empty key", []string{keys[0], ""}},
	} {
		if _, err := cl.Lookup(ctx, tc.chain); !errors.Is(err, client.ErrInvalidArgument) {
			t.Errorf("lookup of %s: %v, want ErrInvalidArgument", tc.name, err)
		}
		if _, err := cl.BatchExists(ctx, tc.chain); !errors.Is(err, client.ErrInvalidArgument) {
			t.Errorf("batch exists of %s: %v, want ErrInvalidArgument", tc.name, err)
		}
	}
	if _, errs := cl.GetMatched(ctx, m, bufs[:1]); !errors.Is(errs[0], client.ErrInvalidArgument) {
		t.Errorf("get matched with too few buffers: %v", errs[0])
	}
}

// BenchmarkLookup1024 measures one client looking up a cached chain of
// 1024 blocks from the master (no descriptor cache): the path behind
// `tidepool bench lookup`.
func BenchmarkLookup1024(b *testing.B) {
	c := newCluster(b, clusterOpts{})
	cl, err := client.New(client.Config{Masters: []string{c.addr}, LookupCache: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	keys := make([]string, 1024)
	vals := make([][]byte, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("kv/xxh3-64/m/t/%016x", i)
		vals[i] = []byte{1}
	}
	putChain(b, cl, keys, vals)
	ctx := testCtx(b)
	b.ReportAllocs()
	for b.Loop() {
		if m, err := cl.Lookup(ctx, keys); err != nil || m.Len() != 1024 {
			b.Fatalf("%d, %v", m.Len(), err)
		}
	}
	b.ReportMetric(float64(b.N)*1024/b.Elapsed().Seconds(), "probes/s")
}
