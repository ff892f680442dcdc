package kvhash

import (
	"encoding/binary"
	"fmt"
	"unicode/utf8"
)

// CBOR major types (RFC 8949 section 3.1).
const (
	cborUint  = 0
	cborNeg   = 1
	cborBytes = 2
	cborText  = 3
	cborArray = 4

	cborFalse = 0xf4
	cborTrue  = 0xf5
	cborNull  = 0xf6
)

// appendHead appends a data item head with its argument in the shortest
// form, as core deterministic encoding requires (RFC 8949 section 4.2.1).
func appendHead(b []byte, major byte, n uint64) []byte {
	m := major << 5
	switch {
	case n < 24:
		return append(b, m|byte(n))
	case n <= 0xff:
		return append(b, m|24, byte(n))
	case n <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, m|25), uint16(n))
	case n <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, m|26), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, m|27), n)
}

func appendInt(b []byte, v int64) []byte {
	if v < 0 {
		return appendHead(b, cborNeg, uint64(^v)) // -1 - v
	}
	return appendHead(b, cborUint, uint64(v))
}

func appendBytes(b, v []byte) []byte {
	return append(appendHead(b, cborBytes, uint64(len(v))), v...)
}

func appendText(b []byte, s string) ([]byte, error) {
	if !utf8.ValidString(s) {
		return b, fmt.Errorf("%w: text %q is not valid UTF-8", ErrExtraKeys, s)
	}
	return append(appendHead(b, cborText, uint64(len(s))), s...), nil
}

// appendValue appends the canonical CBOR encoding of v: nil (null), a bool,
// an integer, a string (a text string), a []byte (a byte string) or a []any
// of these (an array).
func appendValue(b []byte, v any) ([]byte, error) {
	switch v := v.(type) {
	case nil:
		return append(b, cborNull), nil
	case bool:
		if v {
			return append(b, cborTrue), nil
		}
		return append(b, cborFalse), nil
	case int:
		return appendInt(b, int64(v)), nil
	case int32:
		return appendInt(b, int64(v)), nil
	case int64:
		return appendInt(b, v), nil
	case uint:
		return appendHead(b, cborUint, uint64(v)), nil
	case uint32:
		return appendHead(b, cborUint, uint64(v)), nil
	case uint64:
		return appendHead(b, cborUint, v), nil
	case string:
		return appendText(b, v)
	case []byte:
		return appendBytes(b, v), nil
	case []any:
		b = appendHead(b, cborArray, uint64(len(v)))
		for _, e := range v {
			var err error
			if b, err = appendValue(b, e); err != nil {
				return b, err
			}
		}
		return b, nil
	}
	return b, fmt.Errorf("%w: %T has no CBOR encoding here (want nil, bool, an integer, string, []byte or []any)", ErrExtraKeys, v)
}
