package framed

import (
	"testing"
	"time"
)

// A connection the client left idle for clientIdle is replaced before a
// call takes it, so no call meets the server's close of an idle
// connection; one with a call in flight is kept.
func TestClientReplacesIdleConnection(t *testing.T) {
	s := startServer(t, "127.0.0.1:0", &testMaster{}, nil)
	c, _ := newClient(t, s.addr)
	ctx := testCtx(t)
	r, err := list(ctx, c, "first")
	wantEcho(t, r, err, "first")
	old := liveConn(c)
	if old == nil {
		t.Fatal("no framed connection after a call")
	}
	old.mu.Lock()
	old.mu.used = time.Now().Add(-clientIdle)
	old.mu.Unlock()
	r, err = list(ctx, c, "second")
	wantEcho(t, r, err, "second")
	if cur := liveConn(c); cur == nil || cur == old || old.live() {
		t.Fatalf("the idle connection was kept (now %p, idle one %p live %v)", cur, old, old.live())
	}

	// In use: kept however long ago a call took it.
	cur := liveConn(c)
	cur.mu.Lock()
	cur.mu.used = time.Now().Add(-clientIdle)
	cur.mu.pending[1<<62] = make(chan answer, 1)
	cur.mu.Unlock()
	r, err = list(ctx, c, "third")
	wantEcho(t, r, err, "third")
	if liveConn(c) != cur {
		t.Fatal("a connection with a call in flight was replaced")
	}
	cur.forget(1 << 62)
}
