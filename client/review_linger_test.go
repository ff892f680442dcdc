package client

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// lingerMaster is a fake master over one engine segment "seg". It places
// a put of a key starting "bad/" on segment "nope" of the same peer (the
// write fails at once, not ErrUnavailable), one of a key starting "lost/"
// on a closed port (the write fails ErrUnavailable, so BatchPutWith places
// it once more: then on "seg"), and the others on "seg". BatchPutEnd
// publishes every item and records the keys of each call; PutRevoke is
// counted and, while holdRevoke is set, does not answer until release is
// closed (or its ctx ends).
type lingerMaster struct {
	endRecorder
	endpoint string
	dead     string // a closed port
	release  chan struct{}

	mu         sync.Mutex
	putID      uint64
	starts     map[string]int
	holdRevoke bool
	revokes    int
}

func (m *lingerMaster) BatchPutStart(ctx context.Context, req *pb.BatchPutStartRequest) (*pb.BatchPutStartResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.starts == nil {
		m.starts = map[string]int{}
	}
	resp := &pb.BatchPutStartResponse{}
	for _, it := range req.Items {
		m.putID++
		m.starts[it.Key]++
		ep, seg := m.endpoint, "seg"
		switch {
		case strings.HasPrefix(it.Key, "bad/"):
			seg = "nope"
		case strings.HasPrefix(it.Key, "lost/") && m.starts[it.Key] == 1:
			ep = m.dead
		}
		off := (m.putID % 64) * 4096
		resp.Results = append(resp.Results, &pb.PutStartResult{Status: &pb.ItemStatus{}, PutId: m.putID, WriteTimeoutMs: 10_000,
			Replicas: []*pb.Replica{{Segment: seg, Node: "s0", Endpoint: ep, Offset: off, Length: it.Size, Tier: pb.Tier_TIER_DRAM}}})
	}
	return resp, nil
}

func (m *lingerMaster) PutRevoke(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	m.mu.Lock()
	m.revokes++
	hold := m.holdRevoke
	m.mu.Unlock()
	if hold {
		select {
		case <-m.release:
		case <-ctx.Done():
		}
	}
	return &pb.ItemsResponse{}, nil
}

func (m *lingerMaster) revoked() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.revokes
}

// lingerFixture starts a store engine with a 256 KiB segment "seg", the
// fake master and a client of it.
func lingerFixture(t *testing.T) (*Client, *lingerMaster) {
	t.Helper()
	addr := servePeer(t, engine.NewMemSegment("seg", make([]byte, 64*4096)))
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	dead.Close()
	m := &lingerMaster{endpoint: addr, dead: deadAddr, release: make(chan struct{})}
	c := fakeMasterClient(t, m)
	c.setWriteTimeout(10 * time.Second)
	return c, m
}

// writingNow is the queue's count of puts still writing.
func writingNow(q *endQueue) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.writing
}

// pollUntil polls cond for up to 10 s.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestReviewLingerRevokingPutStillCounted: a put whose writes all failed
// will never call end. It was uncounted only in putBatch's deferred
// stopWrite, after c.revoke's PutRevoke round trip (up to 5 s): meanwhile
// every sender lingered its whole bound for it (found by review; fixed by
// uncounting a put before it revokes).
func TestReviewLingerRevokingPutStillCounted(t *testing.T) {
	c, m := lingerFixture(t)
	q := c.ends
	q.mu.Lock()
	q.lingerFor = time.Minute // the bound, made visible
	q.mu.Unlock()
	m.mu.Lock()
	m.holdRevoke = true
	m.mu.Unlock()
	released := false
	release := func() {
		if !released {
			released = true
			close(m.release)
		}
	}
	defer release()

	putDone := make(chan error, 1)
	go func() { putDone <- c.Put(context.Background(), "bad/1", bytes.Repeat([]byte{1}, 4096)) }()
	pollUntil(t, "the failed put's PutRevoke", func() bool { return m.revoked() > 0 })
	// Its writes are over and it will not call end.
	n := writingNow(q)

	sent := make(chan struct{})
	call := endOf("other", false)
	go func() {
		defer close(sent)
		c.end(context.Background(), call)
	}()
	var lingered bool
	select {
	case <-sent:
	case <-time.After(3 * time.Second): // the revoke is held longer
		lingered = true
	}
	release()
	if err := <-putDone; err == nil {
		t.Error("a put whose write failed succeeded")
	}
	<-sent
	if call.err != nil {
		t.Errorf("the other put's end: %v", call.err)
	}
	if n != 0 || lingered {
		t.Fatalf("while a put whose writes failed revoked them, %d puts were counted as writing, and a sender lingered for it (%v): it lingers for a put that will never join", n, lingered)
	}
}

