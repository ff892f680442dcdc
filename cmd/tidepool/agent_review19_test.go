package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/mastertest"
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
	var stderr bytes.Buffer
	e := &env{stdin: strings.NewReader(""), stdout: &bytes.Buffer{}, stderr: &stderr, getenv: func(string) string { return "" }}
	// A secure pool admits a store only with a store's credential, which
	// an agent's client token is not: --segment is refused at once.
	code := run(context.Background(), e, []string{"agent", "--socket", sock, "--http", "", "--masters", m.Addr(), "--token-file", clientFile,
		"--segment", "8MiB", "--segment-id", "r19-agent", "--no-shm"})
	if code != 2 || !strings.Contains(stderr.String(), "--segment") {
		t.Fatalf("agent --segment on a secure pool: exit %d, %s", code, stderr.String())
	}
}
