"""tidepool.hashing against the reference vectors of client/kvhash and the
Go implementation's `tidepool hash`."""

import json
import os
import random
import subprocess
import unittest

import harness
from tidepool import hashing
from tidepool.hashing import (SGLANG_SHA256, VLLM_SHA256_CBOR, XXH3, Hasher, Namespace)

VECTORS = os.path.join(harness.REPO, "client", "kvhash", "testdata", "vectors.json")


def hasher_for(case):
    return Hasher(case["scheme"], case["block_size"], case.get("seed"))


def block_extra(case):
    """Each block's extra keys, as vectors.py applies them."""
    if case.get("extra_keys") is not None:
        return [case["extra_keys"]] * (len(case["tokens"]) // case["block_size"])
    return case.get("block_extra_keys")


class VectorsTest(unittest.TestCase):
    def setUp(self):
        with open(VECTORS) as f:
            self.cases = json.load(f)["cases"]

    def test_every_scheme_is_covered(self):
        self.assertEqual({c["scheme"] for c in self.cases}, set(hashing.SCHEMES))

    def test_vectors(self):
        for case in self.cases:
            with self.subTest(case["name"], scheme=case["scheme"]):
                h = hasher_for(case)
                got = [x.hex() for x in h.hash(case["tokens"], extra=block_extra(case))]
                self.assertEqual(got, case["hashes"])
                if case["scheme"] == VLLM_SHA256_CBOR:
                    self.assertEqual(h.root.hex(), case["root"])
                else:
                    self.assertIsNone(h.root)

    def test_chains_extend(self):
        # Hashing a prompt in two parts, the second from the first's last
        # hash, gives the same chain as hashing it whole.
        for case in self.cases:
            n = len(case["hashes"])
            if n < 2 or block_extra(case) is not None:
                continue
            with self.subTest(case["name"]):
                h = hasher_for(case)
                bs = case["block_size"]
                first = h.hash(case["tokens"][:bs])
                rest = h.hash(case["tokens"][bs:], parent=first[-1])
                self.assertEqual([x.hex() for x in first + rest], case["hashes"])
                rest_hex = h.hash(case["tokens"][bs:], parent=first[-1].hex())
                self.assertEqual(rest, rest_hex)


class HasherTest(unittest.TestCase):
    def test_defaults(self):
        self.assertEqual(Hasher(VLLM_SHA256_CBOR, seed="0").block_size, 16)
        self.assertEqual(Hasher(SGLANG_SHA256).block_size, 64)
        self.assertEqual(Hasher(XXH3).block_size, 64)
        self.assertEqual([hashing.hash_size(s) for s in hashing.SCHEMES], [32, 32, 8])
        self.assertEqual(hashing.hash_size("md5"), 0)
        # xxh3's default seed is Dynamo's 1337, given any way.
        tokens = list(range(64))
        self.assertEqual(Hasher(XXH3).hash(tokens), Hasher(XXH3, seed=1337).hash(tokens))
        self.assertEqual(Hasher(XXH3).hash(tokens), Hasher(XXH3, seed="0x539").hash(tokens))
        self.assertEqual(Hasher(XXH3).hash(tokens), Hasher(XXH3, seed="02471").hash(tokens))  # octal, as Go
        self.assertNotEqual(Hasher(XXH3).hash(tokens), Hasher(XXH3, seed=0).hash(tokens))

    def test_vllm_seed_from_environment(self):
        old = os.environ.get("PYTHONHASHSEED")
        try:
            os.environ["PYTHONHASHSEED"] = "12345"
            self.assertEqual(Hasher(VLLM_SHA256_CBOR).root, Hasher(VLLM_SHA256_CBOR, seed="12345").root)
            del os.environ["PYTHONHASHSEED"]
            with self.assertRaises(hashing.SeedError):
                Hasher(VLLM_SHA256_CBOR)
        finally:
            if old is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = old
        self.assertEqual(Hasher(VLLM_SHA256_CBOR, seed=7).root, Hasher(VLLM_SHA256_CBOR, seed="7").root)

    def test_errors(self):
        bad = [
            (lambda: Hasher("md5"), hashing.SchemeError),
            (lambda: Hasher(XXH3, block_size=-1), hashing.BlockSizeError),
            (lambda: Hasher(XXH3, block_size=2.5), hashing.BlockSizeError),
            (lambda: Hasher(SGLANG_SHA256, seed="1"), hashing.SeedError),
            (lambda: Hasher(XXH3, seed="-1"), hashing.SeedError),
            (lambda: Hasher(XXH3, seed="x"), hashing.SeedError),
            (lambda: Hasher(XXH3, seed=2**64), hashing.SeedError),
            (lambda: Hasher(VLLM_SHA256_CBOR, seed="\ud800"), hashing.SeedError),
            (lambda: Hasher(XXH3, block_size=1).hash([2**32]), hashing.TokenError),
            (lambda: Hasher(XXH3, block_size=1).hash([-1]), hashing.TokenError),
            (lambda: Hasher(XXH3, block_size=1).hash(["1"]), hashing.TokenError),
            (lambda: Hasher(XXH3, block_size=1).hash([1], extra=[["lora"]]), hashing.ExtraKeysError),
            (lambda: Hasher(VLLM_SHA256_CBOR, 1, "0").hash([1], extra=[[1.5]]), hashing.ExtraKeysError),
            (lambda: Hasher(VLLM_SHA256_CBOR, 1, "0").hash([1], extra=[[{"a": 1}]]), hashing.ExtraKeysError),
            (lambda: Hasher(VLLM_SHA256_CBOR, 1, "0").hash([1], extra=[[2**64]]), hashing.ExtraKeysError),
            (lambda: Hasher(VLLM_SHA256_CBOR, 1, "0").hash([1], extra=["lora"]), hashing.ExtraKeysError),
            (lambda: Hasher(SGLANG_SHA256, 1).hash([1], parent=b"\0" * 8), hashing.ParentError),
            (lambda: Hasher(XXH3, 1).hash([1], parent="zz"), hashing.ParentError),
        ]
        for i, (fn, err) in enumerate(bad):
            with self.subTest(i=i, want=err.__name__):
                with self.assertRaises(err):
                    fn()
        self.assertTrue(issubclass(hashing.HashError, ValueError))

    def test_extra_keys_take_bytes_and_tuples(self):
        h = Hasher(VLLM_SHA256_CBOR, 2, "0")
        a = h.hash([1, 2], extra=[["lora", ("img", 0), b"\x01"]])
        b = h.hash([1, 2], extra=[("lora", ["img", 0], bytearray(b"\x01"))])
        self.assertEqual(a, b)
        self.assertNotEqual(a, h.hash([1, 2]))
        self.assertNotEqual(h.hash([1, 2], extra=[[]]), h.hash([1, 2]))  # () is not None


class NamespaceTest(unittest.TestCase):
    def test_keys(self):
        # The same table as client/kvhash's TestNamespaceKey.
        h = bytes([0xab, 0xcd, 0, 1, 2, 3, 4, 5])
        cases = [
            (Namespace(XXH3, "llama", "acme"), "kv/xxh3-64/llama/acme/abcd000102030405"),
            (Namespace(XXH3, "llama", ""), "kv/xxh3-64/llama//abcd000102030405"),
            (Namespace(XXH3, "meta-llama/Llama-3.1-8B", "a b"),
             "kv/xxh3-64/meta-llama%2FLlama-3.1-8B/a%20b/abcd000102030405"),
            (Namespace(XXH3, "100%", "x/y"), "kv/xxh3-64/100%25/x%2Fy/abcd000102030405"),
        ]
        for ns, want in cases:
            with self.subTest(ns=ns):
                ns.validate()
                self.assertEqual(ns.key(h), want)
                self.assertEqual(ns.key(h.hex()), want)
        self.assertNotEqual(Namespace(XXH3, "m/t", "x").key(h), Namespace(XXH3, "m", "t/x").key(h))

    def test_escaping_matches_go(self):
        # url.PathEscape's output for each input, from Go 1.26.
        want = {
            "": "",
            "$&+,/:;=?@": "$&+%2C%2F:%3B=%3F@",
            "100%": "100%25",
            "Qwen/Qwen2.5-7B-Instruct@tp0-2": "Qwen%2FQwen2.5-7B-Instruct@tp0-2",
            "tab\tnl\n": "tab%09nl%0A",
            "~-_.!*'()[]{}#<>\"\\^`|": "~-_.%21%2A%27%28%29%5B%5D%7B%7D%23%3C%3E%22%5C%5E%60%7C",
            "\u00fc\u6c34\U0001f600": "%C3%BC%E6%B0%B4%F0%9F%98%80",
        }
        for s, esc in want.items():
            self.assertEqual(hashing.path_escape(s), esc, repr(s))

    def test_validate(self):
        for ns, err in [
            (Namespace("md5", "m"), hashing.SchemeError),
            (Namespace(XXH3, "", "t"), hashing.NamespaceError),
            (Namespace(VLLM_SHA256_CBOR, "m" * hashing.MAX_KEY_LEN), hashing.NamespaceError),
        ]:
            with self.subTest(ns=ns):
                with self.assertRaises(err):
                    ns.validate()

    def test_blocks(self):
        h = Hasher(VLLM_SHA256_CBOR, 2, "0")
        ns = Namespace(VLLM_SHA256_CBOR, "m")
        tokens = [1, 2, 3, 4, 5, 6, 7]
        blocks = ns.blocks(h, tokens)
        hashes = h.hash(tokens)
        self.assertEqual(len(blocks), 3)
        for i, b in enumerate(blocks):
            self.assertEqual(b.hash, hashes[i])
            self.assertEqual(b.key, ns.key(hashes[i]))
            self.assertEqual(b.parent, blocks[i - 1].key if i else "")
        rest = ns.blocks(h, tokens[2:], parent=blocks[0].hash)
        self.assertEqual([b.key for b in rest], [b.key for b in blocks[1:]])
        self.assertEqual(rest[0].parent, blocks[0].key)
        self.assertEqual(ns.keys(h, tokens), [b.key for b in blocks])
        with self.assertRaises(hashing.NamespaceError):
            Namespace(XXH3, "m").blocks(h, tokens)


@unittest.skipUnless(harness.have_go(), "needs go (or $TIDEPOOL_BIN) for `tidepool hash`")
class GoAgreesTest(unittest.TestCase):
    """Random prompts hash to the same keys here as in `tidepool hash`."""

    def cli(self, *args):
        r = subprocess.run([harness.binary(), "hash"] + list(args), capture_output=True, text=True, check=True)
        return r.stdout.split()

    def test_random_prompts(self):
        rng = random.Random(5)
        for scheme, seed in [(VLLM_SHA256_CBOR, "42"), (SGLANG_SHA256, None), (XXH3, None), (XXH3, "7")]:
            for bs in (1, 4, 16):
                with self.subTest(scheme=scheme, block_size=bs, seed=seed):
                    tokens = [rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32), rng.randrange(256)])
                              for _ in range(rng.randrange(bs, 5 * bs))]
                    args = ["--scheme", scheme, "--block-size", str(bs),
                            "--tokens", ",".join(map(str, tokens)),
                            "--keys", "--model", "org/model v1", "--tenant", "t/1"]
                    if seed is not None:
                        args += ["--seed", seed]
                    ns = Namespace(scheme, "org/model v1", "t/1")
                    self.assertEqual(ns.keys(Hasher(scheme, bs, seed), tokens), self.cli(*args))

    def test_extra_keys(self):
        extra = [["lora", ["mm-hash", 4], "salt"], None, ["lora"]]
        tokens = list(range(12))
        got = self.cli("--scheme", VLLM_SHA256_CBOR, "--block-size", "4", "--seed", "0",
                       "--block-extra-keys", json.dumps(extra), "--tokens", ",".join(map(str, tokens)))
        self.assertEqual([x.hex() for x in Hasher(VLLM_SHA256_CBOR, 4, "0").hash(tokens, extra=extra)], got)


if __name__ == "__main__":
    unittest.main()
