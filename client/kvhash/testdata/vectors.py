#!/usr/bin/python3
"""Reference vectors for package kvhash.

Run from the repository root with Debian's Python and its packages
python3-cbor2 and python3-xxhash (apt-get install python3-cbor2 python3-xxhash):

    /usr/bin/python3 client/kvhash/testdata/vectors.py > client/kvhash/testdata/vectors.json

Each scheme is written here from its published algorithm, with the same
libraries the engines use, so the Go tests check kvhash against them:

- vllm-sha256-cbor: vLLM's sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True)).
  The root hash (vLLM's NONE_HASH) is sha256_cbor(PYTHONHASHSEED), and block i's
  hash is sha256_cbor((parent, tuple(block_tokens), extra_keys)), the parent
  being the root for block 0. extra_keys is None or a tuple.
- sglang-sha256: SGLang HiCache's get_hash_str: sha256 over the parent's raw
  digest (nothing for the first page) and each token as 4 bytes little-endian;
  the hex digest.
- xxh3-64: Dynamo's chain: block_hash = xxh3_64(tokens as u32 LE, seed);
  sequence hash of block 0 is its block_hash, of block i>0
  xxh3_64(u64 LE parent sequence hash || u64 LE block_hash, seed); printed as 16
  hex digits (big-endian).

Only full blocks are hashed; a trailing partial block is ignored. The Go tests
read vectors.json and never need Python.
"""

import hashlib
import json
import struct
import sys

import cbor2
import xxhash

MAX = 2**32 - 1


def blocks(tokens, size):
    return [tokens[i:i + size] for i in range(0, len(tokens) - size + 1, size)]


def as_tuple(v):
    """vLLM passes extra keys as tuples (lists encode the same in CBOR)."""
    if isinstance(v, list):
        return tuple(as_tuple(x) for x in v)
    return v


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def vllm(tokens, size, seed, extra):
    parent = sha256_cbor(seed)  # NONE_HASH
    out = []
    for i, block in enumerate(blocks(tokens, size)):
        keys = extra[i] if extra is not None and i < len(extra) else None
        parent = sha256_cbor((parent, tuple(block), as_tuple(keys)))
        out.append(parent.hex())
    return out


def sglang(tokens, size):
    prior = None
    out = []
    for block in blocks(tokens, size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in block:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def xxh3(tokens, size, seed):
    out = []
    seq = None
    for block in blocks(tokens, size):
        bh = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(block), *block), seed=seed)
        if seq is None:
            seq = bh
        else:
            seq = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq, bh), seed=seed)
        out.append("%016x" % seq)
    return out


def main():
    big = [MAX, MAX - 1, 0, 65536, 255, 256, 23, 24, 65535, 1, 2, 2**31, 2**24, 2**16 - 1, 2**8, MAX]
    ints = ["ints", 0, 23, 24, 255, 256, 65535, 65536, MAX, 2**32, 2**63, 2**64 - 1,
            -1, -24, -25, -256, -257, -65536, -65537, -2**32, -2**32 - 1, -2**63,
            True, False, None, [], "", "\u00fc\u6c34\U0001f600"]
    cases = []

    def add_vllm(name, tokens, size, seed, extra=None, block_extra=None):
        per_block = block_extra
        if extra is not None:
            per_block = [extra] * (len(tokens) // size)
        cases.append({
            "name": name, "scheme": "vllm-sha256-cbor", "block_size": size, "seed": seed,
            "tokens": tokens, "extra_keys": extra, "block_extra_keys": block_extra,
            "root": sha256_cbor(seed).hex(),
            "hashes": vllm(tokens, size, seed, per_block),
        })

    add_vllm("seed 0, two blocks and a partial", list(range(40)), 16, "0")
    add_vllm("seed 12345, large ids", big + big[:6], 4, "12345")
    add_vllm("empty seed", list(range(100, 132)), 16, "")
    add_vllm("long seed, one block of 1", [7, 0, MAX], 1, "seed-" + "x" * 40)
    add_vllm("too short for a block", list(range(15)), 16, "0")
    add_vllm("lora name on every block", list(range(1000, 1048)), 16, "0", extra=["my-lora"])
    add_vllm("multimodal [mm_hash, offset] per block", list(range(12)), 4, "42",
             block_extra=[[["3f2a9c0d1e", 2]], [["3f2a9c0d1e", -2]], None])
    add_vllm("cache salt on the first block only", list(range(50)), 16, "0",
             block_extra=[["salt-xyz"]])
    add_vllm("lora, two images and a salt", list(range(32)), 8, "0",
             block_extra=[["lora-a", ["img-1", 0], ["img-2", 6], "salt"], ["lora-a", ["img-2", -2]], ["lora-a"], []])
    add_vllm("integer and other CBOR heads in extra keys", [1, 2, 3, 4], 2, "0", extra=ints)
    add_vllm("block size 64 (long CBOR token array)", [(i * 2654435761) % 2**32 for i in range(200)], 64, "0")

    def add_sglang(name, tokens, size):
        cases.append({"name": name, "scheme": "sglang-sha256", "block_size": size,
                      "tokens": tokens, "hashes": sglang(tokens, size)})

    add_sglang("page 64, two pages and a partial", list(range(150)), 64)
    add_sglang("page 4, large ids", big, 4)
    add_sglang("page 1, zeros", [0, 0, 0], 1)
    add_sglang("too short for a page", list(range(10)), 16)

    def add_xxh3(name, tokens, size, seed=None):
        c = {"name": name, "scheme": "xxh3-64", "block_size": size, "tokens": tokens}
        if seed is not None:
            c["seed"] = str(seed)
        c["hashes"] = xxh3(tokens, size, 1337 if seed is None else seed)
        cases.append(c)

    add_xxh3("block 64, three blocks and a partial", list(range(200)), 64)
    add_xxh3("block 4, large ids", big, 4)
    add_xxh3("block 1 and 2 (short inputs)", [0, MAX, 5, 6], 1)
    add_xxh3("block 2", [0, MAX, 5, 6, 9], 2)
    add_xxh3("block 16", list(range(64)), 16)
    add_xxh3("block 50 (200 bytes)", list(range(100)), 50)
    add_xxh3("block 300 (1200 bytes)", [(i * 40503) % 2**32 for i in range(600)], 300)
    add_xxh3("seed 0", list(range(128)), 64, seed=0)
    add_xxh3("seed 2^64-1", list(range(128)), 64, seed=2**64 - 1)
    add_xxh3("too short for a block", [1, 2, 3], 64)

    # One case per line keeps the file short and its diffs readable.
    sys.stdout.write('{"generated_by": "client/kvhash/testdata/vectors.py", "cases": [\n')
    sys.stdout.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
    sys.stdout.write("\n]}\n")


if __name__ == "__main__":
    main()
