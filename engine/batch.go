package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// Target names a segment on a peer: the peer engine's host:port and the segment's name.
type Target struct {
	Endpoint string
	Segment  string
	// Ticket is the master's permission for the transfer, sent with each request to the peer,
	// whose Guard checks it (see Config.Guard). Tasks merge into one request only if their
	// tickets are equal, so a ticket covering consecutive objects keeps their reads together.
	Ticket string
}

func (t Target) String() string { return t.Endpoint + "/" + t.Segment }

// Rails returns the peer's rail addresses: Endpoint is one address, or
// several separated by commas when the peer listens on several rails.
func (t Target) Rails() []string { return strings.Split(t.Endpoint, ",") }

// Priority is a task's QoS class. It is carried to the transport but not yet scheduled on. The
// zero value means Medium, so callers that do not care land in the middle class.
type Priority int

const (
	High   Priority = iota + 1 // foreground gets on an inference's critical path
	Medium                     // puts, prefetch; the default
	Low                        // demotion, repair, rebalancing
)

func (p Priority) String() string {
	switch p {
	case High:
		return "high"
	case Medium, 0:
		return "medium"
	case Low:
		return "low"
	default:
		return fmt.Sprintf("priority(%d)", int(p))
	}
}

// Options qualify one task.
type Options struct {
	Priority Priority
	// Deadline, if set, bounds the whole task, queueing included; past it the task ends TimedOut.
	Deadline time.Time
	// Tenant names whose in-flight cap (Config.TenantInflight) the task counts against.
	Tenant string
}

// State is where a task is in its life. Pending and Running are transient; the others are
// terminal, and every task reaches exactly one of them.
type State int32

const (
	Pending  State = iota // added, not yet started
	Running               // on the wire
	Done                  // all bytes moved
	Failed                // the peer or the network said no; Err says why
	Canceled              // the Submit context was canceled
	TimedOut              // the deadline (Options.Deadline or the Submit context's) passed
)

func (s State) String() string {
	switch s {
	case Pending:
		return "pending"
	case Running:
		return "running"
	case Done:
		return "done"
	case Failed:
		return "failed"
	case Canceled:
		return "canceled"
	case TimedOut:
		return "timed_out"
	default:
		return fmt.Sprintf("state(%d)", int(s))
	}
}

// Terminal reports whether s is a final state.
func (s State) Terminal() bool { return s >= Done }

// Task is one transfer in a batch.
type Task struct {
	op    Op
	opts  Options
	state atomic.Int32
	err   error // written once, before state turns terminal
	// done is made by the first Done, if any: Wait counts on the batch
	// instead, so most tasks never need a channel of their own.
	done   atomic.Pointer[chan struct{}]
	closed atomic.Bool // done closed
	batch  *Batch      // counted in its pending; nil for a task outside any
	start  time.Time
}

func newTask(kind OpKind, buf []byte, t Target, off int64, o Options) *Task {
	return &Task{op: Op{Kind: kind, Target: t, Offset: off, Buf: buf, Priority: o.Priority}, opts: o}
}

// State returns the task's current state.
func (t *Task) State() State { return State(t.state.Load()) }

// Err returns why the task did not finish Done: nil while it is not terminal and when it is Done.
// Errors wrap the engine's sentinels; Canceled wraps context.Canceled, TimedOut wraps both
// ErrTimedOut and context.DeadlineExceeded.
func (t *Task) Err() error {
	if !t.State().Terminal() {
		return nil
	}
	return t.err // the atomic load above orders this read after finish's write
}

// Done returns a channel closed when the task reaches a terminal state.
func (t *Task) Done() <-chan struct{} {
	if p := t.done.Load(); p != nil {
		return *p
	}
	ch := make(chan struct{})
	if !t.done.CompareAndSwap(nil, &ch) {
		return *t.done.Load()
	}
	if t.State().Terminal() { // finish may have looked for a channel before there was one
		t.closeDone()
	}
	return ch
}

func (t *Task) closeDone() {
	if p := t.done.Load(); p != nil && t.closed.CompareAndSwap(false, true) {
		close(*p)
	}
}

