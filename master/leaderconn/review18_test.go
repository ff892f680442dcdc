package leaderconn

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview18SilentMasterNotReported shows that WithWaiting's hook runs
// only when an attempt has failed, not when a second has passed: against
// a master address that accepts connections and never answers (a hung
// process, a black-holed host), each attempt takes framed's 5 s dial
// timeout, so the "after 1 s" report comes after 5 s, and a command with
// --timeout under 5 s (`tidepool get --timeout 2s`) says nothing at all
// before it fails. FAILS now.
func TestReview18SilentMasterNotReported(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var held []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // accepted, never answered
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	}()
	conn, err := Dial([]string{ln.Addr().String()}, Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	var first time.Duration
	ctx := WithWaiting(context.Background(), func(Wait) {
		if first == 0 {
			first = time.Since(start)
		}
	})
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	err = conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		_, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, opts...)
		return err
	})
	t.Logf("call ended after %v: %v; first report after %v", time.Since(start).Round(time.Millisecond), err, first)
	if first == 0 || first > 2*time.Second {
		t.Errorf("no report within 2 s of waiting for a silent master (first report: %v)", first)
	}
}
