package kvevents

import (
	"context"
	"encoding/binary"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// TestReview21MalformedReadyDoesNotPanic: a peer's READY command whose
// metadata is one byte (a property name length of 0, then no value
// length) makes zmq4's Metadata.UnmarshalZMTP slice past the frame
// (protocol.go, Property.Write reads data[n:n+4] unchecked): a panic in
// the handshake goroutine, which nothing recovers, so anyone who can
// reach the --kv-events port (tcp://*:PORT by default) kills the master.
// The attack runs in a child process, so that the crash fails this test
// alone.
func TestReview21MalformedReadyDoesNotPanic(t *testing.T) {
	if os.Getenv("REVIEW21_CHILD") == "1" {
		malformedReadyChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestReview21MalformedReadyDoesNotPanic$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "REVIEW21_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		s := string(out)
		if i := strings.Index(s, "panic:"); i >= 0 {
			s = s[i:min(len(s), i+1500)]
		}
		t.Fatalf("a peer's READY with one byte of metadata: the publisher's process died (%v):\n%s", err, s)
	}
}

func malformedReadyChild(t *testing.T) {
	for _, which := range []string{"pub", "replay"} {
		p := newPublisher(t, "")
		addr := p.Addr()
		if which == "replay" {
			addr = p.ReplayAddr()
		}
		c, err := net.Dial("tcp", strings.TrimPrefix(addr, "tcp://"))
		if err != nil {
			t.Fatal(err)
		}
		greeting := make([]byte, greetingLen)
		greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
		copy(greeting[12:], "NULL")
		ready := append([]byte{5}, "READY"...)
		ready = append(ready, 0) // metadata: a property of an empty name, cut short
		msg := append(greeting, flagCommand, byte(len(ready)))
		msg = append(msg, ready...)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		// The publisher hangs up on the peer...
		c.SetReadDeadline(time.Now().Add(wait))
		if _, err := io.Copy(io.Discard, c); os.IsTimeout(err) {
			t.Fatalf("%s: the connection stays open after a malformed READY", which)
		}
		c.Close()
		// ...and goes on serving.
		subscribe(t, p)
	}
}

// TestReview21ClearIsPodWideForLLMD: llm-d parses a topic kv@POD@MODEL
// and takes AllBlocksCleared as pod-wide: "AllBlocksCleared is pod-wide
// ... drop every entry for this pod across all tiers" (llm-d-kv-cache,
// pkg/kvevents/pool.go: p.index.Clear(ctx, podIdentifier)); Dynamo clears
// the whole worker. Every model of a pool without tenants is the one pod
// "tidepool" (kv@tidepool@MODEL), so the clear rule, which clears one
// topic, wipes every other model's blocks from the router's view while
// the pool still holds them.
func TestReview21ClearIsPodWideForLLMD(t *testing.T) {
	t.Run("a model emptied", func(t *testing.T) {
		b, v := newBatcher(), llmdView{}
		b.stored(keyOf("a", 1), "", "", dram)
		b.stored(keyOf("b", 1), "", "", dram)
		v.apply(t, b.flush(1, nil))
		// Model a's only block is evicted; model b's stays in the pool.
		b.removed(keyOf("a", 1), "", dram)
		v.apply(t, b.flush(2, nil))
		if !v[blockAt{"tidepool/b", "b", 1, "CPU"}] {
			t.Fatalf("after model a's last block left, llm-d's view is %v: model b's block, still in the pool, is gone", v)
		}
	})
	t.Run("a restore", func(t *testing.T) {
		b, v := newBatcher(), llmdView{}
		b.stored(keyOf("a", 1), "", "", dram)
		b.stored(keyOf("b", 1), "", "", dram)
		v.apply(t, b.flush(1, nil))
		// A snapshot restore of the same two blocks.
		b.cleared()
		b.stored(keyOf("a", 1), "", "", dram)
		b.stored(keyOf("b", 1), "", "", dram)
		v.apply(t, b.flush(2, nil))
		if len(v) != 2 {
			t.Fatalf("after a restore of 2 blocks, llm-d's view is %v: topic b's AllBlocksCleared wiped topic a's restored block", v)
		}
	})
}

type blockAt struct {
	pod, model string
	hash       uint64
	medium     string
}

// llmdView is a router's index as llm-d keeps it: entries per pod, the
// pod and model parsed from the topic (strings.Split on '@', 3 parts).
type llmdView map[blockAt]bool

func (v llmdView) apply(t *testing.T, bs []batch) {
	t.Helper()
	for _, b := range bs {
		parts := strings.Split(b.topic, "@")
		if len(parts) != 3 {
			t.Fatalf("topic %q: llm-d wants kv@POD@MODEL", b.topic)
		}
		pod, model := parts[1], parts[2]
		for _, ev := range b.events {
			switch ev.kind {
			case blockStored:
				for _, h := range ev.hashes {
					v[blockAt{pod, model, h, ev.medium}] = true
				}
			case blockRemoved:
				for _, h := range ev.hashes {
					delete(v, blockAt{pod, model, h, ev.medium})
				}
			case allBlocksCleared:
				for k := range v {
					if k.pod == pod {
						delete(v, k)
					}
				}
			}
		}
	}
}

// TestReview21SameBlockTwoKeys: parseKey strips a tenant's prefix when
// the key has it and takes the key as it is when it has not ("tenant
// without prefix" in TestParseKey), so two objects of tenant acme,
// "acme/kv/xxh3-64/m//H" and "kv/xxh3-64/m//H" (a pool without security
// takes both), are one block of one topic. The batcher counts them as two
// but publishes the removal of either as BlockRemoved: the subscriber
// drops a block the pool still holds.
func TestReview21SameBlockTwoKeys(t *testing.T) {
	key := "kv/xxh3-64/m//" + hex8
	b := newBatcher()
	view := map[string]map[uint64]bool{}
	apply := func(bs []batch) {
		for _, bt := range bs {
			set := view[bt.topic]
			if set == nil {
				set = map[uint64]bool{}
				view[bt.topic] = set
			}
			for _, ev := range bt.events {
				for _, h := range ev.hashes {
					set[h] = ev.kind == blockStored
				}
				if ev.kind == allBlocksCleared {
					clear(set)
				}
			}
		}
	}
	b.stored(key, "", "acme", dram)
	b.stored("acme/"+key, "", "acme", dram)
	apply(b.flush(1, nil))
	b.removed(key, "acme", dram)
	apply(b.flush(2, nil))
	if !view["kv@tidepool/m/acme/@m"][0x0123456789abcdef] || view["kv@tidepool/m@m"][0x0123456789abcdef] {
		t.Fatalf("after one of two objects naming the block left, the subscriber's view is %v: the block the other still holds is gone", view)
	}
}

// TestReview21RestoreNotDropped: a restore hears the whole table in one
// entry, so its Flush queues len(table)/512 batches at once, and what
// exceeds Config.QueueSize is dropped (its numbers spent, never
// replayable): with the default 4096, any table over about 2M blocks, a
// size a master is built for. The subscriber gets the AllBlocksCleared and
// then only part of the table, and cannot get the rest back. Shown here
// with a queue of 4 and a table of 8 batches.
func TestReview21RestoreNotDropped(t *testing.T) {
	p, err := New(Config{Endpoint: "tcp://127.0.0.1:0", QueueSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Cleared()
	for i := range uint64(8 * maxBatchHashes) {
		p.Stored(keyOf("m", i), "", "", dram)
	}
	p.Flush(1)
	waitFor(t, func() bool { s := p.Stats(); return s.Published+s.Dropped == 8 })
	if s := p.Stats(); s.Dropped != 0 {
		t.Fatalf("a restore of %d blocks: %+v: %d of its 8 batches dropped, and with them the blocks they stored", 8*maxBatchHashes, s, s.Dropped)
	}
}

// TestReview21ReplayNotHeldBySlowPeer: one goroutine serves every replay,
// a request at a time, and waits up to writeTimeout (10 s) for each
// message to a peer. A peer that asks for a replay and reads nothing
// holds every other peer's replay for 10 s; one that reads just under one
// message per 10 s holds it for as long as the 10,000 batches take. Here
// a second peer, asking for a replay that is only the end marker, gets
// nothing within 3 s.
func TestReview21ReplayNotHeldBySlowPeer(t *testing.T) {
	p := newPublisher(t, EncodingArray)
	// 32 batches of 1 MiB (the topic: cheap to encode), far more than the
	// kernel's buffers hold.
	topic := "kv@" + strings.Repeat("x", 1<<20)
	for range 32 {
		p.queue <- batch{topic: topic, seq: p.seq, events: []event{{kind: allBlocksCleared}}}
		p.seq++
	}
	waitFor(t, func() bool { return p.Stats().Published == 32 })

	// The slow peer: asks for everything, reads one byte to know its
	// replay started, then nothing.
	c, err := net.Dial("tcp", strings.TrimPrefix(p.ReplayAddr(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	zc, err := zmq4.Open(c, null.Security(), zmq4.Dealer, nil, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := zc.SendMsg(zmq4.NewMsgFrom([]byte{}, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(wait))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatalf("the slow peer's replay did not start: %v", err)
	}

	// Another peer asks for a replay from the future: the end marker alone.
	sock := zmq4.NewDealer(context.Background())
	if err := sock.Dial(p.ReplayAddr()); err != nil {
		t.Fatal(err)
	}
	r := newReceiver(t, sock)
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, math.MaxUint64-1))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-r.msgs:
		if len(m.Frames) != 4 || len(m.Frames[3]) != 0 {
			t.Fatalf("answer %d frames, want the end marker", len(m.Frames))
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a replay request got no answer within 3s: another peer's stalled replay holds the one replay goroutine")
	}
}