// finish moves t to its terminal state. Each task is finished by exactly one goroutine.
func (t *Task) finish(s State, err error) {
	if err != nil {
		t.err = fmt.Errorf("%s %s[%d:+%d]: %w", t.op.Kind, t.op.Target, t.op.Offset, len(t.op.Buf), err)
	}
	t.state.Store(int32(s))
	t.closeDone()
	if b := t.batch; b != nil && b.pending.Add(-1) == 0 {
		close(b.all)
	}
}

// validate catches what no peer can serve, before any I/O.
func (t *Task) validate() error {
	switch op := &t.op; {
	case op.Target.Endpoint == "":
		return fmt.Errorf("%w: empty endpoint", ErrInvalid)
	case len(op.Target.Ticket) > MaxTicket:
		return fmt.Errorf("%w: ticket of %d bytes, at most %d", ErrInvalid, len(op.Target.Ticket), MaxTicket)
	case op.Target.Segment == "" || len(op.Target.Segment) > MaxSegmentName:
		return fmt.Errorf("%w: segment name must be 1..%d bytes", ErrInvalid, MaxSegmentName)
	case op.Offset < 0 || int64(len(op.Buf)) > (1<<63-1)-op.Offset:
		return fmt.Errorf("%w: offset %d", ErrOutOfRange, op.Offset)
	}
	return nil
}

// Batch is a set of transfers submitted together. Build it with Read and Write, start it with
// Submit, then Wait. A batch is submitted once; Wait and the Task methods may be called from any
// goroutine.
type Batch struct {
	e       *Engine
	pending atomic.Int64  // tasks not terminal, from Submit on
	all     chan struct{} // made by Submit; closed when pending reaches 0
	mu      struct {
		sync.Mutex
		tasks     []*Task
		slab      []Task // where the next tasks are allocated: a few allocations a batch, not one a task
		submitted bool
	}
}

// Read adds a task that copies len(dst) bytes at off in the target segment into dst. dst must not
// be touched until the task is terminal.
func (b *Batch) Read(dst []byte, t Target, off int64, o Options) *Task {
	return b.add(OpRead, dst, t, off, o)
}

// Write adds a task that copies src into the target segment at off. src must not be modified
// until the task is terminal.
func (b *Batch) Write(src []byte, t Target, off int64, o Options) *Task {
	return b.add(OpWrite, src, t, off, o)
}

func (b *Batch) add(kind OpKind, buf []byte, tg Target, off int64, o Options) *Task {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mu.submitted {
		// No panic: the task fails on its own and is not part of the batch.
		t := newTask(kind, buf, tg, off, o)
		t.finish(Failed, fmt.Errorf("%w: batch already submitted", ErrInvalid))
		return t
	}
	if len(b.mu.slab) == 0 {
		b.mu.slab = make([]Task, min(max(4, len(b.mu.tasks)), 256))
	}
	t := &b.mu.slab[0]
	b.mu.slab = b.mu.slab[1:]
	t.op, t.opts, t.batch = Op{Kind: kind, Target: tg, Offset: off, Buf: buf, Priority: o.Priority}, o, b
	b.mu.tasks = append(b.mu.tasks, t)
	return t
}

// Submit starts every task. Canceling ctx cancels the tasks not yet terminal (they end Canceled,
// or TimedOut if ctx's deadline passed), so ctx must outlive the transfers, not just this call.
// Submit does not block on I/O.
func (b *Batch) Submit(ctx context.Context) error {
	tasks, err := b.submit()
	if err != nil {
		return err
	}
	go b.e.dispatch(ctx, tasks)
	return nil
}

// Run starts every task, as Submit, and waits until all are terminal. The
// caller's goroutine does what Submit hands to another: the copies into
// and out of memory mapped here, and starting the others. A caller that
// would wait at once so saves two goroutine hand-offs, each of which may
// wake a thread. It returns the first error in task order, as Wait.
func (b *Batch) Run(ctx context.Context) error {
	tasks, err := b.submit()
	if err != nil {
		return err
	}
	b.e.dispatch(ctx, tasks)
	return b.Wait(context.Background())
}

