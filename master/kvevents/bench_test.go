package kvevents

import "testing"

// BenchmarkStored is what one Stored costs the FSM, a chain's block at a
// time, a Flush every 16 blocks.
func BenchmarkStored(b *testing.B) {
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = vllmKey("meta-llama/Llama-3.1-8B", uint64(i))
	}
	bt := newBatcher()
	var out []batch
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		k := i % len(keys)
		parent := ""
		if k > 0 {
			parent = keys[k-1]
		}
		bt.stored(keys[k], parent, "", dram)
		if i%16 == 15 {
			out = bt.flush(1, out[:0])
		}
	}
}

// BenchmarkIgnored is what a key that is no KV block costs.
func BenchmarkIgnored(b *testing.B) {
	bt := newBatcher()
	b.ReportAllocs()
	for b.Loop() {
		bt.stored("tenant/some/object/key", "", "tenant", dram)
	}
}
