package kvevents

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoding is how the events of a batch are written: as msgspec writes
// vLLM's KVCacheEvent structs with array_like=True (EncodingArray, every
// vLLM before the map events, SGLang, and every consumer), or as tagged maps
// (EncodingMap, vLLM since the map events). The batch itself is always the
// positional array [ts, events, data_parallel_rank].
type Encoding string

// The encodings; "" is EncodingArray, which old and new consumers decode.
const (
	EncodingArray Encoding = "array"
	EncodingMap   Encoding = "map"
)

// The wire forms, fields in vLLM's order, the tag first: an array-encoded
// struct is msgspec's array_like form, a map-encoded one its tagged form.
type (
	wireBatch struct {
		_msgpack         struct{} `msgpack:",as_array"`
		TS               float64
		Events           []any
		DataParallelRank *int
	}
	wireStored struct {
		Type            string   `msgpack:"type"`
		BlockHashes     []uint64 `msgpack:"block_hashes"`
		ParentBlockHash *uint64  `msgpack:"parent_block_hash"`
		TokenIDs        []uint32 `msgpack:"token_ids"`
		BlockSize       int      `msgpack:"block_size"`
		LoraID          *int     `msgpack:"lora_id"`
		Medium          string   `msgpack:"medium"`
		LoraName        *string  `msgpack:"lora_name"`
	}
	wireRemoved struct {
		Type        string   `msgpack:"type"`
		BlockHashes []uint64 `msgpack:"block_hashes"`
		Medium      string   `msgpack:"medium"`
	}
	wireCleared struct {
		Type string `msgpack:"type"`
	}
)

// encode is b's payload.
func encode(enc Encoding, b batch) ([]byte, error) {
	w := wireBatch{TS: b.ts, Events: make([]any, len(b.events))}
	for i, ev := range b.events {
		switch ev.kind {
		case blockStored:
			s := wireStored{Type: "BlockStored", BlockHashes: ev.hashes, TokenIDs: []uint32{}, BlockSize: ev.blockSize, Medium: ev.medium}
			if ev.hasParent {
				s.ParentBlockHash = &ev.parent
			}
			w.Events[i] = s
		case blockRemoved:
			w.Events[i] = wireRemoved{Type: "BlockRemoved", BlockHashes: ev.hashes, Medium: ev.medium}
		case allBlocksCleared:
			w.Events[i] = wireCleared{Type: "AllBlocksCleared"}
		}
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true) // as msgspec: the smallest form of each integer
	e.UseArrayEncodedStructs(enc != EncodingMap)
	if err := e.Encode(&w); err != nil {
		return nil, fmt.Errorf("kvevents: encode batch: %w", err)
	}
	return buf.Bytes(), nil
}
