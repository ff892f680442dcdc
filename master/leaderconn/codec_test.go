package leaderconn

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestCodecRoundTrip: messages small and large, whole or cut into the
// pieces HTTP/2 frames deliver, decode to what was encoded; a value that
// is not a message is refused.
func TestCodecRoundTrip(t *testing.T) {
	c := newCodec()
	for _, n := range []int{0, 1, 100, 5000} {
		in := &pb.LookupRequest{}
		for i := range n {
			in.Keys = append(in.Keys, fmt.Sprintf("kv/xxh3-64/m/t/%016x", i))
		}
		data, err := c.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		whole := data.Materialize()
		data.Free()
		for _, piece := range []int{len(whole) + 1, 16 << 10, 7} {
			var bs mem.BufferSlice
			for off := 0; off < len(whole); off += piece {
				bs = append(bs, mem.SliceBuffer(whole[off:min(off+piece, len(whole))]))
			}
			out := &pb.LookupRequest{}
			if err := c.Unmarshal(bs, out); err != nil {
				t.Fatalf("%d keys in pieces of %d: %v", n, piece, err)
			}
			if !proto.Equal(in, out) {
				t.Fatalf("%d keys in pieces of %d: decoded %d keys", n, piece, len(out.Keys))
			}
		}
	}
	if _, err := c.Marshal("not a message"); err == nil {
		t.Fatal("marshalled a string")
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{1})}, new(int)); err == nil {
		t.Fatal("unmarshalled into an int")
	}
}
