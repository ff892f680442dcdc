package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// wait is how long a test waits for something to arrive.
const wait = 10 * time.Second

// probeTopic is the topic of the probes subscribe publishes.
const probeTopic = "kv@tidepool/probe@probe"

// A decoded batch, its events as maps with vLLM's field names whatever
// the encoding.
type decoded struct {
	topic  string
	seq    uint64
	ts     float64
	events []map[string]any
}

// vLLM's field order of each event's array form, after the tag.
var fieldOrder = map[string][]string{
	"BlockStored":      {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"},
	"BlockRemoved":     {"block_hashes", "medium"},
	"AllBlocksCleared": {},
}

// decode decodes a batch as a consumer would, checking its form: a
// 3-array of a float64, events of the encoding enc, and nil.
func decode(t *testing.T, enc Encoding, frames [][]byte) decoded {
	t.Helper()
	if len(frames) != 3 || len(frames[1]) != 8 {
		t.Fatalf("message of %d frames, want [topic, seq8, payload]", len(frames))
	}
	d := decoded{topic: string(frames[0]), seq: binary.BigEndian.Uint64(frames[1])}
	payload := frames[2]
	if payload[0] != 0x93 || payload[1] != 0xcb {
		t.Fatalf("payload starts % x, want a 3-array and a float64", payload[:2])
	}
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	dec.UseLooseInterfaceDecoding(true)
	var raw []any
	if err := dec.Decode(&raw); err != nil {
		t.Fatalf("decode batch: %v", err)
	}
	if len(raw) != 3 || raw[2] != nil {
		t.Fatalf("batch %v: want [ts, events, nil]", raw)
	}
	d.ts = raw[0].(float64)
	for _, r := range raw[1].([]any) {
		ev := map[string]any{}
		switch r := r.(type) {
		case []any:
			if enc != EncodingArray {
				t.Fatalf("array event %v in the %s encoding", r, enc)
			}
			tag, _ := r[0].(string)
			names, ok := fieldOrder[tag]
			if !ok || len(r) != 1+len(names) {
				t.Fatalf("event %v: unknown tag or %d fields", r, len(r))
			}
			ev["type"] = tag
			for i, name := range names {
				ev[name] = r[1+i]
			}
		case map[string]any:
			if enc != EncodingMap {
				t.Fatalf("map event %v in the %s encoding", r, enc)
			}
			ev = r
			tag, _ := r["type"].(string)
			if names, ok := fieldOrder[tag]; !ok || len(r) != 1+len(names) {
				t.Fatalf("event %v: unknown type or %d keys", r, len(r))
			}
		default:
			t.Fatalf("event %T %v", r, r)
		}
		d.events = append(d.events, ev)
	}
	return d
}

// String sums an event up as "TYPE MEDIUM parent [hashes]".
func summary(ev map[string]any) string {
	switch ev["type"] {
	case "BlockStored":
		return fmt.Sprintf("stored %v %v %v", ev["medium"], ev["parent_block_hash"], ev["block_hashes"])
	case "BlockRemoved":
		return fmt.Sprintf("removed %v %v", ev["medium"], ev["block_hashes"])
	}
	return "cleared"
}

// receiver collects the messages of a zmq4 socket.
type receiver struct {
	sock zmq4.Socket
	msgs chan zmq4.Msg
}

func newReceiver(t *testing.T, sock zmq4.Socket) *receiver {
	r := &receiver{sock: sock, msgs: make(chan zmq4.Msg, 1024)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := sock.Recv()
			if err != nil {
				return
			}
			r.msgs <- m
		}
	}()
	t.Cleanup(func() {
		sock.Close()
		<-done
	})
	return r
}

// next is the next message, skipping those of other topics than topic
// when topic is not "".
func (r *receiver) next(t *testing.T, topic string) zmq4.Msg {
	t.Helper()
	deadline := time.After(wait)
	for {
		select {
		case m := <-r.msgs:
			if topic == "" || string(m.Frames[0]) == topic {
				return m
			}
		case <-deadline:
			t.Fatalf("nothing on %q within %v", topic, wait)
		}
	}
}

// subscribe connects a SUB socket to p, subscribed to every KV topic,
// and returns once it receives: a subscriber misses what was published
// before its subscription arrived, so it publishes probes until one
// arrives. Probes are on the topic of model "probe".
func subscribe(t *testing.T, p *Publisher) *receiver {
	t.Helper()
	sock := zmq4.NewSub(context.Background())
	if err := sock.Dial(p.Addr()); err != nil {
		t.Fatal(err)
	}
	r := newReceiver(t, sock)
	if err := sock.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(wait)
	for i := uint64(1); ; i++ {
		p.Stored(keyOf("probe", i), "", "", dram)
		p.Flush(0)
		select {
		case <-r.msgs:
			return r
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no probe arrived within %v", wait)
		}
	}
}

// replay asks p to replay from start and returns the batches received,
// checking that the end marker ends them.
func replay(t *testing.T, p *Publisher, start uint64) [][][]byte {
	t.Helper()
	sock := zmq4.NewDealer(context.Background())
	if err := sock.Dial(p.ReplayAddr()); err != nil {
		t.Fatal(err)
	}
	r := newReceiver(t, sock)
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, start))); err != nil {
		t.Fatal(err)
	}
	var out [][][]byte
	for {
		m := r.next(t, "")
		if len(m.Frames) != 4 || len(m.Frames[0]) != 0 {
			t.Fatalf("replay message of %d frames, want [\"\", topic, seq, payload]", len(m.Frames))
		}
		if len(m.Frames[3]) == 0 {
			if len(m.Frames[1]) != 0 || !bytes.Equal(m.Frames[2], endSeq) {
				t.Fatalf("end marker % x, want [\"\", \"\", FF×8, \"\"]", m.Frames)
			}
			return out
		}
		out = append(out, m.Frames[1:])
	}
}
