// Package engine is Tidepool's data plane: it moves bytes between a client's buffers and the
// memory segments that store nodes serve, and serves this node's own segments to peers. The master
// is never on this path; it only hands out (endpoint, segment, offset) descriptors.
//
// # Segments
//
// A Segment is a named range of bytes (a DRAM arena, an HBM region, an SSD file). Register makes
// it reachable by peers; Serve accepts their connections. Segments that implement Mapped are
// served without intermediate copies: payloads are read off the socket straight into segment
// memory and sent straight from it. MemSegment is the in-memory one.
//
// # Batches
//
// Transfers are declarative. Build a Batch with Read and Write, each of which returns a Task,
// start everything with Submit, then Wait:
//
//	b := eng.NewBatch()
//	t := b.Read(dst, engine.Target{Endpoint: "10.0.0.7:7000", Segment: "dram-0"}, off, engine.Options{
//		Priority: engine.High,
//		Deadline: time.Now().Add(50 * time.Millisecond),
//	})
//	if err := b.Submit(ctx); err != nil { ... }
//	err := b.Wait(ctx) // first error in task order, errors.Is-able; t.State() says how t ended
//
// A task goes Pending -> Running -> one terminal state, and every task reaches exactly one:
// Done, Failed (Err wraps ErrSegmentNotFound, ErrOutOfRange, ErrUnavailable, ErrProtocol,
// ErrRemote, ErrInvalid or ErrClosed), Canceled (the Submit context was canceled) or TimedOut
// (Options.Deadline or the context's deadline passed). A peer that stops answering cannot hold a
// task: cancellation and deadlines close the connection the task is blocked on, and Close fails
// whatever is still in flight with ErrClosed and waits for every goroutine it started.
//
// # Seams for what comes next
//
//   - Transport is the plug-in point for how bytes travel; TCP is built in (frame.go documents the
//     wire format), shm, local, file and fault-injecting test transports plug in the same way.
//   - split cuts large tasks into chunks that run in parallel over pooled connections; the slicer
//     and the bandwidth-aware sprayer over several rails replace it.
//   - Priority is carried from Options to every Op but not yet scheduled on; dispatch, FIFO per
//     batch with an engine-wide cap on tasks in flight, is where the QoS classes will plug in.
package engine
