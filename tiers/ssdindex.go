package tiers

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/cockroachdb/pebble/v2"

	"github.com/tidepool-kv/tidepool/engine"
)

// SSDObject is one object stored on an SSD tier: Size bytes at Offset in the
// tier's data file, whose checksum is Checksum. The rest is the master's
// metadata of the object, kept so that a re-adopted object keeps its pins,
// its parent key and its tenant.
type SSDObject struct {
	Key          string
	Offset, Size uint64
	Checksum     uint32
	HardPinned   bool
	SoftPinUntil int64 // unix nanos; 0 for none
	Parent       string
	Tenant       string
}

// MaxSSDIndexKey is the longest object key, parent key or tenant the SSD
// index stores.
const MaxSSDIndexKey = 4096

// SSDIndex records the objects on an SSD tier, so that a restarted store
// re-adopts them instead of losing them. It is a small pebble DB next to the
// tier's data file; every write is one synced batch.
//
// SSDIndex is safe for concurrent use. After Close (the tier's Close closes
// it) every method fails with an error wrapping engine.ErrClosed.
type SSDIndex struct {
	name     string // the tier's, for errors
	capacity uint64 // the tier's; every object lies within it

	// mu is read-held by Put, Delete and All, which pebble orders itself,
	// and held by Replace, which reads then writes and must not interleave
	// with other writes, and by Close.
	mu     sync.RWMutex
	db     *pebble.DB
	closed bool
}

// Index keys are objectPrefix + object key, so that other records (format
// versions, tier metadata) can live beside the objects later.
const objectPrefix = 'o'

// Values are a version byte, then
//
//	version 1: uvarint offset, uvarint size, uint32 LE checksum;
//	version 2: version 1's fields, then uvarint flags (flagHardPinned),
//	           varint soft pin (unix nanos), uvarint length and bytes of the
//	           parent key, uvarint length and bytes of the tenant.
//
// Writes use ssdValueVersion; reads accept both, so that an index written by
// an older release is re-adopted (its objects without pins or metadata).
const (
	ssdValueV1      = 1
	ssdValueVersion = 2
)

// Flags of a version 2 value. Other bits make the value malformed.
const (
	flagHardPinned = 1 << 0
	knownFlags     = flagHardPinned
)

var (
	objectLower = []byte{objectPrefix}
	objectUpper = []byte{objectPrefix + 1}
)

// openSSDIndex opens or creates the index at dir. pebble locks the directory,
// so a second process opening the same tier fails here.
func openSSDIndex(name, dir string, capacity int64) (*SSDIndex, error) {
	opts := &pebble.Options{
		// A few entries per object, written in small synced batches and read
		// whole only at start-up: keep memory use modest.
		CacheSize:          4 << 20,
		MemTableSize:       4 << 20,
		FormatMajorVersion: pebble.FormatNewest,
		Logger:             quietPebbleLogger{pebble.DefaultLogger},
	}
	db, err := pebble.Open(dir, opts)
	if err != nil {
		return nil, fmt.Errorf("ssd tier %q: open index %s (is another store using this tier?): %w", name, dir, err)
	}
	return &SSDIndex{name: name, capacity: uint64(capacity), db: db}, nil
}

