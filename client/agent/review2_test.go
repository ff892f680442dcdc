package agent_test

import (
	"testing"

	"github.com/tidepool-kv/tidepool/client/agent"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview2AttachRetryAtLimit: a retried Attach (its answer lost) of
// memory already attached answers its region even when the session holds
// MaxAttached regions: the retry adds none (commit c9f96b3's intent). The
// early check in attach, before mapMemfd, refuses it with
// RESOURCE_EXHAUSTED instead, so a client whose last Attach answer was
// lost at the limit can never learn its region id.
func TestReview2AttachRetryAtLimit(t *testing.T) {
	f := newFixture(t, agent.Config{})
	r := f.open("limit-retry", 4096)
	var last *memfd
	var lastID uint32
	for range agent.MaxAttached {
		last = sealable(t, 4096)
		lastID = attach(t, f, r.id, last)
	}
	resp, err := f.ac.Attach(testCtx(t), &pb.AttachRequest{Session: r.id, Path: last.path, Size: last.size})
	if err != nil {
		t.Fatalf("retried Attach of region %d at the limit: %v, want region %d", lastID, err, lastID)
	}
	if resp.Region != lastID {
		t.Fatalf("retried Attach answered region %d, want %d", resp.Region, lastID)
	}
}
