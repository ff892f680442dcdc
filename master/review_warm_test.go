package master

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReviewWarmOrderManyRounds: warm asks for each key exactly once and
// in order over several rounds of 64, the last one partial, and reads the
// home slot of every key (n = 0, 1, 63, 64, 65, 128, 200), on empty
// shards too, changing nothing.
func TestReviewWarmOrderManyRounds(t *testing.T) {
	tab := newObjectTable()
	tab.warm(3, func(i int) string { return fmt.Sprintf("k/%d", i) }) // every shard empty
	for i := range 5000 {
		tab.put(allocObject(fmt.Sprintf("k/%d", i), ""))
	}
	for _, n := range []int{0, 1, 63, 64, 65, 128, 200} {
		var asked []int
		tab.warm(n, func(i int) string { asked = append(asked, i); return fmt.Sprintf("k/%d", i) })
		want := make([]int, n)
		for i := range want {
			want[i] = i
		}
		if !slices.Equal(asked, want) {
			t.Fatalf("n=%d: warm asked for %v", n, asked)
		}
	}
	if tab.len() != 5000 || tab.get("k/7") == nil || tab.get("k/5000") != nil {
		t.Fatalf("after warm: len %d, get(k/7) %v, get(k/5000) %v", tab.len(), tab.get("k/7"), tab.get("k/5000"))
	}
}

// reviewTwin is two FSMs fed the same commands, one publishing in the
// packed form (warmed), the other in the listed form (not warmed).
type reviewTwin struct{ packed, listed *fsmDriver }

func newReviewTwin(t *testing.T) *reviewTwin {
	tw := &reviewTwin{newDriver(t), newDriver(t)}
	for _, d := range []*fsmDriver{tw.packed, tw.listed} {
		d.register(t0, "n1", "ep1", dram("a", 1<<40))
	}
	return tw
}

func (tw *reviewTwin) reserve(t *testing.T, now int64, bytes uint64) (uint64, uint64) {
	var id, off uint64
	for i, d := range []*fsmDriver{tw.packed, tw.listed} {
		r, ok := d.apply(now, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
			Segment: "n1/a@1", Bytes: bytes, MinSpan: 4096, AllocUntilUnixNano: now + 1e12, ReleaseAfterUnixNano: now + 2e12,
		}}}).(ReserveResult)
		if !ok || r.Err != nil || len(r.Spans) != 1 {
			t.Fatalf("reserve: %+v", r)
		}
		if i == 1 && (r.ID != id || r.Spans[0].off != off) {
			t.Fatalf("twins differ: reservation %d@%d against %d@%d", r.ID, r.Spans[0].off, id, off)
		}
		id, off = r.ID, r.Spans[0].off
	}
	return id, off
}

func listedOf(c *pb.PublishColumnsCmd) *pb.PublishColumnsCmd {
	l := proto.Clone(c).(*pb.PublishColumnsCmd)
	at, pat := 0, 0
	for i, kl := range c.KeyLengths {
		l.KeyList = append(l.KeyList, unpack(c.Keys, &at, kl))
		if len(c.ParentLengths) > 0 {
			l.ParentList = append(l.ParentList, unpack(c.Parents, &pat, c.ParentLengths[i]))
		}
	}
	l.Keys, l.KeyLengths, l.Parents, l.ParentLengths = nil, nil, nil, nil
	return l
}

// applyPublish applies c through Apply from its encoding; a panic comes
// back as an error string so a test can name it.
func applyPublish(d *fsmDriver, now int64, c *pb.PublishColumnsCmd) (out any, panicked string) {
	defer func() {
		if r := recover(); r != nil {
			panicked = fmt.Sprint(r)
		}
	}()
	return d.apply(now, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: c}}), ""
}

func errStrings(out any) string {
	switch v := out.(type) {
	case []error:
		s := make([]string, len(v))
		for i, e := range v {
			s[i] = fmt.Sprint(e)
		}
		return strings.Join(s, "|")
	default:
		return fmt.Sprintf("%T %v", out, out)
	}
}

