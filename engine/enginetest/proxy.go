package enginetest

import (
	"net"
	"sync"
	"testing"
)

// Proxy is a TCP bridge on loopback in front of one target address, with
// fault hooks for tests (like etcd's bridge): it can stall the
// client-to-target direction after a number of bytes, resume it, and cut
// every connection while refusing new ones.
type Proxy struct {
	ln   net.Listener
	quit chan struct{}
	wg   sync.WaitGroup

	mu struct {
		sync.Mutex
		target   string
		down     bool
		conns    map[net.Conn]struct{}
		limit    int64 // bytes client->target may still pass; <0: no limit
		stalled  chan struct{}
		resume   chan struct{}
		signaled bool
	}
}

// NewProxy listens on loopback; connections are forwarded to target, which
// may be set later with SetTarget (before the first connection). The test's
// cleanup closes it.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, quit: make(chan struct{})}
	p.mu.target = target
	p.mu.conns = map[net.Conn]struct{}{}
	p.mu.limit = -1
	p.mu.stalled = make(chan struct{})
	p.mu.resume = make(chan struct{})
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.Close)
	return p
}

func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) SetTarget(target string) {
	p.mu.Lock()
	p.mu.target = target
	p.mu.Unlock()
}

// StallAfter lets n more bytes through from clients to the target, then
// holds the rest until ResumeAll; stalled is closed when the hold begins.
func (p *Proxy) StallAfter(n int64) (stalled <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mu.limit = n
	p.mu.stalled = make(chan struct{})
	p.mu.resume = make(chan struct{})
	p.mu.signaled = false
	return p.mu.stalled
}

// ResumeAll lifts the stall.
func (p *Proxy) ResumeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mu.limit = -1
	close(p.mu.resume)
	p.mu.resume = make(chan struct{})
}

// SetDown(true) cuts every connection and refuses new ones until SetDown(false).
func (p *Proxy) SetDown(down bool) {
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

// Close stops the proxy and its connections; calling it again does nothing.
func (p *Proxy) Close() {
	select {
	case <-p.quit:
		return
	default:
	}
	close(p.quit)
	p.ln.Close()
	p.SetDown(true)
	p.wg.Wait()
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down, target := p.mu.down, p.mu.target
		p.mu.Unlock()
		if down || target == "" {
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.mu.down {
			p.mu.Unlock()
			c.Close()
			up.Close()
			continue
		}
		p.mu.conns[c], p.mu.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		done := make(chan struct{})
		var once sync.Once
		end := func() {
			once.Do(func() {
				close(done)
				c.Close()
				up.Close()
				p.mu.Lock()
				delete(p.mu.conns, c)
				delete(p.mu.conns, up)
				p.mu.Unlock()
			})
		}
		p.wg.Add(2)
		go func() { defer p.wg.Done(); defer end(); p.pipe(c, up, done, true) }()
		go func() { defer p.wg.Done(); defer end(); p.pipe(up, c, done, false) }()
	}
}

// pipe copies src to dst; the client-to-target direction obeys the stall.
func (p *Proxy) pipe(src, dst net.Conn, done <-chan struct{}, gated bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		b := buf[:n]
		for len(b) > 0 {
			k := len(b)
			if gated {
				var wait <-chan struct{}
				if k, wait = p.admit(k); k == 0 {
					select {
					case <-wait:
						continue
					case <-done:
						return
					case <-p.quit:
						return
					}
				}
			}
			if _, err := dst.Write(b[:k]); err != nil {
				return
			}
			b = b[k:]
		}
		if err != nil {
			return
		}
	}
}

// admit returns how many of n bytes may pass now; 0 with a channel to wait
// on when the stall holds.
func (p *Proxy) admit(n int) (int, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.limit < 0 {
		return n, nil
	}
	if p.mu.limit == 0 {
		if !p.mu.signaled {
			p.mu.signaled = true
			close(p.mu.stalled)
		}
		return 0, p.mu.resume
	}
	k := min(int64(n), p.mu.limit)
	p.mu.limit -= k
	return int(k), nil
}
