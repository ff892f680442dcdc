package client

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Get returns the value of key.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	vals, errs := c.BatchGet(ctx, []string{key})
	return vals[0], errs[0]
}

// GetInto reads the value of key into buf and returns its length. buf must
// be at least as long as the value.
func (c *Client) GetInto(ctx context.Context, key string, buf []byte) (int, error) {
	ns, errs := c.BatchGetInto(ctx, []string{key}, [][]byte{buf})
	return ns[0], errs[0]
}

// BatchGet returns the values of keys with one master round trip, and one
// error per key.
func (c *Client) BatchGet(ctx context.Context, keys []string) ([][]byte, []error) {
	return c.batchRead(ctx, keys, func(_ int, size uint64) ([]byte, error) { return make([]byte, size), nil })
}

// BatchGetInto reads the value of keys[i] into bufs[i] and returns the
// lengths.
func (c *Client) BatchGetInto(ctx context.Context, keys []string, bufs [][]byte) ([]int, []error) {
	ns := make([]int, len(keys))
	if len(bufs) != len(keys) {
		errs := make([]error, len(keys))
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %d keys but %d buffers", ErrInvalidArgument, len(keys), len(bufs))
		}
		return ns, errs
	}
	vals, errs := c.batchRead(ctx, keys, func(i int, size uint64) ([]byte, error) {
		if uint64(len(bufs[i])) < size {
			return nil, fmt.Errorf("%w: %d bytes for a value of %d", ErrShortBuffer, len(bufs[i]), size)
		}
		return bufs[i][:size], nil
	})
	for i, v := range vals {
		ns[i] = len(v)
	}
	return ns, errs
}

// batchRead looks keys up, reads every found value from its first replica
// in one engine batch, and falls back to the other replicas one by one.
func (c *Client) batchRead(ctx context.Context, keys []string, buffer func(i int, size uint64) ([]byte, error)) ([][]byte, []error) {
	vals := make([][]byte, len(keys))
	errs := make([]error, len(keys))
	var query []string
	var idx []int
	for i, k := range keys {
		if errs[i] = validKey(k); errs[i] == nil {
			query = append(query, k)
			idx = append(idx, i)
		}
	}
	if len(query) == 0 {
		return vals, errs
	}
	var resp *pb.GetReplicasResponse
	var asked time.Time
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		asked = time.Now() // per attempt: a retry after a failover gets a fresh lease
		resp, err = m.GetReplicas(ctx, &pb.KeysRequest{Keys: query}, o...)
		return err
	})
	if err == nil && len(resp.Results) != len(query) {
		err = fmt.Errorf("%w: master answered %d results for %d keys", ErrProtocol, len(resp.Results), len(query))
	}
	if err != nil {
		for _, i := range idx {
			errs[i] = err
		}
		return vals, errs
	}
	// The lease runs from when the master answered, which is no earlier than
	// when we asked: measuring from our side is conservative.
	leaseEnd := asked.Add(time.Duration(resp.LeaseTtlMs) * time.Millisecond)
	qvals := make([][]byte, len(query))
	qerrs := make([]error, len(query))
	c.readReplicas(ctx, query, resp.Results, leaseEnd, qvals, qerrs, func(j int, size uint64) ([]byte, error) { return buffer(idx[j], size) })
	for j, i := range idx {
		vals[i], errs[i] = qvals[j], qerrs[j]
	}
	return vals, errs
}

