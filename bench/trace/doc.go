// Package trace is request traces in the format of Mooncake's published
// ones (kvcache-ai/Mooncake FAST25-release: JSON lines of timestamp in ms,
// input_length and output_length in tokens, and hash_ids, one id per
// 512-token block of the prompt, equal leading ids a shared prefix), a
// generator of such traces for tests, and the offline policies a pool's
// memory is judged against: LRU and Belady's optimum, simulated over the
// same trace and capacity.
//
// A request hits the blocks of the longest prefix of its chain that the
// cache holds: a block after the first miss is recomputed by prefill
// anyway. After it, every block of its chain is in the cache (the missing
// ones put), as far as the policy admits them.
package trace
