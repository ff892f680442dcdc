package store

import (
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestAdoptPages: pages of kept objects stay under both the object and the
// byte bound, and together hold every object once, in order.
func TestAdoptPages(t *testing.T) {
	long := strings.Repeat("k", 4000)
	for _, tc := range []struct {
		name string
		n    int
		key  func(i int) string
	}{
		{"none", 0, nil},
		{"one", 1, func(i int) string { return "a" }},
		{"short keys", 25_000, func(i int) string { return fmt.Sprintf("k%06d", i) }},
		{"long keys, parents and tenants", 5_000, func(i int) string { return fmt.Sprintf("%s%06d", long, i) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kept := make([]*pb.AdoptedObject, tc.n)
			for i := range kept {
				k := tc.key(i)
				kept[i] = &pb.AdoptedObject{Key: k, Parent: k, Tenant: k, Segment: "ssd0", Size: 1}
			}
			total := 0
			for _, page := range adoptPages(kept) {
				bytes := 0
				for _, o := range page {
					if o != kept[total] {
						t.Fatalf("object %d out of order", total)
					}
					total++
					bytes += proto.Size(o)
				}
				if len(page) == 0 || len(page) > adoptPage || bytes > adoptPageBytes {
					t.Fatalf("a page of %d objects, %d bytes", len(page), bytes)
				}
			}
			if total != tc.n {
				t.Fatalf("%d objects paged, want %d", total, tc.n)
			}
		})
	}
}
