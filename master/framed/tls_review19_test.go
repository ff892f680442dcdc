package framed

import (
	"context"
	"crypto/tls"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/auth"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview19TLSConnsLeaveSniffing: every TLS connection a server with
// RequireTLS accepts must leave the "not yet identified" set once its
// preface is read. sniff deletes the *tls.Conn it made, not the raw
// connection startSniff added, so each one stays counted; after maxConns
// TLS connections in the server's life (closed long ago) every new
// connection is refused as "too many connections not yet identified".
func TestReview19TLSConnsLeaveSniffing(t *testing.T) {
	p := testPKI(t)
	srvCfg, err := p.files(p.dir, auth.Master).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	s := startTLSServer(t, srvCfg, make(chan context.Context), nil)
	clientCfg, err := p.files(p.dir, auth.Client).ClientConfig(auth.Master)
	if err != nil {
		t.Fatal(err)
	}
	clientCfg.ServerName = "127.0.0.1"

	// One framed TLS connection, opened and closed: nothing should be
	// left of it.
	open := func() error {
		c, err := tls.Dial("tcp", s.addr, clientCfg)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, preface); err != nil {
			return err
		}
		_, err = io.ReadFull(c, make([]byte, len(preface)))
		return err
	}
	if err := open(); err != nil {
		t.Fatal(err)
	}
	sniffing := func() int {
		s.framed.mu.Lock()
		defer s.framed.mu.Unlock()
		return len(s.framed.mu.sniffing)
	}
	time.Sleep(100 * time.Millisecond)
	if n := sniffing(); n != 0 {
		t.Errorf("after one TLS connection, served and closed, %d connections are still counted as not yet identified", n)
	}

	// The consequence: maxConns of them and the port takes no more.
	var wg sync.WaitGroup
	work := make(chan struct{})
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range work {
				_ = open()
			}
		}()
	}
	for range maxConns {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	fb := &failingConn{}
	c := NewClient(s.addr, fb, Credentials{TLS: clientCfg})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := pb.NewMasterClient(c).Exists(ctx, &pb.KeysRequest{Keys: []string{"y"}}); err != nil {
		t.Errorf("a framed TLS call after %d TLS connections (all closed; %d counted as not yet identified): %v", maxConns+1, sniffing(), err)
	}
}
