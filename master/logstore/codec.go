package logstore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// Key layout. Log keys are the prefix followed by the big-endian index, so
// pebble's byte-wise ordering is index order.
const (
	logPrefix    byte = 0x01
	stablePrefix byte = 0x02
	primePrefix  byte = 0x03 // a key that exists only while the WAL is primed

	logKeyLen = 1 + 8
)

// logVersion is the first byte of every encoded log entry.
const logVersion byte = 1

func logKey(index uint64) []byte {
	k := make([]byte, logKeyLen)
	putLogKey(k, index)
	return k
}

// putLogKey writes the key of index into k, logKeyLen bytes.
func putLogKey(k []byte, index uint64) {
	k[0] = logPrefix
	binary.BigEndian.PutUint64(k[1:], index)
}

// parseLogKey returns the index encoded in a log key.
func parseLogKey(k []byte) (uint64, error) {
	if len(k) != logKeyLen || k[0] != logPrefix {
		return 0, fmt.Errorf("logstore: malformed log key %x", k)
	}
	return binary.BigEndian.Uint64(k[1:]), nil
}

func stableKey(key []byte) []byte {
	k := make([]byte, 0, 1+len(key))
	k = append(k, stablePrefix)
	return append(k, key...)
}

// appendLog appends the encoding of l to dst:
//
//	version | uvarint Index | uvarint Term | Type | varint AppendedAt (UnixNano)
//	| uvarint len(Data) | Data | uvarint len(Extensions) | Extensions
//
// A zero AppendedAt is stored as 0 (time.Time{}.UnixNano is out of range).
func appendLog(dst []byte, l *raft.Log) []byte {
	dst = append(dst, logVersion)
	dst = binary.AppendUvarint(dst, l.Index)
	dst = binary.AppendUvarint(dst, l.Term)
	dst = append(dst, byte(l.Type))
	dst = binary.AppendVarint(dst, appendedAt(l))
	dst = binary.AppendUvarint(dst, uint64(len(l.Data)))
	dst = append(dst, l.Data...)
	dst = binary.AppendUvarint(dst, uint64(len(l.Extensions)))
	dst = append(dst, l.Extensions...)
	return dst
}

// logLen is the length of appendLog's encoding of l.
func logLen(l *raft.Log) int {
	var b [binary.MaxVarintLen64]byte
	n := 1 + binary.PutUvarint(b[:], l.Index) + binary.PutUvarint(b[:], l.Term) + 1 + binary.PutVarint(b[:], appendedAt(l))
	n += binary.PutUvarint(b[:], uint64(len(l.Data))) + len(l.Data)
	return n + binary.PutUvarint(b[:], uint64(len(l.Extensions))) + len(l.Extensions)
}

func appendedAt(l *raft.Log) int64 {
	if l.AppendedAt.IsZero() {
		return 0
	}
	return l.AppendedAt.UnixNano()
}

// decodeLog decodes b into l. Data and Extensions are copied, so b may be
// reused afterwards. Malformed input yields an error, never a panic.
func decodeLog(b []byte, l *raft.Log) error {
	d := decoder{b: b}
	if v := d.byte(); d.err == nil && v != logVersion {
		return fmt.Errorf("unknown log encoding version %d", v)
	}
	var out raft.Log
	out.Index = d.uvarint()
	out.Term = d.uvarint()
	out.Type = raft.LogType(d.byte())
	if at := d.varint(); at != 0 {
		out.AppendedAt = time.Unix(0, at)
	}
	out.Data = d.bytes()
	out.Extensions = d.bytes()
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%d trailing bytes", len(d.b))
	}
	if d.err != nil {
		return fmt.Errorf("decoding log entry: %w", d.err)
	}
	*l = out
	return nil
}

// decoder consumes b front to back; after the first error every read
// returns a zero value and err stays set.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) byte() byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) == 0 {
		d.err = errors.New("truncated")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errors.New("bad uvarint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.err = errors.New("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// bytes reads a length-prefixed byte string and returns a copy of it, or nil
// if it is empty.
func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = errors.New("truncated")
		return nil
	}
	if n == 0 {
		return nil
	}
	out := make([]byte, n)
	copy(out, d.b[:n])
	d.b = d.b[n:]
	return out
}
