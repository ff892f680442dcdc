package store

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Copies are the master's commands to this node, handed out on heartbeats:
// read an object's bytes from one replica, check them, write them to a new
// replica (demotion, promotion, drain). Results go back on the next
// heartbeat, which a finished copy brings forward.

// copySlots is how many more copies the node can take now.
func (n *Node) copySlots() uint32 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return uint32(max(0, n.cfg.CopyConcurrency-len(n.mu.copying)))
}

// takeResults removes the results not yet reported; putBack returns them
// when the heartbeat that carried them failed.
func (n *Node) takeResults() (done []*pb.CopyResult, gen uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	done, n.mu.done = n.mu.done, nil
	return done, n.mu.gen
}

func (n *Node) putBack(done []*pb.CopyResult, gen uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if gen == n.mu.gen { // else the node registered again: the master forgot these copies
		n.mu.done = append(done, n.mu.done...)
	}
}

// startCopy runs t in the background until it ends or ctx is canceled.
// A task the master sends again while it runs is not started twice.
func (n *Node) startCopy(ctx context.Context, t *pb.CopyTask) {
	n.mu.Lock()
	if _, running := n.mu.copying[t.Id]; running {
		n.mu.Unlock()
		return
	}
	gen := n.mu.gen
	if len(n.mu.copying) >= n.cfg.CopyConcurrency {
		n.mu.Unlock()
		// The master sent more than copy_slots: refuse, it may try later.
		n.copyDone(gen, t, status.Errorf(codes.ResourceExhausted,
			"copy %d of %q: node %s runs %d copies already", t.Id, t.Key, n.cfg.ID, n.cfg.CopyConcurrency))
		return
	}
	n.mu.copying[t.Id] = struct{}{}
	n.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		n.copyDone(gen, t, n.copy(ctx, t))
	}()
}

// copyDone queues t's result for the master and wakes the run loop to
// report it now rather than at the next tick.
func (n *Node) copyDone(gen uint64, t *pb.CopyTask, err error) {
	st := status.Convert(err)
	res := &pb.CopyResult{Id: t.Id, Key: t.Key, Status: &pb.ItemStatus{Code: int32(st.Code()), Message: st.Message()}}
	if err != nil {
		n.log.Warn("copy failed", "id", t.Id, "key", t.Key, "code", st.Code(), "err", st.Message())
	} else {
		n.log.Debug("copied", "id", t.Id, "key", t.Key, "bytes", t.Size)
	}
	if n.copies != nil {
		if err != nil {
			n.copies.WithLabelValues("failed").Inc()
		} else {
			n.copies.WithLabelValues("ok").Inc()
			n.copiedBytes.Add(float64(t.Size))
		}
	}
	n.mu.Lock()
	delete(n.mu.copying, t.Id)
	if gen == n.mu.gen {
		n.mu.done = append(n.mu.done, res)
	}
	n.mu.Unlock()
	select {
	case n.wake <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// copy moves t's bytes; its error is a gRPC status for the master.
func (n *Node) copy(ctx context.Context, t *pb.CopyTask) error {
	if err := checkCopy(t); err != nil {
		return err
	}
	// The buffer below is the object's size: bound it by the source's tier
	// (the master hands a copy to the node holding its source), else by
	// this node's largest, so a bad task cannot exhaust memory.
	if c := n.copyLimit(t.Source.Segment); t.Size > c {
		return status.Errorf(codes.InvalidArgument, "copy %d of %q: %d bytes exceed the %d a copy from %s may move here", t.Id, t.Key, t.Size, c, t.Source.Segment)
	}
	timeout := time.Duration(min(t.TimeoutMs, math.MaxInt64/uint64(time.Millisecond))) * time.Millisecond
	opts := engine.Options{Priority: engine.Low, Deadline: time.Now().Add(timeout)}
	buf := make([]byte, t.Size)
	if task := n.transfer(ctx, false, buf, t.Source, opts); task.State() != engine.Done {
		return transferStatus(ctx, task, fmt.Sprintf("copy %d of %q: read source %s", t.Id, t.Key, t.Source.Segment))
	}
	// Never write bytes that are not the object's: the source is corrupt.
	if got := crc32.Checksum(buf, crc32.MakeTable(crc32.Castagnoli)); got != t.Checksum {
		return status.Errorf(codes.DataLoss, "copy %d of %q: bytes read from source %s do not match the checksum: want %08x, got %08x",
			t.Id, t.Key, t.Source.Segment, t.Checksum, got)
	}
	if task := n.transfer(ctx, true, buf, t.Target, opts); task.State() != engine.Done {
		return transferStatus(ctx, task, fmt.Sprintf("copy %d of %q: write target %s", t.Id, t.Key, t.Target.Segment))
	}
	return nil
}

// transfer reads r's bytes into buf, or writes buf to r, and returns the
// terminal task.
func (n *Node) transfer(ctx context.Context, write bool, buf []byte, r *pb.Replica, opts engine.Options) *engine.Task {
	b := n.eng.NewBatch()
	target := engine.Target{Endpoint: r.Endpoint, Segment: r.Segment, Ticket: string(r.Ticket)}
	var task *engine.Task
	if write {
		task = b.Write(buf, target, int64(r.Offset), opts)
	} else {
		task = b.Read(buf, target, int64(r.Offset), opts)
	}
	if err := b.Submit(ctx); err == nil {
		// Not ctx: the task must be terminal, so buf is no longer on the wire.
		_ = b.Wait(context.Background())
	}
	return task
}

// transferStatus maps a failed task to a code the way clients see engine
// failures: a peer or network failure is Unavailable.
func transferStatus(ctx context.Context, task *engine.Task, what string) error {
	code := codes.Unavailable
	switch {
	case ctx.Err() != nil:
		code = codes.Canceled // the node is closing, or was drained
	case task.State() == engine.TimedOut:
		code = codes.DeadlineExceeded
	case task.State() == engine.Canceled:
		code = codes.Canceled
	case errors.Is(task.Err(), engine.ErrForbidden):
		code = codes.PermissionDenied // the master's ticket was refused: asking again cannot help
	}
	return status.Errorf(code, "%s: %v", what, task.Err())
}

// checkCopy rejects a task no transfer could carry out.
// copyLimit is the largest copy from segment name this node makes: the
// capacity of its tier registered under that name, else of its largest.
func (n *Node) copyLimit(name string) uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	var largest uint64
	for i, t := range n.cfg.Tiers {
		if i < len(n.mu.names) && n.mu.names[i] == name {
			return uint64(t.Capacity())
		}
		largest = max(largest, uint64(t.Capacity()))
	}
	return largest
}

func checkCopy(t *pb.CopyTask) error {
	bad := func(why string) error {
		return status.Errorf(codes.InvalidArgument, "copy %d of %q: %s", t.Id, t.Key, why)
	}
	switch {
	case t.Source == nil || t.Target == nil:
		return bad("no source or no target replica")
	case t.Size == 0:
		return bad("size 0")
	case t.Size != t.Source.Length || t.Size != t.Target.Length:
		return bad("size differs from a replica's length")
	case t.Source.Offset > math.MaxInt64 || t.Target.Offset > math.MaxInt64 ||
		t.Size > math.MaxInt64-t.Source.Offset || t.Size > math.MaxInt64-t.Target.Offset:
		return bad("replica offset out of range")
	case t.Source.Endpoint == "" || t.Source.Segment == "" || t.Target.Endpoint == "" || t.Target.Segment == "":
		return bad("a replica has no endpoint or segment")
	case t.TimeoutMs == 0:
		return bad("no timeout")
	}
	return nil
}
