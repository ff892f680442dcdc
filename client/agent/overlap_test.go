package agent_test

import (
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/tidepool-kv/tidepool/client/agent"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestGetOverlappingSpans: gets whose spans overlap are refused, and no
// healthy replica is reported corrupt because two values landed in the
// same bytes: the objects stay for everyone else.
func TestGetOverlappingSpans(t *testing.T) {
	f := newFixture(t, agent.Config{LeasedBlocks: -1})
	ctx := testCtx(t)
	r := f.open("overlap", 1<<20)
	const n = 64 << 10
	copy(r.mem, value(1, n))
	copy(r.mem[n:], value(2, n))
	keys := []string{"overlap/a", "overlap/b"}
	put, err := f.ac.BatchPut(ctx, &pb.AgentPutRequest{Session: r.id, Keys: keys,
		Spans: []*pb.Span{{Offset: 0, Length: n}, {Offset: n, Length: n}}})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, put.Results, codes.OK)

	// A buggy client names one span for both values.
	same := &pb.Span{Offset: 2 * n, Length: n}
	got, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: keys, Spans: []*pb.Span{same, same}})
	if err != nil {
		t.Fatal(err)
	}
	checkItems(t, got.Results, codes.InvalidArgument, codes.InvalidArgument)

	// Whatever the client got, the objects must still be there.
	for _, k := range keys {
		ok, err := f.cl.Exists(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Errorf("%s was dropped from the cluster: a healthy replica was reported corrupt", k)
		}
	}
}
