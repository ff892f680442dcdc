package kvhash

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/zeebo/xxh3"
)

// Scheme names a block-hashing scheme.
type Scheme string

// The schemes a Hasher speaks; see the package documentation.
const (
	VLLMSHA256CBOR Scheme = "vllm-sha256-cbor"
	SGLangSHA256   Scheme = "sglang-sha256"
	XXH3           Scheme = "xxh3-64"
)

// Schemes lists every scheme, in a stable order.
func Schemes() []Scheme { return []Scheme{VLLMSHA256CBOR, SGLangSHA256, XXH3} }

// DefaultBlockSize is the block size the scheme's engine uses by default:
// 16 tokens for vLLM, 64 for the others.
func (s Scheme) DefaultBlockSize() int {
	if s == VLLMSHA256CBOR {
		return 16
	}
	return 64
}

// HashSize is the length in bytes of the scheme's hashes: 32, or 8 for
// xxh3-64. It is 0 for an unknown scheme.
func (s Scheme) HashSize() int {
	switch s {
	case VLLMSHA256CBOR, SGLangSHA256:
		return sha256.Size
	case XXH3:
		return 8
	}
	return 0
}

// DefaultXXH3Seed is Dynamo's XXH3 seed.
const DefaultXXH3Seed = 1337

var (
	// ErrScheme: the scheme is not one of Schemes.
	ErrScheme = errors.New("kvhash: unknown scheme")
	// ErrBlockSize: the block size is not positive.
	ErrBlockSize = errors.New("kvhash: block size must be positive")
	// ErrSeed: the seed does not suit the scheme.
	ErrSeed = errors.New("kvhash: bad seed")
	// ErrToken: a token id is outside 0..2^32-1.
	ErrToken = errors.New("kvhash: token id out of range")
	// ErrExtraKeys: extra keys given to a scheme without them, or a value
	// that has no encoding.
	ErrExtraKeys = errors.New("kvhash: bad extra keys")
	// ErrParent: a parent hash of the wrong length for the scheme.
	ErrParent = errors.New("kvhash: bad parent hash")
	// ErrNamespace: a namespace without a model, of another scheme than its
	// hasher, or too long for an object key.
	ErrNamespace = errors.New("kvhash: bad namespace")
)

// Hash is one block's chain hash: 32 bytes for the SHA-256 schemes, 8
// (big-endian) for xxh3-64.
type Hash []byte

// String is the lower-case hex form, as the engines print it.
func (h Hash) String() string { return hex.EncodeToString(h) }

// ParseHash parses the hex form of a Hash.
func ParseHash(s string) (Hash, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrParent, err)
	}
	return b, nil
}

// Config selects a scheme and its parameters.
type Config struct {
	Scheme Scheme
	// BlockSize is the number of tokens per block; 0 picks the scheme's
	// DefaultBlockSize.
	BlockSize int
	// Seed is, for vllm-sha256-cbor, the engine's PYTHONHASHSEED, used
	// verbatim ("" is the empty string, not "unset": vLLM without the
	// variable hashes a random root and can't be matched); for xxh3-64 a
	// decimal (or 0x hex) uint64, "" meaning DefaultXXH3Seed; sglang-sha256
	// takes none.
	Seed string
}

// Hasher hashes token lists into chains of block hashes. It is immutable
// and safe for concurrent use.
type Hasher struct {
	scheme    Scheme
	blockSize int
	root      []byte // vllm-sha256-cbor: the hash of the seed (vLLM's NONE_HASH)
	seed      uint64 // xxh3-64
}

// New returns a Hasher for cfg.
func New(cfg Config) (*Hasher, error) {
	h := &Hasher{scheme: cfg.Scheme, blockSize: cfg.BlockSize}
	if h.blockSize == 0 {
		h.blockSize = cfg.Scheme.DefaultBlockSize()
	}
	if h.blockSize < 0 {
		return nil, fmt.Errorf("%w: got %d", ErrBlockSize, cfg.BlockSize)
	}
	switch cfg.Scheme {
	case VLLMSHA256CBOR:
		b, err := appendText(nil, cfg.Seed)
		if err != nil {
			return nil, fmt.Errorf("%w: %s seed is not valid UTF-8", ErrSeed, cfg.Scheme)
		}
		sum := sha256.Sum256(b)
		h.root = sum[:]
	case SGLangSHA256:
		if cfg.Seed != "" {
			return nil, fmt.Errorf("%w: %s takes no seed", ErrSeed, cfg.Scheme)
		}
	case XXH3:
		h.seed = DefaultXXH3Seed
		if cfg.Seed != "" {
			s, err := strconv.ParseUint(cfg.Seed, 0, 64)
			if err != nil {
				return nil, fmt.Errorf("%w: %s seed %q: want an unsigned 64-bit integer", ErrSeed, cfg.Scheme, cfg.Seed)
			}
			h.seed = s
		}
	default:
		return nil, fmt.Errorf("%w %q (want %s, %s or %s)", ErrScheme, cfg.Scheme, VLLMSHA256CBOR, SGLangSHA256, XXH3)
	}
	return h, nil
}

