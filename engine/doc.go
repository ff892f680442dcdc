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
// A caller that would wait at once calls Run instead: the same, but its own goroutine does the
// copies through shared memory and starts the rest, which saves two goroutine hand-offs.
//
// A task goes Pending -> Running -> one terminal state, and every task reaches exactly one:
// Done, Failed (Err wraps ErrSegmentNotFound, ErrOutOfRange, ErrUnavailable, ErrProtocol,
// ErrRemote, ErrInvalid or ErrClosed), Canceled (the Submit context was canceled) or TimedOut
// (Options.Deadline or the context's deadline passed). A peer that stops answering cannot hold a
// task: cancellation and deadlines close the connection the task is blocked on, and Close fails
// whatever is still in flight with ErrClosed and waits for every goroutine it started.
//
// # How a task travels
//
// Consecutive tasks that continue each other in the segment and in memory travel as one request.
// The engine tries its transports in order, each falling over to the next: local (the segment is
// served by this engine), shm (the peer is on this host and its segment is memory: mapped through
// /proc/<pid>/fd, then a memcpy; a goroutine touches each page of a new mapping once, so first
// touches stay off the copies' path), file (the same for file-backed segments: pread and pwrite) and
// then the peer's rails over TCP, one rail per listen address of the peer (Target.Endpoint lists
// them, comma separated).
//
// On the rails a request is cut into slices (slice.go), queued per peer by QoS class with aging
// (qos.go), and each slice is bound to a rail when a connection slot frees up, to the rail with
// the lowest predicted finish time (spray.go, rail.go); Config.RoundRobin is the baseline that
// deals slices in turn. A rail that errs three times in ten seconds is paused; its slices are
// retried elsewhere (sched.go). Rails reports what the engine knows of each rail.
//
// # Tickets
//
// Target.Ticket travels with every request over the rails; a server with a Config.Guard (a
// store) admits a request only if its Guard accepts the ticket for those bytes, and ends it by
// the time the Guard gives. A refusal fails the task with ErrForbidden. Same-process and
// same-host transports do not pass through the guard (see docs/architecture.md).
//
// engine/enginetest wraps a transport to shape rails (bandwidth, latency, jitter) and inject
// faults, so heterogeneous links can be tested on loopback.
package engine
