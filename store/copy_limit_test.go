package store

import (
	"context"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestCopyHugeSize: a copy buffers the whole object, so a task whose
// size no tier of the node could hold is refused InvalidArgument instead of
// exhausting (or, past the allocator's limit, panicking) the process.
func TestCopyHugeSize(t *testing.T) {
	const size = 1 << 50
	task := &pb.CopyTask{
		Id: 1, Key: "k", Size: size, Checksum: 0, TimeoutMs: 1000,
		Source: &pb.Replica{Segment: "s/a@1", Endpoint: "127.0.0.1:1", Offset: 0, Length: size},
		Target: &pb.Replica{Segment: "s/b@1", Endpoint: "127.0.0.1:1", Offset: 0, Length: size},
	}
	if err := checkCopy(task); err != nil {
		t.Skipf("refused: %v", err)
	}
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("copy of a %d-byte task panicked (in a store goroutine: a crash): %v", uint64(size), p)
		}
	}()
	_ = (&Node{}).copy(context.Background(), task)
}
