package trace

import (
	"math"
	"math/rand/v2"
)

// GenConfig shapes a generated trace. Zero fields take the defaults.
type GenConfig struct {
	Requests int
	Seed     uint64
	// MeanGapMs is the mean time between arrivals (exponential); default 50.
	MeanGapMs float64
	// Shares of the three kinds of request, relative to each other;
	// default 0.4, 0.4, 0.2:
	//   - System: one of SystemPrompts shared system prompts of
	//     SystemBlocks blocks (picked by a Zipf law: a few are hot), then a
	//     question of its own of 1-UserBlocks blocks.
	//   - Conversation: the next turn of a conversation, whose prompt is
	//     the previous turn's prompt, its answer and a new question (1-4
	//     blocks more); a conversation starts with a system prompt and
	//     ends after 2-MaxTurns turns. Open conversations are picked with a
	//     bias to the recent ones.
	//   - OneShot: 1-2*UserBlocks blocks seen nowhere else.
	System, Conversation, OneShot float64
	// SystemPrompts (default 64), SystemBlocks (default 6), UserBlocks
	// (default 4), MaxTurns (default 12), OpenConversations (default
	// 1024): enough that a pool of a few percent of the distinct blocks
	// tells policies apart.
	SystemPrompts, SystemBlocks, UserBlocks, MaxTurns, OpenConversations int
}

func (c *GenConfig) defaults() {
	if c.MeanGapMs <= 0 {
		c.MeanGapMs = 50
	}
	if c.System <= 0 && c.Conversation <= 0 && c.OneShot <= 0 {
		c.System, c.Conversation, c.OneShot = 0.4, 0.4, 0.2
	}
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.SystemPrompts, 64)
	def(&c.SystemBlocks, 6)
	def(&c.UserBlocks, 4)
	def(&c.MaxTurns, 12)
	def(&c.OpenConversations, 1024)
}

// Generate makes a trace of cfg.Requests requests; the same config makes
// the same trace. Hash ids are consecutive from 0 in order of first use,
// as in Mooncake's traces.
func Generate(cfg GenConfig) []Request {
	cfg.defaults()
	g := &generator{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0x7472616365))}
	g.prompts = make([][]int64, cfg.SystemPrompts)
	for i := range g.prompts {
		g.prompts[i] = g.fresh(cfg.SystemBlocks)
	}
	g.zipf = rand.NewZipf(g.rng, 1.2, 1, uint64(cfg.SystemPrompts-1))
	out := make([]Request, 0, cfg.Requests)
	var at float64
	total := cfg.System + cfg.Conversation + cfg.OneShot
	for range cfg.Requests {
		var chain []int64
		switch x := g.rng.Float64() * total; {
		case x < cfg.System:
			chain = append(g.systemPrompt(), g.fresh(1+g.rng.IntN(cfg.UserBlocks))...)
		case x < cfg.System+cfg.Conversation:
			chain = g.turn()
		default:
			chain = g.fresh(1 + g.rng.IntN(2*cfg.UserBlocks))
		}
		// The last block is partly filled.
		input := int64(len(chain))*BlockTokens - int64(g.rng.IntN(BlockTokens))
		out = append(out, Request{
			Timestamp: int64(math.Round(at)), InputLength: input, OutputLength: 50 + int64(g.rng.IntN(750)),
			HashIDs: chain,
		})
		at += g.rng.ExpFloat64() * cfg.MeanGapMs
	}
	// Renumber by first use (the system prompts were made first).
	ids := map[int64]int64{}
	for _, r := range out {
		for i, id := range r.HashIDs {
			n, ok := ids[id]
			if !ok {
				n = int64(len(ids))
				ids[id] = n
			}
			r.HashIDs[i] = n
		}
	}
	return out
}

type generator struct {
	cfg     GenConfig
	rng     *rand.Rand
	zipf    *rand.Zipf
	next    int64
	prompts [][]int64
	convs   []*conversation // open, oldest first
}

type conversation struct {
	chain []int64
	turns int
	max   int
}

// fresh is n blocks never seen before.
func (g *generator) fresh(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = g.next
		g.next++
	}
	return out
}

func (g *generator) systemPrompt() []int64 {
	p := g.prompts[g.zipf.Uint64()]
	return append([]int64(nil), p...)
}

// turn is the next turn of an open conversation, or the first of a new one.
func (g *generator) turn() []int64 {
	if len(g.convs) == 0 || (len(g.convs) < g.cfg.OpenConversations && g.rng.IntN(4) == 0) {
		c := &conversation{chain: append(g.systemPrompt(), g.fresh(1+g.rng.IntN(g.cfg.UserBlocks))...), max: 2 + g.rng.IntN(g.cfg.MaxTurns-1)}
		g.convs = append(g.convs, c)
		c.turns = 1
		return append([]int64(nil), c.chain...)
	}
	// The recent ones more often: the newest of two picks.
	i := max(g.rng.IntN(len(g.convs)), g.rng.IntN(len(g.convs)))
	c := g.convs[i]
	c.chain = append(c.chain, g.fresh(1+g.rng.IntN(4))...)
	c.turns++
	chain := append([]int64(nil), c.chain...)
	if c.turns >= c.max {
		g.convs = append(g.convs[:i], g.convs[i+1:]...)
	}
	return chain
}
