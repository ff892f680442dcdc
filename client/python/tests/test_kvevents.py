"""A KV-aware router's view of the pool: a subscriber built on Debian's
python3-zmq and python3-msgpack, as llm-d and Dynamo subscribe to vLLM,
follows a real `tidepool up --kv-events` through puts, evictions and a
clear, in both encodings, replays a missed range by sequence number, and
ends with the same blocks as the master lists."""

import os
import shutil
import struct
import subprocess
import tempfile
import threading
import unittest

import msgpack
import zmq

import harness
import tidepool
from tidepool import hashing

# vLLM's event fields (vllm/distributed/kv_events.py), in its array order.
FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}
END_SEQ = b"\xff" * 8
MEDIUM = {"dram": "CPU", "ssd": "DISK", "hbm": "GPU"}


def decode_event(raw):
    """An event of either encoding as (type, fields by vLLM's names)."""
    if isinstance(raw, list):
        kind, values = raw[0], raw[1:]
        names = FIELDS[kind]
        if len(values) > len(names):
            raise AssertionError("%s carries %d fields, vLLM's has %d" % (kind, len(values), len(names)))
        return kind, dict(zip(names, values))
    if isinstance(raw, dict):
        kind = raw["type"]
        fields = {k: v for k, v in raw.items() if k != "type"}
        if set(fields) - set(FIELDS[kind]):
            raise AssertionError("%s has fields %s beyond vLLM's" % (kind, sorted(set(fields) - set(FIELDS[kind]))))
        return kind, fields
    raise AssertionError("an event is %r" % (raw,))


def decode_batch(payload):
    """vLLM's EventBatch: [ts, events, data_parallel_rank]."""
    batch = msgpack.unpackb(payload, raw=False)
    if not isinstance(batch, list) or len(batch) != 3 or not isinstance(batch[0], float):
        raise AssertionError("a batch is %r" % (batch,))
    return [decode_event(e) for e in batch[1]]


def block_hash(h):
    """vLLM's int block hash of one of our hashes: its last 8 bytes."""
    return int.from_bytes(h[-8:], "big")


class Subscriber:
    """A router's subscriber: live batches on SUB, gaps and a late start
    filled from the replay ROUTER through a DEALER; the view is the blocks
    stored per topic, as (hash, medium)."""

    def __init__(self, endpoint, replay):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.lock = threading.Lock()
        self.batches = {}  # seq -> (topic, events), every batch seen
        self.view = {}  # topic -> set of (hash, medium)
        self.next = 0  # the next sequence number to apply
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def replay(self, start):
        """Every kept batch from start, as [(seq, topic, payload)], read
        until the end marker."""
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 10000)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay_endpoint)
        try:
            d.send_multipart([b"", struct.pack(">Q", start)])
            out = []
            while True:
                frames = d.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise AssertionError("a replay answer of %d frames" % len(frames))
                _, topic, seq, payload = frames
                if seq == END_SEQ and payload == b"":
                    return out
                out.append((struct.unpack(">Q", seq)[0], topic.decode(), payload))
        finally:
            d.close()

    def _apply(self, seq, topic, payload):
        if seq < self.next:
            return
        if seq > self.next:
            # A gap: what this subscriber missed (or other topics'
            # batches, which it subscribes to as well) comes by replay.
            for s, t, p in self.replay(self.next):
                if s >= seq:
                    break
                self._apply(s, t, p)
            if seq > self.next:
                raise AssertionError("batches %d..%d lost" % (self.next, seq - 1))
        events = decode_batch(payload)
        with self.lock:
            self.batches[seq] = (topic, events)
            view = self.view.setdefault(topic, set())
            for kind, f in events:
                if kind == "BlockStored":
                    view.update((h, f["medium"]) for h in f["block_hashes"])
                elif kind == "BlockRemoved":
                    view.difference_update((h, f["medium"]) for h in f["block_hashes"])
                else:
                    view.clear()
            self.next = seq + 1

    def _run(self):
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            self._apply(struct.unpack(">Q", seq)[0], topic.decode(), payload)

    def events(self, since):
        """(seq, topic, events) of every batch from since on."""
        with self.lock:
            return [(s,) + self.batches[s] for s in sorted(self.batches) if s >= since]

    def wait(self, cond, what):
        return harness.poll(lambda: cond(self), timeout=20, what=what)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