// submit marks b submitted and returns its tasks, counted as one
// dispatch the engine waits for on Close.
func (b *Batch) submit() ([]*Task, error) {
	b.mu.Lock()
	if b.mu.submitted {
		b.mu.Unlock()
		return nil, fmt.Errorf("%w: batch already submitted", ErrInvalid)
	}
	b.mu.submitted = true
	tasks := b.mu.tasks
	b.all = make(chan struct{})
	if b.pending.Store(int64(len(tasks))); len(tasks) == 0 {
		close(b.all)
	}
	b.mu.Unlock()

	now := time.Now()
	for _, t := range tasks {
		t.start = now
	}
	if !b.e.start() {
		for _, t := range tasks {
			b.e.finish(t, Failed, ErrClosed)
		}
		return nil, ErrClosed
	}
	return tasks, nil
}

// Wait blocks until every task is terminal and returns the first error in task order, or nil if
// all are Done. If ctx ends first it returns ctx.Err(); the tasks go on.
func (b *Batch) Wait(ctx context.Context) error {
	b.mu.Lock()
	submitted, tasks := b.mu.submitted, b.mu.tasks
	b.mu.Unlock()
	if !submitted {
		return fmt.Errorf("%w: Wait before Submit", ErrInvalid)
	}
	select {
	case <-b.all:
	case <-ctx.Done():
		return ctx.Err()
	}
	for _, t := range tasks {
		if t.err != nil {
			return t.err
		}
	}
	return nil
}

// dispatch starts a batch's tasks in order as in-flight slots free up, and returns when all are
// terminal. It is where the QoS scheduler will plug in: today it is FIFO per batch.
func (e *Engine) dispatch(ctx context.Context, tasks []*Task) {
	defer e.wg.Done()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(e.ctx, func() { cancel(ErrClosed) })
	defer stop()

	var valid []*Task
	for _, t := range tasks {
		if err := t.validate(); err != nil {
			e.finish(t, Failed, err)
			continue
		}
		valid = append(valid, t)
	}
	var wg sync.WaitGroup
	for _, group := range e.copyInline(ctx, mergeContiguous(valid)) {
		t := group[0]
		op := t.op
		if len(group) > 1 {
			op.Buf = t.op.Buf[:groupLen(group)] // continues checked the capacity
		}
		finish := func(s State, err error) {
			for _, g := range group {
				e.finish(g, s, err)
			}
		}
		tctx, tcancel := ctx, context.CancelFunc(func() {})
		if !t.opts.Deadline.IsZero() {
			tctx, tcancel = context.WithDeadlineCause(ctx, t.opts.Deadline, ErrTimedOut)
		}
		if err := e.acquire(tctx); err != nil {
			finish(outcome(tctx, err))
			tcancel()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer tcancel()
			defer e.release()
			for _, g := range group {
				g.state.Store(int32(Running))
			}
			finish(outcome(tctx, e.transfer(tctx, &op, t.opts)))
		}()
	}
	wg.Wait()
}

// copyInline does the groups whose peer segment is mapped here (shm)
// right away, in this goroutine: a memcpy needs no slot, deadline or
// goroutine of its own. Whether each peer is still alive is checked once,
// after its copies; the groups of a peer that has exited go on to the
// transports with the others it returns.
func (e *Engine) copyInline(ctx context.Context, groups [][]*Task) (rest [][]*Task) {
	if e.shm == nil {
		return groups
	}
	type copied struct {
		key    shmKey
		groups [][]*Task
	}
	var byMap map[*shmMapping]*copied
	for _, group := range groups {
		t := group[0]
		if ctx.Err() != nil || (!t.opts.Deadline.IsZero() && !time.Now().Before(t.opts.Deadline)) {
			rest = append(rest, group) // the general path ends it as it should
			continue
		}
		op := t.op
		if len(group) > 1 {
			op.Buf = t.op.Buf[:groupLen(group)]
		}
		key, m, handled, err := e.shm.copyCached(&op)
		if !handled {
			rest = append(rest, group)
			continue
		}
		if err != nil {
			for _, g := range group {
				e.finish(g, Failed, err)
			}
			continue
		}
		if byMap == nil {
			byMap = map[*shmMapping]*copied{}
		}
		c := byMap[m]
		if c == nil {
			c = &copied{key: key}
			byMap[m] = c
		}
		c.groups = append(c.groups, group)
	}
	for m, c := range byMap {
		if err := e.shm.landed(c.key, m); err != nil {
			// The peer went: the transports try again, from describing it.
			rest = append(rest, c.groups...)
			continue
		}
		for _, group := range c.groups {
			for _, g := range group {
				e.finish(g, Done, nil)
			}
		}
	}
	return rest
}

