package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Config configures a Publisher.
type Config struct {
	// Endpoint is where the PUB socket listens: tcp://HOST:PORT, HOST * for
	// every interface, PORT 0 for any free port (see Addr).
	Endpoint string
	// ReplayEndpoint is where the ROUTER replay socket listens, in the same
	// form; "" for none.
	ReplayEndpoint string
	// Encoding is how events are written; "" is EncodingArray.
	Encoding Encoding
	// BufferSteps is how many of the last batches replay can send again;
	// 0 is 10,000, as vLLM.
	BufferSteps int
	// BufferBytes caps the payload bytes of those batches; 0 is 64 MiB.
	BufferBytes int
	// QueueSize is how many batches may wait for the sender; 0 is 4096.
	QueueSize int
	// Logger; nil discards.
	Logger *slog.Logger
}

// DefaultConfig listens on vLLM's default endpoint, with no replay.
func DefaultConfig() Config {
	return Config{Endpoint: "tcp://*:5557", Encoding: EncodingArray, BufferSteps: 10_000, BufferBytes: 64 << 20, QueueSize: 4096}
}

var (
	// ErrEncoding: an Encoding that is neither array nor map.
	ErrEncoding = errors.New("kvevents: unknown encoding")
	// ErrEndpoint: an endpoint that is not tcp://HOST:PORT.
	ErrEndpoint = errors.New("kvevents: bad endpoint")
)

// Stats counts batches. A batch is published once the sender gave it to
// the PUB socket (and the replay buffer); it is dropped when the queue to
// the sender was full. Its sequence number is spent either way.
type Stats struct {
	Published, Dropped uint64
	// Lagged counts the messages that one subscriber's queue had no room
	// for: it read too slowly.
	Lagged uint64
}

// Publisher publishes the pool's KV events as vLLM does; see the package
// documentation. Stored, Removed, Cleared and Flush are the FSM's: it
// calls them one at a time, under its lock, in log order. They never
// block. Addr, ReplayAddr, Stats and Close are safe for concurrent use.
type Publisher struct {
	encoding Encoding
	log      *slog.Logger
	pub      *pubServer
	replay   *server // nil without replay
	history  history
	queue    chan batch
	replays  chan struct{} // a slot per replay being served
	done     chan struct{}
	wg       sync.WaitGroup

	closed             atomic.Bool
	closeOnce          sync.Once
	closeErr           error
	published, dropped atomic.Uint64

	// The FSM's, touched under its lock alone.
	batcher     *batcher
	seq         uint64  // the next batch's sequence number
	restoring   bool    // Cleared since the last Flush
	out         []batch // Flush's, reused
	lastDropLog time.Time
}

// New starts a Publisher listening on cfg's endpoints.
func New(cfg Config) (*Publisher, error) {
	def := DefaultConfig()
	if cfg.Encoding == "" {
		cfg.Encoding = def.Encoding
	}
	if cfg.Encoding != EncodingArray && cfg.Encoding != EncodingMap {
		return nil, fmt.Errorf("%w %q (want %s or %s)", ErrEncoding, cfg.Encoding, EncodingArray, EncodingMap)
	}
	cfg.BufferSteps = orDefault(cfg.BufferSteps, def.BufferSteps)
	cfg.BufferBytes = orDefault(cfg.BufferBytes, def.BufferBytes)
	cfg.QueueSize = orDefault(cfg.QueueSize, def.QueueSize)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Publisher{
		encoding: cfg.Encoding,
		log:      cfg.Logger,
		history:  history{steps: cfg.BufferSteps, bytes: cfg.BufferBytes},
		queue:    make(chan batch, cfg.QueueSize),
		replays:  make(chan struct{}, maxReplays),
		done:     make(chan struct{}),
		batcher:  newBatcher(),
	}
	var err error
	if p.pub, err = listenPub(cfg.Endpoint, p.log); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if p.replay, err = listen(cfg.ReplayEndpoint, zmq4.Router, p.handleReplay, p.log); err != nil {
			p.pub.close()
			return nil, err
		}
	}
	p.wg.Add(1)
	go p.send()
	return p, nil
}

