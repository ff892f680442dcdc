package integration

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestReview16UpStopsPromptly: one SIGTERM to `up --masters 3 --stores 2`
// stops the cluster promptly. up signals every child at once, so the
// masters are gone while each store still asks them to leave the pool, a
// call that retries for its 10 s timeout: the cluster takes that long to
// stop, and every store logs that it could not leave.
func TestReview16UpStopsPromptly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	u := startUp(t, ctx, t.TempDir(), "--masters", "3", "--stores", "2", "--dram", "64MiB", "--ssd", "0")
	mustCLI(t, ctx, strings.NewReader("v"), "put", "k", "-", "--masters", u.grpc)
	checkNoSharedExtents(t, u.grpc) // before the cluster stops
	start := time.Now()
	if code := u.term(t, 60*time.Second); code != 0 {
		t.Fatalf("up exited %d on SIGTERM", code)
	}
	took := time.Since(start)
	stuck := strings.Count(u.out.String(), "leave the pool; the master will notice")
	t.Logf("up stopped %v after SIGTERM; %d store(s) could not leave the pool", took, stuck)
	if took > 5*time.Second || stuck > 0 {
		t.Fatalf("up took %v to stop, and %d store(s) could not leave the pool: the masters stopped first", took, stuck)
	}
}