// readReplicas reads each found object of objs (keys[i]'s) from its first
// replica in one engine batch, falls back to the other replicas one by
// one, and fills vals and errs.
func (c *Client) readReplicas(ctx context.Context, keys []string, objs []*pb.ObjectReplicas, leaseEnd time.Time, vals [][]byte, errs []error, buffer func(i int, size uint64) ([]byte, error)) {
	type read struct {
		i    int
		obj  *pb.ObjectReplicas
		task *engine.Task
	}
	var reads []read
	batch := c.eng.NewBatch()
	for i, obj := range objs {
		if errs[i] = itemError(obj.Status); errs[i] != nil {
			continue
		}
		if len(obj.Replicas) == 0 {
			errs[i] = fmt.Errorf("%w: %q has no live replica", ErrUnavailable, keys[i])
			continue
		}
		if vals[i], errs[i] = buffer(i, obj.Size); errs[i] != nil {
			continue
		}
		rep := obj.Replicas[0]
		t := batch.Read(vals[i], target(rep), int64(rep.Offset), engine.Options{Priority: engine.High, Deadline: leaseEnd})
		reads = append(reads, read{i, obj, t})
	}
	submitted := len(reads) > 0 && batch.Submit(ctx) == nil
	// The first replicas' checksums, in parallel and each as soon as its
	// read is done, while the others still copy: hashing costs as much as
	// the copy, and the values are independent.
	first := make([]error, len(reads))
	forEach(len(reads), func(j int) {
		r := reads[j]
		if submitted {
			<-r.task.Done() // terminal: canceled with ctx at the latest
		}
		first[j] = c.check(r.task.Err(), r.obj, vals[r.i], leaseEnd)
	})
	if submitted {
		// Every task is terminal already; Wait releases the batch.
		_ = batch.Wait(context.Background())
	}
	for j, r := range reads {
		err := first[j]
		c.reportCorrupt(err, keys[r.i], r.obj, r.obj.Replicas[0])
		for _, rep := range r.obj.Replicas[1:] {
			if err == nil {
				break
			}
			err = c.check(c.readOne(ctx, vals[r.i], rep, leaseEnd), r.obj, vals[r.i], leaseEnd)
			c.reportCorrupt(err, keys[r.i], r.obj, rep)
		}
		if err != nil {
			vals[r.i], errs[r.i] = nil, fmt.Errorf("get %q: %w", keys[r.i], err)
		}
	}
}

func (c *Client) readOne(ctx context.Context, dst []byte, rep *pb.Replica, deadline time.Time) error {
	b := c.eng.NewBatch()
	t := b.Read(dst, target(rep), int64(rep.Offset), engine.Options{Priority: engine.High, Deadline: deadline})
	_ = b.Run(ctx) // every task terminal when it returns; see batchRead
	return t.Err()
}

// check validates a finished read: the transfer succeeded, within the
// lease, and the bytes match the checksum.
func (c *Client) check(err error, obj *pb.ObjectReplicas, got []byte, leaseEnd time.Time) error {
	switch {
	case err != nil && time.Now().After(leaseEnd):
		return fmt.Errorf("%w: %w", ErrLeaseExpired, err)
	case err != nil:
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	case time.Now().After(leaseEnd):
		return ErrLeaseExpired
	case Checksum(got) != obj.Checksum:
		return fmt.Errorf("%w: want %08x, got %08x", ErrChecksum, obj.Checksum, Checksum(got))
	}
	return nil
}

// reportCorrupt tells the master about a replica whose bytes failed the
// checksum, so it drops it: the next get reads a good replica, or finds the
// key absent and the engine recomputes, instead of failing forever.
func (c *Client) reportCorrupt(err error, key string, obj *pb.ObjectReplicas, rep *pb.Replica) {
	if !errors.Is(err, ErrChecksum) || c.shared {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	report := &pb.CorruptReplica{Key: key, Segment: rep.Segment, Checksum: obj.Checksum}
	if err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) error {
		_, err := m.ReportCorrupt(ctx, report, o...)
		return err
	}); err != nil {
		c.log.Warn("report a corrupt replica", "key", key, "segment", rep.Segment, "err", err)
	}
}

func target(r *pb.Replica) engine.Target {
	return engine.Target{Endpoint: r.Endpoint, Segment: r.Segment, Ticket: string(r.Ticket)}
}