func orDefault(v, def int) int {
	if v <= 0 {
		return def
	}
	return v
}

// Addr is the PUB socket's endpoint, tcp://HOST:PORT, its port chosen.
func (p *Publisher) Addr() string { return p.pub.addr() }

// ReplayAddr is the replay socket's endpoint, or "" without one.
func (p *Publisher) ReplayAddr() string {
	if p.replay == nil {
		return ""
	}
	return p.replay.addr()
}

// Stored: a complete object entered tier (it gained its first replica
// there, or became complete with replicas there). parent is the key of the
// block before it, "" for none; tenant is the object's, "" for none.
func (p *Publisher) Stored(key, parent, tenant string, tier pb.Tier) {
	if !p.closed.Load() {
		p.batcher.stored(key, parent, tenant, tier)
	}
}

// Removed: a complete object left tier (lost its last replica there, or
// left the table).
func (p *Publisher) Removed(key, tenant string, tier pb.Tier) {
	if !p.closed.Load() {
		p.batcher.removed(key, tenant, tier)
	}
}

// Cleared: the FSM's state was replaced wholesale (a snapshot restore);
// Stored calls for everything restored follow.
func (p *Publisher) Cleared() {
	if !p.closed.Load() {
		p.batcher.cleared()
		p.restoring = true
	}
}

// Flush ends one raft entry's changes, nowUnixNano the entry's time: what
// was heard since the last Flush goes to the sender as batches, each with
// the next sequence number. A batch the queue has no room for is dropped.
func (p *Publisher) Flush(nowUnixNano int64) {
	if p.closed.Load() {
		return
	}
	if nowUnixNano == 0 {
		nowUnixNano = time.Now().UnixNano() // a restore's: it has no entry's time
	}
	p.out = p.batcher.flush(float64(nowUnixNano)/1e9, p.out[:0])
	restoring := p.restoring
	p.restoring = false
	for _, b := range p.out {
		b.seq = p.seq
		p.seq++
		if restoring {
			// A restore's batches are the whole table, more than the
			// queue holds, and a subscriber cannot do without them:
			// they wait for the sender (which waits for no peer).
			select {
			case p.queue <- b:
			case <-p.done:
			}
			continue
		}
		select {
		case p.queue <- b:
		default:
			p.dropped.Add(1)
			if now := time.Now(); now.Sub(p.lastDropLog) >= time.Second {
				p.lastDropLog = now
				p.log.Warn("kvevents: send queue full, batches dropped", "dropped", p.dropped.Load())
			}
		}
	}
	clear(p.out)
}

// send encodes and publishes the queued batches until Close.
func (p *Publisher) send() {
	defer p.wg.Done()
	for {
		select {
		case <-p.done:
			return
		case b := <-p.queue:
			payload, err := encode(p.encoding, b)
			if err != nil {
				p.dropped.Add(1)
				p.log.Error("kvevents: batch dropped", "topic", b.topic, "seq", b.seq, "err", err)
				continue
			}
			s := sent{topic: []byte(b.topic), seq: binary.BigEndian.AppendUint64(nil, b.seq), payload: payload}
			p.pub.publish(b.topic, s.topic, s.seq, s.payload)
			if p.replay != nil {
				p.history.add(s)
			}
			p.published.Add(1)
		}
	}
}

// Stats returns the batch counts so far.
func (p *Publisher) Stats() Stats {
	return Stats{Published: p.published.Load(), Dropped: p.dropped.Load(), Lagged: p.pub.lagged.Load()}
}

// Close stops the publisher: it closes the sockets and every connection
// and waits for every goroutine. Batches still queued are not sent. Close
// may be called more than once.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		close(p.done)
		var errReplay error
		if p.replay != nil {
			errReplay = p.replay.close()
		}
		p.wg.Wait()
		p.closeErr = errors.Join(p.pub.close(), errReplay)
	})
	return p.closeErr
}