// Put records objs, replacing any entries of the same keys, in one synced
// batch. Of several objects of one key, the last wins.
func (x *SSDIndex) Put(objs ...SSDObject) error {
	for _, o := range objs {
		if err := x.validObject(o); err != nil {
			return err
		}
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	if x.closed {
		return x.errClosed()
	}
	if len(objs) == 0 {
		return nil
	}
	b := x.db.NewBatch()
	defer b.Close()
	var key, val []byte
	for _, o := range objs {
		key, val = appendObjectKey(key[:0], o.Key), appendObjectValue(val[:0], o)
		if err := b.Set(key, val, nil); err != nil { // Set copies key and value
			return fmt.Errorf("ssd index %q: batch put %q: %w", x.name, o.Key, err)
		}
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("ssd index %q: put %d objects: %w", x.name, len(objs), err)
	}
	return nil
}

// Delete removes the entries of keys, in one synced batch. Keys without an
// entry are ignored.
func (x *SSDIndex) Delete(keys ...string) error {
	for _, k := range keys {
		if err := validIndexKey(k); err != nil {
			return fmt.Errorf("ssd index %q: %w", x.name, err)
		}
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	if x.closed {
		return x.errClosed()
	}
	if len(keys) == 0 {
		return nil
	}
	b := x.db.NewBatch()
	defer b.Close()
	var key []byte
	for _, k := range keys {
		key = appendObjectKey(key[:0], k)
		if err := b.Delete(key, nil); err != nil {
			return fmt.Errorf("ssd index %q: batch delete %q: %w", x.name, k, err)
		}
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("ssd index %q: delete %d keys: %w", x.name, len(keys), err)
	}
	return nil
}

// All returns every recorded object in key order (bytewise). An entry that
// does not decode fails the whole call.
func (x *SSDIndex) All() ([]SSDObject, error) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if x.closed {
		return nil, x.errClosed()
	}
	it, err := x.db.NewIter(&pebble.IterOptions{LowerBound: objectLower, UpperBound: objectUpper})
	if err != nil {
		return nil, fmt.Errorf("ssd index %q: %w", x.name, err)
	}
	var objs []SSDObject
	for ok := it.First(); ok; ok = it.Next() {
		key := string(it.Key()[1:])
		v, err := it.ValueAndErr()
		if err == nil {
			var o SSDObject
			if o, err = decodeObjectValue(v); err == nil {
				o.Key = key
				objs = append(objs, o)
				continue
			}
		}
		_ = it.Close()
		return nil, fmt.Errorf("ssd index %q: entry %q: %w", x.name, key, err)
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		return nil, fmt.Errorf("ssd index %q: scan: %w", x.name, err)
	}
	return objs, nil
}

// Replace makes the index exactly objs: it deletes the entries of keys not in
// objs and writes those that are missing or differ in any field (an entry
// that does not decode, or is of an older encoding version, differs), all in
// one synced batch; if nothing differs it writes nothing. Two objects of one
// key are an error.
func (x *SSDIndex) Replace(objs []SSDObject) error {
	want := slices.Clone(objs)
	slices.SortFunc(want, func(a, b SSDObject) int { return strings.Compare(a.Key, b.Key) })
	for i, o := range want {
		if err := x.validObject(o); err != nil {
			return err
		}
		if i > 0 && want[i-1].Key == o.Key {
			return fmt.Errorf("ssd index %q: replace: key %q given twice", x.name, o.Key)
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return x.errClosed()
	}
	b := x.db.NewBatch()
	defer b.Close()
	var key, val []byte
	set := func(o SSDObject) error {
		key, val = appendObjectKey(key[:0], o.Key), appendObjectValue(val[:0], o)
		return b.Set(key, val, nil)
	}

	it, err := x.db.NewIter(&pebble.IterOptions{LowerBound: objectLower, UpperBound: objectUpper})
	if err != nil {
		return fmt.Errorf("ssd index %q: %w", x.name, err)
	}
	// Merge the sorted entries with the sorted objects.
	i := 0
	var werr error
	for ok := it.First(); ok && werr == nil; ok = it.Next() {
		have := it.Key()[1:]
		for i < len(want) && want[i].Key < string(have) && werr == nil {
			werr = set(want[i])
			i++
		}
		if werr != nil {
			break
		}
		if i < len(want) && want[i].Key == string(have) {
			v, err := it.ValueAndErr()
			if err != nil {
				werr = err
				break
			}
			val = appendObjectValue(val[:0], want[i])
			if !bytes.Equal(v, val) {
				werr = set(want[i])
			}
			i++
			continue
		}
		werr = b.Delete(it.Key(), nil)
	}
	if err := errors.Join(werr, it.Error(), it.Close()); err != nil {
		return fmt.Errorf("ssd index %q: replace: %w", x.name, err)
	}
	for ; i < len(want); i++ {
		if err := set(want[i]); err != nil {
			return fmt.Errorf("ssd index %q: replace: %w", x.name, err)
		}
	}
	if b.Empty() {
		return nil
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("ssd index %q: replace with %d objects: %w", x.name, len(want), err)
	}
	return nil
}

// Close closes the DB. Closing again does nothing.
func (x *SSDIndex) Close() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return nil
	}
	x.closed = true
	if err := x.db.Close(); err != nil {
		return fmt.Errorf("ssd index %q: close: %w", x.name, err)
	}
	return nil
}

func (x *SSDIndex) errClosed() error {
	return fmt.Errorf("ssd index %q: %w", x.name, engine.ErrClosed)
}

func (x *SSDIndex) validObject(o SSDObject) error {
	if err := validIndexKey(o.Key); err != nil {
		return fmt.Errorf("ssd index %q: %w", x.name, err)
	}
	if o.Offset > x.capacity || o.Size > x.capacity-o.Offset {
		return fmt.Errorf("ssd index %q: object %q: %w: %d bytes at %d in %d",
			x.name, o.Key, ErrOutOfRange, o.Size, o.Offset, x.capacity)
	}
	if len(o.Parent) > MaxSSDIndexKey || len(o.Tenant) > MaxSSDIndexKey {
		return fmt.Errorf("ssd index %q: object %q: parent key or tenant longer than %d bytes", x.name, o.Key, MaxSSDIndexKey)
	}
	return nil
}

