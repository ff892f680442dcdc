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
iperf3 -s -p 55211 >/dev/null 2>&1 & pids+=($!)
for _ in $(seq 50); do
	iperf3 -c 127.0.0.1 -p 55211 -t 5 -J >"$work/iperf.json" 2>/dev/null && grep -q sum_received "$work/iperf.json" && break
	sleep 0.2
done
echo "tidepool.mooncake benchmark (${BENCH_SECONDS:-3} s a row)" >&2
TIDEPOOL_BIN="$work/tidepool" PYTHONPATH=client/python $PY client/python/benchmarks/mooncake_bench.py >"$work/mc.json"
$PY - "$work/iperf.json" "$work/mc.json" <<'PYEOF'
import json, sys
iperf = json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"] / 8e9
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
memcpy = next(r["GBps"] for r in rows if r["op"] == "memcpy")
print(f"Baselines: memcpy (ctypes.memmove) of 64 MiB between two buffers {memcpy:.2f} GB/s; iperf3 loopback, one stream, {iperf:.2f} GB/s\n")
print("| op | memory | path | calls | ms per call | GB/s | vs memcpy | vs iperf3 | M keys/s |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    gb = r.get("GBps")
    vs_m = f"{gb/memcpy:.0%}" if gb and r["op"] != "memcpy" and r["path"] == "shm" else ""
    vs_i = f"{gb/iperf:.0%}" if gb and r["path"] == "tcp" else ""
    print(f"| {r['op']} | {r.get('into', '%d keys' % r.get('keys', 0))} | {r['path']} | {r['calls']} | {r['ms_per_call']:.2f} | "
          f"{gb if gb else ''} | {vs_m} | {vs_i} | {r.get('Mkeys_per_s', '')} |")
PYEOF
