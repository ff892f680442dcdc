package tidepoolpb

import (
	"errors"
	"fmt"
	"unsafe"
)

// PackKeys sets r's keys in packed form (PackedKeys and KeyLengths), the
// cheap one for a long chain, reusing the capacity r's packed fields
// already have.
func (r *LookupRequest) PackKeys(keys []string) {
	n := 0
	for _, k := range keys {
		n += len(k)
	}
	packed, lens := r.PackedKeys[:0], r.KeyLengths[:0]
	if cap(packed) < n {
		packed = make([]byte, 0, n)
	}
	if cap(lens) < len(keys) {
		lens = make([]uint32, 0, len(keys))
	}
	for _, k := range keys {
		packed = append(packed, k...)
		lens = append(lens, uint32(len(k)))
	}
	r.Keys, r.PackedKeys, r.KeyLengths = nil, packed, lens
}

// ChainKeys returns r's keys, whichever form they came in. Packed keys are
// views of r.PackedKeys, not copies: one kept past the request keeps all
// of it, so clone what you keep. More than max keys, both forms at once,
// or lengths that do not add up to the packed bytes are an error.
func (r *LookupRequest) ChainKeys(max int) ([]string, error) {
	if len(r.PackedKeys) == 0 && len(r.KeyLengths) == 0 {
		return r.Keys, nil
	}
	if len(r.Keys) > 0 {
		return nil, errors.New("keys both listed and packed")
	}
	if len(r.KeyLengths) > max {
		return nil, fmt.Errorf("%d keys exceed the batch limit of %d", len(r.KeyLengths), max)
	}
	keys := make([]string, len(r.KeyLengths))
	rest := r.PackedKeys
	for i, n := range r.KeyLengths {
		if uint64(n) > uint64(len(rest)) {
			return nil, fmt.Errorf("packed key %d of %d bytes runs past the %d packed bytes", i, n, len(r.PackedKeys))
		}
		if n > 0 {
			keys[i] = unsafe.String(&rest[0], int(n))
		}
		rest = rest[n:]
	}
	if len(rest) > 0 {
		return nil, fmt.Errorf("%d packed bytes after the last key", len(rest))
	}
	return keys, nil
}