func validIndexKey(k string) error {
	if k == "" || len(k) > MaxSSDIndexKey {
		return fmt.Errorf("object key must be 1..%d bytes, got %d", MaxSSDIndexKey, len(k))
	}
	return nil
}

func appendObjectKey(b []byte, key string) []byte {
	return append(append(b, objectPrefix), key...)
}

func appendObjectValue(b []byte, o SSDObject) []byte {
	b = append(b, ssdValueVersion)
	b = binary.AppendUvarint(b, o.Offset)
	b = binary.AppendUvarint(b, o.Size)
	b = binary.LittleEndian.AppendUint32(b, o.Checksum)
	var flags uint64
	if o.HardPinned {
		flags |= flagHardPinned
	}
	b = binary.AppendUvarint(b, flags)
	b = binary.AppendVarint(b, o.SoftPinUntil)
	b = binary.AppendUvarint(b, uint64(len(o.Parent)))
	b = append(b, o.Parent...)
	b = binary.AppendUvarint(b, uint64(len(o.Tenant)))
	return append(b, o.Tenant...)
}

// errBadValue reports an index entry that does not decode.
var errBadValue = errors.New("malformed value")

// decodeObjectValue decodes a value written by appendObjectValue, of this
// version or version 1; the returned object has no Key.
func decodeObjectValue(v []byte) (SSDObject, error) {
	var o SSDObject
	if len(v) == 0 {
		return o, fmt.Errorf("%w: empty", errBadValue)
	}
	version := v[0]
	if version != ssdValueV1 && version != ssdValueVersion {
		return o, fmt.Errorf("%w: version %d, want %d or %d", errBadValue, version, ssdValueV1, ssdValueVersion)
	}
	v = v[1:]
	var n int
	if o.Offset, n = binary.Uvarint(v); n <= 0 {
		return o, fmt.Errorf("%w: bad offset", errBadValue)
	}
	v = v[n:]
	if o.Size, n = binary.Uvarint(v); n <= 0 {
		return o, fmt.Errorf("%w: bad size", errBadValue)
	}
	v = v[n:]
	if len(v) < 4 {
		return o, fmt.Errorf("%w: %d bytes of checksum, want 4", errBadValue, len(v))
	}
	o.Checksum = binary.LittleEndian.Uint32(v)
	v = v[4:]
	if version == ssdValueV1 {
		if len(v) != 0 {
			return o, fmt.Errorf("%w: %d trailing bytes", errBadValue, len(v))
		}
		return o, nil
	}
	flags, n := binary.Uvarint(v)
	if n <= 0 || flags&^knownFlags != 0 {
		return o, fmt.Errorf("%w: bad flags", errBadValue)
	}
	o.HardPinned = flags&flagHardPinned != 0
	v = v[n:]
	if o.SoftPinUntil, n = binary.Varint(v); n <= 0 {
		return o, fmt.Errorf("%w: bad soft pin", errBadValue)
	}
	v = v[n:]
	var err error
	if o.Parent, v, err = decodeString(v, "parent"); err != nil {
		return o, err
	}
	if o.Tenant, v, err = decodeString(v, "tenant"); err != nil {
		return o, err
	}
	if len(v) != 0 {
		return o, fmt.Errorf("%w: %d trailing bytes", errBadValue, len(v))
	}
	return o, nil
}

// decodeString decodes a uvarint length and that many bytes, at most
// MaxSSDIndexKey, and returns the rest of v.
func decodeString(v []byte, what string) (string, []byte, error) {
	l, n := binary.Uvarint(v)
	if n <= 0 {
		return "", nil, fmt.Errorf("%w: bad %s length", errBadValue, what)
	}
	v = v[n:]
	if l > MaxSSDIndexKey || l > uint64(len(v)) {
		return "", nil, fmt.Errorf("%w: %s of %d bytes, %d left (at most %d)", errBadValue, what, l, len(v), MaxSSDIndexKey)
	}
	return string(v[:l]), v[l:], nil
}

// quietPebbleLogger drops pebble's informational messages but keeps errors
// and fatal errors.
type quietPebbleLogger struct {
	pebble.Logger
}

func (quietPebbleLogger) Infof(string, ...any) {}
