package store_test

import (
	"io"
	"net"
	"sync"
	"testing"
)

// proxy is a TCP bridge on loopback in front of one address that a test
// can take down (cut every connection, refuse new ones) and bring back.
type proxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		down   bool
		closed bool
		conns  map[net.Conn]struct{}
	}
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target}
	p.mu.conns = map[net.Conn]struct{}{}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

// setDown(true) cuts every connection and refuses new ones until setDown(false).
func (p *proxy) setDown(down bool) {
	p.mu.Lock()
	p.mu.down = down
	var conns []net.Conn
	if down {
		for c := range p.mu.conns {
			conns = append(conns, c)
		}
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

func (p *proxy) close() {
	p.mu.Lock()
	p.mu.closed = true
	p.mu.Unlock()
	p.ln.Close()
	p.setDown(true)
	p.wg.Wait()
}

func (p *proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		p.mu.Lock()
		if err != nil || p.mu.down || p.mu.closed {
			p.mu.Unlock()
			c.Close()
			if up != nil {
				up.Close()
			}
			continue
		}
		p.mu.conns[c], p.mu.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		var once sync.Once
		end := func() {
			once.Do(func() {
				c.Close()
				up.Close()
				p.mu.Lock()
				delete(p.mu.conns, c)
				delete(p.mu.conns, up)
				p.mu.Unlock()
			})
		}
		p.wg.Add(2)
		go func() { defer p.wg.Done(); defer end(); io.Copy(up, c) }()
		go func() { defer p.wg.Done(); defer end(); io.Copy(c, up) }()
	}
}
