package kvevents

import (
	"encoding/binary"
	"sort"
	"sync"
)

// endSeq is the sequence frame of the message that ends a replay: -1 as
// vLLM writes it, FF×8.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// maxReplays is how many replays may be served at once, each by its
// peer's own goroutine, so that a slow peer holds up only itself; more
// requests are dropped, and their clients time out and ask again.
const maxReplays = 8

// sent is one published batch, kept for replay. Its frames are shared,
// never written to.
type sent struct {
	topic, seq, payload []byte
}

// history keeps the last batches published, at most steps of them and
// bytes of payload, for replay. The sender adds while the replay
// goroutine reads.
type history struct {
	steps, bytes int

	mu struct {
		sync.Mutex
		kept  []sent // oldest first
		bytes int
	}
}

func (h *history) add(s sent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.mu.kept = append(h.mu.kept, s)
	h.mu.bytes += len(s.payload)
	for len(h.mu.kept) > 0 && (len(h.mu.kept) > h.steps || h.mu.bytes > h.bytes) {
		h.mu.bytes -= len(h.mu.kept[0].payload)
		h.mu.kept[0] = sent{} // let the payload go
		h.mu.kept = h.mu.kept[1:]
	}
}

// since copies out the batches kept with a sequence number of start or
// later, so that sending them holds no lock. As in vLLM, a start older
// than the oldest batch kept replays from the oldest.
func (h *history) since(start uint64) []sent {
	h.mu.Lock()
	defer h.mu.Unlock()
	i := sort.Search(len(h.mu.kept), func(i int) bool { return binary.BigEndian.Uint64(h.mu.kept[i].seq) >= start })
	return append([]sent(nil), h.mu.kept[i:]...)
}

// handleReplay reads one replay client's requests and answers each. A
// ROUTER socket reads a request as [identity, "", start]; on the wire,
// without the identity the ROUTER adds, it is ["", start as 8 bytes
// big-endian].
func (p *Publisher) handleReplay(c *peer) {
	for {
		frames, command, err := c.readMsg()
		if err != nil {
			return
		}
		if command {
			c.command(frames[0])
			continue
		}
		if len(frames) != 2 || len(frames[0]) != 0 || len(frames[1]) != 8 {
			p.log.Debug("kvevents: malformed replay request ignored", "peer", c.conn.RemoteAddr(), "frames", len(frames))
			continue
		}
		select {
		case p.replays <- struct{}{}:
		default:
			p.log.Debug("kvevents: replays busy, request dropped", "peer", c.conn.RemoteAddr())
			continue
		}
		err = p.replayTo(c, binary.BigEndian.Uint64(frames[1]))
		<-p.replays
		if err != nil {
			p.log.Debug("kvevents: replay", "peer", c.conn.RemoteAddr(), "err", err)
			return
		}
	}
}

// replayTo answers a request to replay from start: one message ["",
// topic, seq, payload] per batch kept from start on (vLLM's replay with
// the topic frame), then ["", "", FF×8, ""].
func (p *Publisher) replayTo(c *peer, start uint64) error {
	for _, s := range p.history.since(start) {
		select {
		case <-p.done:
			return nil
		default:
		}
		if err := c.send(appendMsg(nil, []byte{}, s.topic, s.seq, s.payload)); err != nil {
			return err
		}
	}
	return c.send(appendMsg(nil, []byte{}, []byte{}, endSeq, []byte{}))
}
