package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// unsparse takes both forms of a BatchPutEnd answer (a master that
// predates sparse results answers every item) and refuses one that does
// not fit the request.
func TestUnsparse(t *testing.T) {
	bad := &pb.ItemStatus{Code: 9, Message: "refused"}
	tests := []struct {
		name   string
		resp   *pb.BatchPutEndResponse
		n      int
		failed []int // items answered with bad; nil results elsewhere
		err    bool
	}{
		{name: "every item, as older masters answer", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{{}, bad, {}}}, n: 3, failed: []int{1}},
		{name: "all succeeded", resp: &pb.BatchPutEndResponse{}, n: 3},
		{name: "some failed", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{0, 2}}, n: 3, failed: []int{0, 2}},
		{name: "all failed", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{0, 1}}, n: 2, failed: []int{0, 1}},
		{name: "holds per item", resp: &pb.BatchPutEndResponse{HoldMs: []uint32{0, 5}}, n: 2},
		{name: "too few of every item", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{{}, {}}}, n: 3, err: true},
		{name: "failed item past the request", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad}, Failed: []uint32{3}}, n: 3, err: true},
		{name: "failed items out of order", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{2, 1}}, n: 3, err: true},
		{name: "failed item twice", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{1, 1}}, n: 3, err: true},
		{name: "more results than failed items", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad, bad}, Failed: []uint32{1}}, n: 3, err: true},
		{name: "fewer results than failed items", resp: &pb.BatchPutEndResponse{Results: []*pb.ItemStatus{bad}, Failed: []uint32{0, 1}}, n: 3, err: true},
		{name: "holds not per item", resp: &pb.BatchPutEndResponse{HoldMs: []uint32{5}}, n: 2, err: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := unsparse(tt.resp, tt.n)
			if tt.err {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("unsparse = %v; want ErrProtocol", err)
				}
				return
			}
			if err != nil || len(tt.resp.Results) != tt.n {
				t.Fatalf("unsparse = %v, %d results; want nil, %d", err, len(tt.resp.Results), tt.n)
			}
			for i, st := range tt.resp.Results {
				want := 0
				for _, f := range tt.failed {
					if f == i {
						want = 9
					}
				}
				if got := st.GetCode(); got != int32(want) {
					t.Errorf("item %d: code %d, want %d", i, got, want)
				}
			}
		})
	}
}

// endRecorder is a fake master that answers every BatchPutEnd item
// published and keeps each call's keys.
type endRecorder struct {
	pb.UnimplementedMasterServer
	mu    sync.Mutex
	calls [][]string
}

func (m *endRecorder) BatchPutEnd(_ context.Context, req *pb.BatchPutEndRequest) (*pb.BatchPutEndResponse, error) {
	var keys []string
	for _, it := range req.Items {
		keys = append(keys, it.Key)
	}
	m.mu.Lock()
	m.calls = append(m.calls, keys)
	m.mu.Unlock()
	return &pb.BatchPutEndResponse{}, nil // sparse: every item published
}

func (m *endRecorder) got() [][]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.calls)
}

// lingering starts a fake master that records BatchPutEnds and a client
// of it whose senders wait up to bound for puts still writing.
func lingering(t *testing.T, bound time.Duration) (*Client, *endRecorder, *endQueue) {
	t.Helper()
	m := &endRecorder{}
	c := fakeMasterClient(t, m)
	c.ends.lingerFor = bound // before any call: no lock needed
	return c, m, c.ends
}

// waitClosed fails t unless ch closes within 10 s.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal(what)
	}
}

func endOf(key string, wrote bool) *endCall {
	return &endCall{items: []*pb.PutEndItem{{Key: key, PutId: 1, Size: 1}}, wrote: wrote}
}

// waitQueued polls until n calls wait in q.
func waitQueued(t *testing.T, q *endQueue, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		q.mu.Lock()
		got := len(q.waiting)
		q.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d calls queued, want %d", got, n)
		}
	}
}

// A sender waits for the puts of its client that are still writing, so
// they share its BatchPutEnd; one that gives up ends the wait, and the wait
// is bounded.
func TestEndLingersForWriters(t *testing.T) {
	t.Run("writers join", func(t *testing.T) {
		c, m, q := lingering(t, time.Minute)
		q.startWrite()
		q.startWrite()
		var wg sync.WaitGroup
		first := endOf("first", false)
		wg.Go(func() { c.end(context.Background(), first) })
		waitQueued(t, q, 1) // the sender waits for the two writers
		if got := m.got(); len(got) != 0 {
			t.Fatalf("the sender did not wait for the writers: %v", got)
		}
		a, b := endOf("a", true), endOf("b", true)
		wg.Go(func() { c.end(context.Background(), a) })
		wg.Go(func() { c.end(context.Background(), b) })
		wg.Wait()
		for _, call := range []*endCall{first, a, b} {
			if call.err != nil {
				t.Fatal(call.err)
			}
		}
		got := m.got()
		if len(got) != 1 || len(got[0]) != 3 {
			t.Fatalf("BatchPutEnds %v, want one with all three puts", got)
		}
		// After a coalesced BatchPutEnd the next sender yields once
		// for its peers; alone, it still sends at once.
		done := make(chan struct{})
		last := endOf("last", false)
		go func() {
			defer close(done)
			c.end(context.Background(), last)
		}()
		waitClosed(t, done, "a lone put after a coalesced BatchPutEnd waits")
		if last.err != nil || len(m.got()) != 2 {
			t.Fatalf("err %v, BatchPutEnds %v", last.err, m.got())
		}
	})
	t.Run("a writer gives up", func(t *testing.T) {
		c, m, q := lingering(t, time.Minute)
		q.startWrite()
		done := make(chan struct{})
		go func() {
			defer close(done)
			c.end(context.Background(), endOf("first", false))
		}()
		waitQueued(t, q, 1)
		q.stopWrite()
		waitClosed(t, done, "the sender still waits for a put that gave up")
		if got := m.got(); len(got) != 1 {
			t.Fatalf("BatchPutEnds %v", got)
		}
	})
	t.Run("a full BatchPutEnd goes at once", func(t *testing.T) {
		c, _, q := lingering(t, time.Minute)
		q.startWrite() // would not fit anyway
		call := &endCall{}
		for i := range maxEndItems {
			call.items = append(call.items, &pb.PutEndItem{Key: fmt.Sprintf("k%d", i), PutId: uint64(i + 1), Size: 1})
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			c.end(context.Background(), call)
		}()
		waitClosed(t, done, "the sender of a full BatchPutEnd waits for another put")
		if call.err != nil {
			t.Fatal(call.err)
		}
	})
	t.Run("bounded", func(t *testing.T) {
		c, m, q := lingering(t, 20*time.Millisecond)
		q.startWrite() // never comes
		start := time.Now()
		call := endOf("first", false)
		c.end(context.Background(), call)
		if call.err != nil {
			t.Fatal(call.err)
		}
		if took := time.Since(start); took < q.lingerFor {
			t.Fatalf("sent after %v, before the linger of %v", took, q.lingerFor)
		}
		if got := m.got(); len(got) != 1 {
			t.Fatalf("BatchPutEnds %v", got)
		}
	})
}