// TestReviewWarmPublishSameAsListed: a packed publish (warmed) of 200
// items, with empty keys, an over-long key, duplicates, empty and
// non-empty parents, gives the same per-item results and the same table
// as the same publish in the listed form (never warmed).
func TestReviewWarmPublishSameAsListed(t *testing.T) {
	tw := newReviewTwin(t)
	now := t0 + 1000
	for round, n := range []int{200, 65, 64, 1} {
		const size = 4096
		id, off := tw.reserve(t, now, uint64(n)*size)
		its := make([]*pb.PublishItem, n)
		var keys []string
		for i := range its {
			key := fmt.Sprintf("r%d/%d", round, i)
			switch {
			case i%17 == 5:
				key = "" // refused: empty key
			case i%29 == 7:
				key = strings.Repeat("x", MaxKeyLen+1) // refused: too long
			case i%13 == 3 && i > 0:
				key = its[i-1].Key // duplicate of the one before
			}
			parent := ""
			if i%3 == 1 {
				parent = fmt.Sprintf("p/%d", i)
			}
			its[i] = &pb.PublishItem{Key: key, Parent: parent, Size: size, Checksum: uint32(i), PutId: uint64(i + 1),
				Replicas:     []*pb.Extent{{Segment: "n1/a@1", Offset: off + uint64(i*size), Length: size}},
				Reservations: []uint64{id}}
			keys = append(keys, key)
		}
		c := columnsOf(its)
		if n > 5 && !slices.Contains(c.KeyLengths, 0) {
			t.Fatal("no empty key in the batch")
		}
		outP, pp := applyPublish(tw.packed, now, c)
		outL, pl := applyPublish(tw.listed, now, listedOf(c))
		if pp != "" || pl != "" {
			t.Fatalf("n=%d: panic packed %q listed %q", n, pp, pl)
		}
		if a, b := errStrings(outP), errStrings(outL); a != b {
			t.Fatalf("n=%d: packed %s\nlisted %s", n, a, b)
		}
		for _, k := range keys {
			op, ol := tw.packed.f.objects.get(k), tw.listed.f.objects.get(k)
			if (op == nil) != (ol == nil) || op != nil && (op.key() != ol.key() || op.parent() != ol.parent()) {
				t.Fatalf("n=%d: key %q packed %v listed %v", n, k, op, ol)
			}
		}
	}
	if a, b := tw.packed.f.objects.len(), tw.listed.f.objects.len(); a != b || a == 0 {
		t.Fatalf("table lengths %d and %d", a, b)
	}
}

// TestReviewWarmMalformedColumns: malformed packed columns are refused
// with ErrInvalidRequest by Apply, never a panic (warm must not run on
// them).
func TestReviewWarmMalformedColumns(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 1<<40))
	now := t0 + 1000
	cols := func(keys []byte, lengths ...uint32) *pb.PublishColumnsCmd {
		n := len(lengths)
		return &pb.PublishColumnsCmd{Keys: keys, KeyLengths: lengths, Sizes: make([]uint64, n), Checksums: make([]uint32, n),
			PutIds: make([]uint64, n), ReplicasWanted: make([]uint32, n), ReplicaCounts: make([]uint32, n)}
	}
	many := make([]uint32, MaxBatchKeys+1)
	many[0] = 1
	cases := map[string]*pb.PublishColumnsCmd{
		"sum over":         cols([]byte("abc"), 2, 2),
		"sum under":        cols([]byte("abcde"), 2, 2),
		"huge length":      cols([]byte("ab"), math.MaxUint32, 2),
		"two huge":         cols([]byte("ab"), math.MaxUint32, math.MaxUint32, 4),
		"lengths, no keys": cols(nil, 1),
		"keys, no lengths": cols([]byte("abc")),
		"too many":         cols([]byte("a"), many...),
		"sizes short":      func() *pb.PublishColumnsCmd { c := cols([]byte("ab"), 1, 1); c.Sizes = c.Sizes[:1]; return c }(),
		"both forms":       func() *pb.PublishColumnsCmd { c := cols([]byte("ab"), 1, 1); c.KeyList = []string{"a", "b"}; return c }(),
		"listed with packed parent": func() *pb.PublishColumnsCmd {
			c := cols(nil)
			c.KeyList = []string{"a"}
			c.ParentLengths = []uint32{0}
			return c
		}(),
	}
	for name, c := range cases {
		out, p := applyPublish(d, now, c)
		if p != "" {
			t.Errorf("%s: Apply panicked: %s", name, p)
			continue
		}
		if err, ok := out.(error); !ok || !strings.Contains(err.Error(), "do not line up") && !strings.Contains(err.Error(), "items in one command") {
			t.Errorf("%s: Apply returned %T %v, want a refusal", name, out, out)
		}
	}
	// Well formed edge cases: nothing at all, and all keys empty.
	out, p := applyPublish(d, now, &pb.PublishColumnsCmd{})
	if p != "" || errStrings(out) != "" {
		t.Errorf("empty command: %q %s", p, errStrings(out))
	}
	out, p = applyPublish(d, now, cols(nil, 0, 0, 0))
	if p != "" || len(out.([]error)) != 3 || out.([]error)[0] == nil {
		t.Errorf("all keys empty: %q %s", p, errStrings(out))
	}
}

