package kvevents

import (
	"strings"
	"testing"

	"github.com/tidepool-kv/tidepool/client/kvhash"
)

var (
	hex32 = strings.Repeat("00", 24) + "8000000000000001" // sha256: the last 8 bytes count
	hex8  = "0123456789abcdef"                            // xxh3-64
)

func TestParseKey(t *testing.T) {
	llama := kvhash.Namespace{Scheme: kvhash.VLLMSHA256CBOR, Model: "meta-llama/Llama-3.1-8B"}
	team := kvhash.Namespace{Scheme: kvhash.XXH3, Model: "m", Tenant: "team a"}
	good := []struct {
		name, key, tenant string
		topic             string
		hash              uint64
		blockSize         int
	}{
		{"vllm", llama.Key(mustHash(hex32)), "", "kv@tidepool/meta-llama%2FLlama-3.1-8B@meta-llama/Llama-3.1-8B", 0x8000000000000001, 16},
		{"xxh3 namespace tenant", team.Key(mustHash(hex8)), "", "kv@tidepool/m//team%20a@m", 0x0123456789abcdef, 64},
		{"secure pool", "acme/kv/sglang-sha256/m//" + hex32, "acme", "kv@tidepool/m/acme/@m", 0x8000000000000001, 64},
		{"secure pool, namespace tenant", "acme/" + team.Key(mustHash(hex8)), "acme", "kv@tidepool/m/acme/team%20a@m", 0x0123456789abcdef, 64},
		{"tenant without prefix (only recorded: no topic of its own)", "kv/xxh3-64/m//" + hex8, "acme", "kv@tidepool/m@m", 0x0123456789abcdef, 64},
	}
	for _, tc := range good {
		t.Run(tc.name, func(t *testing.T) {
			b, ok := parseKey(tc.key, tc.tenant)
			if !ok {
				t.Fatalf("parseKey(%q, %q) refused", tc.key, tc.tenant)
			}
			if b.topic != tc.topic || b.hash != tc.hash || b.blockSize != tc.blockSize {
				t.Fatalf("parseKey(%q, %q) = %q %#x %d, want %q %#x %d", tc.key, tc.tenant, b.topic, b.hash, b.blockSize, tc.topic, tc.hash, tc.blockSize)
			}
		})
	}

	bad := []struct{ name, key, tenant string }{
		{"empty", "", ""},
		{"not kv", "hello/world", ""},
		{"kv only", "kv/", ""},
		{"unknown scheme", "kv/md5/m//" + hex32, ""},
		{"short hash", "kv/xxh3-64/m//" + hex8[1:], ""},
		{"long hash", "kv/xxh3-64/m//" + hex8 + "00", ""},
		{"upper-case hash", "kv/xxh3-64/m//" + strings.ToUpper(hex8), ""},
		{"not hex", "kv/xxh3-64/m//0123456789abcdeg", ""},
		{"extra segment", "kv/xxh3-64/m//x/" + hex8, ""},
		{"missing segment", "kv/xxh3-64/m/" + hex8, ""},
		{"no model", "kv/xxh3-64///" + hex8, ""},
		{"model with @", "kv/xxh3-64/a@b//" + hex8, ""},
		{"model escaping @", "kv/xxh3-64/a%40b//" + hex8, ""},
		{"non-canonical escape", "kv/xxh3-64/a%2fb//" + hex8, ""},
		{"bad escape", "kv/xxh3-64/a%zz//" + hex8, ""},
		{"namespace tenant with @", "kv/xxh3-64/m/t@u/" + hex8, ""},
		{"tenant with @", "a@b/kv/xxh3-64/m//" + hex8, "a@b"},
		{"another tenant's prefix", "acme/kv/xxh3-64/m//" + hex8, "other"},
		{"tenant prefix without tenant", "acme/kv/xxh3-64/m//" + hex8, ""},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			if b, ok := parseKey(tc.key, tc.tenant); ok {
				t.Fatalf("parseKey(%q, %q) = %+v, want refused", tc.key, tc.tenant, b)
			}
		})
	}
}

func TestParentHash(t *testing.T) {
	ns := kvhash.Namespace{Scheme: kvhash.XXH3, Model: "m"}
	b, _ := parseKey("acme/"+ns.Key(mustHash("00000000000000ff")), "acme")
	for _, tc := range []struct {
		parent string
		want   uint64
		ok     bool
	}{
		{"acme/" + ns.Key(mustHash(hex8)), 0x0123456789abcdef, true},
		{ns.Key(mustHash(hex8)), 0, false}, // without the prefix: another key space
		{"", 0, false},
		{"acme/kv/xxh3-64/other//" + hex8, 0, false},              // another model
		{"acme/kv/vllm-sha256-cbor/m//" + hex32, 0, false},        // another scheme
		{"acme/" + ns.Key(mustHash(hex8)) + "0", 0, false},        // too long
		{"acme/kv/xxh3-64/m//" + strings.ToUpper(hex8), 0, false}, // not as keys are spelled
	} {
		if h, ok := parentHash(tc.parent, b); h != tc.want || ok != tc.ok {
			t.Errorf("parentHash(%q) = %#x %v, want %#x %v", tc.parent, h, ok, tc.want, tc.ok)
		}
	}
}

func TestTopic(t *testing.T) {
	ns := kvhash.Namespace{Scheme: kvhash.VLLMSHA256CBOR, Model: "org/model", Tenant: "a b"}
	if got, want := Topic("acme", ns), "kv@tidepool/org%2Fmodel/acme/a%20b@org/model"; got != want {
		t.Errorf("Topic = %q, want %q", got, want)
	}
	ns.Tenant = ""
	if got, want := Topic("", ns), "kv@tidepool/org%2Fmodel@org/model"; got != want {
		t.Errorf("Topic = %q, want %q", got, want)
	}
	// llm-d splits a topic on '@' into kv, pod and model.
	if parts := strings.Split(Topic("acme", ns), "@"); len(parts) != 3 || parts[1] != "tidepool/org%2Fmodel/acme/" || parts[2] != "org/model" {
		t.Errorf("Topic splits into %q", parts)
	}
}

func mustHash(s string) kvhash.Hash {
	h, err := kvhash.ParseHash(s)
	if err != nil {
		panic(err)
	}
	return h
}
