package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Every test closes its cluster; nothing may be left running.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestClient runs the happy paths and input checks on one shared cluster.
func TestClient(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	cl := c.newClient()
	ctx := testCtx(t)

	t.Run("RoundTrip", func(t *testing.T) {
		for i, size := range []int{1, 4 << 10, 1<<20 + 3, 8 << 20} {
			t.Run(fmt.Sprint(size), func(t *testing.T) {
				key := fmt.Sprintf("rt/%d", size)
				want := value(uint64(i), size)
				if err := cl.Put(ctx, key, want); err != nil {
					t.Fatalf("Put: %v", err)
				}
				got, err := cl.Get(ctx, key)
				if err != nil {
					t.Fatalf("Get: %v", err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("Get returned %d bytes that differ from the %d put", len(got), len(want))
				}
				// GetInto fills an exact buffer and a larger one, leaving
				// the tail of the larger one alone.
				for _, extra := range []int{0, 100} {
					buf := bytes.Repeat([]byte{0xee}, size+extra)
					n, err := cl.GetInto(ctx, key, buf)
					if err != nil {
						t.Fatalf("GetInto(+%d): %v", extra, err)
					}
					if n != size || !bytes.Equal(buf[:n], want) {
						t.Fatalf("GetInto(+%d) = %d bytes, want %d equal to the value", extra, n, size)
					}
					if extra > 0 && !bytes.Equal(buf[n:], bytes.Repeat([]byte{0xee}, extra)) {
						t.Fatalf("GetInto wrote past the value")
					}
				}
				info, err := cl.List(ctx, key)
				if err != nil || len(info) != 1 {
					t.Fatalf("List(%q) = %d objects, %v", key, len(info), err)
				}
				if o := info[0]; o.Size != uint64(size) || o.Checksum != client.Checksum(want) || o.State != pb.ObjectState_OBJECT_STATE_COMPLETE {
					t.Fatalf("List: %v", o)
				}
			})
		}
	})

	t.Run("Batch", func(t *testing.T) {
		const n = 50
		keys := make([]string, n)
		vals := make([][]byte, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("batch/%02d", i)
			vals[i] = value(uint64(100+i), 1+i*997)
		}
		for i, err := range cl.BatchPut(ctx, keys, vals) {
			if err != nil {
				t.Fatalf("BatchPut %s: %v", keys[i], err)
			}
		}
		// Ask in reverse order with an unknown key in the middle.
		ask := slices.Clone(keys)
		slices.Reverse(ask)
		ask = slices.Insert(ask, n/2, "batch/missing")
		got, errs := cl.BatchGet(ctx, ask)
		if len(got) != len(ask) || len(errs) != len(ask) {
			t.Fatalf("BatchGet returned %d values and %d errors for %d keys", len(got), len(errs), len(ask))
		}
		for j, k := range ask {
			if k == "batch/missing" {
				if !errors.Is(errs[j], client.ErrNotFound) || got[j] != nil {
					t.Fatalf("BatchGet of a missing key = %d bytes, %v; want ErrNotFound", len(got[j]), errs[j])
				}
				continue
			}
			i := slices.Index(keys, k)
			if errs[j] != nil || !bytes.Equal(got[j], vals[i]) {
				t.Fatalf("BatchGet %s: %d bytes, %v", k, len(got[j]), errs[j])
			}
		}
		bufs := make([][]byte, n)
		for i := range bufs {
			bufs[i] = make([]byte, len(vals[i]))
		}
		ns, errs := cl.BatchGetInto(ctx, keys, bufs)
		for i := range keys {
			if errs[i] != nil || ns[i] != len(vals[i]) || !bytes.Equal(bufs[i], vals[i]) {
				t.Fatalf("BatchGetInto %s: %d bytes, %v", keys[i], ns[i], errs[i])
			}
		}
	})

	t.Run("ExistsRemove", func(t *testing.T) {
		key := "er/key"
		if err := cl.Put(ctx, key, []byte("value")); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			key  string
			want bool
		}{{key, true}, {"er/other", false}, {"er/ke", false}} {
			if got, err := cl.Exists(ctx, tc.key); err != nil || got != tc.want {
				t.Errorf("Exists(%q) = %v, %v; want %v", tc.key, got, err, tc.want)
			}
		}
		if err := cl.Remove(ctx, key); err != nil {
			t.Fatalf("Remove: %v", err)
		}
		if v, err := cl.Get(ctx, key); !errors.Is(err, client.ErrNotFound) {
			t.Fatalf("Get after Remove = %q, %v; want ErrNotFound", v, err)
		}
		if ok, err := cl.Exists(ctx, key); ok || err != nil {
			t.Fatalf("Exists after Remove = %v, %v", ok, err)
		}
		if err := cl.Remove(ctx, key); !errors.Is(err, client.ErrNotFound) {
			t.Fatalf("second Remove = %v, want ErrNotFound", err)
		}
		// The key can be put again, with another value.
		if err := cl.Put(ctx, key, []byte("second")); err != nil {
			t.Fatal(err)
		}
		if v, err := cl.Get(ctx, key); err != nil || string(v) != "second" {
			t.Fatalf("Get after re-put = %q, %v", v, err)
		}
	})

	t.Run("List", func(t *testing.T) {
		// More keys than one page of the master (1000), tiny values.
		const n = 1234
		keys := make([]string, n)
		vals := make([][]byte, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("list/%05d", i)
			vals[i] = []byte{byte(i)}
		}
		for _, k := range []string{"lisu", "list", "lis/0", "list0"} {
			if err := cl.Put(ctx, k, []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
		for i, err := range cl.BatchPut(ctx, keys, vals) {
			if err != nil {
				t.Fatalf("BatchPut %s: %v", keys[i], err)
			}
		}
		got, err := cl.List(ctx, "list/")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != n {
			t.Fatalf("List returned %d objects, want %d", len(got), n)
		}
		for i, o := range got {
			if o.Key != keys[i] || o.Size != 1 || o.State != pb.ObjectState_OBJECT_STATE_COMPLETE || len(o.Replicas) != 1 {
				t.Fatalf("List[%d] = %v, want key %s", i, o, keys[i])
			}
		}
		if got, err := cl.List(ctx, "nothing/"); err != nil || len(got) != 0 {
			t.Fatalf("List of an unused prefix = %d objects, %v", len(got), err)
		}
	})

	t.Run("ExistingKey", func(t *testing.T) {
		key := "immutable"
		orig := value(7, 3000)
		if err := cl.Put(ctx, key, orig); err != nil {
			t.Fatal(err)
		}
		// Objects are immutable: a second put succeeds and changes nothing,
		// whatever its size.
		for _, v := range [][]byte{value(8, 3000), value(9, 10), value(10, 100000)} {
			if err := cl.Put(ctx, key, v); err != nil {
				t.Fatalf("Put of an existing key: %v", err)
			}
			if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, orig) {
				t.Fatalf("Get after a second Put: %d bytes, %v; want the original %d", len(got), err, len(orig))
			}
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		ops := []struct {
			name string
			do   func(key string) error
		}{
			{"Put", func(k string) error { return cl.Put(ctx, k, []byte("v")) }},
			{"Get", func(k string) error { _, err := cl.Get(ctx, k); return err }},
			{"GetInto", func(k string) error { _, err := cl.GetInto(ctx, k, make([]byte, 8)); return err }},
			{"Exists", func(k string) error { _, err := cl.Exists(ctx, k); return err }},
			{"Remove", func(k string) error { return cl.Remove(ctx, k) }},
		}
		keys := []struct{ name, key string }{
			{"empty", ""},
			{"4097B", strings.Repeat("k", client.MaxKeyLen+1)},
		}
		for _, op := range ops {
			for _, k := range keys {
				t.Run(op.name+"/"+k.name, func(t *testing.T) {
					if err := op.do(k.key); !errors.Is(err, client.ErrInvalidArgument) {
						t.Fatalf("%s with a bad key = %v, want ErrInvalidArgument", op.name, err)
					}
				})
			}
		}

		t.Run("MaxKeyLen", func(t *testing.T) {
			key := strings.Repeat("m", client.MaxKeyLen)
			if err := cl.Put(ctx, key, []byte("v")); err != nil {
				t.Fatalf("Put with a %d-byte key: %v", len(key), err)
			}
			if v, err := cl.Get(ctx, key); err != nil || string(v) != "v" {
				t.Fatalf("Get with a %d-byte key = %q, %v", len(key), v, err)
			}
		})
		t.Run("EmptyValue", func(t *testing.T) {
			for _, v := range [][]byte{nil, {}} {
				if err := cl.Put(ctx, "empty-value", v); !errors.Is(err, client.ErrInvalidArgument) {
					t.Fatalf("Put of %#v = %v, want ErrInvalidArgument", v, err)
				}
			}
			if ok, _ := cl.Exists(ctx, "empty-value"); ok {
				t.Fatal("a rejected put left the key visible")
			}
		})
		t.Run("ShortBuffer", func(t *testing.T) {
			if err := cl.Put(ctx, "short", []byte("0123456789")); err != nil {
				t.Fatal(err)
			}
			for _, buf := range [][]byte{nil, make([]byte, 9)} {
				if n, err := cl.GetInto(ctx, "short", buf); !errors.Is(err, client.ErrInvalidArgument) || n != 0 {
					t.Fatalf("GetInto with %d bytes = %d, %v; want ErrInvalidArgument", len(buf), n, err)
				}
			}
		})
		t.Run("UnknownKey", func(t *testing.T) {
			if v, err := cl.Get(ctx, "no/such/key"); !errors.Is(err, client.ErrNotFound) || v != nil {
				t.Fatalf("Get = %q, %v; want ErrNotFound", v, err)
			}
			if n, err := cl.GetInto(ctx, "no/such/key", make([]byte, 10)); !errors.Is(err, client.ErrNotFound) || n != 0 {
				t.Fatalf("GetInto = %d, %v; want ErrNotFound", n, err)
			}
		})
		t.Run("MismatchedBatch", func(t *testing.T) {
			errs := cl.BatchPut(ctx, []string{"mm/a", "mm/b"}, [][]byte{[]byte("a")})
			if len(errs) != 2 {
				t.Fatalf("BatchPut returned %d errors for 2 keys", len(errs))
			}
			for _, err := range errs {
				if !errors.Is(err, client.ErrInvalidArgument) {
					t.Fatalf("BatchPut with 2 keys and 1 value: %v, want ErrInvalidArgument", err)
				}
			}
			errs = cl.BatchPut(ctx, []string{"mm/a"}, [][]byte{[]byte("a"), []byte("b")})
			if len(errs) != 1 || !errors.Is(errs[0], client.ErrInvalidArgument) {
				t.Fatalf("BatchPut with 1 key and 2 values: %v", errs)
			}
			if ok, _ := cl.Exists(ctx, "mm/a"); ok {
				t.Fatal("a rejected batch stored a value")
			}
			ns, errs := cl.BatchGetInto(ctx, []string{"short", "mm/a"}, [][]byte{make([]byte, 64)})
			if len(ns) != 2 || len(errs) != 2 || !errors.Is(errs[0], client.ErrInvalidArgument) || !errors.Is(errs[1], client.ErrInvalidArgument) {
				t.Fatalf("BatchGetInto with 2 keys and 1 buffer = %v, %v", ns, errs)
			}
		})
		t.Run("MixedBatch", func(t *testing.T) {
			// One bad item fails alone; the others are stored.
			keys := []string{"mixed/ok1", "", "mixed/empty", "mixed/ok2"}
			vals := [][]byte{[]byte("one"), []byte("x"), nil, []byte("two")}
			errs := cl.BatchPut(ctx, keys, vals)
			for i, wantBad := range []bool{false, true, true, false} {
				if bad := errors.Is(errs[i], client.ErrInvalidArgument); bad != wantBad || (!wantBad && errs[i] != nil) {
					t.Fatalf("BatchPut item %d (%q): %v", i, keys[i], errs[i])
				}
			}
			got, errs := cl.BatchGet(ctx, []string{"mixed/ok1", "", "mixed/ok2"})
			if errs[0] != nil || string(got[0]) != "one" || !errors.Is(errs[1], client.ErrInvalidArgument) || errs[2] != nil || string(got[2]) != "two" {
				t.Fatalf("BatchGet = %q, %v", got, errs)
			}
		})
	})

	t.Run("Concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		errc := make(chan error, 8)
		for g := range 8 {
			wg.Go(func() {
				for i := range 10 {
					key := fmt.Sprintf("conc/%d/%d", g, i)
					v := value(uint64(1000*g+i), 16<<10+g)
					if err := cl.Put(ctx, key, v); err != nil {
						errc <- fmt.Errorf("Put %s: %w", key, err)
						return
					}
					got, err := cl.Get(ctx, key)
					if err != nil || !bytes.Equal(got, v) {
						errc <- fmt.Errorf("Get %s: %d bytes, %v", key, len(got), err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Error(err)
		}
	})
}

// TestPoolLimits fills a small pool: a value larger than any segment is
// ErrTooLarge, a value that does not fit now (every object read-leased, so
// none can be evicted) is ErrNoSpace, the objects already stored are
// untouched, and removed space returns only after the read leases on it
// end.
func TestPoolLimits(t *testing.T) {
	const capacity = 4 << 20
	const lease = 5 * time.Second
	c := newCluster(t, clusterOpts{
		stores: []storeSpec{{id: "s0", capacity: capacity}},
		master: func(cfg *master.Config) { cfg.LeaseTTL = lease },
	})
	cl := c.newClient()
	ctx := testCtx(t)

	if err := cl.Put(ctx, "huge", make([]byte, capacity+1)); !errors.Is(err, client.ErrTooLarge) {
		t.Fatalf("Put larger than the only segment = %v, want ErrTooLarge", err)
	}
	vals := make([][]byte, 4)
	for i := range vals {
		vals[i] = value(uint64(i), 1<<20)
		if err := cl.Put(ctx, fmt.Sprintf("full/%d", i), vals[i]); err != nil {
			t.Fatalf("Put %d: %v", i, err)
		}
	}
	for i, want := range vals { // leased by the reads
		if got, err := cl.Get(ctx, fmt.Sprintf("full/%d", i)); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("Get full/%d: %d bytes, %v", i, len(got), err)
		}
	}
	for _, size := range []int{1 << 20, 1} {
		if err := cl.Put(ctx, "overflow", make([]byte, size)); !errors.Is(err, client.ErrNoSpace) {
			t.Fatalf("Put of %d bytes into a full pool = %v, want ErrNoSpace", size, err)
		}
	}
	if ok, err := cl.Exists(ctx, "overflow"); ok || err != nil {
		t.Fatalf("Exists of a rejected put = %v, %v", ok, err)
	}
	for i, want := range vals {
		if got, err := cl.Get(ctx, fmt.Sprintf("full/%d", i)); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("Get full/%d after ErrNoSpace: %d bytes, %v", i, len(got), err)
		}
	}

	// full/0 was just read, so its space stays taken for the lease.
	if err := cl.Remove(ctx, "full/0"); err != nil {
		t.Fatal(err)
	}
	next := value(99, 1<<20)
	if err := cl.Put(ctx, "next", next); !errors.Is(err, client.ErrNoSpace) {
		t.Fatalf("Put into space still under a read lease = %v, want ErrNoSpace", err)
	}
	waitFor(t, 2*lease, "the removed space to be reused", func() bool {
		err := cl.Put(ctx, "next", next)
		if err != nil && !errors.Is(err, client.ErrNoSpace) {
			t.Fatalf("Put: %v", err)
		}
		return err == nil
	})
	if got, err := cl.Get(ctx, "next"); err != nil || !bytes.Equal(got, next) {
		t.Fatalf("Get next: %d bytes, %v", len(got), err)
	}
}

// TestStoreKilledMidPut closes the store a large put is being written to,
// while the write is held half way by a proxy: the put fails and leaves
// nothing behind, and the other store's objects stay readable.
func TestStoreKilledMidPut(t *testing.T) {
	c := newCluster(t, clusterOpts{stores: []storeSpec{
		{id: "a", capacity: 96 << 20, proxied: true}, // the only one with room for the big put
		{id: "b", capacity: 16 << 20},
	}})
	cl := c.newClient()
	ctx := testCtx(t)

	small := map[string][]byte{}
	for i := range 8 {
		key := fmt.Sprintf("small/%d", i)
		small[key] = value(uint64(i), 4<<10)
		if err := cl.Put(ctx, key, small[key]); err != nil {
			t.Fatal(err)
		}
	}
	on := map[string][]string{} // node -> keys
	infos, err := cl.List(ctx, "small/")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range infos {
		on[o.Replicas[0].Node] = append(on[o.Replicas[0].Node], o.Key)
	}
	if len(on["a"]) == 0 || len(on["b"]) == 0 {
		t.Fatalf("placement did not spread the small objects over both stores: %v", on)
	}

	a := c.stores[0]
	stalled := a.proxy.StallAfter(4 << 20)
	big := value(42, 64<<20)
	errc := make(chan error, 1)
	go func() { errc <- cl.Put(ctx, "big", big) }()
	select {
	case <-stalled:
	case err := <-errc:
		t.Fatalf("the big put ended before the proxy held it: %v", err)
	case <-time.After(startTimeout):
		t.Fatal("the big put never reached store a")
	}
	// A put in flight is no object yet: it is the leader's until its PutEnd.
	if infos, err := cl.List(ctx, "big"); err != nil || len(infos) != 0 {
		t.Fatalf("List(big) mid-put = %v, %v; want nothing", infos, err)
	}
	if err := cl.Remove(ctx, "big"); !errors.Is(err, client.ErrConflict) {
		t.Fatalf("Remove(big) mid-put = %v, want ErrConflict", err)
	}
	c.stopStore(a)

	// The put is placed again at once, but no other store has room.
	err = <-errc
	if !errors.Is(err, client.ErrUnavailable) && !errors.Is(err, client.ErrTooLarge) {
		t.Fatalf("Put to a store closed mid-write = %v, want ErrUnavailable or, placed again once it left, ErrTooLarge", err)
	}
	if ok, err := cl.Exists(ctx, "big"); ok || err != nil {
		t.Fatalf("Exists(big) = %v, %v after the failed put", ok, err)
	}
	if v, err := cl.Get(ctx, "big"); !errors.Is(err, client.ErrNotFound) || v != nil {
		t.Fatalf("Get(big) = %d bytes, %v; want ErrNotFound", len(v), err)
	}
	if infos, err := cl.List(ctx, "big"); err != nil || len(infos) != 0 {
		t.Fatalf("List(big) after the failed put = %v, %v; want nothing (revoked)", infos, err)
	}
	for _, k := range on["b"] {
		if got, err := cl.Get(ctx, k); err != nil || !bytes.Equal(got, small[k]) {
			t.Fatalf("Get %s from the surviving store: %d bytes, %v", k, len(got), err)
		}
	}

	// The dead store's objects never return bytes: unreachable until the
	// master declares the node dead, gone after.
	waitFor(t, 4*mastertest.NodeTTL, "the master to drop the dead store's objects", func() bool {
		gone := 0
		for _, k := range on["a"] {
			v, err := cl.Get(ctx, k)
			switch {
			case errors.Is(err, client.ErrNotFound):
				gone++
			case errors.Is(err, client.ErrUnavailable):
			default:
				t.Fatalf("Get %s on the dead store = %d bytes, %v", k, len(v), err)
			}
		}
		return gone == len(on["a"])
	})
	// New puts go to the survivor.
	v := value(43, 1<<20)
	if err := cl.Put(ctx, "after", v); err != nil {
		t.Fatalf("Put after the store died: %v", err)
	}
	if got, err := cl.Get(ctx, "after"); err != nil || !bytes.Equal(got, v) {
		t.Fatalf("Get after: %d bytes, %v", len(got), err)
	}
}

// TestPutRevokedByMaster holds a put's write past the master's put timeout:
// the put fails, the key stays absent, and a new put of the key succeeds.
func TestPutRevokedByMaster(t *testing.T) {
	c := newCluster(t, clusterOpts{
		stores: []storeSpec{{id: "s0", proxied: true}},
		master: func(cfg *master.Config) { cfg.PutTimeout = time.Second },
	})
	cl := c.newClient()
	ctx := testCtx(t)

	stalled := c.stores[0].proxy.StallAfter(1 << 20)
	errc := make(chan error, 1)
	go func() { errc <- cl.Put(ctx, "slow", value(1, 4<<20)) }()
	select {
	case <-stalled:
	case err := <-errc:
		t.Fatalf("the put ended before the proxy held it: %v", err)
	case <-time.After(startTimeout):
		t.Fatal("the put never reached the store")
	}
	// While it is in progress the key is invisible and taken.
	if err := cl.Put(ctx, "slow", []byte("other")); !errors.Is(err, client.ErrConflict) {
		t.Fatalf("Put of a key whose put is in progress = %v, want ErrConflict", err)
	}
	if err := cl.Remove(ctx, "slow"); !errors.Is(err, client.ErrConflict) {
		t.Fatalf("Remove of a key whose put is in progress = %v, want ErrConflict", err)
	}
	if v, err := cl.Get(ctx, "slow"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Get of a key whose put is in progress = %d bytes, %v; want ErrNotFound", len(v), err)
	}
	waitFor(t, 10*time.Second, "the master to revoke the stalled put", func() bool {
		err := cl.Remove(ctx, "slow")
		if err != nil && !errors.Is(err, client.ErrNotFound) && !errors.Is(err, client.ErrConflict) {
			t.Fatal(err)
		}
		return errors.Is(err, client.ErrNotFound)
	})
	c.stores[0].proxy.ResumeAll()
	// The write's deadline is the put timeout, so the put fails on its own
	// (timed out) or at PutEnd (revoked); either way it is not published.
	if err := <-errc; !errors.Is(err, client.ErrConflict) && !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("Put revoked before it ended = %v, want ErrConflict or ErrUnavailable", err)
	}
	if ok, err := cl.Exists(ctx, "slow"); ok || err != nil {
		t.Fatalf("Exists of a revoked put = %v, %v", ok, err)
	}
	v := value(2, 4<<20)
	if err := cl.Put(ctx, "slow", v); err != nil {
		t.Fatalf("Put after the revoke: %v", err)
	}
	if got, err := cl.Get(ctx, "slow"); err != nil || !bytes.Equal(got, v) {
		t.Fatalf("Get: %d bytes, %v", len(got), err)
	}
}

// TestLeaseExpired: a read that finishes after its lease is discarded.
func TestLeaseExpired(t *testing.T) {
	// The lease travels in whole milliseconds, so a sub-millisecond TTL
	// reaches the client as 0 ms: every read finishes after its lease.
	c := newCluster(t, clusterOpts{master: func(cfg *master.Config) { cfg.LeaseTTL = time.Microsecond }})
	cl := c.newClient()
	ctx := testCtx(t)

	if err := cl.Put(ctx, "k", value(1, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if v, err := cl.Get(ctx, "k"); !errors.Is(err, client.ErrLeaseExpired) || v != nil {
		t.Fatalf("Get = %d bytes, %v; want ErrLeaseExpired", len(v), err)
	}
	if n, err := cl.GetInto(ctx, "k", make([]byte, 1<<20)); !errors.Is(err, client.ErrLeaseExpired) || n != 0 {
		t.Fatalf("GetInto = %d, %v; want ErrLeaseExpired", n, err)
	}
	if ok, err := cl.Exists(ctx, "k"); !ok || err != nil {
		t.Fatalf("Exists = %v, %v; the object itself is fine", ok, err)
	}
}

// TestChecksum corrupts a stored value in the store's memory: Get refuses it.
func TestChecksum(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	cl := c.newClient()
	ctx := testCtx(t)

	want := value(5, 64<<10)
	if err := cl.Put(ctx, "k", want); err != nil {
		t.Fatal(err)
	}
	infos, err := cl.List(ctx, "k")
	if err != nil || len(infos) != 1 || len(infos[0].Replicas) != 1 {
		t.Fatalf("List = %v, %v", infos, err)
	}
	rep := infos[0].Replicas[0]
	mem := c.stores[0].tier.Bytes()
	if !bytes.Equal(mem[rep.Offset:rep.Offset+rep.Length], want) {
		t.Fatalf("the tier does not hold the value at %s+%d", rep.Segment, rep.Offset)
	}
	pos := rep.Offset + rep.Length/2
	mem[pos] ^= 0x01

	if n, err := cl.GetInto(ctx, "k", make([]byte, len(want))); !errors.Is(err, client.ErrChecksum) || n != 0 {
		t.Fatalf("GetInto of a corrupted value = %d, %v; want ErrChecksum", n, err)
	}
	// The reader reported the replica; it was the only one, so the key is
	// gone and an engine recomputes instead of failing on every get.
	if v, err := cl.Get(ctx, "k"); !errors.Is(err, client.ErrNotFound) || v != nil {
		t.Fatalf("Get after the corrupt replica was reported = %d bytes, %v; want ErrNotFound", len(v), err)
	}
}

// TestChecksumRepair: with two replicas, a get that finds one corrupt
// returns the other's bytes, and the corrupt replica is dropped.
func TestChecksumRepair(t *testing.T) {
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "s0"}, {id: "s1"}}})
	cl, err := client.New(client.Config{Masters: []string{c.addr}, Replicas: 2, EngineConfig: engine.Config{NoShm: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	ctx := testCtx(t)
	want := value(6, 64<<10)
	if err := cl.Put(ctx, "k", want); err != nil {
		t.Fatal(err)
	}
	infos, err := cl.List(ctx, "k")
	if err != nil || len(infos) != 1 || len(infos[0].Replicas) != 2 {
		t.Fatalf("List = %v, %v; want two replicas", infos, err)
	}
	// Corrupt the replica a get reads first.
	first := infos[0].Replicas[0]
	for _, s := range c.stores {
		if s.spec.id == first.Node {
			s.tier.Bytes()[first.Offset+7] ^= 0xff
		}
	}
	if got, err := cl.Get(ctx, "k"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("Get with one corrupt replica: %d bytes, %v", len(got), err)
	}
	infos, err = cl.List(ctx, "k")
	if err != nil || len(infos) != 1 || len(infos[0].Replicas) != 1 || infos[0].Replicas[0].Node == first.Node {
		t.Fatalf("after the repair List = %v, %v; want the good replica only", infos, err)
	}
}

// TestMasterRestart restarts the only master on its Dir: a client made
// before the restart reads every complete object, a removed one stays
// removed, and new puts work.
//
// The stores heartbeat only once an hour here, and the test waits until
// the new master has replayed its log, because the master has a race that
// TestMasterRestartHeartbeats covers: it serves leader-only RPCs as soon
// as raft makes it leader, before its FSM has replayed the log.
func TestMasterRestart(t *testing.T) {
	c := newCluster(t, clusterOpts{
		stores:    []storeSpec{{id: "s0"}, {id: "s1"}},
		heartbeat: time.Hour,
		master:    func(cfg *master.Config) { cfg.NodeTTL = 2 * time.Hour },
	})
	cl := c.newClient()
	ctx := testCtx(t)

	keys, vals := putMany(t, cl, "mr/", 20)
	if err := cl.Put(ctx, "mr/removed", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := cl.Remove(ctx, "mr/removed"); err != nil {
		t.Fatal(err)
	}
	if err := cl.Put(ctx, "mr/zlast", []byte("last")); err != nil {
		t.Fatal(err)
	}

	c.master.Restart()
	// Workaround for the race above: wait for the last write to replay.
	waitFor(t, startTimeout, "the new master to replay its log", func() bool {
		ok, err := cl.Exists(ctx, "mr/zlast")
		return ok && err == nil
	})

	checkAll(t, cl, keys, vals)
	if ok, err := cl.Exists(ctx, "mr/removed"); ok || err != nil {
		t.Fatalf("a removed key came back after the restart: %v, %v", ok, err)
	}
	for _, s := range c.stores {
		if e := s.node.Epoch(); e != 1 {
			t.Fatalf("store %s is in epoch %d after the master restart, want 1", s.spec.id, e)
		}
	}
	v := value(77, 100_000)
	if err := cl.Put(ctx, "mr/new", v); err != nil {
		t.Fatalf("Put after the master restart: %v", err)
	}
	if got, err := cl.Get(ctx, "mr/new"); err != nil || !bytes.Equal(got, v) {
		t.Fatalf("Get mr/new: %d bytes, %v", len(got), err)
	}
}

// TestMasterRestartHeartbeats restarts the master while stores heartbeat
// fast and reads right away: every object must survive every restart and
// the stores must stay in epoch 1.
//
// It fails today (3 of 5 runs here; a single restart at 100 ms heartbeats
// failed 3 of 25 runs): raft reports leadership before
// the no-op of the new term commits, so Heartbeat and GetReplicas run
// against an FSM that has not replayed the log yet. The heartbeat gets
// NotFound, the store registers again in a new epoch and the master drops
// all of its objects; a Get in that window returns ErrNotFound. The fix
// belongs in master: wait for raft.Barrier after becoming leader before
// serving leader-only RPCs (and refresh lastSeen after it).
func TestMasterRestartHeartbeats(t *testing.T) {
	c := newCluster(t, clusterOpts{
		stores:    []storeSpec{{id: "s0"}, {id: "s1"}},
		heartbeat: 10 * time.Millisecond,
	})
	cl := c.newClient()
	ctx := testCtx(t)

	keys, vals := putMany(t, cl, "mrh/", 20)
	for r := range 3 {
		c.master.Restart()
		got, errs := cl.BatchGet(ctx, keys)
		for i := range keys {
			if errs[i] != nil || !bytes.Equal(got[i], vals[i]) {
				t.Fatalf("restart %d: Get %s: %d bytes, %v", r, keys[i], len(got[i]), errs[i])
			}
		}
		for _, s := range c.stores {
			if e := s.node.Epoch(); e != 1 {
				t.Fatalf("restart %d: store %s is in epoch %d, want 1 (it registered again and lost its objects)", r, s.spec.id, e)
			}
		}
	}
}

// putMany stores n values of assorted sizes under prefix.
func putMany(t *testing.T, cl *client.Client, prefix string, n int) ([]string, [][]byte) {
	t.Helper()
	keys := make([]string, n)
	vals := make([][]byte, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%02d", prefix, i)
		vals[i] = value(uint64(i), 1+i*50_000)
	}
	for i, err := range cl.BatchPut(testCtx(t), keys, vals) {
		if err != nil {
			t.Fatalf("BatchPut %s: %v", keys[i], err)
		}
	}
	return keys, vals
}

// checkAll reads keys back and compares them with vals.
func checkAll(t *testing.T, cl *client.Client, keys []string, vals [][]byte) {
	t.Helper()
	got, errs := cl.BatchGet(testCtx(t), keys)
	for i := range keys {
		if errs[i] != nil || !bytes.Equal(got[i], vals[i]) {
			t.Fatalf("Get %s: %d bytes, %v", keys[i], len(got[i]), errs[i])
		}
	}
}

// TestStoreRestart restarts a store with the same ID and an empty tier: it
// registers in a new epoch, its old objects are gone, new puts work.
func TestStoreRestart(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	cl := c.newClient()
	ctx := testCtx(t)

	keys := []string{"sr/a", "sr/b", "sr/c"}
	for i, k := range keys {
		if err := cl.Put(ctx, k, value(uint64(i), 10_000)); err != nil {
			t.Fatal(err)
		}
	}
	if e := c.stores[0].node.Epoch(); e != 1 {
		t.Fatalf("epoch %d before the restart, want 1", e)
	}
	c.restartStore(0)
	if e := c.stores[0].node.Epoch(); e != 2 {
		t.Fatalf("epoch %d after the restart, want 2", e)
	}
	for _, k := range keys {
		if v, err := cl.Get(ctx, k); !errors.Is(err, client.ErrNotFound) || v != nil {
			t.Fatalf("Get %s after the store restart = %d bytes, %v; want ErrNotFound", k, len(v), err)
		}
		if ok, err := cl.Exists(ctx, k); ok || err != nil {
			t.Fatalf("Exists %s = %v, %v", k, ok, err)
		}
	}
	if infos, err := cl.List(ctx, "sr/"); err != nil || len(infos) != 0 {
		t.Fatalf("List after the store restart = %v, %v", infos, err)
	}
	v := value(9, 2<<20)
	if err := cl.Put(ctx, "sr/a", v); err != nil {
		t.Fatalf("Put after the store restart: %v", err)
	}
	if got, err := cl.Get(ctx, "sr/a"); err != nil || !bytes.Equal(got, v) {
		t.Fatalf("Get: %d bytes, %v", len(got), err)
	}
	infos, err := cl.List(ctx, "sr/a")
	if err != nil || len(infos) != 1 || infos[0].Replicas[0].Segment != "s0/dram0@2" {
		t.Fatalf("List sr/a = %v, %v; want a replica on s0/dram0@2", infos, err)
	}
}

// TestSharedMemoryGet: with the store on this host, values move through its
// mapped DRAM, not over the store's rails.
func TestSharedMemoryGet(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	eng := engine.New(engine.Config{})
	t.Cleanup(func() { eng.Close() })
	cl, err := client.New(client.Config{Masters: []string{c.addr}, Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	ctx := testCtx(t)
	v := value(7, 3<<20+5)
	if err := cl.Put(ctx, "shm", v); err != nil {
		t.Fatal(err)
	}
	if got, err := cl.Get(ctx, "shm"); err != nil || !bytes.Equal(got, v) {
		t.Fatalf("Get: %d bytes, %v", len(got), err)
	}
	if rails := eng.Rails(); len(rails) != 0 {
		t.Fatalf("bytes went over rails %v; want shared memory only", rails)
	}
}