// TestReviewWarmRace: FSM.warm, as BatchPutStart calls it, beside Apply of
// publishes that grow the table (run with -race).
func TestReviewWarmRace(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 1<<40))
	now := t0 + 1000
	const n, size, batches = 128, 4096, 40
	var stop atomic.Bool
	var rounds atomic.Int64
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := make([]string, n)
			for round := 0; !stop.Load(); round++ {
				for i := range keys {
					keys[i] = fmt.Sprintf("race/%d", (round*n+i+g*7)%(n*batches))
				}
				d.f.warm(len(keys), func(i int) string { return keys[i] })
				_ = d.f.putState(keys[0], now)
				rounds.Add(1)
			}
		}()
	}
	seq := 0
	for range batches {
		r, ok := d.apply(now, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{
			Segment: "n1/a@1", Bytes: n * size, MinSpan: size, AllocUntilUnixNano: now + 1e12, ReleaseAfterUnixNano: now + 2e12,
		}}}).(ReserveResult)
		if !ok || r.Err != nil {
			t.Fatalf("reserve: %+v", r)
		}
		its := make([]*pb.PublishItem, n)
		for i := range its {
			its[i] = &pb.PublishItem{Key: fmt.Sprintf("race/%d", seq), Size: size, PutId: uint64(seq + 1),
				Replicas: []*pb.Extent{{Segment: "n1/a@1", Offset: r.Spans[0].off + uint64(i*size), Length: size}}, Reservations: []uint64{r.ID}}
			seq++
		}
		errs, ok := d.apply(now, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: columnsOf(its)}}).([]error)
		if !ok || slices.ContainsFunc(errs, func(e error) bool { return e != nil }) {
			t.Fatalf("publish: %v", errs)
		}
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d warm rounds beside %d publishes", rounds.Load(), batches)
	if d.f.objects.len() != n*batches {
		t.Fatalf("len %d", d.f.objects.len())
	}
}

// TestReviewWarmBatchPutStartRace: BatchPutStart (which warms under the
// read lock) from two goroutines beside BatchPutEnd's publishes, through
// a one-member cluster (run with -race).
func TestReviewWarmBatchPutStartRace(t *testing.T) {
	const n, size, batches = 64, 64, 12
	c := newCluster(t, 1, nil)
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 1<<40))
	ms := &masterService{s: m.srv}
	ctx := rpcCtx(t)
	var wg sync.WaitGroup
	errc := make(chan error, 2)
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range batches {
				req := &pb.BatchPutStartRequest{Items: make([]*pb.PutStartRequest, n)}
				for i := range req.Items {
					req.Items[i] = &pb.PutStartRequest{Key: fmt.Sprintf("g%d/%d/%d", g, b, i), Size: size, Tier: pb.Tier_TIER_DRAM}
				}
				resp, err := ms.BatchPutStart(ctx, req)
				if err != nil {
					errc <- err
					return
				}
				end := &pb.BatchPutEndRequest{Items: make([]*pb.PutEndItem, n)}
				for i, r := range resp.Results {
					if r.Status.GetCode() != 0 {
						errc <- fmt.Errorf("start %s: %s", req.Items[i].Key, r.Status.GetMessage())
						return
					}
					end.Items[i] = &pb.PutEndItem{Key: req.Items[i].Key, PutId: r.PutId, Size: size}
				}
				if _, err := ms.BatchPutEnd(ctx, end); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if got := m.srv.fsm.objects.len(); got != 2*n*batches {
		t.Fatalf("%d objects, want %d", got, 2*n*batches)
	}
}
