package leaderconn

import (
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// A lookup of 1024 blocks or a batch of puts is a message of tens of KiB.
// gRPC's proto codec takes its buffers from a pool whose tiers jump from
// 32 KiB to 1 MiB, and the pool zeroes a buffer's whole capacity when it
// hands it out: each such message cleared a MiB at each end, a tenth of a
// lookup's CPU. Master RPCs use this codec instead, on both ends.
//
// They also use fixed HTTP/2 flow-control windows (a stream 4 MiB, a
// connection 16 MiB; gRPC's estimate of the bandwidth-delay product grows
// both to at most 16 MiB), which turns that estimate off: it pings the
// peer as data arrives, more frames and wake-ups on the way of every small
// RPC (64 KiB puts at concurrency 1 ran 12% faster without it here).
const (
	streamWindow = 4 << 20
	connWindow   = 16 << 20
)

// ServerOptions make a gRPC server of master RPCs use the codec and the
// fixed windows.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ForceServerCodecV2(newCodec()), grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow)}
}

// DialOptions make a client of master RPCs use the codec and the fixed
// windows.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.ForceCodecV2(newCodec())),
		grpc.WithInitialWindowSize(streamWindow), grpc.WithInitialConnWindowSize(connWindow)}
}

// codec is gRPC's proto codec with a pool tiered at every power of two,
// and without a copy of a message that arrived in one buffer.
type codec struct{ pool mem.BufferPool }

func newCodec() codec {
	var sizes []int
	for n := 4 << 10; n <= 4<<20; n *= 2 {
		sizes = append(sizes, n)
	}
	return codec{mem.NewTieredBufferPool(sizes...)}
}

func (codec) Name() string { return "proto" }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("proto codec: %T is not a proto message", v)
	}
	size := proto.Size(m)
	opts := proto.MarshalOptions{UseCachedSize: true} // the size was just computed
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := opts.Marshal(m)
		if err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	}
	buf := c.pool.Get(size)
	if _, err := opts.MarshalAppend((*buf)[:0], m); err != nil {
		c.pool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, c.pool)}, nil
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("proto codec: %T is not a proto message", v)
	}
	if len(data) == 1 { // proto.Unmarshal copies what it keeps
		return proto.Unmarshal(data[0].ReadOnlyData(), m)
	}
	buf := data.MaterializeToBuffer(c.pool)
	defer buf.Free()
	return proto.Unmarshal(buf.ReadOnlyData(), m)
}

var _ encoding.CodecV2 = codec{}
