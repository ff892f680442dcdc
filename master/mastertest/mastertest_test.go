package mastertest_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
)

// Stop and the cleanups must end every goroutine the harness starts.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestRestart: Restart keeps the master's state and RestartFresh drops it;
// both keep its address. The store heartbeats once an hour, so only the
// master's state can list it.
func TestRestart(t *testing.T) {
	m := mastertest.Start(t, nil)
	addr := m.Addr()
	mastertest.StartStore(t, []string{addr}, "s0", 1<<20, func(cfg *store.Config) { cfg.HeartbeatInterval = time.Hour })
	cl, err := client.New(client.Config{Masters: []string{addr}, Logger: mastertest.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	// segments polls until the master answers, and counts its segments.
	segments := func() int {
		t.Helper()
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			st, err := cl.Status(ctx)
			cancel()
			if err == nil {
				return len(st.Segments)
			}
			if time.Now().After(deadline) {
				t.Fatalf("the master did not answer: %v", err)
			}
		}
	}

	m.Restart()
	if m.Addr() != addr || m.Server() == nil {
		t.Fatalf("after Restart: address %s (was %s), server %v", m.Addr(), addr, m.Server())
	}
	// The log replays after the master answers; wait for it.
	for deadline := time.Now().Add(15 * time.Second); segments() != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the restarted master lost the store's segment")
		}
	}
	m.RestartFresh()
	if n := segments(); m.Addr() != addr || n != 0 {
		t.Fatalf("after RestartFresh: address %s (was %s), %d segments, want 0", m.Addr(), addr, n)
	}
}

// TestStop: Stop may be called more than once, and before the cleanup.
func TestStop(t *testing.T) {
	m := mastertest.Start(t, nil)
	m.Stop()
	m.Stop()
	if m.Server() != nil {
		t.Fatal("Server() is not nil after Stop")
	}
}
