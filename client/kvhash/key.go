package kvhash

import (
	"fmt"
	"net/url"
)

// MaxKeyLen is the longest object key Tidepool accepts.
const MaxKeyLen = 4096

// Namespace places a scheme's block hashes under object keys of their own:
//
//	kv/SCHEME/MODEL/TENANT/HEX
//
// MODEL and TENANT are path-escaped (url.PathEscape: "/" becomes %2F), so a
// key splits unambiguously on "/" and model names such as
// "meta-llama/Llama-3.1-8B" keep their slash inside one segment. Model must
// name everything that changes a block's bytes (the model, and where they
// differ its dtype, parallel rank and layout); Tenant may be empty.
type Namespace struct {
	Scheme        Scheme
	Model, Tenant string
}

// Prefix is the part of every key of ns before the hash, ending in "/":
// `tidepool ls PREFIX` lists the namespace.
func (ns Namespace) Prefix() string {
	return "kv/" + string(ns.Scheme) + "/" + url.PathEscape(ns.Model) + "/" + url.PathEscape(ns.Tenant) + "/"
}

// Key is the object key of block hash h.
func (ns Namespace) Key(h Hash) string { return ns.Prefix() + h.String() }

// Validate reports whether ns makes valid keys: a known scheme, a model, and
// keys no longer than MaxKeyLen.
func (ns Namespace) Validate() error {
	if ns.Scheme.HashSize() == 0 {
		return fmt.Errorf("%w %q", ErrScheme, ns.Scheme)
	}
	if ns.Model == "" {
		return fmt.Errorf("%w: no model", ErrNamespace)
	}
	if n := len(ns.Prefix()) + 2*ns.Scheme.HashSize(); n > MaxKeyLen {
		return fmt.Errorf("%w: keys would be %d bytes, more than %d", ErrNamespace, n, MaxKeyLen)
	}
	return nil
}

// Block is one full block of a prompt: its hash, its object key, and the key
// of its parent block ("" for a prompt's first block).
type Block struct {
	Hash        Hash
	Key, Parent string
}

// Blocks hashes tokens with h, as h.Hash does, and returns the keys of the
// full blocks in ns. Block i's parent is block i-1; the first block's parent
// is parent's key, or "" when parent is nil.
func (ns Namespace) Blocks(h *Hasher, parent Hash, tokens []uint32, extra [][]any) ([]Block, error) {
	if err := ns.Validate(); err != nil {
		return nil, err
	}
	if ns.Scheme != h.Scheme() {
		return nil, fmt.Errorf("%w: namespace of %s, hasher of %s", ErrNamespace, ns.Scheme, h.Scheme())
	}
	hashes, err := h.Hash(parent, tokens, extra)
	if err != nil {
		return nil, err
	}
	out := make([]Block, len(hashes))
	prev := ""
	if len(parent) > 0 {
		prev = ns.Key(parent)
	}
	for i, hh := range hashes {
		out[i] = Block{Hash: hh, Key: ns.Key(hh), Parent: prev}
		prev = out[i].Key
	}
	return out, nil
}
