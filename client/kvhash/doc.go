// Package kvhash names KV-cache blocks the way inference engines do.
//
// An engine cuts a prompt's token ids into blocks of a fixed size and hashes
// them into a chain: each block's hash covers its parent's, so one hash names
// a whole prefix and two prompts share a block's hash exactly when they share
// every token up to the end of that block. Only full blocks are hashed; a
// trailing partial block has no hash.
//
// A Hasher speaks one engine's scheme, byte for byte:
//
//   - vllm-sha256-cbor: vLLM's sha256_cbor prefix caching. A block's hash is
//     SHA-256 of the canonical CBOR (RFC 8949 core deterministic encoding, as
//     python's cbor2.dumps(x, canonical=True)) of the array
//     [parent hash, [token ids], extra keys]. The first block's parent is the
//     root hash, SHA-256 of the canonical CBOR of the seed string (vLLM's
//     PYTHONHASHSEED). Extra keys are null or an array (a LoRA name,
//     [multimodal hash, offset] pairs, a cache salt). Block size 16.
//   - sglang-sha256: SGLang HiCache's page hash: SHA-256 over the parent's
//     32-byte digest (nothing for the first page) and each token as 4 bytes
//     little-endian. Page size 64.
//   - xxh3-64: Dynamo's chain: a block's content hash is XXH3-64 (seed 1337) of
//     its tokens as 4-byte little-endian words; the chain hash of the first
//     block is its content hash, of every later block XXH3-64 of the parent's
//     chain hash and the content hash, each as 8 bytes little-endian. Block
//     size 64. A Hash holds the chain hash as 8 bytes big-endian, so its hex
//     form is the usual %016x.
//
// A Namespace turns hashes into object keys, kv/SCHEME/MODEL/TENANT/HEX, so
// that blocks of different schemes, models and tenants never share a key.
// Blocks returns a prompt's keys with each block's parent key.
//
// testdata/vectors.py computes reference hashes with hashlib, cbor2 and
// xxhash; the tests check every scheme against its output.
//
// Errors wrap the sentinels below; test them with errors.Is.
package kvhash
