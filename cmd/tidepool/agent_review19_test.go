package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview19AgentSegmentSecure: `tidepool agent --segment` on a pool
// with tokens contributes its DRAM as a store node. The agent is given its
// tenant's client token (--token-file, which it must have), and its store
// must still register with the masters.
func TestReview19AgentSegmentSecure(t *testing.T) {
	const adminToken, clientToken = "r19-admin-token-0123456789", "r19-client-token-0123456789"
	dir := t.TempDir()
	tokensPath := filepath.Join(dir, "tokens.json")
	body := fmt.Sprintf(`{"tokens": [{"name": "admin", "role": "admin", "token": %q},
	  {"name": "a", "role": "client", "tenant": "a", "token": %q}]}`, adminToken, clientToken)
	if err := os.WriteFile(tokensPath, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens, err := auth.LoadTokens(tokensPath)
	if err != nil {
		t.Fatal(err)
	}
	m := mastertest.Start(t, func(cfg *master.Config) { cfg.Security = master.Security{Tokens: tokens} })
	clientFile := filepath.Join(dir, "client.token")
	if err := os.WriteFile(clientFile, []byte(clientToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	sock := filepath.Join(shortDir(t), "agent.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr bytes.Buffer
	e := &env{stdin: strings.NewReader(""), stdout: &bytes.Buffer{}, stderr: &stderr, getenv: func(string) string { return "" }}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, e, []string{"agent", "--socket", sock, "--http", "", "--masters", m.Addr(), "--token-file", clientFile,
			"--segment", "8MiB", "--segment-id", "r19-agent", "--no-shm", "--log-level", "warn"}) // warn: the store's refusals show in the failure
	}()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("the agent did not stop")
		}
	}()

	admin, err := leaderconn.Dial([]string{m.Addr()}, leaderconn.Credentials{Token: adminToken})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	var segs []*pb.SegmentInfo
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		select {
		case code := <-done:
			done <- code
			t.Fatalf("agent exited %d: %s", code, stderr.String())
		default:
		}
		sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
		_ = admin.Do(sctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
			st, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, o...)
			if err == nil {
				segs = st.Segments
			}
			return err
		})
		scancel()
		if len(segs) > 0 {
			return
		}
	}
	t.Fatalf("the agent's --segment never registered with a pool that has tokens (segments %v); agent log: %s", segs, stderr.String())
}
