package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"

	"github.com/tidepool-kv/tidepool/client/kvhash"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newPublisher(t *testing.T, enc Encoding) *Publisher {
	t.Helper()
	p, err := New(Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: enc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

// vllmKey is the key of a vLLM block of model whose hash ends in the 8
// bytes of i.
func vllmKey(model string, i uint64) string {
	h := make(kvhash.Hash, 32)
	binary.BigEndian.PutUint64(h[24:], i)
	return kvhash.Namespace{Scheme: kvhash.VLLMSHA256CBOR, Model: model}.Key(h)
}

func TestPublish(t *testing.T) {
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		t.Run(string(enc), func(t *testing.T) { testPublish(t, enc) })
	}
}

func testPublish(t *testing.T, enc Encoding) {
	p := newPublisher(t, enc)
	sub := subscribe(t, p)
	const a, b = "kv@tidepool/org%2Fa@org/a", "kv@tidepool/b@b"
	big := uint64(1) << 63 // needs a full unsigned 64-bit integer
	var live [][][]byte    // what arrived, all but probes
	next := func(topic string) decoded {
		t.Helper()
		m := sub.next(t, topic)
		live = append(live, m.Frames)
		return decode(t, enc, m.Frames)
	}
	want := func(d decoded, events ...string) {
		t.Helper()
		var got []string
		for _, ev := range d.events {
			got = append(got, summary(ev))
		}
		if !reflect.DeepEqual(got, events) {
			t.Fatalf("batch %d on %s: %q, want %q", d.seq, d.topic, got, events)
		}
	}

	// A chain of 3 is one BlockStored; another model's block has a topic
	// of its own; what is not a KV key publishes nothing.
	p.Stored(vllmKey("org/a", big+1), "", "", dram)
	p.Stored(vllmKey("org/a", 2), vllmKey("org/a", big+1), "", dram)
	p.Stored(vllmKey("org/a", 3), vllmKey("org/a", 2), "", dram)
	p.Stored("not/a/kv/key", "", "", dram)
	p.Stored(keyOf("b", 1), "", "", hbm)
	p.Flush(1_700_000_000_500_000_000)
	chain := next(a)
	want(chain, fmt.Sprintf("stored CPU <nil> [%d 2 3]", big+1))
	ev := chain.events[0]
	if h := ev["block_hashes"].([]any)[0]; h != big+1 {
		t.Fatalf("hash %T %v, want uint64 %d", h, h, big+1)
	}
	if ev["block_size"] != int64(16) || !reflect.DeepEqual(ev["token_ids"], []any{}) || ev["lora_id"] != nil || ev["lora_name"] != nil {
		t.Fatalf("BlockStored %v: want block_size 16, token_ids [], lora_id and lora_name nil", ev)
	}
	if chain.ts != 1_700_000_000.5 {
		t.Fatalf("ts %v, want the entry's time in seconds", chain.ts)
	}
	other := next(b)
	want(other, "stored GPU <nil> [1]")
	if other.events[0]["block_size"] != int64(64) || other.seq != chain.seq+1 {
		t.Fatalf("batch %d on %s: %v, want block_size 64 and seq %d", other.seq, b, other.events, chain.seq+1)
	}

	// A demotion: out of DRAM, into SSD.
	p.Removed(vllmKey("org/a", 3), "", dram)
	p.Stored(vllmKey("org/a", 3), vllmKey("org/a", 2), "", ssd)
	p.Flush(2e18)
	demotion := next(a)
	want(demotion, "removed CPU [3]", "stored DISK 2 [3]")

	// An entry of nothing but a key that is no KV block publishes nothing:
	// the next batch has the next sequence number.
	p.Removed("not/a/kv/key", "", dram)
	p.Flush(2e18)
	p.Stored(keyOf("b", 2), keyOf("b", 1), "", hbm)
	p.Flush(2e18)
	want(next(b), "stored GPU 1 [2]")

	// Removing everything the topic holds clears it.
	p.Removed(vllmKey("org/a", big+1), "", dram)
	p.Removed(vllmKey("org/a", 2), "", dram)
	p.Removed(vllmKey("org/a", 3), "", ssd)
	p.Flush(3e18)
	want(next(a), "cleared")

	// A restore clears what remains, then stores what it restores.
	p.Cleared()
	p.Stored(keyOf("b", 7), "", "", ssd)
	p.Flush(4e18)
	want(next(b), "cleared", "stored DISK <nil> [7]")

	for i := 1; i < len(live); i++ {
		if prev, seq := binary.BigEndian.Uint64(live[i-1][1]), binary.BigEndian.Uint64(live[i][1]); seq != prev+1 {
			t.Fatalf("batch %d after %d: want consecutive numbers (all are on the topics seen)", seq, prev)
		}
	}

	// Replay from the demotion: exactly the batches from there on (the
	// restore's clearing of the probes' topic among them), then the end
	// marker.
	waitFor(t, func() bool { return p.Stats().Published == p.seq })
	var got [][][]byte
	for i, m := range replay(t, p, demotion.seq) {
		if seq := binary.BigEndian.Uint64(m[1]); seq != demotion.seq+uint64(i) {
			t.Fatalf("replayed batch %d is %d, want %d", i, seq, demotion.seq+uint64(i))
		}
		if string(m[0]) != probeTopic {
			got = append(got, m)
		}
	}
	if i := slicesIndex(live, demotion.seq); !reflect.DeepEqual(got, live[i:]) {
		t.Fatalf("replay from %d: %d batches, want the %d published from there", demotion.seq, len(got), len(live[i:]))
	}
	if got := replay(t, p, math.MaxUint64-1); len(got) != 0 {
		t.Fatalf("replay from the future: %d batches, want none", len(got))
	}
	if s := p.Stats(); s.Dropped != 0 || s.Lagged != 0 {
		t.Fatalf("stats %+v, want nothing dropped", s)
	}
}

func slicesIndex(msgs [][][]byte, seq uint64) int {
	for i, m := range msgs {
		if binary.BigEndian.Uint64(m[1]) == seq {
			return i
		}
	}
	return -1
}

// waitFor polls cond until it holds, failing the test after wait.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(wait); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v", wait)
		}
	}
}

