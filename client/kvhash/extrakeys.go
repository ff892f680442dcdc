package kvhash

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// ParseExtraKeys parses one block's extra keys from JSON: null (no extra
// keys) or an array of strings, integers, bools, nulls and nested arrays,
// e.g. ["my-lora"] or [["<mm hash>", 0], "<cache salt>"]. Numbers must be
// integers from -2^63 to 2^64-1; objects and fractions have no place in vLLM's
// extra keys and are refused.
func ParseExtraKeys(data []byte) ([]any, error) {
	v, err := decodeJSON(data)
	if err != nil {
		return nil, err
	}
	if v == nil {
		return nil, nil
	}
	a, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("%w: want a JSON array or null", ErrExtraKeys)
	}
	return a, nil
}

// ParseBlockExtraKeys parses every block's extra keys from JSON: an array
// whose entry i is block i's extra keys, as ParseExtraKeys takes them.
func ParseBlockExtraKeys(data []byte) ([][]any, error) {
	v, err := decodeJSON(data)
	if err != nil {
		return nil, err
	}
	a, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("%w: want a JSON array with one entry per block", ErrExtraKeys)
	}
	out := make([][]any, len(a))
	for i, e := range a {
		if e == nil {
			continue
		}
		if out[i], ok = e.([]any); !ok {
			return nil, fmt.Errorf("%w: block %d: want a JSON array or null", ErrExtraKeys, i)
		}
	}
	return out, nil
}

func decodeJSON(data []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrExtraKeys, err)
	}
	if _, err := d.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: data after the JSON value", ErrExtraKeys)
	}
	return fromJSON(v)
}

// fromJSON turns json.Numbers into int64 or uint64 and refuses objects.
func fromJSON(v any) (any, error) {
	switch v := v.(type) {
	case json.Number:
		if i, err := strconv.ParseInt(v.String(), 10, 64); err == nil {
			return i, nil
		}
		if u, err := strconv.ParseUint(v.String(), 10, 64); err == nil {
			return u, nil
		}
		return nil, fmt.Errorf("%w: number %s is not an integer from -2^63 to 2^64-1", ErrExtraKeys, v)
	case []any:
		for i, e := range v {
			var err error
			if v[i], err = fromJSON(e); err != nil {
				return nil, err
			}
		}
		return v, nil
	case map[string]any:
		return nil, fmt.Errorf("%w: JSON objects are not supported", ErrExtraKeys)
	}
	return v, nil // nil, bool, string
}