// mergeContiguous groups consecutive tasks that continue each other, in the
// segment and in memory (a run of KV blocks read into one host buffer), so
// each group travels as one request: fewer, larger slices.
func mergeContiguous(tasks []*Task) [][]*Task {
	groups := make([][]*Task, 0, len(tasks))
	for i := 0; i < len(tasks); {
		j := i + 1
		for j < len(tasks) && continues(tasks[i:j], tasks[j]) {
			j++
		}
		groups = append(groups, tasks[i:j:j]) // windows of tasks: no allocation a group
		i = j
	}
	return groups
}

// continues reports whether t picks up exactly where group ends.
func continues(group []*Task, t *Task) bool {
	last, first := group[len(group)-1], group[0]
	if t.op.Kind != last.op.Kind || t.op.Target != last.op.Target || t.opts != first.opts ||
		len(last.op.Buf) == 0 || len(t.op.Buf) == 0 ||
		t.op.Offset != last.op.Offset+int64(len(last.op.Buf)) || groupLen(group)+len(t.op.Buf) > MaxOpLen ||
		t.op.Offset < first.op.Offset {
		return false
	}
	// One allocation: the first buffer's capacity reaches over t's bytes,
	// which start right where the last buffer ends.
	n := groupLen(group)
	if cap(first.op.Buf) < n+len(t.op.Buf) {
		return false
	}
	end := unsafe.Add(unsafe.Pointer(unsafe.SliceData(last.op.Buf)), len(last.op.Buf))
	return end == unsafe.Pointer(unsafe.SliceData(t.op.Buf))
}

func groupLen(group []*Task) int {
	n := 0
	for _, t := range group {
		n += len(t.op.Buf)
	}
	return n
}

// finish records metrics and moves t to its terminal state.
func (e *Engine) finish(t *Task, s State, err error) {
	e.met.task(t.op.Kind, s, len(t.op.Buf), time.Since(t.start))
	t.finish(s, err)
}

// outcome turns a transfer's error into the task's terminal state. Once ctx is done its cause
// wins over whatever the transport reported, since the transport's error (a closed connection)
// is only the symptom.
func outcome(ctx context.Context, err error) (State, error) {
	if err == nil {
		return Done, nil
	}
	if ctx.Err() == nil {
		if errors.Is(err, ErrTimedOut) {
			// The scheduler failed it fast: its deadline cannot be met.
			return TimedOut, fmt.Errorf("%w: %w", err, context.DeadlineExceeded)
		}
		return Failed, err
	}
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, ErrClosed):
		return Failed, ErrClosed
	case errors.Is(cause, ErrTimedOut), errors.Is(cause, context.DeadlineExceeded):
		return TimedOut, fmt.Errorf("%w: %w", ErrTimedOut, context.DeadlineExceeded)
	case cause == ctx.Err():
		return Canceled, cause
	default:
		return Canceled, fmt.Errorf("%w: %w", ctx.Err(), cause)
	}
}

// transfer moves one task's bytes: by a copy when the target is this
// engine's own segment (local), through shared memory (shm) or the peer's
// file (file) when the peer is on this host, else sliced and sprayed over
// the peer's rails.
func (e *Engine) transfer(ctx context.Context, op *Op, opts Options) error {
	for _, tr := range e.near {
		// Anything but a transport's own verdict on the bytes falls over to
		// the next, and last to the rails, which may reach the peer where a
		// same-host path cannot.
		err := tr.Do(ctx, op)
		if err == nil || errors.Is(err, ErrOutOfRange) {
			return err
		}
	}
	return e.peer(e.tr, op.Target).do(ctx, op, opts)
}