func TestMapEncodingPutsTypeFirst(t *testing.T) {
	payload, err := encode(EncodingMap, batch{ts: 1, events: []event{{kind: blockRemoved, hashes: []uint64{1}, medium: "CPU"}}})
	if err != nil {
		t.Fatal(err)
	}
	// [ts, [{"type": ...
	if want := []byte{0x93, 0xcb}; !bytes.HasPrefix(payload, want) {
		t.Fatalf("payload % x", payload)
	}
	if want := append([]byte{0x91, 0x83, 0xa4}, "type"...); !bytes.HasPrefix(payload[10:], want) {
		t.Fatalf("events % x, want a map with \"type\" first", payload[10:])
	}
}

func TestFlushDropsWhatDoesNotFit(t *testing.T) {
	// No sender: the queue's one slot fills.
	p := &Publisher{queue: make(chan batch, 1), batcher: newBatcher(), log: slog.New(slog.DiscardHandler)}
	p.Stored(keyOf("a", 1), "", "", dram)
	p.Stored(keyOf("b", 1), "", "", dram)
	p.Stored(keyOf("c", 1), "", "", dram)
	p.Flush(1)
	p.Stored(keyOf("a", 2), "", "", dram)
	p.Flush(2)
	if got := p.dropped.Load(); got != 3 {
		t.Fatalf("dropped %d, want 3", got)
	}
	if b := <-p.queue; b.seq != 0 || b.topic != "kv@tidepool/a@a" {
		t.Fatalf("queued batch %d on %s, want 0 on a", b.seq, b.topic)
	}
	if p.seq != 4 {
		t.Fatalf("next seq %d: dropped batches must spend theirs", p.seq)
	}
}

