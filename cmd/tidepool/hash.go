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

// runHash prints the chain hashes (or object keys) of a token list's full
// blocks, one per line, as an inference engine computes them.
func runHash(_ context.Context, e *env, args []string) error {
	fs := newFlags("hash", hashArgs, "Print one hex hash per full block of a token list, as an inference engine hashes it\n(a trailing partial block has none). Tokens come from --tokens, or from stdin\n(separated by newlines, spaces or commas) when it is absent or -.", e.stderr)
	scheme := fs.String("scheme", "", "hashing scheme: vllm-sha256-cbor, sglang-sha256 or xxh3-64 (required)")
	blockSize := fs.Int("block-size", 0, "tokens per block (default 16 for vllm-sha256-cbor, 64 for the others)")
	seed := fs.String("seed", "", "vllm-sha256-cbor: vLLM's PYTHONHASHSEED (default $PYTHONHASHSEED); xxh3-64: the XXH3 seed (default 1337)")
	extraKeys := fs.String("extra-keys", "", "vllm-sha256-cbor: every block's extra keys as JSON, e.g. '[\"my-lora\"]' (default null)")
	blockExtraKeys := fs.String("block-extra-keys", "", "vllm-sha256-cbor: per-block extra keys, a JSON array of arrays or nulls, e.g. '[[\"salt\"], [[\"mm-hash\", 4]]]'; blocks past its end get null")
	tokensFlag := fs.String("tokens", "-", "token ids separated by commas, or - for stdin")
	keys := fs.Bool("keys", false, "print object keys, kv/SCHEME/MODEL/TENANT/HASH, instead of hashes")
	model := fs.String("model", "", "with --keys: the model (and whatever else changes a block's bytes)")
	tenant := fs.String("tenant", "", "with --keys: the tenant")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	cfg := kvhash.Config{Scheme: kvhash.Scheme(*scheme), BlockSize: *blockSize, Seed: *seed}
	switch {
	case *scheme == "":
		return fmt.Errorf("%w: --scheme is required: vllm-sha256-cbor, sglang-sha256 or xxh3-64", errUsage)
	case set["block-size"] && *blockSize <= 0:
		return fmt.Errorf("%w: --block-size must be positive", errUsage)
	case set["extra-keys"] && set["block-extra-keys"]:
		return fmt.Errorf("%w: --extra-keys and --block-extra-keys exclude each other", errUsage)
	case !*keys && (set["model"] || set["tenant"]):
		return fmt.Errorf("%w: --model and --tenant need --keys", errUsage)
	}
	if cfg.Scheme == kvhash.VLLMSHA256CBOR && !set["seed"] {
		if cfg.Seed = e.getenv("PYTHONHASHSEED"); cfg.Seed == "" {
			return fmt.Errorf("%w: vllm-sha256-cbor needs vLLM's PYTHONHASHSEED: --seed or $PYTHONHASHSEED", errUsage)
		}
	}
	h, err := kvhash.New(cfg)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	ns := kvhash.Namespace{Scheme: h.Scheme(), Model: *model, Tenant: *tenant}
	if *keys {
		if err := ns.Validate(); err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
	}

	var tokens []uint32
	if *tokensFlag == "-" {
		in, err := io.ReadAll(e.stdin)
		if err != nil {
			return fmt.Errorf("read tokens: %w", err)
		}
		if tokens, err = parseTokens(string(in)); err != nil {
			return fmt.Errorf("stdin: %w", err)
		}
	} else if tokens, err = parseTokens(*tokensFlag); err != nil {
		return fmt.Errorf("%w: --tokens: %v", errUsage, err)
	}
	n := len(tokens) / h.BlockSize()
	var extra [][]any
	switch {
	case set["extra-keys"]:
		k, err := kvhash.ParseExtraKeys([]byte(*extraKeys))
		if err != nil {
			return fmt.Errorf("%w: --extra-keys: %v", errUsage, err)
		}
		if k != nil {
			extra = make([][]any, n)
			for i := range extra {
				extra[i] = k
			}
		}
	case set["block-extra-keys"]:
		if extra, err = kvhash.ParseBlockExtraKeys([]byte(*blockExtraKeys)); err != nil {
			return fmt.Errorf("%w: --block-extra-keys: %v", errUsage, err)
		}
	}
	hashes, err := h.Hash(nil, tokens, extra)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
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
