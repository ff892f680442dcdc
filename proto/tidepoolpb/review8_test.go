package tidepoolpb

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
)

// TestReview8UnmarshalCopiesPackedKeys: ChainKeys' views point into
// PackedKeys, and so are only as safe as that field is owned by the
// message. proto.Unmarshal (which leaderconn's codec and gRPC's own call
// before they return the wire buffer to a pool) must copy a bytes field,
// not alias the input: scribbling over the input after Unmarshal must
// leave the keys as they were. This guards against a move to an aliasing
// unmarshal (UnmarshalOptions with aliasing, vtprotobuf's unsafe mode).
func TestReview8UnmarshalCopiesPackedKeys(t *testing.T) {
	keys := make([]string, 64)
	for i := range keys {
		keys[i] = fmt.Sprintf("tenant/model/%04d/%s", i, strings.Repeat("k", i))
	}
	req := &LookupRequest{}
	req.PackKeys(keys)
	wire, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	got := &LookupRequest{}
	if err := proto.Unmarshal(wire, got); err != nil {
		t.Fatal(err)
	}
	views, err := got.ChainKeys(len(keys))
	if err != nil {
		t.Fatal(err)
	}
	for i := range wire {
		wire[i] = 'X' // the pool hands the buffer to the next message
	}
	if !slices.Equal(views, keys) {
		t.Fatalf("keys changed with the wire buffer: %q", views[:2])
	}
}

// TestReview8ChainKeysNeverPanics: any lengths and bytes give keys that
// add up exactly, or an error; never a panic, never more than max keys.
func TestReview8ChainKeysNeverPanics(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 8))
	for range 20000 {
		req := &LookupRequest{PackedKeys: make([]byte, r.IntN(64))}
		for range r.IntN(12) {
			var n uint32
			switch r.IntN(4) {
			case 0:
				n = 0
			case 1:
				n = r.Uint32()
			case 2:
				n = 1<<32 - 1
			default:
				n = uint32(r.IntN(16))
			}
			req.KeyLengths = append(req.KeyLengths, n)
		}
		if r.IntN(8) == 0 {
			req.Keys = []string{"k"}
		}
		max := r.IntN(12)
		keys, err := req.ChainKeys(max)
		if err != nil {
			continue
		}
		if len(req.Keys) > 0 && (len(req.PackedKeys) > 0 || len(req.KeyLengths) > 0) {
			t.Fatalf("%+v: both forms accepted", req)
		}
		if len(req.KeyLengths) > 0 && len(keys) > max {
			t.Fatalf("%d keys past a limit of %d", len(keys), max)
		}
		total := 0
		for _, k := range keys {
			total += len(k)
		}
		if len(req.KeyLengths) > 0 && total != len(req.PackedKeys) {
			t.Fatalf("keys of %d bytes from %d packed", total, len(req.PackedKeys))
		}
	}
}