// Scheme returns the hasher's scheme.
func (h *Hasher) Scheme() Scheme { return h.scheme }

// BlockSize returns the number of tokens per block.
func (h *Hasher) BlockSize() int { return h.blockSize }

// Root returns the root hash of vllm-sha256-cbor, the parent of a prompt's
// first block (vLLM's NONE_HASH); nil for the other schemes.
func (h *Hasher) Root() Hash { return append(Hash(nil), h.root...) }

// Hash returns the chain hashes of the full blocks of tokens, one per block;
// a trailing partial block is ignored.
//
// parent is the hash of the block just before tokens[0], to extend a chain;
// nil starts a prompt. extra[i] is block i's extra keys, for vllm-sha256-cbor
// only: nil (and every block past the end of extra) encodes as CBOR null,
// anything else as an array of its values, which may be nil, bools, integers,
// strings, []byte and nested []any.
func (h *Hasher) Hash(parent Hash, tokens []uint32, extra [][]any) ([]Hash, error) {
	if len(parent) != 0 && len(parent) != h.scheme.HashSize() {
		return nil, fmt.Errorf("%w: %d bytes, want %d for %s", ErrParent, len(parent), h.scheme.HashSize(), h.scheme)
	}
	if h.scheme != VLLMSHA256CBOR {
		for i, e := range extra {
			if e != nil {
				return nil, fmt.Errorf("%w: block %d: %s takes no extra keys", ErrExtraKeys, i, h.scheme)
			}
		}
	}
	n := len(tokens) / h.blockSize
	size := h.scheme.HashSize()
	out := make([]Hash, n)
	all := make([]byte, n*size) // one allocation for every hash
	for i := range out {
		out[i] = all[i*size : (i+1)*size : (i+1)*size]
	}
	var err error
	switch h.scheme {
	case VLLMSHA256CBOR:
		err = h.vllm(out, parent, tokens, extra)
	case SGLangSHA256:
		h.sglang(out, parent, tokens)
	case XXH3:
		h.xxh3(out, parent, tokens)
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// vllm hashes sha256(cbor([parent, [tokens], extra keys])) per block.
func (h *Hasher) vllm(out []Hash, parent Hash, tokens []uint32, extra [][]any) error {
	if len(parent) == 0 {
		parent = h.root
	}
	bs := h.blockSize
	buf := make([]byte, 0, 3+sha256.Size+9+5*bs)
	for i := range out {
		b := append(buf[:0], cborArray<<5|3)
		b = appendBytes(b, parent)
		b = appendHead(b, cborArray, uint64(bs))
		for _, t := range tokens[i*bs : (i+1)*bs] {
			b = appendHead(b, cborUint, uint64(t))
		}
		if i < len(extra) && extra[i] != nil {
			var err error
			if b, err = appendValue(b, extra[i]); err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
		} else {
			b = append(b, cborNull)
		}
		sum := sha256.Sum256(b)
		copy(out[i], sum[:])
		parent, buf = out[i], b
	}
	return nil
}

// sglang hashes sha256(parent digest || tokens as u32 LE) per page.
func (h *Hasher) sglang(out []Hash, parent Hash, tokens []uint32) {
	bs := h.blockSize
	d := sha256.New()
	buf := make([]byte, 0, 4*bs)
	for i := range out {
		d.Reset()
		d.Write(parent) // empty for the first page
		buf = appendTokens(buf[:0], tokens[i*bs:(i+1)*bs])
		d.Write(buf)
		d.Sum(out[i][:0])
		parent = out[i]
	}
}

// appendTokens appends each token as 4 bytes little-endian.
func appendTokens(b []byte, tokens []uint32) []byte {
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return b
}

// xxh3 chains Dynamo's sequence hashes.
func (h *Hasher) xxh3(out []Hash, parent Hash, tokens []uint32) {
	bs := h.blockSize
	buf := make([]byte, 0, 4*bs)
	var seq uint64
	first := len(parent) == 0
	if !first {
		seq = binary.BigEndian.Uint64(parent)
	}
	var pair [16]byte
	for i := range out {
		buf = appendTokens(buf[:0], tokens[i*bs:(i+1)*bs])
		block := xxh3.HashSeed(buf, h.seed)
		if first {
			seq, first = block, false
		} else {
			binary.LittleEndian.PutUint64(pair[:8], seq)
			binary.LittleEndian.PutUint64(pair[8:], block)
			seq = xxh3.HashSeed(pair[:], h.seed)
		}
		binary.BigEndian.PutUint64(out[i], seq)
	}
}

// Tokens converts token ids held as ints, checking that each fits in 32
// bits.
func Tokens(ids []int) ([]uint32, error) {
	out := make([]uint32, len(ids))
	for i, t := range ids {
		if t < 0 || uint64(t) > math.MaxUint32 {
			return nil, fmt.Errorf("%w: token %d is %d", ErrToken, i, t)
		}
		out[i] = uint32(t)
	}
	return out, nil
}