class KVEventsTest:
    """Run once per encoding by the subclasses below."""

    ENCODING = None

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-kvevents-")
        pub, rep = harness.free_addr(), harness.free_addr()
        cls.up = harness.Up(cls.dir, extra=["--kv-events", "tcp://" + pub, "--kv-events-replay", "tcp://" + rep,
                                             "--kv-events-encoding", cls.ENCODING])
        cls.agent = harness.Agent(cls.dir, cls.up.grpc)
        cls.sub = Subscriber("tcp://" + pub, "tcp://" + rep)
        cls.hasher = hashing.Hasher("xxh3-64")
        cls.client = tidepool.Client(cls.agent.socket, shm_bytes=1 << 20)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.sub.close()
        cls.agent.stop()
        cls.up.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def cli(self, *args):
        return subprocess.run([harness.binary()] + list(args) + ["--masters", self.up.grpc],
                              check=True, capture_output=True, text=True).stdout

    def put_prompt(self, ns, seed, blocks):
        tokens = [(seed * 7919 + i) % 50000 for i in range(blocks * self.hasher.block_size)]
        chain = ns.blocks(self.hasher, tokens)
        keys = [b.key for b in chain]
        self.assertEqual(self.client.batch_set(keys, [b"v" * 1024] * len(keys), chain=True), [True] * len(keys))
        return chain

    def master_view(self, ns):
        """What the master lists of ns, as the subscriber should see it."""
        out = set()
        for line in self.cli("ls", "-l", ns.prefix).splitlines()[1:]:
            key, *_, replicas = line.split(None, 5)
            h = bytes.fromhex(key[len(ns.prefix):])
            for seg in replicas.strip("[]").split():
                tier = seg.split("/")[1].split("@")[0].rstrip("0123456789")
                out.add((block_hash(h), MEDIUM[tier]))
        return out

    def test_put_evict_clear_replay(self):
        ns = hashing.Namespace("xxh3-64", "org/model-" + self.ENCODING)
        topic = "kv@tidepool/%s@%s" % (hashing.path_escape(ns.model), ns.model)
        start = self.sub.next
        chain = self.put_prompt(ns, 1, 3)
        hashes = [block_hash(b.hash) for b in chain]
        stored = self.sub.wait(lambda s: [e for e in s.events(start) if e[1] == topic], "the put's events")
        kind, f = stored[0][2][0]
        self.assertEqual((kind, f["block_hashes"], f["parent_block_hash"], f["medium"], f["block_size"], f["token_ids"]),
                         ("BlockStored", hashes, None, "CPU", 64, []))
        self.assertIsNone(f["lora_id"])

        # An eviction of the last block.
        after_put = self.sub.next
        self.cli("admin", "evict", "--key", chain[-1].key)
        removed = self.sub.wait(lambda s: [e for e in s.events(after_put) if e[1] == topic], "the eviction's events")
        self.assertEqual(removed[0][2], [("BlockRemoved", {"block_hashes": [hashes[-1]], "medium": "CPU"})])

        # A clear of the namespace empties the topic: AllBlocksCleared.
        after_evict = self.sub.next
        self.assertEqual(self.client.clear(ns.prefix), 2)
        cleared = self.sub.wait(lambda s: [e for e in s.events(after_evict) if e[1] == topic], "the clear's events")
        self.assertEqual(cleared[0][2], [("AllBlocksCleared", {})])
        self.assertEqual(self.sub.view.get(topic), set())

        # A missed range, replayed by sequence number, is what came live.
        replayed = [(s, t, decode_batch(p)) for s, t, p in self.sub.replay(stored[0][0])]
        live = self.sub.events(stored[0][0])
        self.assertEqual(replayed[:len(live)], live)
        self.assertEqual(self.sub.replay(1 << 62), [])

    def test_view_equals_master_after_evictions(self):
        ns = hashing.Namespace("xxh3-64", "org/view-" + self.ENCODING, "t1")
        topic = "kv@tidepool/%s//t1@%s" % (hashing.path_escape(ns.model), ns.model)
        chains = [self.put_prompt(ns, 100 + i, 6) for i in range(8)]
        # Evictions: whole prompts, single blocks, and every block of the
        # namespace whose hash starts with a digit.
        for c in chains[:2]:
            self.cli("admin", "evict", "--key", c[-1].key)
        self.cli("admin", "evict", "--prefix", ns.prefix + "1")
        for d in "23":
            self.cli("admin", "evict", "--prefix", ns.prefix + d)
        self.put_prompt(ns, 200, 4)
        want = self.master_view(ns)
        self.assertTrue(0 < len(want) < 8 * 6 + 4)
        self.sub.wait(lambda s: s.view.get(topic) == want, "the subscriber's view equal to the master's %d blocks" % len(want))


@unittest.skipUnless(harness.have_go(), "needs go to build the tidepool binary")
class ArrayEventsTest(KVEventsTest, unittest.TestCase):
    ENCODING = "array"


@unittest.skipUnless(harness.have_go(), "needs go to build the tidepool binary")
class MapEventsTest(KVEventsTest, unittest.TestCase):
    ENCODING = "map"


if __name__ == "__main__":
    unittest.main()
