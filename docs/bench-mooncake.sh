#!/usr/bin/env bash
# The Mooncake-API table of docs/benchmarks.md: tidepool.mooncake's
# batch_get_into, batch_put_from and batch_is_exist (one Python thread,
# client/python/benchmarks/mooncake_bench.py) next to memcpy and a
# one-stream iperf3 of the same run. Needs Debian's iperf3 and the Python
# packages of `make pytest`. docs/benchmarks.sh runs it last.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
go build -o "$work/tidepool" ./cmd/tidepool
# The shared machine's loopback rate drifts (one stream read 1.7 and 3.3
# GB/s in two runs of one day): one stream before the rows and one after,
# and the table divides by the higher.
. docs/iperf.sh
iperf_servers 55211
before=$(iperf_one 55211)
echo "tidepool.mooncake benchmark (${BENCH_SECONDS:-3} s a row)" >&2
TIDEPOOL_BIN="$work/tidepool" PYTHONPATH=client/python $PY client/python/benchmarks/mooncake_bench.py >"$work/mc.json"
after=$(iperf_one 55211)
$PY - "$before" "$after" "$work/mc.json" <<'PYEOF'
import json, sys
before, after = float(sys.argv[1]), float(sys.argv[2])
iperf = max(before, after)
rows = [json.loads(l) for l in open(sys.argv[3]) if l.strip()]
memcpy = next(r["GBps"] for r in rows if r["op"] == "memcpy")
print(f"Baselines: memcpy (ctypes.memmove) of 64 MiB between two buffers {memcpy:.2f} GB/s; iperf3 loopback, one stream, {iperf:.2f} GB/s (the higher of {before:.2f} before the rows and {after:.2f} after)\n")
print("| op | memory | path | calls | ms per call | GB/s | vs memcpy | vs iperf3 | M keys/s |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    gb = r.get("GBps")
    vs_m = f"{gb/memcpy:.0%}" if gb and r["op"] != "memcpy" and r["path"] == "shm" else ""
    vs_i = f"{gb/iperf:.0%}" if gb and r["path"] == "tcp" else ""
    print(f"| {r['op']} | {r.get('into', '%d keys' % r.get('keys', 0))} | {r['path']} | {r['calls']} | {r['ms_per_call']:.2f} | "
          f"{gb if gb else ''} | {vs_m} | {vs_i} | {r.get('Mkeys_per_s', '')} |")
PYEOF
