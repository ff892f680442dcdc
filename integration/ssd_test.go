package integration

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// TestStoreRestartKeepsSSDObjects: a store process killed and started again
// on the same SSD directory offers its objects back, and every one reads
// back byte for byte; a hard pinned one is still hard pinned.
func TestStoreRestartKeepsSSDObjects(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir())
	ssdDir := filepath.Join(t.TempDir(), "ssd")
	tier := "ssd:" + ssdDir + ":256MiB"
	s := startStoreArgs(t, ctx, "s1", m.grpc, "--tier", tier, "--index-sync", "100ms")

	c, err := client.New(client.Config{Masters: []string{m.grpc}, Tier: "ssd"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	src := newRand(t)
	values := map[string][]byte{}
	const pinned = "ssd/00"
	for i := range 20 {
		v := randomBytes(src, 1+int(src.Uint64()%(4<<20)))
		k := fmt.Sprintf("ssd/%02d", i)
		if err := c.Put(ctx, k, v); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
		values[k] = v
		if k == pinned {
			// Pinned before the other puts, so the sync that indexes them
			// all reads the pin too.
			mustCLI(t, ctx, nil, "admin", "pin", k, "--hard", "--masters", m.grpc)
		}
	}
	waitFor(t, 30*time.Second, func() error {
		n, err := counter(s.http, "tidepool_store_indexed_objects")
		if err != nil || n != float64(len(values)) {
			return fmt.Errorf("indexed objects %v (%v), want %d", n, err, len(values))
		}
		return nil
	})

	s.kill(t) // a crash, not a clean stop
	s = startStoreArgs(t, ctx, "s1", m.grpc, "--tier", tier, "--index-sync", "100ms")
	for k, want := range values {
		var got []byte
		waitFor(t, 30*time.Second, func() error {
			got, err = c.Get(ctx, k)
			return err
		})
		if !bytes.Equal(got, want) {
			t.Fatalf("%s after the restart: %d bytes that differ from the %d put", k, len(got), len(want))
		}
	}
	objs, err := c.List(ctx, "ssd/")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != len(values) {
		t.Fatalf("List after the restart: %d objects, want %d", len(objs), len(values))
	}
	for _, o := range objs {
		if o.HardPinned != (o.Key == pinned) {
			t.Errorf("%s after the restart: hard pinned %v", o.Key, o.HardPinned)
		}
	}
	_ = s
}

// startStoreArgs starts a store daemon with extra flags.
func startStoreArgs(t *testing.T, ctx context.Context, id, masters string, extra ...string) *storeProc {
	t.Helper()
	s := &storeProc{id: id}
	s.proc = startDaemon(t, ctx, "store "+id, func() ([]string, string) {
		s.engine, s.http = freeAddr(t), freeAddr(t)
		return append([]string{"store", "--id", id, "--masters", masters, "--listen", s.engine, "--http", s.http}, extra...), s.http
	})
	return s
}
