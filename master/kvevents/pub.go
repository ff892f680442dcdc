package kvevents

import (
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
)

// Each subscriber has a queue of its own, so that a slow one neither
// holds up the others nor makes the master hold more than this for it;
// what does not fit is dropped, as a ZeroMQ PUB socket drops at its high
// water mark, and the subscriber sees a gap in the sequence numbers.
const (
	subQueueLen   = 1024
	subQueueBytes = 4 << 20
	// maxSubscriptions is the most prefixes one subscriber may hold.
	maxSubscriptions = 256
)

// pubServer is the PUB socket: it sends each message to the subscribers
// of a prefix of its topic.
type pubServer struct {
	*server
	lagged atomic.Uint64 // messages some subscriber's queue had no room for

	mu   sync.RWMutex
	subs map[*subscriber]struct{}
}

type subscriber struct {
	*peer
	out    chan message
	queued atomic.Int64 // bytes in out

	mu     sync.Mutex
	topics map[string]int // subscribed prefixes, with how many times
}

// message is one message to send: its frames, shared by every subscriber
// and never written to.
type message struct {
	frames [][]byte
	size   int64
}

func listenPub(endpoint string, log *slog.Logger) (*pubServer, error) {
	ps := &pubServer{subs: make(map[*subscriber]struct{})}
	s, err := listen(endpoint, zmq4.Pub, ps.handle, log)
	if err != nil {
		return nil, err
	}
	ps.server = s
	return ps, nil
}

// publish queues frames for every subscriber of topic; it never blocks.
func (ps *pubServer) publish(topic string, frames ...[]byte) {
	m := message{frames: frames}
	for _, f := range frames {
		m.size += int64(len(f))
	}
	ps.mu.RLock()
	defer ps.mu.RUnlock()
	for s := range ps.subs {
		if s.subscribed(topic) && !s.enqueue(m) {
			ps.lagged.Add(1)
		}
	}
}

func (s *subscriber) enqueue(m message) bool {
	if q := s.queued.Load(); q > 0 && q+m.size > subQueueBytes {
		return false
	}
	select {
	case s.out <- m:
		s.queued.Add(m.size)
		return true
	default:
		return false
	}
}

func (s *subscriber) subscribed(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for prefix := range s.topics {
		if strings.HasPrefix(topic, prefix) {
			return true
		}
	}
	return false
}

// subscribe counts a subscription to prefix (on) or its cancellation. It
// reports false for a subscription beyond maxSubscriptions.
func (s *subscriber) subscribe(prefix string, on bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case on && s.topics[prefix] == 0 && len(s.topics) == maxSubscriptions:
		return false
	case on:
		s.topics[prefix]++
	case s.topics[prefix] > 1:
		s.topics[prefix]--
	default:
		delete(s.topics, prefix)
	}
	return true
}

// handle serves one subscriber: it reads its subscriptions while a
// goroutine of its own writes its queue.
func (ps *pubServer) handle(p *peer) {
	s := &subscriber{peer: p, out: make(chan message, subQueueLen), topics: make(map[string]int)}
	ps.mu.Lock()
	ps.subs[s] = struct{}{}
	ps.mu.Unlock()

	stop, wrote := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(wrote)
		for {
			select {
			case <-stop:
				return
			case m := <-s.out:
				s.queued.Add(-m.size)
				if err := s.send(appendMsg(nil, m.frames...)); err != nil {
					ps.log.Debug("kvevents: subscriber dropped", "peer", p.conn.RemoteAddr(), "err", err)
					p.conn.Close() // ends the reads below
					return
				}
			}
		}
	}()

	for ok := true; ok; {
		frames, command, err := p.readMsg()
		if err != nil {
			break
		}
		switch {
		case command:
			// ZMTP 3.1 subscribes by command.
			switch name, body := p.command(frames[0]); name {
			case "SUBSCRIBE", "CANCEL":
				ok = s.subscribe(string(body), name == "SUBSCRIBE")
			}
		case len(frames) == 1 && len(frames[0]) > 0 && frames[0][0] <= 1:
			// ZMTP 3.0: 1 then the prefix subscribes, 0 cancels.
			ok = s.subscribe(string(frames[0][1:]), frames[0][0] == 1)
		}
	}

	ps.mu.Lock()
	delete(ps.subs, s)
	ps.mu.Unlock()
	p.conn.Close() // ends a write in progress
	close(stop)
	<-wrote
}
