package ticket

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
)

// Size is the length of a ticket on the wire.
const Size = 64

// msgSize is the signed part of a ticket, before the tag.
const msgSize = 48

// NodeKeySize is the length of a NodeKey.
const NodeKeySize = 32

// Op is what a ticket allows.
type Op uint8

const (
	Read  Op = 1
	Write Op = 2
)

func (o Op) String() string {
	switch o {
	case Read:
		return "read"
	case Write:
		return "write"
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Errors of Open and Check. Each says why a request was refused.
var (
	ErrMalformed = errors.New("ticket: malformed")
	ErrForged    = errors.New("ticket: not signed for this segment")
	ErrExpired   = errors.New("ticket: expired")
	ErrOp        = errors.New("ticket: issued for another operation")
	ErrExtent    = errors.New("ticket: bytes outside its extent")
)

// Ticket is the content of a ticket.
type Ticket struct {
	Op     Op
	ID     uint64 // the put or copy it serves; 0 for reads
	Off    uint64
	Len    uint64
	Expiry int64 // unix nanoseconds
}

// NewNodeKey returns a fresh random node key.
func NewNodeKey() ([]byte, error) {
	k := make([]byte, NodeKeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, fmt.Errorf("ticket: node key: %w", err)
	}
	return k, nil
}

// Key signs and opens the tickets of one segment.
type Key struct {
	block cipher.Block
}

// SegmentKey derives the key of segment from its node's key.
func SegmentKey(nodeKey []byte, segment string) (*Key, error) {
	if len(nodeKey) != NodeKeySize {
		return nil, fmt.Errorf("ticket: node key of %d bytes, want %d", len(nodeKey), NodeKeySize)
	}
	mac := hmac.New(sha256.New, nodeKey)
	mac.Write([]byte("tidepool ticket v1\x00"))
	mac.Write([]byte(segment))
	block, err := aes.NewCipher(mac.Sum(nil)[:16])
	if err != nil {
		return nil, err
	}
	return &Key{block: block}, nil
}

// Append appends t, signed, to dst.
func (k *Key) Append(dst []byte, t Ticket) []byte {
	at := len(dst)
	dst = binary.BigEndian.AppendUint64(dst, t.Off)
	dst = binary.BigEndian.AppendUint64(dst, t.Len)
	dst = binary.BigEndian.AppendUint64(dst, uint64(t.Expiry))
	dst = binary.BigEndian.AppendUint64(dst, t.ID)
	dst = append(dst, byte(t.Op))
	dst = append(dst, make([]byte, Size-msgSize+15)...)
	k.tag(dst[at:at+msgSize], dst[at+msgSize:at+Size])
	return dst
}

// Sign returns t signed.
func (k *Key) Sign(t Ticket) []byte { return k.Append(make([]byte, 0, Size), t) }

// tag computes the CBC-MAC of the blocks of m into out.
func (k *Key) tag(m, out []byte) {
	k.block.Encrypt(out, m[:16])
	for b := 16; b < len(m); b += 16 {
		subtle.XORBytes(out, out, m[b:b+16])
		k.block.Encrypt(out, out)
	}
}

// Open checks b's tag and returns its content.
func (k *Key) Open(b []byte) (Ticket, error) {
	if len(b) != Size {
		return Ticket{}, fmt.Errorf("%w: %d bytes, want %d", ErrMalformed, len(b), Size)
	}
	want := make([]byte, 16)
	k.tag(b[:msgSize], want)
	if subtle.ConstantTimeCompare(want, b[msgSize:]) != 1 {
		return Ticket{}, ErrForged
	}
	return Ticket{
		Op:     Op(b[32]),
		ID:     binary.BigEndian.Uint64(b[24:]),
		Off:    binary.BigEndian.Uint64(b[0:]),
		Len:    binary.BigEndian.Uint64(b[8:]),
		Expiry: int64(binary.BigEndian.Uint64(b[16:])),
	}, nil
}

// Check opens b and returns its content if it allows op on the n bytes at
// off at now (unix nanoseconds).
func (k *Key) Check(b []byte, op Op, off, n uint64, now int64) (Ticket, error) {
	t, err := k.Open(b)
	if err != nil {
		return Ticket{}, err
	}
	switch {
	case t.Op != op:
		return t, fmt.Errorf("%w: a %s ticket for a %s", ErrOp, t.Op, op)
	case now >= t.Expiry:
		return t, fmt.Errorf("%w: %d ns ago", ErrExpired, now-t.Expiry)
	case off < t.Off || n > t.Len || off-t.Off > t.Len-n:
		return t, fmt.Errorf("%w: [%d, +%d) outside [%d, +%d)", ErrExtent, off, n, t.Off, t.Len)
	}
	return t, nil
}
