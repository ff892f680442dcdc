package kvevents

import (
	"net/url"
	"strconv"
	"strings"

	"github.com/tidepool-kv/tidepool/client/kvhash"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// block is what an object key says about the KV block it holds.
type block struct {
	topic     string
	ns        string // the key up to the hash, with any tenant prefix: the hash space
	hash      uint64 // the hash as vLLM's int form: its last 8 bytes, big-endian
	hexLen    int    // the length of the hash's hex form
	blockSize int
}

// parseKey parses key, of an object of tenant, into the block it names. Only
// keys kvhash.Namespace makes (kv/SCHEME/MODEL/NSTENANT/HEX, after a secure
// pool's TENANT/ prefix) name blocks, and only canonically spelled ones, so
// that one namespace has one topic. Keys whose model or tenants hold '@'
// name none: a topic is split on '@'.
func parseKey(full, tenant string) (block, bool) {
	key, tenant := stripTenant(full, tenant)
	rest, ok := strings.CutPrefix(key, "kv/") // rejects most keys cheaply
	if !ok {
		return block{}, false
	}
	scheme, rest, _ := strings.Cut(rest, "/")
	model, rest, _ := strings.Cut(rest, "/")
	nstenant, hex, ok := strings.Cut(rest, "/")
	size := kvhash.Scheme(scheme).HashSize()
	if !ok || size == 0 || len(hex) != 2*size || !lowerHex(hex) {
		return block{}, false
	}
	if strings.Contains(tenant, "@") || strings.Contains(tenant, "/") {
		return block{}, false
	}
	name, ok := unescape(model)
	if !ok || name == "" {
		return block{}, false
	}
	if _, ok := unescape(nstenant); !ok {
		return block{}, false
	}
	return block{
		topic:     topic(tenant, nstenant, name),
		ns:        full[:len(full)-len(hex)],
		hash:      lastUint64(hex),
		hexLen:    len(hex),
		blockSize: kvhash.Scheme(scheme).DefaultBlockSize(),
	}, true
}

// parentHash is the hash of parent, the key of b's parent block, when it
// names a block of b's namespace: the chain goes on in the same hash space.
func parentHash(parent string, b block) (uint64, bool) {
	hex, ok := strings.CutPrefix(parent, b.ns)
	if !ok || len(hex) != b.hexLen || !lowerHex(hex) {
		return 0, false
	}
	return lastUint64(hex), true
}

// stripTenant takes a secure pool's TENANT/ prefix off key, and reports
// the tenant it took ("" for none). An object whose tenant is only
// recorded (a pool without tokens: its key has no prefix) names no
// tenant in its topic, so two objects never publish the same block.
func stripTenant(key, tenant string) (string, string) {
	if tenant != "" && len(key) > len(tenant) && key[len(tenant)] == '/' && key[:len(tenant)] == tenant {
		return key[len(tenant)+1:], tenant
	}
	return key, ""
}

// lastUint64 reads the last 8 bytes of a hash's lower-case hex form (at
// least 16 digits, checked by the caller) as a big-endian integer.
func lastUint64(hex string) uint64 {
	h, _ := strconv.ParseUint(hex[len(hex)-16:], 16, 64)
	return h
}

// Topic is the topic of ns's blocks put by a client of tenant in a
// secure pool ("" for none): kv@POD@MODEL, POD tidepool/MODEL path-escaped,
// then /TENANT/NSTENANT (NSTENANT path-escaped as in keys) when either is
// set. Routers clear a whole pod on AllBlocksCleared, so each topic is a
// pod of its own.
func Topic(tenant string, ns kvhash.Namespace) string {
	return topic(tenant, url.PathEscape(ns.Tenant), ns.Model)
}

func topic(tenant, nstenant, model string) string {
	pod := "tidepool/" + url.PathEscape(model)
	if tenant != "" || nstenant != "" {
		pod += "/" + tenant + "/" + nstenant
	}
	return "kv@" + pod + "@" + model
}

// unescape undoes url.PathEscape on a key segment, refusing one that
// PathEscape would not have written (another spelling of the same name)
// and one holding '@'.
func unescape(seg string) (string, bool) {
	if strings.Contains(seg, "@") {
		return "", false // PathEscape leaves '@' alone, so %40 is refused below
	}
	s, err := url.PathUnescape(seg)
	if err != nil || url.PathEscape(s) != seg {
		return "", false
	}
	return s, true
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// medium is vLLM's name for a tier, "" for none.
func medium(t pb.Tier) string {
	switch t {
	case pb.Tier_TIER_HBM:
		return "GPU"
	case pb.Tier_TIER_DRAM:
		return "CPU"
	case pb.Tier_TIER_SSD:
		return "DISK"
	}
	return ""
}
