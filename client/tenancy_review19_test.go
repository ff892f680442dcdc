package client_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
)

// TestReview19TenantStreamOfPuts: a client of a tenant (a pool with a
// tokens file) puts a stream of values of one shape, as a KV cache does.
// After the first few the client asks for grants and puts through them;
// every put must still succeed.
func TestReview19TenantStreamOfPuts(t *testing.T) {
	const storeToken, clientToken = "r19-store-token-0123456789", "r19-tenant-a-token-0123456789"
	path := filepath.Join(t.TempDir(), "tokens.json")
	body := fmt.Sprintf(`{"tokens": [{"name": "store", "role": "store", "token": %q},
	  {"name": "a", "role": "client", "tenant": "a", "token": %q}]}`, storeToken, clientToken)
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	m := mastertest.Start(t, func(cfg *master.Config) { cfg.Security = master.Security{Tokens: tokens} })
	mastertest.StartStore(t, []string{m.Addr()}, "s0", 16<<20, func(cfg *store.Config) {
		cfg.Credentials = leaderconn.Credentials{Token: storeToken}
	})
	cl, err := client.New(client.Config{Masters: []string{m.Addr()}, Credentials: leaderconn.Credentials{Token: clientToken},
		EngineConfig: engine.Config{NoShm: true}, Logger: mastertest.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	value := make([]byte, 4096)
	for i := range 20 {
		if err := cl.Put(ctx, fmt.Sprintf("block-%d", i), value); err != nil {
			t.Fatalf("tenant a's put %d of a stream of one shape: %v", i, err)
		}
	}
}