// TestReviewLingerCounterBalanced: every way a put leaves putBatch
// uncounts it: published, a write failed (revoked), a write found its
// store unreachable (placed once more, through putBatch again), its ctx
// ended before or while writing, and a batch mixing them.
func TestReviewLingerCounterBalanced(t *testing.T) {
	c, m := lingerFixture(t)
	q := c.ends
	val := bytes.Repeat([]byte{7}, 4096)
	ctx := context.Background()
	check := func(what string) {
		t.Helper()
		if n := writingNow(q); n != 0 {
			t.Fatalf("after %s, %d puts are still counted as writing", what, n)
		}
	}
	if err := c.Put(ctx, "good/1", val); err != nil {
		t.Fatal(err)
	}
	check("a put")
	if err := c.Put(ctx, "bad/1", val); err == nil {
		t.Fatal("a put whose write failed succeeded")
	}
	check("a failed write")
	if err := c.Put(ctx, "lost/1", val); err != nil {
		t.Fatalf("a put placed once more after an unreachable store: %v", err)
	}
	check("a write to an unreachable store, placed once more")
	m.mu.Lock()
	again := m.starts["lost/1"]
	m.mu.Unlock()
	if again != 2 {
		t.Fatalf("lost/1 placed %d times, want 2 (putBatch again)", again)
	}
	errs := c.BatchPut(ctx, []string{"good/2", "bad/2", "lost/2", "good/3"}, [][]byte{val, val, val, val})
	if errs[0] != nil || errs[1] == nil || errs[2] != nil || errs[3] != nil {
		t.Fatalf("mixed batch: %v", errs)
	}
	check("a mixed batch")
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_ = c.Put(canceled, "good/4", val)
	check("a put whose ctx had ended")

	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			keys := []string{"good/c" + string(rune('a'+i)), "bad/c" + string(rune('a'+i))}
			tctx, cancel := context.WithTimeout(ctx, time.Duration(i%4)*time.Millisecond)
			defer cancel()
			_ = c.BatchPut(tctx, keys, [][]byte{val, val})
		})
	}
	wg.Wait()
	check("concurrent puts, some canceled midway")
}

// TestReviewLingerNoLostWakeup: writers that arrive together, while the
// sender lingers or before, never leave it waiting for the bound (a
// minute here): arrived holds one wake-up, and the count is read under
// the lock.
func TestReviewLingerNoLostWakeup(t *testing.T) {
	c, _, q := lingering(t, time.Minute)
	for round := range 100 {
		const writers = 4
		for range writers {
			q.startWrite()
		}
		done := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() { c.end(context.Background(), endOf("s", false)) })
		for i := range writers {
			wg.Go(func() {
				if i%2 == 0 {
					q.stopWrite() // gives up
					return
				}
				c.end(context.Background(), endOf("w", true))
			})
		}
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: a sender still lingers after every writer came or gave up (writing %d)", round, writingNow(q))
		}
		q.mu.Lock()
		busy, waiting, writing := q.busy, len(q.waiting), q.writing
		q.mu.Unlock()
		if busy || waiting != 0 || writing != 0 {
			t.Fatalf("round %d: queue left busy %v, %d waiting, %d writing", round, busy, waiting, writing)
		}
	}
}

// TestReviewLingerStaleWakeupStillBounded: a wake-up left in arrived by a
// writer nobody waited for does not end a later sender's wait early
// while a writer is still counted, and the wait still ends at its bound.
func TestReviewLingerStaleWakeupStillBounded(t *testing.T) {
	c, _, q := lingering(t, 50*time.Millisecond)
	q.startWrite()
	q.stopWrite() // nobody lingers: its wake-up stays in arrived
	q.startWrite()
	defer q.stopWrite()
	start := time.Now()
	call := endOf("s", false)
	c.end(context.Background(), call)
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Fatalf("sent after %v, before the bound, though a writer is still counted", took)
	}
	if call.err != nil {
		t.Fatal(call.err)
	}
}

// TestReviewLingerWaiterCtxEnds: a put whose PutEnd waits behind a
// lingering sender and whose ctx ends leaves at once, with its ctx's
// error, and is not sent; the sender goes on without it.
func TestReviewLingerWaiterCtxEnds(t *testing.T) {
	c, m, q := lingering(t, time.Minute)
	q.startWrite() // w
	q.startWrite() // a writer that is slow
	sent := make(chan struct{})
	first := endOf("first", false)
	go func() {
		defer close(sent)
		c.end(context.Background(), first)
	}()
	waitQueued(t, q, 1)
	ctx, cancel := context.WithCancel(context.Background())
	w := endOf("w", true)
	left := make(chan struct{})
	go func() {
		defer close(left)
		c.end(ctx, w)
	}()
	waitQueued(t, q, 2)
	cancel()
	select {
	case <-left:
	case <-time.After(10 * time.Second):
		t.Fatal("a waiter whose ctx ended still waits behind the lingering sender")
	}
	if !errors.Is(w.err, ErrUnavailable) || !errors.Is(w.err, context.Canceled) {
		t.Fatalf("waiter's err = %v", w.err)
	}
	q.stopWrite() // the slow writer gives up
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("the sender still lingers")
	}
	if first.err != nil {
		t.Fatal(first.err)
	}
	if got := m.got(); len(got) != 1 || len(got[0]) != 1 || got[0][0] != "first" {
		t.Fatalf("BatchPutEnds %v, want one with only the sender's", got)
	}
	if n := writingNow(q); n != 0 {
		t.Fatalf("%d still counted", n)
	}
}