func TestEncodingAndEndpointErrors(t *testing.T) {
	if _, err := New(Config{Endpoint: "tcp://127.0.0.1:0", Encoding: "json"}); !errors.Is(err, ErrEncoding) {
		t.Errorf("encoding json: %v, want ErrEncoding", err)
	}
	for _, ep := range []string{"", "ipc:///tmp/x", "tcp://nohost", "127.0.0.1:0"} {
		if _, err := New(Config{Endpoint: ep}); !errors.Is(err, ErrEndpoint) {
			t.Errorf("endpoint %q: %v, want ErrEndpoint", ep, err)
		}
	}
	if _, err := New(Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "udp://x"}); !errors.Is(err, ErrEndpoint) {
		t.Errorf("replay endpoint udp: %v, want ErrEndpoint", err)
	}
}

func TestCloseTwiceAndCallsAfterClose(t *testing.T) {
	p := newPublisher(t, "")
	subscribe(t, p)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	p.Stored(keyOf("a", 1), "", "", dram)
	p.Removed(keyOf("a", 1), "", dram)
	p.Cleared()
	p.Flush(1)
	if _, err := net.Dial("tcp", strings.TrimPrefix(p.Addr(), "tcp://")); err == nil {
		t.Fatal("the PUB socket still accepts after Close")
	}
}

// TestBadInput feeds nonsense to the FSM's calls and to both sockets: no
// panic, and the publisher goes on.
func TestBadInput(t *testing.T) {
	p := newPublisher(t, EncodingMap)
	for _, key := range []string{"", "/", "kv", "kv/", "kv//", "kv////", "kv/xxh3-64/%/%/" + hex8, "\xff\xfe", strings.Repeat("kv/", 2000)} {
		for _, tier := range []pb.Tier{-1, 0, 1, 2, 3, 99} {
			p.Stored(key, key, key, tier)
			p.Removed(key, key, tier)
		}
	}
	p.Cleared()
	for _, now := range []int64{math.MinInt64, -1, 0, math.MaxInt64} {
		p.Flush(now)
	}

	greeting := make([]byte, greetingLen)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	hugeCommand := append(append([]byte{}, greeting...), flagLong|flagCommand)
	hugeCommand = binary.BigEndian.AppendUint64(hugeCommand, 1<<62)
	for _, addr := range []string{p.Addr(), p.ReplayAddr()} {
		for _, junk := range [][]byte{hugeCommand, bytes.Repeat([]byte{0xff}, 200), greeting[:10]} {
			c, err := net.Dial("tcp", strings.TrimPrefix(addr, "tcp://"))
			if err != nil {
				t.Fatal(err)
			}
			c.Write(junk)
			if len(junk) != 10 {
				// The publisher hangs up (a reset, if it did not read all).
				c.SetReadDeadline(time.Now().Add(wait))
				if _, err := io.Copy(io.Discard, c); os.IsTimeout(err) {
					t.Fatalf("%s: after % x: the connection stays open", addr, junk[:min(len(junk), 16)])
				}
			}
			c.Close()
		}
	}

	// Malformed replay requests are ignored; a good one is answered.
	sock := zmq4.NewDealer(t.Context())
	if err := sock.Dial(p.ReplayAddr()); err != nil {
		t.Fatal(err)
	}
	r := newReceiver(t, sock)
	for _, req := range []zmq4.Msg{zmq4.NewMsgString("x"), zmq4.NewMsgFrom([]byte{}, []byte("short")), zmq4.NewMsgFrom([]byte("x"), make([]byte, 8))} {
		if err := sock.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	if m := r.next(t, ""); len(m.Frames) != 4 {
		t.Fatalf("answer of %d frames, want 4", len(m.Frames))
	}

	// And the PUB socket still publishes.
	subscribe(t, p)
}
