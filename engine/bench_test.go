package engine

import (
	"context"
	"fmt"
	"testing"
)

func BenchmarkReadTCP(b *testing.B)  { benchTCP(b, OpRead) }
func BenchmarkWriteTCP(b *testing.B) { benchTCP(b, OpWrite) }

// benchTCP moves one task of each size per iteration over loopback, so it measures a single
// request's throughput (chunked over the pool for sizes above 1 MiB), not aggregate bandwidth.
func benchTCP(b *testing.B, kind OpKind) {
	for _, size := range []int{64 << 10, 1 << 20, 4 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			p := startPeer(b, Config{}, NewMemSegment("dram", make([]byte, size)))
			c := newClient(b, Config{})
			tgt := Target{Endpoint: p.addr, Segment: "dram"}
			moveEach(b, c, kind, tgt, size)
		})
	}
}

// moveEach moves size bytes at offset 0 of tgt once per iteration.
func moveEach(b *testing.B, c *Engine, kind OpKind, tgt Target, size int) {
	buf := make([]byte, size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for range b.N {
		moveOnce(b, c, kind, tgt, buf)
	}
}

// moveOnce reads tgt into buf or writes buf to it, in one batch.
func moveOnce(b *testing.B, c *Engine, kind OpKind, tgt Target, buf []byte) {
	ctx := context.Background()
	batch := c.NewBatch()
	if kind == OpRead {
		batch.Read(buf, tgt, 0, Options{})
	} else {
		batch.Write(buf, tgt, 0, Options{})
	}
	if err := batch.Submit(ctx); err != nil {
		b.Fatal(err)
	}
	if err := batch.Wait(ctx); err != nil {
		b.Fatal(err)
	}
}
