#!/usr/bin/env bash
# Reproduces the trace-replay table of docs/benchmarks.md: `tidepool bench
# replay` of the committed 10,000-request traces (bench/trace/testdata) at
# 2%, 10% and 50% of each trace's distinct blocks against a fresh
# `tidepool up`, with LRU and Belady simulated on the same trace and
# capacity in the same run. Hit rates do not depend on the machine; the
# TTFT and latency columns do.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACES=${TRACES:-"chat mixed prompts"}
PY=/usr/bin/python3
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}")
up=
cleanup() { [ -n "$up" ] && kill "$up" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "building tidepool" >&2
go build -o "$work/tidepool" ./cmd/tidepool
tp="$work/tidepool"
"$tp" up --dir "$work/up" --listen 127.0.0.1:55503 --raft 127.0.0.1:55504 --engine 127.0.0.1:55505 \
	--http 127.0.0.1:55506 --log-level warn & up=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:55506/readyz >/dev/null 2>&1 && break; sleep 0.1; done
for t in $TRACES; do
	echo "replaying $t-10k" >&2
	"$tp" bench replay --masters 127.0.0.1:55503 --trace "bench/trace/testdata/$t-10k.jsonl.gz" --json |
		sed "s/^{/{\"trace\":\"$t-10k\",/" >>"$work/rows.json"
done

$PY - "$work/rows.json" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
pct = lambda r, k: 100 * r[k] / r[k.replace("Hit", "")]
print("| trace | capacity (blocks) | Tidepool blocks | LRU | Belady | Tidepool tokens | LRU | Belady | Tidepool - LRU (blocks hit) | TTFT p50 / p99 ms | lookup p99 ms | get p99 ms | put p99 ms | errors |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    t, l, b = r["tidepool"], r["lru"], r["belady"]
    print(f"| {r['trace']} | {r['capacity_blocks']} | {pct(t, 'HitBlocks'):.2f}% | {pct(l, 'HitBlocks'):.2f}% | {pct(b, 'HitBlocks'):.2f}% "
          f"| {pct(t, 'HitTokens'):.2f}% | {pct(l, 'HitTokens'):.2f}% | {pct(b, 'HitTokens'):.2f}% | {t['HitBlocks'] - l['HitBlocks']:+d} "
          f"| {r['TTFTp50ms']:.1f} / {r['TTFTp99ms']:.1f} | {r['Lookupp99ms']:.2f} | {r['Getp99ms']:.2f} | {r['Putp99ms']:.2f} | {r['Errors']} |")
PYEOF
