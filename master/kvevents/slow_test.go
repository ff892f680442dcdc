package kvevents

import (
	"net"
	"strings"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// TestSlowSubscriber: a subscriber that never reads misses batches; the
// publisher and the other subscribers go on.
func TestSlowSubscriber(t *testing.T) {
	p := newPublisher(t, EncodingArray)
	c, err := net.Dial("tcp", strings.TrimPrefix(p.Addr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	zc, err := zmq4.Open(c, null.Security(), zmq4.Sub, nil, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := zc.SendMsg(zmq4.NewMsg(append([]byte{1}, "kv@"...))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		p.pub.mu.RLock()
		defer p.pub.mu.RUnlock()
		for s := range p.pub.subs {
			if s.subscribed("kv@") {
				return true
			}
		}
		return false
	})

	// Batches of 1 MiB (the topic, to keep encoding cheap), straight to the
	// sender: more than the subscriber's queue and the kernel's buffers
	// hold.
	topic := "kv@" + strings.Repeat("x", 1<<20)
	for range 32 {
		p.queue <- batch{topic: topic, seq: p.seq, events: []event{{kind: allBlocksCleared}}}
		p.seq++
	}
	waitFor(t, func() bool { return p.Stats().Lagged > 0 && p.Stats().Published+p.Stats().Dropped == p.seq })
	subscribe(t, p)
}
