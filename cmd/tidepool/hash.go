package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/tidepool-kv/tidepool/client/kvhash"
)

const hashArgs = "--scheme S [--block-size N] [--seed S] [--extra-keys JSON] [--tokens 1,2,3|-]"

// blockFlags are the flags that name a prompt's blocks as an engine
// hashes them: `hash` prints them, `lookup` and `score` ask the pool.
type blockFlags struct {
	scheme, seed, extraKeys, blockExtraKeys, tokens, model, tenant string
	blockSize                                                      int
}

func (b *blockFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&b.scheme, "scheme", "", "hashing scheme: vllm-sha256-cbor, sglang-sha256 or xxh3-64")
	fs.IntVar(&b.blockSize, "block-size", 0, "tokens per block (default 16 for vllm-sha256-cbor, 64 for the others)")
	fs.StringVar(&b.seed, "seed", "", "vllm-sha256-cbor: vLLM's PYTHONHASHSEED (default $PYTHONHASHSEED); xxh3-64: the XXH3 seed (default 1337)")
	fs.StringVar(&b.extraKeys, "extra-keys", "", "vllm-sha256-cbor: every block's extra keys as JSON, e.g. '[\"my-lora\"]' (default null)")
	fs.StringVar(&b.blockExtraKeys, "block-extra-keys", "", "vllm-sha256-cbor: per-block extra keys, a JSON array of arrays or nulls, e.g. '[[\"salt\"], [[\"mm-hash\", 4]]]'; blocks past its end get null")
	fs.StringVar(&b.tokens, "tokens", "-", "token ids separated by commas, or - for stdin")
	fs.StringVar(&b.model, "model", "", "the model (and whatever else changes a block's bytes), for object keys")
	fs.StringVar(&b.tenant, "tenant", "", "the tenant, for object keys")
}

