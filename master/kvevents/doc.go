// Package kvevents publishes the pool's KV-cache events the way vLLM
// publishes an engine's (vllm/distributed/kv_events.py), so that a KV-aware
// router (llm-d, Dynamo) can score the pool as it scores a vLLM pod.
//
// # What is published, and when
//
// The master's FSM tells a Publisher, in log order, when a complete object
// enters a tier (Stored) or leaves one (Removed), and when a snapshot
// restore replaced its state (Cleared); Flush ends each raft entry. Only
// objects whose key kvhash.Namespace made, kv/SCHEME/MODEL/NSTENANT/HEX
// (after the TENANT/ prefix a secure pool adds), are KV blocks; every other
// key is ignored. So are keys spelled other than as Namespace spells them,
// and keys whose model or tenants hold '@' (see Topics).
//
// Each Flush turns what it heard into one EventBatch per topic, in the
// order the topics were first heard; a topic's events are in the order
// heard:
//
//   - BlockStored: block_hashes, parent_block_hash, token_ids (always
//     empty: puts carry no token ids), block_size (the scheme's default:
//     16 for vLLM, 64 for the others), lora_id nil, medium, lora_name nil.
//     Consecutive Stored calls of a topic and medium in which each block's
//     parent is the block before make one event, as vLLM stores a run of
//     full blocks. parent_block_hash is the parent key's hash when it names
//     a block of the same namespace, else nil.
//   - BlockRemoved: block_hashes, medium; consecutive Removed calls of a
//     topic and medium make one event.
//   - AllBlocksCleared.
//
// A block hash is vLLM's default int form: the last 8 bytes of the hash
// read big-endian, an unsigned integer. The medium is the tier: HBM is
// "GPU", DRAM "CPU", SSD "DISK" (Dynamo's name for disk; llm-d weighs
// tiers by the lower-cased medium).
//
// # The clear rule
//
// A Publisher counts, per topic, the (key, tier) pairs stored and not yet
// removed. When an entry's removals leave a topic with none, its batch is
// [AllBlocksCleared] alone: everything it held is gone. Cleared (a restore)
// sets every count to zero, and each topic that held blocks starts its
// next batch with AllBlocksCleared, before the restored blocks' BlockStored
// events. A topic is known only while it holds blocks: one left empty is
// forgotten.
//
// # Topics
//
// One topic per model and tenants, in the form llm-d parses,
// kv@POD@MODEL, split on '@', each its own pod (routers take
// AllBlocksCleared as clearing a whole pod):
//
//	kv@tidepool/MODELESC@MODEL                   no tenant, namespace without tenant
//	kv@tidepool/MODELESC/TENANT/NSTENANT@MODEL   otherwise (either may be empty)
//
// MODEL is the model as the client named it (not escaped, '/' and all),
// MODELESC the same path-escaped; TENANT is the tenant of a secure pool,
// whose keys carry its TENANT/ prefix (a tenant only recorded with an
// unprefixed key names none, so two objects never publish one block),
// NSTENANT the namespace's tenant, path-escaped as in keys. Tenants hold
// no '/' and escaped names none, so the pod part is unambiguous. '@' would break the split, so keys
// whose model or tenants hold one publish nothing (rather than publish
// under a name the router would not recognise). Namespaces that differ
// only in scheme share a topic; their block_size and hashes differ.
//
// # Encodings
//
// A batch is always the positional array [ts, events, data_parallel_rank]:
// ts the entry's time in seconds (float64; for a restore, which has none,
// the publisher's clock), data_parallel_rank nil. Events are written as
// Config.Encoding says:
//
//	array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
//	       ["BlockRemoved", block_hashes, medium]
//	       ["AllBlocksCleared"]
//	map:   {"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., "token_ids": [],
//	        "block_size": 16, "lora_id": nil, "medium": "CPU", "lora_name": nil}
//	       {"type": "BlockRemoved", "block_hashes": ..., "medium": ...}
//	       {"type": "AllBlocksCleared"}
//
// The array form (msgspec's array_like, vLLM before its map events, SGLang)
// is the default: every consumer decodes it; current vLLM writes the map
// form, which newer consumers decode too.
//
// # Sockets and sequence numbers
//
// The PUB socket sends each batch as three frames: the topic, an 8-byte
// big-endian sequence number, the msgpack payload. Sequence numbers start
// at 0 when the Publisher starts and count its batches over all topics, so
// a subscriber of one topic sees gaps where other topics' batches went; a
// gap in itself is no loss. A batch dropped because the queue to the
// sender was full spends its number too and is never sent nor replayable:
// Stats counts it.
//
// The replay socket is a ROUTER, as vLLM's. A request is [identity, "",
// start] (a DEALER sends ["", start]), start an 8-byte big-endian sequence
// number. The answer is one message [identity, "", topic, seq, payload] per
// batch kept whose number is start or later (all topics; from the oldest
// kept when start is older), then the end marker [identity, "", "", FF×8,
// ""], vLLM's format since it added the topic frame. Malformed requests are
// ignored.
//
// # Limits
//
// Nothing here waits for the network on the FSM's behalf, and nothing a
// peer does can make the master hold more than these:
//
//   - Flush hands batches to one sender goroutine through a queue of
//     Config.QueueSize batches (4096), dropping what does not fit (logged
//     at most once a second). Encoding happens on the sender. A batch
//     carries at most 512 hashes; a restore's many are cut into several,
//     which wait for room in the queue rather than drop: without them a
//     subscriber's view would stay short of the table.
//   - Replay keeps the last Config.BufferSteps batches (10,000), at most
//     Config.BufferBytes of payload (64 MiB). Each request is served by
//     its peer's goroutine from a copy of the buffer, at most 8 at once
//     (more are dropped), so a slow peer holds up only itself.
//   - Each socket keeps at most 64 connections. A peer has 5 s for its
//     handshake, may send frames of at most 4 KiB, messages of at most 16
//     frames and hold at most 256 subscriptions, and is dropped when one
//     message to it takes over 10 s. ZMTP PINGs are answered.
//   - Each subscriber has its own queue, 1024 messages or 4 MiB; a slow one
//     misses what does not fit (Stats.Lagged) and sees the gap.
//
// zmq4 (github.com/go-zeromq/zmq4) performs each connection's ZMTP
// handshake (a panic inside it on a malformed READY is recovered and the
// peer dropped); the listeners and the framing are this package's own, as
// zmq4's sockets trust their peers and leave a goroutine behind on Close.
// Close stops every goroutine.
package kvevents
