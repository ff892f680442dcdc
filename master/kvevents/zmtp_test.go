package kvevents

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// dialRaw completes a handshake with addr as a socket of type typ and
// returns the connection, to speak ZMTP to it frame by frame.
func dialRaw(t *testing.T, addr string, typ zmq4.SocketType) *zmq4.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(addr, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	// A read that never comes fails the test instead of hanging it.
	if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	zc, err := zmq4.Open(c, null.Security(), typ, nil, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return zc
}

func TestPingAndSubscribeCommands(t *testing.T) {
	p := newPublisher(t, "")
	replay := dialRaw(t, p.ReplayAddr(), zmq4.Dealer)
	if err := replay.SendCmd("PING", []byte{0, 10, 'c', 't', 'x'}); err != nil {
		t.Fatal(err)
	}
	if cmd, err := replay.RecvCmd(); err != nil || cmd.Name != "PONG" || string(cmd.Body) != "ctx" {
		t.Fatalf("answer to PING: %+v %v, want PONG ctx", cmd, err)
	}

	// ZMTP 3.1 subscribes by command.
	sub := dialRaw(t, p.Addr(), zmq4.Sub)
	if err := sub.SendCmd("SUBSCRIBE", []byte(probeTopic)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		p.Stored(keyOf("probe", 1), "", "", dram)
		p.Removed(keyOf("probe", 1), "", dram)
		p.Flush(0)
		p.pub.mu.RLock()
		defer p.pub.mu.RUnlock()
		for s := range p.pub.subs {
			if s.subscribed(probeTopic) {
				return true
			}
		}
		return false
	})
	// The batch of the round that saw the subscription may have gone out
	// before it: one more, now that it is known.
	p.Stored(keyOf("probe", 1), "", "", dram)
	p.Removed(keyOf("probe", 1), "", dram)
	p.Flush(0)
	if m, err := sub.RecvMsg(); err != nil || len(m.Frames) != 3 || string(m.Frames[0]) != probeTopic {
		t.Fatalf("received %q %v, want a batch on %s", m.Frames, err, probeTopic)
	}
}

func TestPeerLimit(t *testing.T) {
	p := newPublisher(t, "")
	for range maxPeers {
		dialRaw(t, p.Addr(), zmq4.Sub)
	}
	waitFor(t, func() bool {
		p.pub.mu.Lock()
		defer p.pub.mu.Unlock()
		return len(p.pub.subs) == maxPeers
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(p.Addr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := zmq4.Open(c, null.Security(), zmq4.Sub, nil, false, nil); err == nil {
		t.Fatalf("peer %d was let in", maxPeers+1)
	}
}