// hashes returns the hasher and the block hashes of the tokens; set says
// which flags were given.
func (b *blockFlags) hashes(e *env, set map[string]bool) (*kvhash.Hasher, []kvhash.Hash, error) {
	cfg := kvhash.Config{Scheme: kvhash.Scheme(b.scheme), BlockSize: b.blockSize, Seed: b.seed}
	switch {
	case b.scheme == "":
		return nil, nil, fmt.Errorf("%w: --scheme is required: vllm-sha256-cbor, sglang-sha256 or xxh3-64", errUsage)
	case set["block-size"] && b.blockSize <= 0:
		return nil, nil, fmt.Errorf("%w: --block-size must be positive", errUsage)
	case set["extra-keys"] && set["block-extra-keys"]:
		return nil, nil, fmt.Errorf("%w: --extra-keys and --block-extra-keys exclude each other", errUsage)
	}
	if cfg.Scheme == kvhash.VLLMSHA256CBOR && !set["seed"] {
		if cfg.Seed = e.getenv("PYTHONHASHSEED"); cfg.Seed == "" {
			return nil, nil, fmt.Errorf("%w: vllm-sha256-cbor needs vLLM's PYTHONHASHSEED: --seed or $PYTHONHASHSEED", errUsage)
		}
	}
	h, err := kvhash.New(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	var tokens []uint32
	if b.tokens == "-" {
		in, err := io.ReadAll(e.stdin)
		if err != nil {
			return nil, nil, fmt.Errorf("read tokens: %w", err)
		}
		if tokens, err = parseTokens(string(in)); err != nil {
			return nil, nil, fmt.Errorf("stdin: %w", err)
		}
	} else if tokens, err = parseTokens(b.tokens); err != nil {
		return nil, nil, fmt.Errorf("%w: --tokens: %v", errUsage, err)
	}
	n := len(tokens) / h.BlockSize()
	var extra [][]any
	switch {
	case set["extra-keys"]:
		k, err := kvhash.ParseExtraKeys([]byte(b.extraKeys))
		if err != nil {
			return nil, nil, fmt.Errorf("%w: --extra-keys: %v", errUsage, err)
		}
		if k != nil {
			extra = make([][]any, n)
			for i := range extra {
				extra[i] = k
			}
		}
	case set["block-extra-keys"]:
		if extra, err = kvhash.ParseBlockExtraKeys([]byte(b.blockExtraKeys)); err != nil {
			return nil, nil, fmt.Errorf("%w: --block-extra-keys: %v", errUsage, err)
		}
	}
	hashes, err := h.Hash(nil, tokens, extra)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	return h, hashes, nil
}

// namespace is where the blocks' object keys live.
func (b *blockFlags) namespace(h *kvhash.Hasher) (kvhash.Namespace, error) {
	ns := kvhash.Namespace{Scheme: h.Scheme(), Model: b.model, Tenant: b.tenant}
	if err := ns.Validate(); err != nil {
		return ns, fmt.Errorf("%w: %v", errUsage, err)
	}
	return ns, nil
}

// keys returns the object keys of the blocks the flags name: --keys, or
// the hashes of the tokens in the model's namespace.
func (b *blockFlags) keys(e *env, fs *flag.FlagSet, keys string) ([]string, error) {
	set := visited(fs)
	if set["keys"] {
		for name := range set {
			if name != "keys" && fs.Lookup(name) != nil && b.owns(name) {
				return nil, fmt.Errorf("%w: --keys names the blocks itself: --%s means nothing with it", errUsage, name)
			}
		}
		out := strings.FieldsFunc(keys, func(r rune) bool { return r == ',' || r == '\n' })
		if len(out) == 0 {
			return nil, fmt.Errorf("%w: --keys names no key", errUsage)
		}
		return out, nil
	}
	h, hashes, err := b.hashes(e, set)
	if err != nil {
		return nil, err
	}
	ns, err := b.namespace(h)
	if err != nil {
		return nil, err
	}
	if len(hashes) == 0 {
		return nil, fmt.Errorf("%w: fewer tokens than one block of %d", errUsage, h.BlockSize())
	}
	out := make([]string, len(hashes))
	for i, hh := range hashes {
		out[i] = ns.Key(hh)
	}
	return out, nil
}

// owns reports whether the flag is one of register's.
func (b *blockFlags) owns(name string) bool {
	switch name {
	case "scheme", "block-size", "seed", "extra-keys", "block-extra-keys", "tokens", "model", "tenant":
		return true
	}
	return false
}

func visited(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

// runHash prints the chain hashes (or object keys) of a token list's full
// blocks, one per line, as an inference engine computes them.
func runHash(_ context.Context, e *env, args []string) error {
	fs := newFlags("hash", hashArgs, "Print one hex hash per full block of a token list, as an inference engine hashes it\n(a trailing partial block has none). Tokens come from --tokens, or from stdin\n(separated by newlines, spaces or commas) when it is absent or -.", e.stderr)
	var b blockFlags
	b.register(fs)
	keys := fs.Bool("keys", false, "print object keys, kv/SCHEME/MODEL/TENANT/HASH, instead of hashes (needs --model)")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return err
	}
	set := visited(fs)
	if !*keys && (set["model"] || set["tenant"]) {
		return fmt.Errorf("%w: --model and --tenant need --keys", errUsage)
	}
	h, hashes, err := b.hashes(e, set)
	if err != nil {
		return err
	}
	var ns kvhash.Namespace
	if *keys {
		if ns, err = b.namespace(h); err != nil {
			return err
		}
	}
	w := bufio.NewWriter(e.stdout)
	for _, hh := range hashes {
		if *keys {
			w.WriteString(ns.Key(hh))
		} else {
			w.WriteString(hh.String())
		}
		w.WriteByte('\n')
	}
	return w.Flush()
}

// parseTokens reads token ids separated by commas and white space.
func parseTokens(s string) ([]uint32, error) {
	fields := strings.FieldsFunc(s, func(r rune) bool {
		return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r'
	})
	out := make([]uint32, len(fields))
	for i, f := range fields {
		t, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("%w: token %d is %q: want 0 to 4294967295", kvhash.ErrToken, i, f)
		}
		out[i] = uint32(t)
	}
	return out, nil
}
